"""The ShardedGradScaler section of docs/distributed.md: its example runs as written on 2 gloo ranks."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[2] / "docs"
HEADING = "## ShardedGradScaler"


def section() -> str:
    """The section's text in docs/distributed.md."""
    page = (DOCS / "distributed.md").read_text()
    start = page.index(HEADING)
    end = page.find("\n## ", start + 1)
    return page[start:] if end < 0 else page[start:end]


def run_the_example(rank: int, size: int) -> dict:
    import torch
    from polyamp.compat.torch import ShardedGradScaler

    (block,) = re.findall(r"```python\n(.*?)```", section(), re.S)
    torch.manual_seed(0)
    namespace: dict = {}
    exec(compile(block, "ShardedGradScaler section", "exec"), namespace)
    scaler, model = namespace["scaler"], namespace["model"]
    return {"type": type(scaler) is ShardedGradScaler, "collectives": scaler.reducer.collectives,
            "skipped": scaler.skipped_steps, "scale": scaler.get_scale(),
            "finite": all(bool(torch.isfinite(p.to_local()).all()) for p in model.parameters())}


def test_the_example_trains_with_one_collective_per_step(run_gloo):
    pytest.importorskip("torch.distributed.fsdp")
    for out in run_gloo(run_the_example, 2, pg_timeout=30.0).results():
        assert out == {"type": True, "collectives": 5, "skipped": 0, "scale": 2.0**16, "finite": True}
