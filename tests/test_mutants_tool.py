"""tools/mutants.py: its mutant list parses, every target exists and its edits apply; a target
that moved is reported as not found, never a crash."""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tool():
    spec = importlib.util.spec_from_file_location("polyamp_tools_mutants", ROOT / "tools" / "mutants.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_list_names_each_mutant_once_with_tests_that_exist(tool):
    names = [m.name for m in tool.MUTANTS]
    assert len(names) == len(set(names)) == len(tool.BY_NAME) >= 20
    for mutant in tool.MUTANTS:
        assert mutant.edits and all(old and old != new for old, new in mutant.edits), mutant.name
        files = [t.split("::")[0] for t in mutant.tests if t.startswith("tests/")]
        assert files and all((ROOT / f).exists() for f in files), mutant.name


@pytest.mark.parametrize("name", [
    "trainer-guard-norm-as-sharded", "digest-without-backoff-host", "digest-without-backoff-device",
    "one-coefficient-per-rank", "lightning-logs-at-batch", "extra-copy-of-the-scale", "first-tensor-only",
    "first-param-group-only", "float-read-in-update", "device-path-host-state", "facade-without-floor",
    "guard-ddof-0", "guard-two-sided", "guard-min-history", "guard-std-0", "guard-window",
    "rule-no-refill", "rule-no-growth-delay", "functional-where-finite-swapped",
    "functional-flag-last-leaf", "optax-inner-state-moves", "optax-updates-not-zeroed",
])
def test_each_target_exists_and_its_edits_apply(tool, name):
    mutant = tool.BY_NAME[name]
    try:
        module = importlib.import_module(mutant.module)
    except ImportError as exc:  # an optional dependency (torch, lightning, optax) is not installed
        pytest.skip(f"{mutant.module} does not import here: {exc}")
    func, code = tool.patched_code(mutant, module)
    assert code is not func.__code__ and code.co_name == func.__code__.co_name


def test_a_moved_target_is_reported_not_a_crash(tool):
    import polyamp.guard

    moved = tool.BY_NAME["guard-ddof-0"]._replace(function="no_such_function")
    with pytest.raises(tool.TargetNotFound, match="no such function"):
        tool.patched_code(moved, polyamp.guard)
    gone = tool.BY_NAME["guard-ddof-0"]._replace(edits=(("text that is not there", "x"),))
    with pytest.raises(tool.TargetNotFound, match="is gone"):
        tool.patched_code(gone, polyamp.guard)


def test_a_mutant_applies_in_memory_and_leaves_the_file_alone(tool):
    import polyamp.guard

    path = Path(polyamp.guard.__file__)
    before, original = path.read_text(), polyamp.guard.mean_std.__code__
    history = [1.0, 2.0, 3.0]
    want = polyamp.guard.mean_std(history)
    try:
        tool.apply(tool.BY_NAME["guard-ddof-0"], polyamp.guard)
        assert polyamp.guard.mean_std(history) != want  # ddof=0: a smaller std
    finally:
        polyamp.guard.mean_std.__code__ = original
    assert polyamp.guard.mean_std(history) == want and path.read_text() == before
