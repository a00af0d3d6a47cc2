"""``polyamp demo --distributed``: the batch split over 2 ranks prints one process's table.

Runs the real command: under ``mpirun -n 2`` (``--distributed mpi``) and as 2 processes with
torchrun's environment (``--distributed torch``), each against a one-process run of the same
settings. What must agree, row by row (the time column aside):

* skipped steps and final scale: equal;
* the float32 row: test accuracy and the fraction of zero gradients equal, the final loss within
  one unit of its last printed digit (1e-4). The loss is a float32 sum over the batch, which
  the split reorders; for positive terms that moves it by at most batch * 2**-24 * loss
  (about 2e-5 here), below one printed unit;
* the float16 rows: the same verdict against float32 (the summary lines). Each rank rounds its
  own partial gradient sums to float16 before the float32 all-reduce, as data-parallel
  hardware does, so their last digits may differ from one process's.
"""

from __future__ import annotations

import importlib.util
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from polyamp import ConfigError
from polyamp.demo.world import World, join

pytestmark = pytest.mark.ranks  # mpirun and torchrun jobs: one at a time under xdist (tests/conftest.py)

ARGS = ["demo", "--steps", "12", "--batch", "512", "--no-plot", "--no-progress"]
PRINTED_UNIT = 1e-4  # the final loss is printed with 4 decimals
TIMEOUT = 180


def _launcher() -> list[str] | None:
    path = Path(__file__).resolve().parents[1] / "distributed" / "conftest.py"
    spec = importlib.util.spec_from_file_location("polyamp_dist_conftest", path)
    module = sys.modules.get(spec.name) or importlib.util.module_from_spec(spec)
    if spec.name not in sys.modules:
        sys.modules[spec.name] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
    launcher, why = module.mpi_launcher()
    if launcher is None:
        pytest.skip(why)
    return launcher


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "POLYAMP_BACKEND"}
    env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", PYTHONUNBUFFERED="1", **extra)
    return env


def _table(stdout: str) -> dict[str, list[str]]:
    """The printed table: run label -> its cells (final loss ... zero grads), the time left out."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("run "))
    rows = {}
    for line in lines[start + 2: start + 5]:
        label, cells = re.split(r"\s{2,}", line.strip(), maxsplit=1)
        rows[label] = cells.split()[:-1]
    return rows


def _summary(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines() if "float32 (tolerance" in line]


@pytest.fixture(scope="module")
def one_process() -> str:
    out = subprocess.run([sys.executable, "-m", "polyamp", *ARGS], capture_output=True, text=True,
                         env=_env(), timeout=TIMEOUT)
    assert out.returncode == 0, out.stderr
    return out.stdout


def _compare(split: str, alone: str, ranks: int) -> None:
    assert split.count("polyamp demo:") == 1 and split.count("run ") == 1  # rank 0 alone prints
    assert f"split over {ranks} ranks" in split
    ours, theirs = _table(split), _table(alone)
    assert list(ours) == list(theirs) == ["float32", "float16, no loss scaling", "float16 + polyamp"]
    for label, (loss, accuracy, skipped, scale, zeros) in ours.items():
        ref_loss, ref_accuracy, ref_skipped, ref_scale, ref_zeros = theirs[label]
        assert (skipped, scale) == (ref_skipped, ref_scale), label
        if label == "float32":
            assert abs(float(loss) - float(ref_loss)) <= PRINTED_UNIT * 1.0001, (loss, ref_loss)
            assert (accuracy, zeros) == (ref_accuracy, ref_zeros)
    assert ours["float16 + polyamp"][3] == "2^17"  # the scale grew once in 12 steps (growth_interval 10)
    assert _summary(split) == _summary(alone)


def test_mpirun_two_ranks_print_the_table_of_one_process(one_process):
    command = [*_launcher(), "-n", "2", sys.executable, "-m", "polyamp", *ARGS, "--distributed", "mpi"]
    out = subprocess.run(command, capture_output=True, text=True, env=_env(), timeout=TIMEOUT)
    assert out.returncode == 0, out.stdout + out.stderr
    _compare(out.stdout, one_process, 2)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_torchrun_style_two_ranks_print_the_table_of_one_process(one_process):
    pytest.importorskip("torch.distributed")
    port = str(_free_port())
    procs = [
        subprocess.Popen([sys.executable, "-m", "polyamp", *ARGS, "--distributed", "torch"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=_env(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port))
        for rank in range(2)
    ]
    try:
        outs = [p.communicate(timeout=TIMEOUT) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], outs
    assert outs[1][0] == ""  # rank 1 prints nothing
    _compare(outs[0][0], one_process, 2)


def test_torch_without_torchruns_environment_is_refused_before_training():
    env = {k: v for k, v in _env().items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    out = subprocess.run([sys.executable, "-m", "polyamp", *ARGS, "--distributed", "torch"],
                         capture_output=True, text=True, env=env, timeout=TIMEOUT)
    assert out.returncode == 2 and out.stdout == ""
    assert "needs torchrun's environment" in out.stderr and "torchrun --nproc-per-node 2" in out.stderr
    assert "but RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT are not set" in out.stderr


def test_only_the_missing_torchrun_variables_are_named():
    env = {k: v for k, v in _env(RANK="0", WORLD_SIZE="1").items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    out = subprocess.run([sys.executable, "-m", "polyamp", *ARGS, "--distributed", "torch"],
                         capture_output=True, text=True, env=env, timeout=TIMEOUT)
    assert out.returncode == 2 and out.stdout == ""
    assert "but MASTER_ADDR, MASTER_PORT are not set" in out.stderr
    env["MASTER_ADDR"] = "127.0.0.1"
    out = subprocess.run([sys.executable, "-m", "polyamp", *ARGS, "--distributed", "torch"],
                         capture_output=True, text=True, env=env, timeout=TIMEOUT)
    assert "but MASTER_PORT is not set" in out.stderr


def test_a_batch_that_does_not_split_evenly_is_refused():
    with pytest.raises(ConfigError, match="--batch=512 cannot be split into 3 equal shards.*--batch=510"):
        World(rank=1, size=3).share(512, "--batch")
    assert World(rank=1, size=2).share(512, "--batch") == slice(256, 512)
    assert join(None) == World()
    with pytest.raises(ConfigError, match="expected one of"):
        join("nccl")
