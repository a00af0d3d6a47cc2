"""Issue 33, item 2: ``polyamp.functional.measure`` counts what the stateful meter counts on every
library, reads nothing on the host, and under ``jax.jit`` traces once."""

from __future__ import annotations

import math

import numpy as np
import pytest

import polyamp
from polyamp import functional as F
from polyamp.precision import PrecisionMeter

TARGETS = (("float16", "loss"), ("bfloat16", 1.0), ("float8_e4m3fn", "amax"), ("float8_e5m2", 2.0**-4))
METER = PrecisionMeter(targets=TARGETS)


def _grads(dtype: str) -> dict[str, np.ndarray]:
    """Gradients spanning float32's normal range, with zeros, infs and nans. No float32 subnormals:
    XLA reads them as 0 (it flushes subnormal inputs), which docs/precision.md says."""
    rng = np.random.default_rng(2)
    spread = rng.standard_normal(2000) * 10.0 ** rng.uniform(-37, 5, 2000)
    spread = np.where(np.abs(spread) < 2.0**-120, 2.0**-120, spread)  # none subnormal in float32
    odd = np.array([0.0, -0.0, math.inf, -math.inf, math.nan, 2.0**-24, 2.0**-25, 65504.0, 65520.0])
    from polyamp._dtypes import numpy_bfloat16

    kind = numpy_bfloat16() if dtype == "bfloat16" else np.dtype(dtype)
    with np.errstate(over="ignore"):
        # keys in sorted order: jax.jit hands a dict to the traced function sorted by key
        return {"b": odd.astype(kind), "empty": np.zeros((0, 3), kind), "w": spread.astype(kind)}


def _numpy_counts(grads: dict[str, np.ndarray], scale: float):
    return METER.count(polyamp.get_backend("numpy"), list(grads.values()), scale)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_measure_counts_what_the_meter_counts_on_every_library(library, dtype):
    if dtype not in library.dtypes:
        pytest.skip(f"{library.name} has no {dtype}")
    grads = _grads(dtype)
    want = _numpy_counts(grads, 2.0**12)
    with library.wide():
        tree = {k: library.make(v) for k, v in grads.items()}
        state = F.init(polyamp.LossScaleConfig(init_scale=2.0**12), like=tree["w"])
        got = F.measure(tree, state, TARGETS)
        counts, extremes = np.asarray(got.counts), np.asarray(got.extremes)
    assert counts.tolist() == want.counts.tolist()
    assert extremes.tolist() == want.extremes.tolist()
    report = METER.report(3, 2.0**12, list(grads), counts, extremes)
    assert [t.name for t in report.tensors] == ["b", "empty", "w"]
    assert report.tensors[1].numel == 0 and report.tensors[1].amin is None


def test_measure_under_jax_jit_traces_once_and_equals_numpy():
    jax = pytest.importorskip("jax", reason="jax is not installed (pip install 'polyamp[jax]')")
    import jax.numpy as jnp

    traces: list = []

    def step(grads, scale):
        traces.append(1)  # runs once per trace
        return F.measure(grads, scale, METER)

    with jax.enable_x64(True):
        jitted = jax.jit(step)
        for seed, scale in enumerate((2.0**10, 2.0**16, 3.0)):
            grads = _grads("float32")
            grads["w"] = grads["w"] * np.float32(1 + seed)
            tree = {k: jnp.asarray(v) for k, v in grads.items()}
            got = jitted(tree, jnp.asarray(scale, jnp.float32))
            want = _numpy_counts(grads, scale)
            assert np.asarray(got.counts).tolist() == want.counts.tolist()
            assert np.asarray(got.extremes).tolist() == want.extremes.tolist()
    assert len(traces) == 1


def test_measure_without_float64_says_how_to_get_it():
    jax = pytest.importorskip("jax", reason="jax is not installed (pip install 'polyamp[jax]')")
    import jax.numpy as jnp

    with jax.enable_x64(False), pytest.raises(polyamp.ConfigError, match="jax_enable_x64"):
        F.measure([jnp.ones(3, jnp.float32)], 1.0)


def test_measure_refuses_what_is_no_gradient():
    with pytest.raises(ValueError, match="at least one gradient"):
        F.measure({}, 1.0)
    with pytest.raises(TypeError, match="a number is no gradient"):
        F.measure([np.ones(2, np.float32), 3.0], 1.0)
    with pytest.raises(polyamp.ConfigError, match="scale must be the loss scale"):
        F.measure([np.ones(2, np.float32)], None)  # the default targets measure float16 at the loss scale
    with pytest.raises(polyamp.ConfigError, match=r"targets\[0\]"):
        F.measure([np.ones(2, np.float32)], 1.0, [("int8", 1.0)])


def test_measure_and_the_meter_make_no_host_read_on_torch(host_reads):
    import torch

    grads = {k: torch.from_numpy(v) for k, v in _grads("float32").items()}
    scale = torch.full((), 2.0**12)
    with host_reads() as reads:
        F.measure(grads, scale, METER)
        METER.count(polyamp.get_backend("torch"), list(grads.values()), scale)
    assert reads.count == 0
