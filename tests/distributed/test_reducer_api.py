"""polyamp.distributed without processes: imports, discovery, plugins, argument checks, polling."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
import time
import types
from importlib.metadata import entry_points

import numpy as np
import pytest

import polyamp
from polyamp import ConfigError, ForeignArrayError, PolyampError
from polyamp._hookspecs import REDUCER_GROUP, hookimpl
from polyamp.distributed import (
    DEFAULT_TIMEOUT,
    Reducer,
    ReducerError,
    ReducerTimeoutError,
    ReducerUnavailableError,
    _discovery,
    check_timeout,
    reducer,
    register_reducer,
    wait_until,
)

BUILT_INS = {"torch", "mpi", "cupy_nccl"}


class LocalReducer(Reducer):
    """A one-rank reducer (the sum over one rank is the array itself): a real, complete plugin."""

    def __init__(self, timeout: float | None = None) -> None:
        super().__init__("local", 0, 1, timeout)

    def _prepare(self, array):
        if not isinstance(array, np.ndarray):
            raise ForeignArrayError(f"{self.describe()} takes NumPy arrays, got {type(array).__name__}")
        return array

    def _allreduce(self, array, op):
        pass

    def _barrier(self):
        pass


class LocalGroup:
    """The object the local plugin accepts."""


def _run(code: str, **env) -> str:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                         timeout=120, env={**os.environ, **env})
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_imports_pull_in_no_engine():
    out = _run("""
        import sys, polyamp
        assert "polyamp.distributed" not in sys.modules
        import polyamp.distributed
        polyamp.distributed._discovery._plugins()  # loads every reducer plugin
        print(",".join(m for m in ("torch", "mpi4py", "cupy", "paddle") if m in sys.modules))
    """)
    assert out == ""


def test_unknown_objects_and_names_are_refused_naming_type_and_kinds():
    with pytest.raises(TypeError) as info:
        reducer(3.5)
    text = str(info.value)
    assert "builtins.float" in text and "3.5" in text
    for kind in ("torch.distributed ProcessGroup", "'torch'", "mpi4py communicator", "'mpi'",
                 "NcclCommunicator", "polyamp.distributed.Reducer", "polyamp.reducers"):
        assert kind in text, kind
    with pytest.raises(ConfigError, match="'gloo'"):  # a str is a value error: not a known name
        reducer("gloo")


@pytest.mark.parametrize("bad", [0, -1.0, math.inf, math.nan, "5", True, [1.0]])
def test_bad_timeouts_are_refused_before_any_engine_is_asked(bad):
    with pytest.raises(ConfigError, match="timeout must be a positive, finite number") as info:
        reducer("mpi", timeout=bad)
    assert "timeout=" in str(info.value)
    assert check_timeout(2) == 2.0 and check_timeout(None) is None


def test_a_reducer_passes_through_and_cannot_be_given_a_new_timeout():
    local = LocalReducer()
    assert reducer(local) is local
    with pytest.raises(ConfigError, match="cannot change the existing reducer"):
        reducer(local, timeout=5)


def test_the_base_class_counts_collectives_and_refusals_issue_none():
    local = LocalReducer()
    x = np.ones(3, np.float32)
    assert local.allreduce_sum_(x) is x and local.allreduce_max_(x) is x
    local.barrier()
    with pytest.raises(ForeignArrayError):
        local.allreduce_sum_([1.0])
    assert local.collectives == 3
    assert repr(local) == "<LocalReducer 'local' rank 0 of 1, timeout engine default, 3 collectives>"


@pytest.mark.parametrize("rank, size", [(1, 1), (-1, 2), (4, 3), (None, 2), (0.5, 2), (True, 2), (0, "2")])
def test_a_rank_outside_its_group_is_refused(rank, size):
    """The agreement's coefficients cancel only over ranks 0 .. size - 1 (e.g. not a global rank)."""
    from polyamp import ConfigError

    class Numbered(LocalReducer):
        def __init__(self) -> None:
            Reducer.__init__(self, "numbered", rank, size, None)

    expected = f"rank={rank!r} is not within .*size={size!r}.*Fix: give this process's rank"
    with pytest.raises(ConfigError, match=expected):
        Numbered()


def test_a_registered_plugin_is_asked_and_must_return_a_reducer():
    plugin = types.ModuleType("local_reducer_plugin")
    plugin.make_reducer = hookimpl(lambda group, timeout: LocalReducer(timeout)
                                   if isinstance(group, LocalGroup) else None)
    plugin.reducer_accepts = hookimpl(lambda: "a LocalGroup (tests)")
    register_reducer(plugin, "local-test")
    made = reducer(LocalGroup(), timeout=4)
    assert isinstance(made, LocalReducer) and made.timeout == 4.0
    with pytest.raises(TypeError) as info:
        reducer(object())
    assert "a LocalGroup (tests)" in str(info.value) and "local-test" in str(info.value)

    class OddGroup:
        pass

    odd = types.ModuleType("odd_reducer_plugin")
    odd.make_reducer = hookimpl(lambda group: "not a reducer" if isinstance(group, OddGroup) else None)
    register_reducer(odd, "odd-test")
    with pytest.raises(TypeError, match="returned str .* not a polyamp.distributed.Reducer"):
        reducer(OddGroup())
    with pytest.raises(TypeError, match="lacks required hooks"):
        register_reducer(types.ModuleType("empty"), "empty-test")


