"""``polyamp.compat.torch.install()``: torch's scaler names build polyamp's scalers, until uninstalled.

Every name torch exports a scaler class under (:data:`TORCH_NAMES`), and modules' own bindings of one
under its name (an alias is left alone), get a stand-in that subclasses the facade's class (first in the
MRO: no torch code runs) AND torch's, so every ``isinstance`` holds; a pickle loads as the facade's
class. Thread-safe; imports nothing of the facade (it hands its classes to :class:`Installer`).
"""

from __future__ import annotations

import copy
import importlib
import sys
import threading
import warnings
from dataclasses import dataclass, field
from typing import Any

from polyamp._caller import user_stacklevel
from polyamp._errors import install_hint

# (module, attribute, kind): "cuda"/"cpu" are the deprecated per-device signatures, "sharded" FSDP's
TORCH_NAMES = (
    ("torch.amp", "GradScaler", "amp"),
    ("torch.amp.grad_scaler", "GradScaler", "amp"),
    ("torch.cuda.amp", "GradScaler", "cuda"),
    ("torch.cuda.amp.grad_scaler", "GradScaler", "cuda"),
    ("torch.cpu.amp", "GradScaler", "cpu"),
    ("torch.cpu.amp.grad_scaler", "GradScaler", "cpu"),
    ("torch.distributed.fsdp.sharded_grad_scaler", "ShardedGradScaler", "sharded"),
    ("torch.distributed.fsdp", "ShardedGradScaler", "sharded"),
)


class StandInMeta(type):
    """The stand-ins' metaclass: ``torch.amp.GradScaler`` (and FSDP's) while installed also counts the
    facade's own class's instances (``_counts``, set on that class only, not its subclasses)."""

    def __instancecheck__(cls, obj: Any) -> bool:
        counts = cls.__dict__.get("_counts")
        return type.__instancecheck__(cls, obj) or (counts is not None and isinstance(obj, counts))


def _per_device_class(parent: type, torch_class: type, device: str) -> type:
    """``torch.<device>.amp.GradScaler``'s signature (no device argument) over polyamp's."""

    def __new__(cls: type, init_scale: float = 2.0**16, growth_factor: float = 2.0,
                backoff_factor: float = 0.5, growth_interval: int = 2000, enabled: bool = True,
                **kwargs: Any) -> Any:
        return parent.__new__(cls, device, enabled=enabled, **kwargs)

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:  # the arguments __new__ bound
        warnings.warn(  # torch's deprecation, as the class it stands in for gives it
            f"`torch.{device}.amp.GradScaler(args...)` is deprecated. Please use "
            f"`torch.amp.GradScaler('{device}', args...)` instead.", FutureWarning,
            stacklevel=user_stacklevel())  # the user's line, as torch's warning names it
        super(cls_, self).__init__(device, *args, **kwargs)

    cls_ = StandInMeta("GradScaler", (parent, torch_class), {
        "__new__": __new__, "__init__": __init__, "__module__": __name__,
        "__qualname__": f"{device}.GradScaler",
        "__doc__": f"What ``torch.{device}.amp.GradScaler`` builds while polyamp is installed.",
    })
    return cls_


def _torch_only(name: str, torch_class: type) -> Any:
    """A method torch's class has and polyamp's lacks: refused, never torch's code on polyamp's state."""

    def refused(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"{torch_class.__qualname__}.{name} is torch's private method, which polyamp's scaler "
            "(installed in its place) does not have. Fix: use the public API (scale, unscale_, step, "
            "update), or build torch's own scaler outside install()."
        )

    refused.__name__ = name
    return refused


def _stand_in(facade_class: type, kind: str, torch_class: type, parent: type | None) -> type:
    """The class bound under torch's names while installed: a subclass of ``facade_class`` (first),
    of ``parent`` (the ``torch.amp`` stand-in, where torch derives from it) and of ``torch_class``."""
    if kind in ("cuda", "cpu"):
        assert parent is not None
        cls = _per_device_class(parent, torch_class, kind)
    else:
        bases = (facade_class, torch_class) if parent is None else (facade_class, parent, torch_class)
        cls = StandInMeta(facade_class.__name__, bases, {
            "__module__": __name__, "__qualname__": f"{kind}.{facade_class.__name__}",
            "__doc__": f"What torch's ``{facade_class.__name__}`` builds while polyamp is installed.",
            "_counts": facade_class,
        })
    for name in set(dir(torch_class)) - set(dir(facade_class)):
        if callable(getattr(torch_class, name)) and not name.startswith("__"):
            setattr(cls, name, _torch_only(name, torch_class))

    def __reduce__(self: Any) -> Any:  # a pickle holds the facade's class: it loads without install()
        restore, (klass, state) = super(cls, self).__reduce__()
        return restore, (facade_class if klass is cls else klass, state)

    __reduce__.names_facade = True  # type: ignore[attr-defined]
    cls.__reduce__ = __reduce__
    if parent is None:  # inherited by the other stand-ins and by users' subclasses
        cls.__copy__ = _copy
        cls.__deepcopy__ = _deepcopy
    return cls


