"""The torch.distributed reducer (gloo on CPU, NCCL on GPU), a plugin of ``polyamp.reducers``.

Timeouts are the process group's own (``init_process_group(timeout=...)``; gloo raises when it
passes, NCCL's watchdog aborts). With ``timeout=`` the reducer also waits on the host for at
most that long (``Work.wait(timeout)``), which on NCCL adds a host sync. Imports torch only
for the name "torch"; otherwise looks it up in ``sys.modules``.
"""

from __future__ import annotations

import logging
import sys
import weakref
from datetime import timedelta
from typing import Any

import numpy as np

from .._errors import ConfigError, ForeignArrayError
from .._hookspecs import hookimpl
from ._errors import ReducerUnavailableError
from ._reducer import Op, Reducer

logger = logging.getLogger("polyamp")
_TIMED_OUT = ("timed out", "timeout")
_PEER_GONE = ("connection", "closed by peer", "reset by peer", "broken pipe", "aborted", "remote")


@hookimpl
def reducer_accepts() -> str:
    return "a torch.distributed ProcessGroup, or 'torch' for the default group (gloo on CPU, NCCL on GPU)"


@hookimpl(trylast=True)
def make_reducer(group: Any, timeout: float | None) -> Reducer | None:
    if isinstance(group, str):
        if group != "torch":
            return None
        return TorchReducer(_default_group(), timeout)
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available():
        return None
    if isinstance(group, dist.ProcessGroup):
        return TorchReducer(group, timeout)
    if dist.is_initialized() and isinstance(group, int) and group == dist.GroupMember.NON_GROUP_MEMBER:
        raise ConfigError(
            f"group={group!r} is torch's GroupMember.NON_GROUP_MEMBER: this rank is not in the "
            "process group new_group() built. Fix: build a reducer only on the group's member ranks."
        )
    return None


def _default_group() -> Any:
    try:
        import torch.distributed as dist
    except ImportError as exc:
        raise ReducerUnavailableError(
            f"reducer 'torch' needs torch.distributed, which cannot be imported ({exc}). "
            "Fix: install torch (pip install 'polyamp[torch]'), or pass another group."
        ) from exc
    if not dist.is_available() or not dist.is_initialized():
        raise ReducerUnavailableError(
            "reducer 'torch' uses torch.distributed's default process group, which is not "
            "initialised in this process. Fix: call torch.distributed.init_process_group(backend, "
            "timeout=...) on every rank first, or pass a ProcessGroup."
        )
    return dist.group.WORLD


def _group_timeout(group: Any) -> float | None:
    """The group's own collective timeout in seconds, where torch lets us read it (else None)."""
    try:
        import torch

        device = group._device_types[0] if group._device_types else torch.device("cpu")
        return group._get_backend(device).options._timeout.total_seconds()
    except Exception:  # a private torch detail: the messages then just say "the group's timeout"
        return None


#: NumPy buffers of at most this many values keep their tensor view (agreement messages), at most
#: this many of them per reducer.
_VIEW_CACHE_VALUES, _VIEW_CACHE_ARRAYS = 4096, 16


