"""The demo's math on one thread: its matmuls are small, and spinning BLAS threads on busy cores
made it 5-8x slower. Limits a user set (:data:`THREAD_ENV_VARS`) are kept.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

__all__ = ["THREAD_ENV_VARS", "single_threaded"]

#: Environment variables through which a user sets BLAS's (or torch's) threads (then left as set).
THREAD_ENV_VARS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


@contextlib.contextmanager
def single_threaded(backend: str) -> Iterator[str]:
    """Run the block with BLAS (through threadpoolctl, when installed) and, for ``backend``
    ``"torch"``, torch's intra-op pool on one thread; restored after. Yields what it did, in words."""
    chosen = [name for name in THREAD_ENV_VARS if os.environ.get(name)]
    if chosen:
        yield f"threads as set by {chosen[0]}={os.environ[chosen[0]]}"
        return
    with contextlib.ExitStack() as stack:
        done = []
        try:
            from threadpoolctl import threadpool_limits
        except ImportError:
            done.append("BLAS threads unchanged (threadpoolctl is not installed)")
        else:
            stack.enter_context(threadpool_limits(limits=1, user_api="blas"))
            done.append("BLAS on one thread")
        torch = sys.modules.get("torch") if backend == "torch" else None
        if torch is not None:
            before = torch.get_num_threads()
            torch.set_num_threads(1)
            stack.callback(torch.set_num_threads, before)
            done.append("torch on one thread")
        yield ", ".join(done)
