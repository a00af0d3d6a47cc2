"""Copies of a LossScaler (pickle, copy.deepcopy, copy.copy): same state, independent, still working."""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest

from polyamp import LossScaleConfig, LossScaler, NoOpLossScaler, ScalerStateError

COPIERS = {
    "pickle": lambda s: pickle.loads(pickle.dumps(s)),
    "deepcopy": copy.deepcopy,
    "copy": copy.copy,
}


@pytest.fixture(params=sorted(COPIERS))
def copier(request):
    return COPIERS[request.param]


def _run(scaler, make_array, pattern):
    for bad in pattern:
        grads = [make_array(np.array([1.0, np.inf if bad else 2.0], np.float32))]
        scaler.step(grads, lambda: None)
        scaler.update()


def test_unbound_copy_keeps_state(copier):
    scaler = LossScaler(LossScaleConfig(init_scale=32.0, growth_interval=3))
    scaler.update(found_inf=False)  # host state only: no backend chosen yet
    twin = copier(scaler)
    assert twin.backend is None and twin.state_dict() == scaler.state_dict()
    assert twin.config == scaler.config and twin.host_state() == (32.0, 1, 0)


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_bound_copy_keeps_state_works_and_is_independent(copier, backend):
    if backend == "torch":
        torch = pytest.importorskip("torch")
        make_array = torch.from_numpy
    else:
        make_array = np.asarray
    config = LossScaleConfig(init_scale=64.0, growth_interval=2, backoff_interval=2)
    scaler = LossScaler(config)
    _run(scaler, make_array, [False, True, False])
    twin = copier(scaler)
    assert twin.backend.name == scaler.backend.name == backend
    assert twin.state_dict() == scaler.state_dict() and twin.steps == 3 and twin.skipped_steps == 1
    _run(twin, make_array, [False, False])  # keeps working: a growth on the copy
    assert twin.get_scale() == 128.0 and scaler.get_scale() == 64.0  # the original is untouched
    assert type(twin.state.scale) is type(scaler.state.scale)  # noqa: E721 - same array library
    _run(scaler, make_array, [True, True])
    assert scaler.get_scale() == 32.0 and twin.get_scale() == 128.0


def test_copy_mid_iteration_is_refused_and_changes_nothing(copier):
    scaler = LossScaler(LossScaleConfig(init_scale=8.0))
    scaler.unscale_([np.ones(1, np.float32)])
    with pytest.raises(ScalerStateError, match=r"call update\(\) first"):
        copier(scaler)
    assert scaler.has_pending_check
    scaler.update()
    assert copier(scaler).get_scale() == scaler.get_scale()


def test_noop_scaler_copies(copier):
    scaler = NoOpLossScaler(LossScaleConfig(init_scale=4.0))
    scaler.step([np.ones(1)], lambda: None)
    scaler.update()
    twin = copier(scaler)
    assert twin.config == scaler.config and twin.steps == 1
    assert twin.step([np.ones(1)], lambda: None)
