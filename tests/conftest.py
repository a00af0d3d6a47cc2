"""Shared fixtures: a backend fixture over every backend that can run here, and array makers."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

import polyamp


def _available(name: str) -> bool:
    return any(i.name == name and i.available for i in polyamp.available_backends())


def _maker(name: str):
    """A function turning a NumPy array into the named backend's array type."""
    if name == "numpy":
        return lambda a: np.array(a, copy=True)
    if name == "torch":
        torch = pytest.importorskip("torch")
        return lambda a: torch.from_numpy(np.array(a, copy=True))
    if name == "array_api":
        xps = pytest.importorskip("array_api_strict")
        return lambda a: xps.asarray(np.array(a, copy=True))
    if name == "cupy":
        cp = pytest.importorskip("cupy")
        return lambda a: cp.asarray(a)
    if name == "paddle":
        paddle = pytest.importorskip("paddle")
        return lambda a: paddle.to_tensor(np.array(a, copy=True))
    raise ValueError(name)


def _to_numpy(a):
    if hasattr(a, "get"):  # cupy
        return a.get()
    if hasattr(a, "numpy"):
        return a.detach().cpu().numpy()
    return np.asarray(a)


BACKENDS = ["numpy", "torch", "array_api", "cupy", "paddle"]


@pytest.fixture(params=BACKENDS)
def backend_name(request):
    """Each backend that can run on this machine (others skip, saying why)."""
    name = request.param
    info = {i.name: i for i in polyamp.available_backends()}.get(name)
    if info is None or not info.available:
        pytest.skip(f"backend {name!r} unavailable: {info.reason if info else 'not installed'}")
    if name == "cupy":
        request.applymarker(pytest.mark.gpu)
    return name


@pytest.fixture
def make_array(backend_name):
    """Turn a NumPy array into the current backend's array type."""
    return _maker(backend_name)


@pytest.fixture
def to_numpy():
    """Bring any backend's array back to NumPy for comparison."""
    return _to_numpy


@pytest.fixture(autouse=True)
def _no_backend_env(monkeypatch):
    """Tests start with POLYAMP_BACKEND unset unless they set it."""
    monkeypatch.delenv("POLYAMP_BACKEND", raising=False)


@pytest.fixture
def registry_restored():
    """A test that registers a backend plugin leaves the registry as it was for the tests after it."""
    from polyamp import _registry

    before = _registry._plugins().names()
    yield
    if _registry._plugins().names() != before:
        _registry._plugins.cache_clear()  # rebuilt from the entry points on next use
        _registry._bound.cache_clear()


@pytest.fixture
def counting_host_reads(monkeypatch):
    """``with counting_host_reads() as counts:`` counts torch's host reads inside the block:
    ``.item()``, ``bool(tensor)``, ``.tolist()``, ``.cpu()`` (skips without torch)."""
    torch = pytest.importorskip("torch")

    @contextlib.contextmanager
    def count():
        counts = {"item": 0, "__bool__": 0, "tolist": 0, "cpu": 0}
        for name in counts:
            original = getattr(torch.Tensor, name)

            def counted(self, *args, _original=original, _name=name, **kwargs):
                counts[_name] += 1
                return _original(self, *args, **kwargs)

            monkeypatch.setattr(torch.Tensor, name, counted)
        yield counts
        monkeypatch.undo()

    return count
