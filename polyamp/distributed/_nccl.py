"""The CuPy NCCL reducer (``cupy.cuda.nccl`` / ``cupyx.distributed``), a plugin of ``polyamp.reducers``.

NCCL runs on a CUDA stream and has no timeout of its own: the reducer enqueues the collective
on the current stream, records an event and polls it (and NCCL's async error) against the
deadline; on a timeout it aborts the communicator so nothing waits on it forever. That poll is a
host sync, the same one the step's skip decision needs right after. Imports nothing itself.
"""

from __future__ import annotations

import sys
from typing import Any

from .._errors import ForeignArrayError
from .._hookspecs import hookimpl
from ._buffers import check_buffer
from ._reducer import DEFAULT_TIMEOUT, Op, Reducer, wait_until

DTYPES = ("float16", "float32", "float64", "int32", "int64")


@hookimpl
def reducer_accepts() -> str:
    return "a CuPy NCCL communicator (cupy.cuda.nccl.NcclCommunicator or cupyx.distributed.NCCLBackend)"


@hookimpl(trylast=True)
def make_reducer(group: Any, timeout: float | None) -> Reducer | None:
    nccl = sys.modules.get("cupy.cuda.nccl")
    if nccl is None or not getattr(nccl, "available", False):
        return None
    cupyx_distributed = sys.modules.get("cupyx.distributed")
    backend = getattr(cupyx_distributed, "NCCLBackend", None)
    if backend is not None and isinstance(group, backend):
        group = group._comm  # cupyx keeps its NcclCommunicator here (cupy 10 to 14)
    if not isinstance(group, nccl.NcclCommunicator):
        return None
    return NCCLReducer(group, nccl, timeout)


class NCCLReducer(Reducer):
    """All-reduces CuPy arrays on the communicator's device over NCCL."""

    def __init__(self, comm: Any, nccl: Any, timeout: float | None) -> None:
        self.comm, self._nccl = comm, nccl
        self._device = comm.device_id()
        self._ops = {"sum": nccl.NCCL_SUM, "max": nccl.NCCL_MAX}
        self._dtypes = {name: getattr(nccl, f"NCCL_{name.upper()}") for name in DTYPES}
        super().__init__("cupy:nccl", comm.rank_id(), comm.size(), timeout or DEFAULT_TIMEOUT)

    def group_key(self) -> Any:
        """The NCCL communicator: reducers built on one share it."""
        return self.comm

    def _prepare(self, array: Any) -> Any:
        cupy = sys.modules.get("cupy")
        if cupy is None or not isinstance(array, cupy.ndarray):
            raise ForeignArrayError(
                f"{self.describe()} all-reduces CuPy arrays, got a "
                f"{type(array).__module__}.{type(array).__name__}. Fix: pass a CuPy array on "
                f"device {self._device}, or use an MPI or torch.distributed reducer."
            )
        check_buffer(self.describe(), f"a CuPy array on device {array.device.id}", array.dtype.name, DTYPES,
                     {"C-contiguous": bool(array.flags.c_contiguous)}, f" on device {self._device}",
                     array.device.id == self._device)
        return array

    def _allreduce(self, array: Any, op: Op) -> None:
        stream = sys.modules["cupy"].cuda.get_current_stream()
        ptr, dtype = array.data.ptr, self._dtypes[array.dtype.name]
        self._run(lambda: self.comm.allReduce(ptr, ptr, array.size, dtype, self._ops[op], stream.ptr),
                  stream, f"all-reduce ({op})")

    def _barrier(self) -> None:
        cupy = sys.modules["cupy"]
        with cupy.cuda.Device(self._device):
            self._allreduce(cupy.zeros(1, cupy.float32), "sum")

    def _run(self, issue: Any, stream: Any, what: str) -> None:
        try:
            issue()
            event = stream.record()
            done = wait_until(lambda: self._finished(event), self.timeout)
        except self._nccl.NcclError as exc:
            self.comm.abort()
            cause = "NCCL reported an error (a peer rank may have died)"
            raise self.fault_error(what, cause, str(exc)) from exc
        if not done:
            self.comm.abort()  # frees the stream: nothing waits on this collective forever
            raise self.timeout_error(what)

    def _finished(self, event: Any) -> bool:
        self.comm.check_async_error()
        return event.done
