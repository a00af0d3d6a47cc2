"""The demo's model, optimizer and loss for numpy and cupy (the hand-written MLP, ``polyamp.optim.Adam``)
and torch (the same network and initial weights); a library is imported only when asked for.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from polyamp import _dtypes, _registry
from polyamp._errors import BackendNotFoundError, BackendUnavailableError, ConfigError, install_hint

from .mlp import MLP, softmax_cross_entropy

NAMES = ("numpy", "cupy", "torch")


@dataclass(frozen=True)
class Kit:
    """What the demo needs from one array library."""

    name: str
    asarray: Callable[[np.ndarray], Any]
    build: Callable[[Any, int], tuple[Any, Any, Any]]  # settings, ranks -> (model, optimizer, loss_fn)
    accuracy: Callable[[Any, Any, Any], float]
    zero_fraction: Callable[[Any], float]


def _sizes(settings: Any) -> list[int]:
    return [2, settings.hidden, settings.hidden, 3]


def _array_kit(name: str, xp: Any) -> Kit:
    """The MLP over NumPy or CuPy arrays (``xp`` is the library module)."""
    from polyamp.optim import Adam

    def build(settings: Any, ranks: int = 1) -> tuple[Any, Any, Any]:
        model = MLP(_sizes(settings), seed=settings.seed + 2, like=xp.zeros((), dtype=xp.float32))
        optimizer = Adam(model.parameters(), lr=settings.lr)
        share = settings.global_batch / ranks  # this rank's share of the global batch
        return model, optimizer, functools.partial(softmax_cross_entropy, normalizer=share)

    def fraction(mask: Any) -> float:
        return float(xp.count_nonzero(mask)) / mask.size

    return Kit(name, xp.asarray, build, accuracy=lambda model, x, y: fraction(model.predict(x) == y),
               zero_fraction=lambda flat: fraction(flat == 0))


def _torch_kit() -> Kit:
    """The same network as an ``nn.Module`` (initial weights copied from the NumPy MLP)."""
    import torch

    def build(settings: Any, ranks: int = 1) -> tuple[Any, Any, Any]:
        reference = MLP(_sizes(settings), seed=settings.seed + 2)
        layers: list[torch.nn.Module] = []
        sizes = _sizes(settings)
        for i, (n_in, n_out) in enumerate(zip(sizes, sizes[1:])):
            linear = torch.nn.Linear(n_in, n_out)
            weight, bias = (p.data for p in reference.parameters()[2 * i: 2 * i + 2])
            with torch.no_grad():
                linear.weight.copy_(torch.from_numpy(np.ascontiguousarray(weight.T)))
                linear.bias.copy_(torch.from_numpy(bias))
            layers += [linear, torch.nn.ReLU()]
        model = torch.nn.Sequential(*layers[:-1])
        optimizer = torch.optim.Adam(model.parameters(), lr=settings.lr)
        share = settings.global_batch / ranks  # this rank's share of the global batch

        def loss_fn(output: Any, target: Any) -> Any:
            return torch.nn.functional.cross_entropy(output, target, reduction="sum") / share

        return model, optimizer, loss_fn

    def accuracy(model: Any, x: Any, y: Any) -> float:
        with torch.no_grad():
            return float((model(x).argmax(dim=1) == y).float().mean())

    return Kit("torch", torch.from_numpy, build, accuracy,
               zero_fraction=lambda flat: float((flat == 0).float().mean()))


def _why_unavailable(name: str) -> str | None:
    """Why backend ``name`` cannot run here, or None when it can."""
    try:
        module = importlib.import_module(name)
    except ImportError as exc:
        return f"{name} is not installed ({exc})"
    if name == "cupy":
        try:
            count = module.cuda.runtime.getDeviceCount()
        except Exception as exc:  # CUDA driver or runtime missing
            return f"cupy is installed but CUDA is not usable ({type(exc).__name__}: {exc})"
        if count < 1:
            return "cupy is installed but no CUDA device is visible"
    return None


def get(name: str) -> Kit:
    """The kit for backend ``name``; a clear error naming it, the reason and what is available."""
    if name not in NAMES:
        raise BackendNotFoundError(
            f"unknown demo backend {name!r}; expected one of {list(NAMES)}, e.g. --backend numpy"
        )
    reason = _why_unavailable(name)
    if reason is not None:
        usable = [n for n in NAMES if n != name and _why_unavailable(n) is None]
        raise BackendUnavailableError(
            f"demo backend {name!r} is not available here: {reason}. Fix: where {name} can run, "
            f"{install_hint(name)}; or pass --backend with one available here: {', '.join(usable)}."
        )
    if name == "torch":
        return _torch_kit()
    return _array_kit(name, importlib.import_module(name))


def chosen(name: str | None) -> str:
    """The demo backend: ``name`` (``--backend``), else ``POLYAMP_BACKEND`` (checked before its
    library is imported), else numpy."""
    if name is not None:
        return name
    env, source = _registry.requested_backend(None)
    if env is None:
        return "numpy"
    _registry.check_known(env, source)  # unknown: the registry's message, no library imported
    if env not in NAMES:
        raise BackendNotFoundError(
            f"{source} names a backend the demo cannot train with; the demo runs on {list(NAMES)}. "
            f"Fix: pass --backend numpy (or another of those), or unset {_registry.ENV_VAR}."
        )
    _registry.get_backend(env, source)  # unavailable here: the registry's message
    return env


def check_dtype(kit: Kit, dtype: str) -> None:
    """Raise ConfigError now, before any training, when ``kit``'s library cannot hold ``dtype``."""
    try:
        _dtypes.cast(kit.asarray(np.zeros(1, np.float32)), dtype)
    except (ImportError, ConfigError) as exc:
        raise ConfigError(
            f"--dtype {dtype} cannot run on the demo backend {kit.name!r} here: {exc}"
        ) from exc
