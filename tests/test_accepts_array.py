"""The optional ``accepts_array`` hook: what a backend works on once chosen, versus what it owns.

A plugin here reuses the torch backend's kernels but owns nothing, so it is never picked
automatically; with ``accepts_array`` it still works on torch tensors when chosen by name.
"""

from __future__ import annotations

import types

import pytest

from polyamp import ForeignArrayError, LossScaler, _hookspecs, _registry

torch = pytest.importorskip("torch")


def _plugin(name: str, accepts: bool) -> types.ModuleType:
    from polyamp.backends import torch as torch_backend

    module = types.ModuleType(name)
    for hook in _hookspecs.REQUIRED_HOOKS + _hookspecs.OPTIONAL_HOOKS:
        setattr(module, hook, getattr(torch_backend, hook))
    module.owns_array = lambda array: False
    if accepts:
        module.accepts_array = lambda array: isinstance(array, torch.Tensor)
    return module


@pytest.fixture
def registered():
    """Register test plugins by name; unregister them afterwards."""
    names = []

    def register(name: str, accepts: bool) -> str:
        _registry.register_backend(_plugin(name, accepts), name)
        names.append(name)
        return name

    yield register
    for name in names:
        _registry._plugins().manager.unregister(name=name)
    _registry._bound.cache_clear()


def test_a_chosen_backend_works_on_what_it_accepts(registered):
    scaler = LossScaler(backend=registered("test_accepting", accepts=True))
    grad = torch.full((3,), 4.0)
    scaler.unscale_([grad])
    assert torch.equal(grad, torch.full((3,), 4.0 / 65536))
    assert scaler.backend.name == "test_accepting"


def test_without_accepts_array_a_backend_accepts_what_it_owns(registered):
    scaler = LossScaler(backend=registered("test_owning_nothing", accepts=False))
    with pytest.raises(ForeignArrayError, match="test_owning_nothing"):
        scaler.unscale_([torch.ones(3)])


def test_accepting_does_not_make_a_backend_the_automatic_choice(registered):
    registered("test_accepting_auto", accepts=True)
    assert _registry.backend_for_array(torch.ones(3)).name == "torch"
