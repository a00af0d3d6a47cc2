"""``polyamp.compat.torch.install()``: torch's scaler names build polyamp's scalers, until uninstalled.

Opt-in and reversible. While installed, ``torch.amp.GradScaler``, ``torch.cuda.amp.GradScaler``,
``torch.cpu.amp.GradScaler`` and FSDP's ``ShardedGradScaler`` (under each name torch exports
them) are polyamp's, so trainers that build the scaler themselves (accelerate, transformers,
timm, Lightning) use polyamp with no attribute surgery. Modules imported before ``install()``
that bound one of torch's classes under its own name (``from torch.amp import GradScaler``, as
``accelerate.checkpointing`` does) are patched too; an alias (``... import GradScaler as
TorchGradScaler``) is left alone, so torch's stays reachable for comparison. ``uninstall()``
puts torch's classes back everywhere a stand-in was bound, also in modules imported meanwhile.

The stand-ins are subclasses of the facade's classes (so ``isinstance`` with polyamp's works);
their instances pickle as the facade's class, so a pickle loads without ``install()``.
Imports nothing of the facade: ``polyamp.compat.torch`` hands its classes to :class:`Installer`.
"""

from __future__ import annotations

import importlib
import sys
import warnings
from dataclasses import dataclass, field
from typing import Any

# (module, attribute, kind): every place torch exports a scaler class. Kinds: "amp" is
# torch.amp.GradScaler's signature, "cuda"/"cpu" the deprecated per-device ones (no device
# argument), "sharded" FSDP's.
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


def _per_device_class(base: type, device: str) -> type:
    """``torch.<device>.amp.GradScaler``'s signature (no device argument) over polyamp's."""

    def __new__(cls: type, init_scale: float = 2.0**16, growth_factor: float = 2.0,
                backoff_factor: float = 0.5, growth_interval: int = 2000, enabled: bool = True,
                **kwargs: Any) -> Any:
        return base.__new__(cls, device, enabled=enabled, **kwargs)

    def __init__(self: Any, init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000, enabled: bool = True,
                 **kwargs: Any) -> None:
        warnings.warn(  # torch's deprecation, as the class it stands in for gives it
            f"`torch.{device}.amp.GradScaler(args...)` is deprecated. Please use "
            f"`torch.amp.GradScaler('{device}', args...)` instead.", FutureWarning, stacklevel=2)
        super(cls_, self).__init__(device, init_scale, growth_factor, backoff_factor,
                                   growth_interval, enabled, **kwargs)

    cls_ = type("GradScaler", (base,), {
        "__new__": __new__, "__init__": __init__, "__module__": __name__,
        "__qualname__": f"{device}.GradScaler",
        "__doc__": f"What ``torch.{device}.amp.GradScaler`` builds while polyamp is installed.",
    })
    return cls_


def _stand_in(base: type, kind: str) -> type:
    """The class bound under torch's names while installed: a subclass of ``base``."""
    if kind in ("cuda", "cpu"):
        cls = _per_device_class(base, kind)
    else:
        cls = type(base.__name__, (base,), {
            "__module__": __name__, "__qualname__": f"{kind}.{base.__name__}",
            "__doc__": f"What torch's ``{base.__name__}`` builds while polyamp is installed.",
        })

    def __reduce__(self: Any) -> Any:
        restore, (klass, state) = super(cls, self).__reduce__()
        return restore, (base if issubclass(klass, cls) else klass, state)

    cls.__reduce__ = __reduce__
    return cls


@dataclass
class Installer:
    """Swaps torch's scaler classes for polyamp's stand-ins and back; one per process."""

    grad_scaler: type
    sharded_grad_scaler: type
    _stand_ins: dict[str, type] = field(default_factory=dict, repr=False)
    _originals: dict[type, Any] = field(default_factory=dict, repr=False)  # stand-in -> torch's
    installed: bool = False

    def install(self) -> Installation:
        """Make torch's scaler names build polyamp's scalers (imports torch); idempotent."""
        if self.installed:
            return Installation(self, owner=False)
        targets = [(mod, name, kind, getattr(mod, name)) for mod, name, kind in _torch_targets()]
        swap: dict[int, type] = {}
        for _mod, _name, kind, original in targets:
            if id(original) not in swap:
                stand_in = self._stand_in(kind)
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
        if not self.installed:
            return
        originals = self._originals
        _rebind(lambda name, value: originals.get(value), skip_torch=False)
        self.installed = False

    def _stand_in(self, kind: str) -> type:
        if kind not in self._stand_ins:
            base = self.sharded_grad_scaler if kind == "sharded" else self.grad_scaler
            self._stand_ins[kind] = _stand_in(base, kind)
        return self._stand_ins[kind]


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
            f"import here ({exc}). Fix: pip install 'polyamp[torch]', or use polyamp's scalers "
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
