"""LossScaler(reducer=...) on real process groups: one agreed skip decision per step.

Gloo with 2 and 3 processes and mpirun -n 3. Each rank holds a shard of one parameter vector
(as in sharded data parallel): rank 0 as torch tensors (float32 and float16), rank 1 as NumPy,
rank 2 (of 3) none at all. Gradient values are dyadic and scales powers of two, so every
product and sum here is exact: the shards trained on the ranks, put together, must equal one
process training the whole vector with a plain scaler, bit for bit.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

N = 12  # parameter values in all
LR = 0.5
STEPS = 7
BAD_STEP, BAD_RANK = 2, 1  # rank 1 alone has an inf gradient at step 2
CLIP_FROM = 4  # from this step on, every rank clips by the global norm
MAX_NORM = 1.0
GROWTH = 2  # growth_interval: the scale moves within the run


def shard_of(rank: int) -> slice:
    """Ranks 0 and 1 own half the vector each; a third rank owns nothing."""
    return [slice(0, N // 2), slice(N // 2, N), slice(0, 0)][rank]


def true_grad(step: int) -> np.ndarray:
    """The unscaled gradient of the whole vector at ``step``: dyadic, so every sum is exact."""
    return ((np.arange(N) - 5.0) / 8.0 * (step % 3 + 1)).astype(np.float32)


def pieces(values: np.ndarray, rank: int) -> list[tuple[int, int, str]]:
    """How a rank splits its shard into gradient arrays: (start, stop, dtype) in the shard."""
    n = values.shape[0]
    if rank == 0:  # torch: a float32 and a float16 gradient
        return [(0, n // 2, "float32"), (n // 2, n, "float16")]
    return [(0, n, "float32")] if n else []


def engine_run(rank: int, size: int, group: str) -> dict:
    """Train this rank's shard with a distributed LossScaler; report decisions and counts."""
    from polyamp import LossScaleConfig, LossScaler, clip_grad_norm_
    from polyamp.distributed import RankMismatchError, ReducerError, reducer

    out: dict = {}
    # 1. configs that differ: every rank raises at the first step, and nothing is applied
    odd_red = reducer(group)
    odd = LossScaler(LossScaleConfig(growth_interval=GROWTH + (rank == size - 1)), reducer=odd_red)
    odd.unscale_([np.ones(2, np.float32)] if rank != 2 else [])
    applied = []
    try:
        odd.step([], lambda: applied.append(1))
    except RankMismatchError as exc:
        out["mismatch"] = str(exc)
    out["mismatch_applied"], out["after_mismatch"] = applied, odd_red.collectives
    try:  # the reducer is retired: nothing more is sent through it
        odd_red.allreduce_sum_(np.zeros(1, np.float32))
    except ReducerError as exc:
        out["retired"] = str(exc)

    red = reducer(group)

    # 2. training: the agreed skip, the collective count, clipping in the same collective
    import torch

    config = LossScaleConfig(init_scale=2.0**4, growth_interval=GROWTH)
    scaler = LossScaler(config, reducer=red)
    master = np.zeros(N, np.float32)[shard_of(rank)].copy()
    out.update(skipped=[], scales=[], counts=[], norms=[])
    for step in range(STEPS):
        scale = scaler.get_scale()
        full = true_grad(step) * np.float32(scale)
        if step == BAD_STEP and rank == BAD_RANK:
            full[N - 1] = np.inf  # in rank 1's shard only
        local = full[shard_of(rank)]
        grads = []
        for start, stop, dtype in pieces(local, rank):
            piece = local[start:stop].astype(dtype)
            grads.append(torch.from_numpy(piece) if rank == 0 else piece)
        before = red.collectives
        scaler.unscale_(grads)
        if step >= CLIP_FROM:
            out["norms"].append(float(clip_grad_norm_(grads, MAX_NORM, scaler=scaler)))

        def apply(grads=grads, local=local) -> None:
            flat = np.concatenate([np.asarray(g, dtype=np.float32) for g in grads]) if grads else local[:0]
            master[...] -= np.float32(LR) * flat

        result = scaler.step(grads, apply)
        scaler.update()
        out["counts"].append(red.collectives - before)
        out["skipped"].append(result.skipped)
        out["scales"].append(float(result.scale_before))
    out["master"], out["final_scale"] = master, scaler.get_scale()
    out["reducer_collectives"] = red.collectives
    return out