class TorchReducer(Reducer):
    """All-reduces torch tensors over a ProcessGroup; NumPy and DLPack arrays through zero-copy views."""

    def __init__(self, group: Any, timeout: float | None) -> None:
        import torch
        import torch.distributed as dist

        self._torch, self._dist = torch, dist
        # Weakly: torch keeps its groups until destroy_process_group(); a strong reference kept past
        # that (e.g. by a scaler) is destroyed at interpreter exit, where gloo aborts the process.
        self._group = weakref.ref(group)
        self._explicit = timeout
        self._devices = {d.type for d in getattr(group, "_device_types", ())}
        self._ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}
        self._views: dict[int, tuple[np.ndarray, Any]] = {}  # small NumPy buffers -> their tensor views
        self._abandoned: list[Any] = []  # (work, tensor) of timed-out waits: torch may still write
        super().__init__(f"torch:{dist.get_backend(group)}", dist.get_rank(group), dist.get_world_size(group),
                         timeout if timeout is not None else _group_timeout(group))

    @property
    def group(self) -> Any:
        """The ProcessGroup; ReducerUnavailableError once torch.distributed destroyed it."""
        group = self._group()
        if group is None:
            raise ReducerUnavailableError(
                f"{self.describe()} cannot issue a collective: its process group was destroyed "
                "(torch.distributed.destroy_process_group()). Fix: build a new reducer (and scaler) "
                "after init_process_group()."
            )
        return group

    def group_key(self) -> Any:
        """The ProcessGroup: reducers built on one group (e.g. two on the default) share it."""
        return self.group

    def _prepare(self, array: Any) -> Any:
        self.group  # noqa: B018 - refuse before anything is issued when the group is gone
        cached = self._views.get(id(array))
        if cached is not None and cached[0] is array and array.flags.writeable:  # a reused message buffer
            return cached[1]
        torch = self._torch
        tensor = array if isinstance(array, torch.Tensor) else self._as_tensor(array)
        problem = None
        if tensor.layout != torch.strided or not tensor.is_contiguous():
            problem = "a non-contiguous or sparse tensor"
        elif self._devices and tensor.device.type not in self._devices:
            problem = f"a tensor on {tensor.device}, a device this group has no backend for"
        if problem is not None:
            raise ForeignArrayError(
                f"{self.describe()} cannot all-reduce {problem} in place. Fix: pass a dense, "
                f"contiguous tensor on one of the group's devices ({sorted(self._devices)})."
            )
        small = isinstance(array, np.ndarray) and array.size <= _VIEW_CACHE_VALUES
        if small and len(self._views) < _VIEW_CACHE_ARRAYS:  # an agreement reuses its message buffer
            self._views[id(array)] = (array, tensor)  # holding the array keeps its id its own
        return tensor

    def _as_tensor(self, array: Any) -> Any:
        """A tensor sharing ``array``'s memory: NumPy through from_numpy, others through DLPack."""
        if isinstance(array, np.ndarray) and array.flags.writeable:
            return self._torch.from_numpy(array)
        what = f"a {type(array).__module__}.{type(array).__name__}"
        if isinstance(array, np.ndarray):
            what = "a read-only NumPy array"
        elif hasattr(array, "__dlpack__"):
            try:
                return self._torch.utils.dlpack.from_dlpack(array)
            except Exception as exc:  # e.g. a dtype torch lacks
                what = f"{what} (DLPack refused: {exc})"
        raise ForeignArrayError(
            f"{self.describe()} cannot all-reduce {what} in place. Fix: pass a torch.Tensor, a "
            "writeable NumPy array, or another array that shares its memory through DLPack."
        )

    def _allreduce(self, tensor: Any, op: Op) -> None:
        if self._explicit is None:  # the per-step path: the process group's own timeout, no wrapper
            try:
                self._dist.all_reduce(tensor, op=self._ops[op], group=self.group)
            except RuntimeError as exc:
                error = self._translate(exc, f"all-reduce ({op})")
                if error is None:
                    raise
                raise error from exc
            return
        self._run(lambda: self._dist.all_reduce(tensor, op=self._ops[op], group=self.group, async_op=True),
                  f"all-reduce ({op})", tensor)

    def _barrier(self) -> None:
        async_op = self._explicit is not None
        self._run(lambda: self._dist.barrier(group=self.group, async_op=async_op), "barrier", None)

    def _abort(self) -> None:
        """Abort the process group (torch's own abort): its connections close, so a late rank's
        collective fails instead of completing against this rank's abandoned one."""
        group = self._group()
        abort = getattr(group, "abort", None)
        if callable(abort):
            try:
                abort()
            except Exception as exc:  # e.g. a backend without abort: the error is raised regardless
                logger.error("polyamp: aborting the process group failed: %s", exc)

    def _run(self, issue: Any, what: str, tensor: Any) -> None:
        work = None
        try:
            work = issue()
            if self._explicit is not None:
                work.wait(timeout=timedelta(seconds=self._explicit))
        except RuntimeError as exc:  # torch's DistError family are RuntimeErrors
            error = self._translate(exc, what)
            if error is None:
                raise
            if work is not None:
                self._abandoned.append((work, tensor))
            raise error from exc

    def _translate(self, exc: RuntimeError, what: str) -> Exception | None:
        """polyamp's error for a torch fault (a timeout, a dead peer); None for any other error."""
        text = str(exc).lower()
        if any(k in text for k in _TIMED_OUT):
            if self._explicit is not None:
                return self.timeout_error(what)
            seconds = "" if self.timeout is None else f" of {self.timeout:g} s"
            return self.timeout_error(what, f"the process group's timeout{seconds} (set by torch.distributed."
                                            "init_process_group(timeout=...) or new_group(timeout=...))")
        if any(k in text for k in _PEER_GONE):
            cause = "a peer rank probably died or exited (its connection closed)"
            return self.fault_error(what, cause, str(exc))
        return None
