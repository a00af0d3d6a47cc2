"""The MPI reducer (mpi4py), a plugin of ``polyamp.reducers``: each collective a non-blocking
``Iallreduce`` polled against the deadline (MPI has no timeout); mpi4py imported only for "mpi".
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from .._errors import ConfigError, ForeignArrayError
from .._hookspecs import hookimpl
from ._buffers import check_buffer
from ._errors import ReducerUnavailableError
from ._mpi_cuda import mpi_is_cuda_aware
from ._reducer import DEFAULT_TIMEOUT, Op, Reducer, wait_until

_DLPACK_CPU = 1  # kDLCPU in DLPack's device enumeration
#: dtypes every MPI has a predefined datatype for.
DTYPES = ("float32", "float64", "int32", "int64")


@hookimpl
def reducer_accepts() -> str:
    return "an mpi4py communicator (mpi4py.MPI.Intracomm), or 'mpi' for COMM_WORLD"


@hookimpl(trylast=True)
def make_reducer(group: Any, timeout: float | None) -> Reducer | None:
    if isinstance(group, str):
        if group != "mpi":
            return None
        mpi = _import_mpi()
        return MPIReducer(mpi.COMM_WORLD, mpi, timeout)
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None or not isinstance(group, mpi.Comm):
        return None
    if group == mpi.COMM_NULL or not isinstance(group, mpi.Intracomm):
        raise ConfigError(
            f"group={group!r} is MPI.COMM_NULL or an inter-communicator; a reducer needs an "
            "intra-communicator this rank belongs to. Fix: pass e.g. MPI.COMM_WORLD or comm.Split(...)."
        )
    return MPIReducer(group, mpi, timeout)


def _import_mpi() -> Any:
    try:
        from mpi4py import MPI
    except ImportError as exc:
        raise ReducerUnavailableError(
            f"reducer 'mpi' needs mpi4py and an MPI library, which cannot be imported ({exc}). "
            "Fix: pip install 'polyamp[mpi]' (mpi4py and Open MPI from wheels), and start the "
            "ranks with mpirun."
        ) from exc
    return MPI


def _on_cpu(array: Any) -> bool:
    """Whether ``array`` offers DLPack with its memory on the CPU (no import, no copy)."""
    try:
        return hasattr(array, "__dlpack__") and array.__dlpack_device__()[0] == _DLPACK_CPU
    except Exception:
        return False


class MPIReducer(Reducer):
    """All-reduces NumPy and CuPy arrays (and CPU DLPack arrays, as views) over an mpi4py intracomm."""

    def __init__(self, comm: Any, mpi: Any, timeout: float | None) -> None:
        self.comm, self._mpi = comm, mpi
        self._ops = {"sum": mpi.SUM, "max": mpi.MAX}
        self._cuda_aware: bool | None = None  # asked at the first CuPy array
        self._abandoned: list[Any] = []  # (request, buffer) of timed-out collectives: MPI may still write
        super().__init__("mpi", comm.Get_rank(), comm.Get_size(), timeout or DEFAULT_TIMEOUT)

    def group_key(self) -> Any:
        """The communicator: reducers built on one (e.g. two on COMM_WORLD) share it."""
        return self.comm

    def _prepare(self, array: Any) -> Any:
        cupy, buffer = sys.modules.get("cupy"), array
        if cupy is not None and isinstance(array, cupy.ndarray):
            if self._cuda_aware is None:  # asked once, before the first CuPy collective
                self._cuda_aware = mpi_is_cuda_aware(self._mpi)
        elif not isinstance(array, np.ndarray):
            if not _on_cpu(array):
                raise self._refuse(array, "")
            try:  # e.g. a CPU torch or paddle tensor: a NumPy view of its memory
                buffer = np.from_dlpack(array)
            except Exception as exc:
                raise self._refuse(array, f" (DLPack refused: {exc})") from exc
        writeable = buffer.flags.writeable if isinstance(buffer, np.ndarray) else True
        check_buffer(self.describe(), f"a {type(array).__name__}", buffer.dtype.name, DTYPES,
                     {"C-contiguous": bool(buffer.flags.c_contiguous), "writeable": bool(writeable)})
        return buffer

    def _refuse(self, array: Any, why: str) -> ForeignArrayError:
        return ForeignArrayError(
            f"{self.describe()} all-reduces NumPy arrays, CuPy arrays and CPU arrays that share "
            f"their memory through DLPack, got a {type(array).__module__}.{type(array).__name__}"
            f"{why}. Fix: pass one of these, or use a torch.distributed reducer for GPU tensors."
        )

    def _allreduce(self, array: Any, op: Op) -> None:
        buffer = array
        if not isinstance(array, np.ndarray):  # a CuPy array
            stream = sys.modules["cupy"].cuda.get_current_stream()
            if self._cuda_aware:  # MPI reads device memory but knows no stream: finish the writers first
                stream.synchronize()
            else:
                buffer = array.get(stream=stream)  # synchronises with the stream
        mpi, what = self._mpi, f"all-reduce ({op})"
        self._wait(lambda: self.comm.Iallreduce(mpi.IN_PLACE, buffer, op=self._ops[op]), what, buffer)
        if buffer is not array:
            array.set(buffer, stream=stream)

    def _barrier(self) -> None:
        self._wait(self.comm.Ibarrier, "barrier", None)

    def _abort(self) -> None:
        """MPI_Abort on the communicator: mpirun ends every rank (a pending collective cannot complete)."""
        self.comm.Abort(1)

    def _wait(self, issue: Any, what: str, buffer: Any) -> None:
        """Issue a non-blocking collective and poll it until done or the deadline passes."""
        try:
            request = issue()
            if wait_until(request.Test, self.timeout):
                return
        except self._mpi.Exception as exc:
            cause = "MPI reported an error (a peer rank may have died)"
            raise self.fault_error(what, cause, str(exc)) from exc
        self._abandoned.append((request, buffer))  # never free memory MPI may still write into
        raise self.timeout_error(what)
