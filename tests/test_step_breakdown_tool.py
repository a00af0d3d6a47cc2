"""tools/step_breakdown.py: each row cuts what it says (its patches run in a process of their own)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = """
import importlib.util, json, os, socket, sys
import torch, torch.distributed as dist
from polyamp.distributed import _fingerprint
spec = importlib.util.spec_from_file_location("step_breakdown", sys.argv[1])
tool = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tool)
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
dist.init_process_group("gloo", rank=0, world_size=1)
tool._patch(sys.argv[2], dist)
built, fields = [0], _fingerprint.Place.fields
def counted(*args, **kwargs):
    built[0] += 1
    return fields(*args, **kwargs)
_fingerprint.Place.fields = counted
from polyamp.compat.torch import ShardedGradScaler
tool._side(ShardedGradScaler, torch, 1)
print(json.dumps({"fields built": built[0]}))
dist.destroy_process_group()
"""


def _row(row: str) -> dict:
    pytest.importorskip("torch.distributed")
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(ROOT / "tools" / "step_breakdown.py"), row],
                          capture_output=True, text=True, timeout=120, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_row_without_the_digest_builds_no_fingerprint_where_rank_0_of_2_does():
    """The digest row's difference to the row above is the fingerprint's cost: its fields and its
    message (301 steps each)."""
    assert _row("two")["fields built"] >= 301
    assert _row("digest")["fields built"] == 0
    assert _row("one")["fields built"] == 0  # a group of one sends its flag alone
