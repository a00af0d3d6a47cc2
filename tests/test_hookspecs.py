"""The hookspecs load without a warning under every pluggy the extras allow (CI runs 1.6 and the newest)."""

from __future__ import annotations

import inspect
import warnings

import pluggy
import pytest

from polyamp import _hookspecs, _registry
from polyamp.distributed import _discovery


def test_reducer_specs_are_staticmethods() -> None:
    """pluggy 1.7 deprecates a class-level spec whose first parameter is not ``self``."""
    for name in _hookspecs.REDUCER_HOOKS + ("reducer_accepts",):
        raw = inspect.getattr_static(_hookspecs.ReducerSpec, name)
        assert isinstance(raw, staticmethod), name
        assert getattr(raw.__func__, f"{_hookspecs.PROJECT}_spec", None) is not None, name


@pytest.mark.parametrize("make", [_discovery._plugins.__wrapped__, _registry._plugins.__wrapped__],
                         ids=["reducers", "backends"])
def test_plugin_sets_load_with_warnings_as_errors(make) -> None:
    """Under ``-W error`` (pluggy 1.7 warned for every ReducerSpec spec) the plugin sets still load."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plugins = make()
    assert plugins.broken == {}
    assert plugins.manager.list_name_plugin()


def test_reducer_spec_arguments_are_the_hook_arguments() -> None:
    """The staticmethod spec keeps both arguments (no implicit first one stripped), on any pluggy."""
    plugins = _discovery._plugins.__wrapped__()
    caller = plugins.manager.hook.make_reducer
    assert tuple(caller.spec.argnames) == ("group", "timeout"), pluggy.__version__
    assert caller.spec.opts["firstresult"] is True
