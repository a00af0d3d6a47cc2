"""The MPI reducer under a real ``mpirun -n 3 --oversubscribe`` (Open MPI from its wheel here).

Skips, saying why, where mpi4py or mpirun is absent. Rank functions are module-level.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np

U32 = 2.0**-24  # float32 unit roundoff
SIZE = 3


def exact_values(rank: int, dtype: str) -> np.ndarray:
    """Values whose sums over a few ranks are exact in any order (dyadic floats, small ints)."""
    if dtype.startswith("int"):
        return np.array([rank, -7 * rank, 2**20 + rank], dtype)
    return np.array([rank + 0.5, -(2.0**-20) * (rank + 1), 1024.0 * rank], dtype)


def random_values(rank: int) -> np.ndarray:
    return np.random.default_rng(100 + rank).standard_normal(1000).astype(np.float32)


def sums_and_counts(rank: int, size: int) -> dict:
    from mpi4py import MPI

    from polyamp import ConfigError, ForeignArrayError
    from polyamp.distributed import reducer
    from polyamp.distributed._mpi_cuda import ENV_VAR, mpi_is_cuda_aware

    red = reducer("mpi")
    out = {"name": red.name, "rank": red.rank, "size": red.size, "timeout": red.timeout}
    for dtype in ("float32", "float64", "int32", "int64"):
        out[dtype] = red.allreduce_sum_(exact_values(rank, dtype))
    out["random"] = red.allreduce_sum_(random_values(rank))
    out["max"] = red.allreduce_max_(np.array([rank, -rank], np.float32))
    out["zero_d"] = float(red.allreduce_sum_(np.array(1.0, np.float32)))
    import torch  # a CPU tensor is reduced in place through a NumPy view of its memory

    tensor = torch.from_numpy(exact_values(rank, "float32").copy())
    out["torch_cpu"] = red.allreduce_sum_(tensor).numpy()
    before = red.collectives
    refused = []
    readonly = np.ones(3, np.float32)
    readonly.flags.writeable = False
    for bad in ([1.0], np.ones(6, np.float32)[::2], readonly, np.ones(3, np.float16),
                torch.ones(3, requires_grad=True)):
        try:
            red.allreduce_sum_(bad)
        except ForeignArrayError as exc:
            refused.append(str(exc))
    out["refused"], out["count_after_refusals"] = refused, red.collectives - before
    red.barrier()
    out["count_total"] = red.collectives
    world = reducer(MPI.COMM_WORLD, timeout=30)
    out["world"] = (world.timeout, world.allreduce_sum_(np.ones(1, np.float32))[0], world.collectives)
    sub = reducer(MPI.COMM_WORLD.Split(color=rank % 2, key=rank))
    out["sub"] = (sub.rank, sub.size, sub.allreduce_sum_(np.full(1, rank + 1.0, np.float32))[0])
    try:
        reducer(MPI.COMM_NULL)
    except ConfigError as exc:
        out["comm_null"] = str(exc)
    out["cuda_aware"] = mpi_is_cuda_aware(MPI)
    os.environ[ENV_VAR] = "1"
    out["cuda_aware_forced"] = mpi_is_cuda_aware(MPI)
    os.environ[ENV_VAR] = "yes"
    try:
        mpi_is_cuda_aware(MPI)
    except ConfigError as exc:
        out["cuda_aware_bad_env"] = str(exc)
    del os.environ[ENV_VAR]
    return out


def test_sums_maxima_counts_and_subcommunicators_under_mpirun(run_mpi):
    job = run_mpi(sums_and_counts, SIZE)
    results = job.results()
    parts = [random_values(r).astype(np.float64) for r in range(SIZE)]
    bound = (SIZE - 1) * U32 * sum(np.abs(p) for p in parts)  # any summation order
    for rank, out in enumerate(results):
        assert (out["name"], out["rank"], out["size"], out["timeout"]) == ("mpi", rank, SIZE, 300.0)
        for dtype in ("float32", "float64", "int32", "int64"):
            expected = sum(exact_values(r, dtype) for r in range(SIZE))
            assert out[dtype].dtype == np.dtype(dtype)
            np.testing.assert_array_equal(out[dtype], expected)
        assert np.all(np.abs(out["random"] - sum(parts)) <= bound)
        np.testing.assert_array_equal(out["random"], results[0]["random"])  # every rank agrees bitwise
        np.testing.assert_array_equal(out["max"], [SIZE - 1, 0])
        assert out["zero_d"] == SIZE
        np.testing.assert_array_equal(out["torch_cpu"], sum(exact_values(r, "float32") for r in range(SIZE)))
        assert len(out["refused"]) == 5 and out["count_after_refusals"] == 0
        assert "builtins.list" in out["refused"][0] and "'mpi' (rank" in out["refused"][0]
        assert "C-contiguous: False" in out["refused"][1] and "writeable: False" in out["refused"][2]
        assert "dtype float16" in out["refused"][3] and "DLPack refused" in out["refused"][4]
        assert out["count_total"] == 9  # 4 exact, random, max, 0-d, torch, barrier; refusals issue none
        assert out["world"] == (30.0, SIZE, 1)
        assert "COMM_NULL" in out["comm_null"]
        assert out["cuda_aware"] in (True, False) and out["cuda_aware_forced"] is True
        assert "POLYAMP_MPI_CUDA_AWARE must be 0 or 1" in out["cuda_aware_bad_env"]
    evens = 1.0 + 3.0  # ranks 0 and 2 (color 0) add rank + 1
    assert [r["sub"] for r in results] == [(0, 2, evens), (0, 1, 2.0), (1, 2, evens)]


def wait_for_files(paths: list[Path], limit: float) -> None:
    deadline = time.monotonic() + limit
    while not all(p.exists() for p in paths) and time.monotonic() < deadline:
        time.sleep(0.05)


def last_rank_hangs(rank: int, size: int, marks: str) -> dict:
    from polyamp.distributed import ReducerTimeoutError, reducer

    red = reducer("mpi", timeout=1.0, on_fault="raise")  # raise only: the default ends the job
    red.allreduce_sum_(np.ones(2, np.float32))
    if rank == size - 1:  # alive, but never joins the next collective
        wait_for_files([Path(marks, f"gave-up-{r}") for r in range(size - 1)], 60.0)
        return {}
    x = np.ones(2, np.float32)
    start = time.monotonic()
    try:
        red.allreduce_sum_(x)
    except ReducerTimeoutError as exc:
        elapsed = time.monotonic() - start
        out = {"message": str(exc), "elapsed": elapsed, "timeout": isinstance(exc, TimeoutError)}
    try:
        red.allreduce_sum_(np.ones(2, np.float32))
    except Exception as exc:
        out["again"] = f"{type(exc).__name__}: {exc}"
    out["collectives"] = red.collectives
    Path(marks, f"gave-up-{rank}").touch()
    return out


def test_hung_rank_gives_a_timeout_error_within_the_timeout(run_mpi, tmp_path):
    job = run_mpi(last_rank_hangs, SIZE, str(tmp_path))
    results = job.results()
    for out in results[:2]:
        assert out["timeout"] and 1.0 <= out["elapsed"] <= 1.0 + 1.5, out
        assert "'mpi'" in out["message"] and "timeout=1 s" in out["message"]
        assert "hung, died, or skipped" in out["message"]
        assert out["again"].startswith("ReducerError:") and "cannot issue another" in out["again"]
        assert out["collectives"] == 2
    assert job.returncode == 0 and not job.timed_out


def last_rank_dies(rank: int, size: int) -> None:
    from polyamp.distributed import reducer

    red = reducer("mpi", timeout=60.0, on_fault="raise")
    red.allreduce_sum_(np.ones(2, np.float32))
    if rank == size - 1:
        os._exit(3)
    red.allreduce_sum_(np.ones(2, np.float32))


def test_dead_rank_ends_the_job_instead_of_a_wait(run_mpi):
    """mpirun ends the whole job when a rank exits early; no rank waits out the 60 s timeout."""
    job = run_mpi(last_rank_dies, SIZE)
    assert not job.timed_out and job.returncode != 0 and job.wall < 30.0
    assert not all(r.finished for r in job.ranks)
