"""The torch.distributed reducer on real gloo process groups: 2 and 3 processes on 127.0.0.1.

Rank functions are module-level (the worker loads them by path) and return plain data.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest

from polyamp.distributed import ReducerError, ReducerTimeoutError

U32 = 2.0**-24  # float32 unit roundoff


def exact_values(rank: int) -> np.ndarray:
    """Dyadic values whose float32 sums over a few ranks are exact in any order."""
    return np.array([rank + 0.5, -(2.0**-20) * (rank + 1), 1024.0 * rank, 0.0], np.float32)


def random_values(rank: int) -> np.ndarray:
    return np.random.default_rng(rank).standard_normal(1000).astype(np.float32)


def sums_and_counts(rank: int, size: int) -> dict:
    import torch
    import torch.distributed as dist

    from polyamp import ConfigError, ForeignArrayError
    from polyamp.distributed import reducer

    red = reducer("torch")
    out = {"name": red.name, "rank": red.rank, "size": red.size, "timeout": red.timeout}
    host = exact_values(rank)
    out["numpy_exact"] = red.allreduce_sum_(host).copy()
    zeros = np.zeros(2, np.float32)
    out["returns_its_argument"] = red.allreduce_sum_(zeros) is zeros
    out["torch_exact"] = red.allreduce_sum_(torch.from_numpy(exact_values(rank))).numpy()
    out["random"] = red.allreduce_sum_(random_values(rank))
    out["max"] = red.allreduce_max_(torch.tensor([rank, -rank], dtype=torch.float32)).numpy()
    out["int_sum"] = red.allreduce_sum_(torch.tensor([rank], dtype=torch.int32)).item()
    import array_api_strict as xp  # any DLPack array: reduced through a zero-copy tensor view

    out["dlpack"] = np.asarray(red.allreduce_sum_(xp.asarray(exact_values(rank))))
    readonly = np.ones(3, np.float32)
    readonly.flags.writeable = False
    before = red.collectives
    refused = []
    strided = np.ones(3, np.float32)[::2]  # refused twice: a refused array's view is not kept
    zeros.flags.writeable = False  # reduced above (its view kept), read-only now: refused, not written
    for bad in (torch.ones(6)[::2], [1.0, 2.0], strided, strided, readonly, zeros):
        try:
            red.allreduce_sum_(bad)
        except ForeignArrayError as exc:
            refused.append(str(exc))
    out["refused"], out["count_after_refusals"] = refused, red.collectives - before
    red.barrier()
    out["after_barrier"] = red.allreduce_sum_(np.ones(1, np.float32))[0]
    out["count_total"] = red.collectives
    if size == 3:  # a subgroup: ranks 0 and 1 only; rank 2 is not a member
        group = dist.new_group([0, 1])
        if rank < 2:
            sub = reducer(group)
            out["sub"] = (sub.rank, sub.size, sub.allreduce_sum_(np.full(1, rank + 1.0, np.float32))[0])
        else:
            try:
                reducer(group)
            except ConfigError as exc:
                out["sub"] = str(exc)
    return out


@pytest.mark.parametrize("size", [2, 3])
def test_sums_maxima_and_counts_on_gloo(run_gloo, size):
    job = run_gloo(sums_and_counts, size, pg_timeout=20.0)
    results = job.results()
    exact = sum(exact_values(r).astype(np.float64) for r in range(size))
    parts = [random_values(r).astype(np.float64) for r in range(size)]
    bound = (size - 1) * U32 * sum(np.abs(p) for p in parts)  # any summation order
    for rank, out in enumerate(results):
        assert (out["name"], out["rank"], out["size"], out["timeout"]) == ("torch:gloo", rank, size, 20.0)
        np.testing.assert_array_equal(out["numpy_exact"], exact.astype(np.float32))
        np.testing.assert_array_equal(out["torch_exact"], exact.astype(np.float32))
        assert np.all(np.abs(out["random"] - sum(parts)) <= bound)
        np.testing.assert_array_equal(out["random"], results[0]["random"])  # every rank agrees bitwise
        np.testing.assert_array_equal(out["max"], [size - 1, 0])
        assert out["int_sum"] == size * (size - 1) // 2
        np.testing.assert_array_equal(out["dlpack"], exact.astype(np.float32))
        assert len(out["refused"]) == 6 and out["count_after_refusals"] == 0
        assert "torch:gloo" in out["refused"][0] and "non-contiguous" in out["refused"][0]
        assert "builtins.list" in out["refused"][1] and out["refused"][2] == out["refused"][3]
        assert "non-contiguous" in out["refused"][2] and "read-only NumPy array" in out["refused"][4]
        assert out["refused"][5] == out["refused"][4]
        assert out["after_barrier"] == size
        assert out["returns_its_argument"]
        assert out["count_total"] == 9  # 7 all-reduces, a barrier, 1 after it; refusals issue none
    if size == 3:
        assert results[0]["sub"] == (0, 2, 3.0) and results[1]["sub"] == (1, 2, 3.0)
        assert "NON_GROUP_MEMBER" in results[2]["sub"]


def wait_for_files(paths: list[Path], limit: float) -> None:
    deadline = time.monotonic() + limit
    while not all(p.exists() for p in paths) and time.monotonic() < deadline:
        time.sleep(0.05)


def last_rank_hangs(rank: int, size: int, timeout: float | None, marks: str) -> dict:
    from polyamp.distributed import reducer

    red = reducer("torch", timeout=timeout)
    red.allreduce_sum_(np.ones(2, np.float32))  # every rank is connected
    if rank == size - 1:  # alive, but never joins the next collective until the others gave up
        wait_for_files([Path(marks, f"gave-up-{r}") for r in range(size - 1)], 60.0)
        return {}
    start = time.monotonic()
    try:
        red.allreduce_sum_(np.ones(2, np.float32))
    except ReducerError as exc:
        out = {"type": type(exc).__name__, "timeout_error": isinstance(exc, ReducerTimeoutError),
               "message": str(exc), "elapsed": time.monotonic() - start}
    start = time.monotonic()
    try:
        red.allreduce_sum_(np.ones(2, np.float32))
    except ReducerError as exc:
        out["again"], out["again_elapsed"] = str(exc), time.monotonic() - start
    out["collectives"] = red.collectives
    Path(marks, f"gave-up-{rank}").touch()
    return out


def test_hung_rank_gives_the_group_timeout_error(run_gloo, tmp_path):
    job = run_gloo(last_rank_hangs, 3, None, str(tmp_path), pg_timeout=2.0)
    for out in job.results()[:2]:
        assert out["timeout_error"], out
        assert 1.9 <= out["elapsed"] <= 2.0 + 1.5  # the group's timeout, not an endless wait
        text = out["message"]
        assert "'torch:gloo'" in text and "timeout of 2 s" in text and "init_process_group(timeout=" in text
        assert "hung, died, or skipped" in text
        assert "cannot issue another collective" in out["again"] and out["again_elapsed"] < 0.1
        assert out["collectives"] == 2  # the refused third call issued nothing


def test_explicit_timeout_bounds_the_wait_before_the_group_timeout(run_gloo, tmp_path):
    job = run_gloo(last_rank_hangs, 2, 1.0, str(tmp_path), pg_timeout=30.0)
    out = job.results()[0]
    assert out["timeout_error"], out
    assert 0.9 <= out["elapsed"] <= 1.0 + 1.5
    assert "timeout=1 s" in out["message"] and "'torch:gloo' (rank 0 of 2)" in out["message"]


def last_rank_dies(rank: int, size: int) -> dict:
    from polyamp.distributed import reducer

    red = reducer("torch")
    red.allreduce_sum_(np.ones(2, np.float32))
    if rank == size - 1:
        os._exit(7)
    start = time.monotonic()
    try:
        red.allreduce_sum_(np.ones(2, np.float32))
    except ReducerError as exc:
        return {"type": type(exc).__name__, "message": str(exc), "elapsed": time.monotonic() - start}
    return {"type": None}


def test_dead_rank_gives_a_clear_error_well_before_the_timeout(run_gloo):
    job = run_gloo(last_rank_dies, 3, pg_timeout=20.0)
    assert not job.ranks[2].finished and "rank 2 exit 7" in job.details
    for outcome in job.ranks[:2]:
        out = outcome.result()
        assert out["type"] == "ReducerError", out
        assert "peer rank probably died" in out["message"] and "'torch:gloo'" in out["message"]
        assert out["elapsed"] < 20.0