def one_process_reference() -> dict:
    """The same training in one process, on the whole vector split as the ranks split it."""
    from polyamp import LossScaleConfig, LossScaler, clip_grad_norm_

    scaler = LossScaler(LossScaleConfig(init_scale=2.0**4, growth_interval=GROWTH))
    master = np.zeros(N, np.float32)
    out: dict = {"skipped": [], "scales": [], "norms": []}
    for step in range(STEPS):
        full = true_grad(step) * np.float32(scaler.get_scale())
        if step == BAD_STEP:
            full[N - 1] = np.inf
        grads = []
        for rank in (0, 1):
            local = full[shard_of(rank)]
            grads += [local[a:b].astype(dtype) for a, b, dtype in pieces(local, rank)]
        scaler.unscale_(grads)
        if step >= CLIP_FROM:
            out["norms"].append(float(clip_grad_norm_(grads, MAX_NORM, scaler=scaler)))

        def apply(grads=grads) -> None:
            master[...] -= np.float32(LR) * np.concatenate([g.astype(np.float32) for g in grads])

        result = scaler.step(grads, apply)
        scaler.update()
        out["skipped"].append(result.skipped)
        out["scales"].append(float(result.scale_before))
    out["master"], out["final_scale"] = master, scaler.get_scale()
    return out


def check_engine_job(results: list[dict], size: int) -> None:
    reference = one_process_reference()
    assert reference["skipped"][BAD_STEP] and sum(reference["skipped"]) == 1
    scales = reference["scales"]
    assert scales[0] < scales[BAD_STEP] > scales[BAD_STEP + 1]  # the scale grew, then backed off
    for rank, out in enumerate(results):
        assert "rank states differ: config fingerprint" in out["mismatch"], out.get("mismatch")
        assert "Fix: build the scaler with the same config on every rank" in out["mismatch"]
        # the step's agreement, then (only after a mismatch) the collective that explains it
        assert out["mismatch_applied"] == [] and out["after_mismatch"] == 2
        assert "cannot issue another collective" in out["retired"]
        # one collective per step, the first too; the clip's first message (a new length) is announced
        announced = [2 if step == CLIP_FROM else 1 for step in range(STEPS)]
        assert out["counts"] == announced, out["counts"]
        assert out["reducer_collectives"] == STEPS + 1
        assert out["skipped"] == reference["skipped"], (rank, out["skipped"])
        assert out["scales"] == reference["scales"] and out["final_scale"] == reference["final_scale"]
        assert out["norms"] == reference["norms"]  # exact: dyadic squares sum exactly in float64
    np.testing.assert_array_equal(np.concatenate([r["master"] for r in results]), reference["master"])
    if size == 3:
        assert results[2]["master"].size == 0  # the rank without gradients took part all along


@pytest.mark.parametrize("size", [2, 3])
def test_overflow_on_one_rank_skips_on_every_rank_gloo(run_gloo, size):
    check_engine_job(run_gloo(engine_run, size, "torch").results(), size)


def test_overflow_on_one_rank_skips_on_every_rank_mpi(run_mpi):
    check_engine_job(run_mpi(engine_run, 3, "mpi").results(), 3)


def mixed_paths(rank: int, size: int, group: str) -> dict:
    """Rank 0's agreements take the device path (as a GPU rank's; forced on NumPy arrays), the
    others the host path: one message either way, so aligned ranks agree; the last rank overflows
    at step 1, and at step 3 rank 0 alone holds another scale."""
    import polyamp._agreement as agreement
    from polyamp import LossScaleConfig, LossScaler

    if rank == 0:
        agreement._on_host = lambda *args: False
    scaler = LossScaler(LossScaleConfig(init_scale=2.0**8), reducer=group)
    applied: list[int] = []
    try:
        for step in range(4):
            g = np.full(3, 2.0, np.float32)
            if step == 1 and rank == size - 1:
                g[0] = np.inf
            if step == 3 and rank == 0:
                scaler.set_scale(4.0)
            scaler.step([g], lambda step=step: applied.append(step))
            scaler.update()
    except Exception as exc:
        return {"applied": applied, "error": type(exc).__name__, "message": str(exc)}
    return {"applied": applied, "error": None, "message": ""}


def check_mixed_paths(results: list[dict]) -> None:
    for out in results:
        assert out["applied"] == [0, 2], out  # step 1 skipped on every rank, step 3 on none
        assert out["error"] == "RankMismatchError" and "rank states differ: scale 2**" in out["message"], out


def test_host_and_device_ranks_agree_gloo(run_gloo):
    check_mixed_paths(run_gloo(mixed_paths, 2, "torch").results())


def test_host_and_device_ranks_agree_mpi(run_mpi):
    check_mixed_paths(run_mpi(mixed_paths, 3, "mpi").results())


