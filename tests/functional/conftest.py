"""Libraries for the functional tests: each turns NumPy gradients into its arrays and back."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from polyamp._dtypes import numpy_bfloat16


@dataclass(frozen=True)
class Library:
    """How one array library holds the test's gradients (``dtypes``: those it has here)."""

    name: str
    make: Callable[[np.ndarray], Any]  # a NumPy array (any float dtype) -> this library's array
    back: Callable[[Any], np.ndarray]  # and back, as float64 (every value of the narrower floats)
    dtypes: tuple[str, ...]
    wide: Callable[[], Any] = contextlib.nullcontext  # a context with float64 (JAX: enable_x64)


def _torch() -> Library:
    torch = pytest.importorskip("torch")
    kinds = {"float32": torch.float32, "float16": torch.float16, "float64": torch.float64,
             "bfloat16": torch.bfloat16}

    def make(a: np.ndarray) -> Any:
        return torch.from_numpy(a.astype(np.float64)).to(kinds[_name(a)])

    return Library("torch", make, lambda t: t.detach().double().numpy(), tuple(kinds))


def _strict() -> Library:
    xps = pytest.importorskip("array_api_strict")
    return Library("array_api_strict", lambda a: xps.asarray(a.copy()),
                   lambda t: np.asarray(t).astype(np.float64), ("float32", "float64"))


def _jax() -> Library:
    jax = pytest.importorskip("jax", reason="jax is not installed (pip install 'polyamp[jax]')")
    import jax.numpy as jnp

    def make(a: np.ndarray) -> Any:
        return jnp.asarray(a.astype(np.float64), dtype=getattr(jnp, _name(a)))

    return Library("jax", make, lambda t: np.asarray(t.astype(jnp.float32)).astype(np.float64)
                   if t.dtype != jnp.float64 else np.asarray(t),
                   ("float32", "float16", "bfloat16"), lambda: jax.enable_x64(True))


def _numpy() -> Library:
    return Library("numpy", lambda a: a.copy(), lambda a: a.astype(np.float64),
                   ("float32", "float16", "float64", "bfloat16"))


def _name(a: np.ndarray) -> str:
    return "bfloat16" if a.dtype == numpy_bfloat16() else a.dtype.name


def _cupy() -> Library:
    import cupy as cp

    return Library("cupy", lambda a: cp.asarray(a), lambda t: cp.asnumpy(t).astype(np.float64),
                   ("float32", "float16", "float64"))


LIBRARIES = {"numpy": _numpy, "torch": _torch, "array_api_strict": _strict, "jax": _jax, "cupy": _cupy}


def _params() -> list[str]:
    """The libraries to hold the core to; CuPy only where its backend can run (a CUDA device):
    tests/gpu and the per-backend tests report its absence once, not per test here."""
    import polyamp

    cupy_runs = any(i.name == "cupy" and i.available for i in polyamp.available_backends())
    return [name for name in LIBRARIES if name != "cupy" or cupy_runs]


@pytest.fixture(params=_params())
def library(request) -> Library:
    """Each library the functional core is held to (skipped with the reason where one is absent)."""
    return LIBRARIES[request.param]()


@pytest.fixture
def ulp() -> Callable[[np.ndarray, str], np.ndarray]:
    """:func:`ulp_of`, for tests (a conftest is not importable under --import-mode=importlib)."""
    return ulp_of


def ulp_of(values: np.ndarray, dtype: str) -> np.ndarray:
    """One unit in the last place of ``values`` (normal floats) in ``dtype``, as float64.

    bfloat16 keeps float32's exponent with 8 significand bits instead of 24: 2**16 float32 ulps.
    """
    magnitude = np.abs(values)
    if dtype == "bfloat16":
        return np.spacing(magnitude.astype(np.float32)).astype(np.float64) * 2.0**16
    return np.spacing(magnitude.astype(dtype)).astype(np.float64)


@pytest.fixture
def make_step():
    """``make_step(optimizer, config, traces)``: issue 24's hand-written functional training step
    (test_jax_jit.py jits it; test_optax.py holds polyamp.optax against it)."""
    jax = pytest.importorskip("jax", reason="jax is not installed (pip install 'polyamp[jax]')")
    optax = pytest.importorskip("optax", reason="optax is not installed (pip install 'polyamp[optax]')")
    import jax.numpy as jnp

    from polyamp import functional as F

    return functools.partial(_step, jax, jnp, optax, F)


def _step(jax, jnp, optax, F, optimizer, config, traces: list):
    def step(params, opt_state, ls, x, y, poison):
        traces.append(1)  # a Python side effect: runs once per trace, never when the compiled step runs

        def scaled_loss(p):
            loss = jnp.mean((x @ p["w"] + p["b"] - y) ** 2) * poison
            return F.scale(ls, loss)

        scaled = jax.grad(scaled_loss)(params)
        grads, found_inf = F.unscale(ls, scaled)
        updates, new_opt_state = optimizer.update(grads, opt_state, params)
        params = F.where_finite(found_inf, optax.apply_updates(params, updates), params)
        opt_state = F.where_finite(found_inf, new_opt_state, opt_state)
        return params, opt_state, F.update(ls, found_inf, config), scaled, grads, found_inf

    return step