def test_built_in_reducers_are_entry_points_of_their_own_group_not_backends():
    names = {ep.name for ep in entry_points(group=REDUCER_GROUP)}
    assert BUILT_INS <= names
    impls = _discovery._plugins().manager.hook.make_reducer.get_hookimpls()
    # trylast: whatever the order entry points load in, pluggy asks every other plugin first
    assert {impl.plugin_name for impl in impls if impl.trylast} == BUILT_INS
    backends = {info.name for info in polyamp.available_backends()}
    assert not ({"mpi", "cupy_nccl"} & backends)
    assert not any("reducer" in info.reason for info in polyamp.available_backends())


def test_a_third_party_entry_point_is_found_and_asked_before_the_built_ins(tmp_path):
    site = tmp_path / "site"
    (site / "thirdred-1.0.dist-info").mkdir(parents=True)
    metadata = "Metadata-Version: 2.1\nName: thirdred\nVersion: 1.0\n"
    (site / "thirdred-1.0.dist-info" / "METADATA").write_text(metadata)
    (site / "thirdred-1.0.dist-info" / "entry_points.txt").write_text(
        "[polyamp.reducers]\nthirdred = thirdred\nbrokenred = brokenred_missing_module\n"
    )
    (site / "thirdred.py").write_text(textwrap.dedent("""
        from polyamp._hookspecs import hookimpl
        from polyamp.distributed import Reducer

        class Group:
            pass

        class ThirdReducer(Reducer):
            def __init__(self, timeout):
                super().__init__("third", 0, 1, timeout)
            def _prepare(self, array):
                return array
            def _allreduce(self, array, op):
                pass
            def _barrier(self):
                pass

        @hookimpl
        def make_reducer(group, timeout):
            if isinstance(group, Group) or group == "mpi":  # claims "mpi" too: asked first
                return ThirdReducer(timeout)
            return None

        @hookimpl
        def reducer_accepts():
            return "a thirdred.Group"
    """))
    out = _run("""
        import sys, polyamp, polyamp.distributed as d, thirdred
        assert d.reducer(thirdred.Group()).name == "third"
        assert d.reducer("mpi", timeout=7).timeout == 7.0 and "mpi4py" not in sys.modules
        try:
            d.reducer(b"x")
        except TypeError as exc:
            print(exc)
        print("backends:", sorted(i.name for i in polyamp.available_backends()))
    """, PYTHONPATH=str(site))
    assert "a thirdred.Group" in out and "thirdred" in out
    assert "failed to load: brokenred (ModuleNotFoundError" in out
    assert "brokenred" not in out.splitlines()[-1] and "thirdred" not in out.splitlines()[-1]


def test_missing_engines_give_a_clear_unavailable_error():
    out = _run("""
        import sys
        sys.modules["mpi4py"] = None  # as if mpi4py were not installed
        from polyamp.distributed import ReducerUnavailableError, reducer
        try:
            reducer("mpi")
        except ReducerUnavailableError as exc:
            print(exc)
    """)
    assert "reducer 'mpi' needs mpi4py" in out and "pip install 'polyamp[mpi]'" in out
    dist = pytest.importorskip("torch.distributed")
    if dist.is_available() and dist.is_initialized():
        pytest.skip("a default process group is initialised in this process")
    with pytest.raises(ReducerUnavailableError, match=r"init_process_group\(backend"):
        reducer("torch")


def test_error_hierarchy():
    assert issubclass(ReducerTimeoutError, ReducerError) and issubclass(ReducerTimeoutError, TimeoutError)
    assert issubclass(ReducerError, PolyampError) and issubclass(ReducerError, RuntimeError)
    assert issubclass(ReducerUnavailableError, ReducerError)
    assert DEFAULT_TIMEOUT == 300.0


def test_wait_until_returns_at_once_when_done_and_after_the_timeout_when_not():
    start = time.monotonic()
    assert wait_until(lambda: True, 10.0) and time.monotonic() - start < 0.05
    calls = []
    assert wait_until(lambda: calls.append(1) or len(calls) >= 5, 10.0) and len(calls) == 5
    start = time.monotonic()
    assert not wait_until(lambda: False, 0.2)
    assert 0.2 <= time.monotonic() - start < 0.2 + 0.5
