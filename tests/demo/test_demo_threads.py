"""The demo trains with BLAS (and torch) on one thread, and keeps a thread count the user set.

Spinning BLAS threads made the demo 5-8x slower on a busy 2-core machine (issue 34);
benchmarks/demo.py shows the time per run. Read through threadpoolctl, the library the demo uses.
"""

from __future__ import annotations

import pytest

from polyamp.demo import DemoSettings, run_demo
from polyamp.demo.threads import THREAD_ENV_VARS, single_threaded

threadpoolctl = pytest.importorskip("threadpoolctl")


def _blas_threads() -> dict[str, int]:
    """Threads of each BLAS library loaded (by path: importing a module may load another)."""
    pools = threadpoolctl.threadpool_info()
    return {p["filepath"]: p["num_threads"] for p in pools if p["user_api"] == "blas"}


def _all(threads: dict[str, int], n: int) -> bool:
    return bool(threads) and set(threads.values()) == {n}


@pytest.fixture
def no_thread_env(monkeypatch):
    for name in THREAD_ENV_VARS:
        monkeypatch.delenv(name, raising=False)


def test_blas_runs_on_one_thread_inside_and_as_before_after(no_thread_env):
    before = _blas_threads()
    assert before, "numpy's BLAS is not visible to threadpoolctl"
    with threadpoolctl.threadpool_limits(limits=2, user_api="blas"):  # as on a 2-core machine
        with single_threaded("numpy") as what:
            assert _all(_blas_threads(), 1) and what == "BLAS on one thread"
        assert _all(_blas_threads(), 2)


def test_a_thread_count_the_user_set_is_kept(monkeypatch):
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "2")
    with threadpoolctl.threadpool_limits(limits=2, user_api="blas"):
        with single_threaded("numpy") as what:
            assert _all(_blas_threads(), 2)
            assert what == "threads as set by OPENBLAS_NUM_THREADS=2"


def test_torch_runs_on_one_thread_inside_and_as_before_after(no_thread_env):
    torch = pytest.importorskip("torch")
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with single_threaded("torch") as what:
            assert torch.get_num_threads() == 1 and what == "BLAS on one thread, torch on one thread"
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_the_demo_trains_on_one_blas_thread(no_thread_env):
    seen: list[dict[str, int]] = []

    def progress(label, steps):
        return lambda loss: seen.append(_blas_threads())

    with threadpoolctl.threadpool_limits(limits=2, user_api="blas"):
        numpys = _blas_threads()  # numpy's BLAS, which computes the matmuls (numba may load scipy's)
        run_demo(DemoSettings(steps=2, batch=64, test_size=16), progress)
        assert {path: _blas_threads()[path] for path in numpys} == numpys  # given back after the demo
    assert len(seen) == 6 and all(_all({p: t[p] for p in numpys}, 1) for t in seen), seen
