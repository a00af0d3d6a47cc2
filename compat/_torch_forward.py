"""``watch_forward(module)``: which modules' outputs held inf/nan in a forward pass, in call order.
A debugging tool: while it watches, one host read per module call; outside it nothing is registered.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["ForwardRecord", "ForwardWatch", "watch_forward"]


@dataclass(frozen=True)
class ForwardRecord:
    """One module call whose output held a non-finite value (``name`` "" for the watched module)."""

    name: str
    dtype: str
    nonfinite: int
    max_abs_finite: float


class ForwardWatch:
    """What :func:`watch_forward` returns: ``records`` in call order, ``first`` (or None)."""

    def __init__(self, module: Any) -> None:
        if not callable(getattr(module, "named_modules", None)):
            raise TypeError(
                f"watch_forward needs a torch.nn.Module, got module={type(module).__name__}. "
                "Fix: pass the model (or the submodule) whose forward pass to watch."
            )
        self._module = module
        self._handles: list[Any] = []
        self.records: list[ForwardRecord] = []

    @property
    def first(self) -> ForwardRecord | None:
        """The first module (in call order) whose output held inf/nan, or None."""
        return self.records[0] if self.records else None

    def __enter__(self) -> ForwardWatch:
        try:
            for name, sub in self._module.named_modules():
                self._handles.append(sub.register_forward_hook(self._hook(name)))
        except BaseException:
            self._remove()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._remove()

    def _remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _hook(self, name: str) -> Any:
        def hook(module: Any, inputs: Any, output: Any) -> None:
            for tensor in _tensors(output):
                record = _check(name, tensor)
                if record is not None:
                    self.records.append(record)
                    return
        return hook


def watch_forward(module: Any) -> ForwardWatch:
    """A context manager recording the modules of ``module`` whose outputs hold inf/nan:
    ``with watch_forward(model) as w: model(x)``, then ``w.first`` / ``w.records``."""
    return ForwardWatch(module)


def _tensors(output: Any) -> Iterator[Any]:
    """The floating tensors in a module's output (a tensor, or lists/tuples/dicts of them)."""
    torch = sys.modules["torch"]
    if isinstance(output, torch.Tensor):
        if output.is_floating_point() or output.is_complex():
            yield output
    elif isinstance(output, (list, tuple, Mapping)):
        for item in output.values() if isinstance(output, Mapping) else output:
            yield from _tensors(item)


def _check(name: str, tensor: Any) -> ForwardRecord | None:
    """A record when ``tensor`` holds inf/nan (vectorised; one host read), else None."""
    torch = sys.modules["torch"]
    if tensor.is_meta:
        raise TypeError(
            f"watch_forward: module {name or '(the watched module)'!r} returned a tensor on the 'meta' "
            "device, which holds no values to check. Fix: watch the model on a real device (after "
            "model.to_empty(device=...) and initialisation)."
        )
    if tensor.layout != torch.strided:  # sparse (COO, CSR, ...): its stored values
        tensor = tensor.coalesce().values() if tensor.layout == torch.sparse_coo else tensor.values()
    with torch.no_grad():
        t = tensor.detach()
        if t.numel() == 0:
            return None
        ok = torch.isfinite(t)
        bad = t.numel() - int(ok.sum().item())
        if not bad:
            return None
        big = torch.where(ok, t.abs(), torch.zeros_like(t.abs())).max().item() if bad < t.numel() else 0.0
    dtype = str(t.dtype).rsplit(".", 1)[-1]
    return ForwardRecord(name, dtype, bad, float(big) if math.isfinite(big) else 0.0)