# -- faults: a rank that hangs or dies, seen through LossScaler.step ---------------------------

def wait_for_files(paths: list[Path], limit: float) -> None:
    deadline = time.monotonic() + limit
    while not all(p.exists() for p in paths) and time.monotonic() < deadline:
        time.sleep(0.05)


def step_with_a_faulty_rank(
    rank: int, size: int, group: str, fault: str, timeout: float, marks: str, on_fault: str = "abort"
) -> dict:
    """Two good steps, then the last rank hangs (or dies) instead of its third step."""
    import os

    from polyamp import LossScaler
    from polyamp.distributed import ReducerError, reducer

    scaler = LossScaler(reducer=reducer(group, timeout=timeout, on_fault=on_fault))
    for _ in range(2):
        scaler.step([np.ones(3, np.float32)], lambda: None)
        scaler.update()
    if rank == size - 1:
        if fault == "dies":
            os._exit(5)
        wait_for_files([Path(marks, f"gave-up-{r}") for r in range(size - 1)], 60.0)
        return {}
    applied, start = [], time.monotonic()
    out: dict = {}
    try:
        scaler.step([np.ones(3, np.float32)], lambda: applied.append(1))
    except ReducerError as exc:
        out = {"type": type(exc).__name__, "message": str(exc), "elapsed": time.monotonic() - start}
    out["applied"] = applied
    Path(marks, f"gave-up-{rank}").touch()
    return out


def check_fault(out: dict, kind: str, name: str, limit: float) -> None:
    assert out["type"] == kind, out
    assert f"'{name}'" in out["message"] and out["elapsed"] <= limit, out
    assert out["applied"] == []  # the bad step never reached the weights


def test_hung_rank_gives_a_timeout_error_through_step_gloo(run_gloo, tmp_path):
    job = run_gloo(step_with_a_faulty_rank, 2, "torch", "hangs", 1.0, str(tmp_path), pg_timeout=30.0)
    out = job.results()[0]
    check_fault(out, "ReducerTimeoutError", "torch:gloo", 1.0 + 1.5)
    assert "timeout=1 s" in out["message"] and "call step on every rank" in out["message"]


def test_dead_rank_gives_a_clear_error_through_step_gloo(run_gloo, tmp_path):
    job = run_gloo(step_with_a_faulty_rank, 2, "torch", "dies", 20.0, str(tmp_path), pg_timeout=20.0)
    assert "rank 1 exit 5" in job.details
    out = job.ranks[0].result()
    check_fault(out, "ReducerError", "torch:gloo", 20.0)
    assert "peer rank probably died" in out["message"]


def test_hung_rank_gives_a_timeout_error_through_step_mpi(run_mpi, tmp_path):
    """on_fault="raise": the rank that timed out raises, and the job goes on."""
    job = run_mpi(step_with_a_faulty_rank, 2, "mpi", "hangs", 1.0, str(tmp_path), "raise")
    out = job.results()[0]
    check_fault(out, "ReducerTimeoutError", "mpi", 1.0 + 1.5)
    assert "timeout=1 s" in out["message"]
    assert job.returncode == 0 and not job.timed_out


def test_hung_rank_ends_the_job_by_default_mpi(run_mpi, tmp_path):
    """The default, on_fault="abort": MPI_Abort ends every rank, the hung one included."""
    job = run_mpi(step_with_a_faulty_rank, 2, "mpi", "hangs", 1.0, str(tmp_path), timeout=60)
    assert not job.timed_out and job.returncode != 0
    assert "ReducerTimeoutError" in job.output and "ending the job (on_fault='abort')" in job.output
    assert not any(r.finished for r in job.ranks)  # neither rank went on past the fault


def after_destroy(rank: int, size: int) -> dict:
    """The reducer holds the group weakly: destroy_process_group() really frees it."""
    import gc

    import torch.distributed as dist

    from polyamp import LossScaler
    from polyamp.distributed import ReducerUnavailableError

    scaler = LossScaler(reducer="torch")
    scaler.step([np.ones(2, np.float32)], lambda: None)
    scaler.update()
    dist.destroy_process_group()
    gc.collect()
    try:
        scaler.step([np.ones(2, np.float32)], lambda: None)
    except ReducerUnavailableError as exc:
        return {"message": str(exc)}
    return {"message": None}


def test_a_destroyed_process_group_is_not_kept_alive_by_the_scaler(run_gloo):
    for out in run_gloo(after_destroy, 2).results():
        assert out["message"] and "process group was destroyed" in out["message"]
