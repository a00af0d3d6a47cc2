"""The MPI reducer (mpi4py), a plugin of ``polyamp.reducers``.

MPI collectives have no timeout, so each one is a non-blocking ``Iallreduce`` polled with
``Test()`` against the reducer's deadline. NumPy arrays are reduced in place; CuPy arrays in
device memory where MPI is CUDA-aware, else through a host copy. Imports mpi4py only for the
name "mpi"; otherwise looks it up in ``sys.modules``.
"""

from __future__ import annotations

import sys
from typing import Any

from .._errors import ConfigError, ForeignArrayError
from .._hookspecs import hookimpl
from ._errors import ReducerUnavailableError
from ._mpi_cuda import mpi_is_cuda_aware
from ._reducer import DEFAULT_TIMEOUT, Op, Reducer, wait_until

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


class MPIReducer(Reducer):
    """All-reduces NumPy arrays (and CuPy arrays) over an mpi4py intra-communicator."""

    def __init__(self, comm: Any, mpi: Any, timeout: float | None) -> None:
        self.comm, self._mpi = comm, mpi
        self._ops = {"sum": mpi.SUM, "max": mpi.MAX}
        self._cuda_aware: bool | None = None  # asked at the first CuPy array
        self._abandoned: list[Any] = []  # (request, buffer) of timed-out collectives: MPI may still write
        super().__init__("mpi", comm.Get_rank(), comm.Get_size(), timeout or DEFAULT_TIMEOUT)

    def _check(self, array: Any) -> None:
        numpy, cupy = sys.modules.get("numpy"), sys.modules.get("cupy")
        if numpy is not None and isinstance(array, numpy.ndarray):
            kind, writeable = "NumPy", array.flags.writeable
        elif cupy is not None and isinstance(array, cupy.ndarray):
            kind, writeable = "CuPy", True
        else:
            raise ForeignArrayError(
                f"{self.describe()} all-reduces NumPy or CuPy arrays, got a "
                f"{type(array).__module__}.{type(array).__name__}. Fix: pass a NumPy array (a CPU "
                "torch tensor's .numpy() shares its memory), or use a torch.distributed reducer."
            )
        if array.dtype.name not in DTYPES or not array.flags.c_contiguous or not writeable:
            raise ForeignArrayError(
                f"{self.describe()} cannot all-reduce a {kind} array of dtype {array.dtype.name} "
                f"(C-contiguous: {array.flags.c_contiguous}, writeable: {writeable}) in place. Fix: "
                f"pass a writeable C-contiguous array of one of {DTYPES}."
            )

    def _allreduce(self, array: Any, op: Op) -> None:
        mpi, what = self._mpi, f"all-reduce ({op})"
        numpy = sys.modules["numpy"]
        if isinstance(array, numpy.ndarray):
            self._wait(lambda: self.comm.Iallreduce(mpi.IN_PLACE, array, op=self._ops[op]), what, array)
            return
        stream = sys.modules["cupy"].cuda.get_current_stream()
        if self._cuda_aware is None:
            self._cuda_aware = mpi_is_cuda_aware(mpi)
        if self._cuda_aware:  # MPI reads device memory but knows no stream: finish the writers first
            stream.synchronize()
            self._wait(lambda: self.comm.Iallreduce(mpi.IN_PLACE, array, op=self._ops[op]), what, array)
            return
        host = array.get(stream=stream)  # synchronises with the stream
        self._wait(lambda: self.comm.Iallreduce(mpi.IN_PLACE, host, op=self._ops[op]), what, host)
        array.set(host, stream=stream)

    def _barrier(self) -> None:
        self._wait(self.comm.Ibarrier, "barrier", None)

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