def _facade_reduce(obj: Any) -> tuple[Any, tuple[Any, Any]]:
    """The facade's ``__reduce__`` of ``obj``, skipping the stand-ins' (which name the facade's class)."""
    for klass in type(obj).__mro__:
        reduce = vars(klass).get("__reduce__")
        if reduce is not None and not getattr(reduce, "names_facade", False):
            return reduce(obj)
    raise AssertionError("no __reduce__ on a stand-in's facade class")  # pragma: no cover


def _copy(self: Any) -> Any:
    """``copy.copy``: the same type (a stand-in stays a stand-in, so it stays torch's)."""
    restore, args = _facade_reduce(self)
    return restore(*args)


def _deepcopy(self: Any, memo: dict[int, Any]) -> Any:
    """``copy.deepcopy``: the same type (a stand-in stays a stand-in, so it stays torch's)."""
    restore, (klass, state) = _facade_reduce(self)
    out = memo[id(self)] = restore(klass, copy.deepcopy(state, memo))
    return out


@dataclass
class Installer:
    """Swaps torch's scaler classes for polyamp's stand-ins and back; one per process, thread-safe."""

    grad_scaler: type
    sharded_grad_scaler: type
    _stand_ins: dict[tuple[str, type], type] = field(default_factory=dict, repr=False)
    _originals: dict[type, Any] = field(default_factory=dict, repr=False)  # stand-in -> torch's
    _lock: Any = field(default_factory=threading.RLock, repr=False)
    installed: bool = False

    def install(self) -> Installation:
        """Make torch's scaler names build polyamp's scalers (imports torch); idempotent."""
        with self._lock:
            if self.installed:
                return Installation(self, owner=False)
            targets = [(mod, name, kind, self._torch_class(getattr(mod, name)))
                       for mod, name, kind in _torch_targets()]
            by_kind = {kind: original for _mod, _name, kind, original in targets}
            swap: dict[int, type] = {}
            for _mod, _name, kind, original in targets:
                if id(original) not in swap:
                    stand_in = self._stand_in(kind, by_kind)
                    self._originals[stand_in] = original
                    swap[id(original)] = stand_in
            for mod, name, _kind, original in targets:
                setattr(mod, name, swap[id(original)])
            by_name = {(orig.__name__, id(orig)): stand for stand, orig in self._originals.items()}
            _rebind(lambda name, value: by_name.get((name, id(value))), skip_torch=True)
            self.installed = True
            return Installation(self, owner=True)

    def uninstall(self) -> None:
        """Put torch's classes back wherever a stand-in is bound (no-op when not installed)."""
        with self._lock:
            if not self.installed:
                return
            originals = self._originals
            _rebind(lambda name, value: originals.get(value), skip_torch=False)
            self.installed = False

    def _torch_class(self, bound: Any) -> Any:
        """torch's class behind a name (a stand-in gives the class it stands in for)."""
        return self._originals.get(bound, bound)

    def _stand_in(self, kind: str, by_kind: dict[str, type]) -> type:
        """The stand-in for ``kind``; those torch derives from ``torch.amp``'s derive from its stand-in."""
        torch_class = by_kind[kind]
        key = (kind, torch_class)
        if key not in self._stand_ins:
            parent = None if kind == "amp" else self._stand_in("amp", by_kind)
            facade = self.sharded_grad_scaler if kind == "sharded" else self.grad_scaler
            self._stand_ins[key] = _stand_in(facade, kind, torch_class, parent)
        return self._stand_ins[key]


@dataclass(frozen=True)
class Installation:
    """What ``install()`` returns; as a context manager, uninstalls on exit if it installed."""

    installer: Installer
    owner: bool

    def __enter__(self) -> Installation:
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.owner:
            self.installer.uninstall()


def _torch_targets() -> list[tuple[Any, str, str]]:
    """The torch modules and names to patch (FSDP's only where torch.distributed is built)."""
    try:
        import torch
    except ImportError as exc:
        raise ImportError(
            f"polyamp.compat.torch.install() swaps torch's GradScaler classes, but torch does not "
            f"import here ({exc}). Fix: {install_hint('torch')}, or use polyamp's scalers "
            "directly without install()"
        ) from exc

    out = []
    for mod_name, name, kind in TORCH_NAMES:
        if kind == "sharded" and not torch.distributed.is_available():
            continue
        module = importlib.import_module(mod_name)
        if hasattr(module, name):  # torch.distributed.fsdp exports ShardedGradScaler in some versions
            out.append((module, name, kind))
    return out


def _rebind(replacement: Any, skip_torch: bool) -> None:
    """Set each module attribute for which ``replacement(name, value)`` gives a class."""
    for mod_name, mod in list(sys.modules.items()):
        if skip_torch and (mod_name == "torch" or mod_name.startswith("torch.")):
            continue  # torch's own names are the explicit list (TORCH_NAMES)
        try:
            namespace = getattr(mod, "__dict__", None)
        except Exception:  # noqa: BLE001 - a lazy module proxy may fail on any attribute
            continue
        if not isinstance(namespace, dict):
            continue
        for name, value in list(namespace.items()):
            if issubclass(type(value), type):  # type(): no attribute access on odd objects
                new = replacement(name, value)
                if new is not None:
                    namespace[name] = new
