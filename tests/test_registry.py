"""Backend discovery and choice: argument, POLYAMP_BACKEND, arrays, default; clear errors."""

from __future__ import annotations

import subprocess
import sys
import types

import numpy as np
import pytest

import polyamp
from polyamp import (
    BackendNotFoundError,
    BackendUnavailableError,
    ForeignArrayError,
    LossScaler,
)


def test_available_backends_lists_builtins():
    infos = {i.name: i for i in polyamp.available_backends()}
    assert {"numpy", "torch", "array_api"} <= set(infos)
    assert infos["numpy"].available and infos["numpy"].version == np.__version__
    for info in infos.values():
        assert info.available or info.reason


def test_argument_beats_environment(monkeypatch):
    monkeypatch.setenv("POLYAMP_BACKEND", "torch")
    assert LossScaler(backend="numpy").backend.name == "numpy"
    assert LossScaler().backend.name == "torch"


def test_empty_environment_means_unset(monkeypatch):
    monkeypatch.setenv("POLYAMP_BACKEND", "  ")
    scaler = LossScaler()
    assert scaler.backend is None
    scaler.scale(np.float32(1.0))
    assert scaler.backend.name == "numpy"


def test_arrays_choose_backend():
    torch = pytest.importorskip("torch")
    scaler = LossScaler()
    scaler.scale(torch.ones(()))
    assert scaler.backend.name == "torch"


def test_default_is_numpy():
    scaler = LossScaler()
    scaler.update(found_inf=np.float32(0.0))
    assert scaler.backend.name == "numpy"


def test_unknown_backend_error_says_what_and_how(monkeypatch):
    monkeypatch.setenv("POLYAMP_BACKEND", "jax-ish")
    with pytest.raises(BackendNotFoundError) as info:
        LossScaler()
    text = str(info.value)
    assert "'jax-ish'" in text and "POLYAMP_BACKEND=jax-ish" in text
    assert "numpy" in text and "Fix:" in text


HEAVY = ("torch", "jax", "paddle", "cupy")

UNKNOWN_NAME_IMPORTS_NOTHING = f"""
import os, runpy, sys
os.environ["POLYAMP_BACKEND"] = "bogus"
import polyamp
try:
    polyamp.LossScaler()
except polyamp.BackendNotFoundError as exc:
    message = str(exc)
else:
    raise SystemExit("LossScaler() with POLYAMP_BACKEND=bogus did not raise")
sys.argv = ["polyamp", "demo", "--steps", "1", "--no-progress", "--no-plot"]
try:
    runpy.run_module("polyamp", run_name="__main__")  # python -m polyamp demo --steps 1
except SystemExit as exit:
    status = exit.code
print(repr(message))
print(status)
print(",".join(m for m in {HEAVY!r} if m in sys.modules))
"""


def test_unknown_backend_name_imports_no_array_library():
    """Naming the backends (for the unknown-name error) asks no plugin whether it can run: the
    scaler and ``python -m polyamp demo`` refuse 'bogus' without importing torch/jax/paddle/cupy."""
    out = subprocess.run([sys.executable, "-c", UNKNOWN_NAME_IMPORTS_NOTHING], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    message, status, imported = out.stdout.splitlines()
    assert "unknown polyamp backend 'bogus'" in message and "POLYAMP_BACKEND=bogus" in message
    for name in ("numpy", "torch", "jax", "paddle", "cupy", "array_api", "Fix:", "polyamp info"):
        assert name in message
    assert status == "2"
    assert "polyamp demo: error: unknown polyamp backend 'bogus'" in out.stderr
    assert imported == ""


def test_unknown_backend_error_asks_no_plugin_whether_it_can_run(registry_restored):
    from polyamp._hookspecs import hookimpl

    asked = []
    plugin = types.ModuleType("slow_backend")

    @hookimpl
    def backend_info():
        asked.append("backend_info")
        return {"available": False, "reason": "imports a large library to find out"}

    plugin.backend_info = backend_info
    for hook in ("owns_array", "full", "unscale_and_check", "update_scale", "read_flag"):
        setattr(plugin, hook, hookimpl(lambda *a, **k: False))
    polyamp.register_backend(plugin, "slowlib")
    with pytest.raises(BackendNotFoundError, match="slowlib") as info:
        LossScaler(backend="nope")
    assert "unknown polyamp backend 'nope' (asked for by backend=)" in str(info.value)
    assert asked == []  # the names were enough
    assert not {i.name: i for i in polyamp.available_backends()}["slowlib"].available
    assert asked == ["backend_info"]  # availability is computed where it is asked for


def test_foreign_arrays_are_refused():
    torch = pytest.importorskip("torch")
    scaler = LossScaler(backend="numpy")
    with pytest.raises(ForeignArrayError) as info:
        scaler.scale(torch.ones(()))
    assert "torch.Tensor" in str(info.value) and "'numpy'" in str(info.value)
    assert scaler.state is None  # nothing changed


def test_unavailable_plugin_is_reported_and_refused(registry_restored):
    from polyamp._hookspecs import hookimpl

    plugin = types.ModuleType("fake_gpu_backend")

    @hookimpl
    def backend_info():
        return {"available": False, "reason": "no device found", "version": "0.0"}

    plugin.backend_info = backend_info
    for hook in ("owns_array", "full", "unscale_and_check", "update_scale", "read_flag"):
        setattr(plugin, hook, hookimpl(lambda *a, **k: False))
    polyamp.register_backend(plugin, "fakegpu")
    info = {i.name: i for i in polyamp.available_backends()}["fakegpu"]
    assert not info.available and info.reason == "no device found"
    with pytest.raises(BackendUnavailableError, match="no device found"):
        LossScaler(backend="fakegpu")


def test_plugin_missing_hooks_is_refused():
    with pytest.raises(TypeError, match="lacks required hooks"):
        polyamp.register_backend(types.ModuleType("empty"), "empty")


def test_import_is_cheap():
    code = (
        "import sys, numpy as np, polyamp; s = polyamp.LossScaler(); "
        "s.scale(np.ones(1, np.float32)); s.step([np.ones(1, np.float32)], lambda: None); "
        "print(','.join(m for m in ('torch', 'cupy', 'paddle', 'jax', 'optax') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
