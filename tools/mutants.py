"""Deliberately broken builds: apply each named mutant in memory, run the tests that should catch
it, print caught/survived per mutant (a Markdown table). Run before a release:

    python tools/mutants.py                 # every mutant
    python tools/mutants.py NAME [NAME ...]  # some of them
    python tools/mutants.py --list          # the mutants, their targets and tests

A mutant names its target by module and function (``Class.method`` for a method), so it survives
refactors that move code around a function: where the function or the text it edits is gone, the
row says "target not found" and nothing runs. Nothing on disk changes: the tests run in a pytest
subprocess whose ``sitecustomize`` (``tools/_mutant_site``, put first on PYTHONPATH with
``POLYAMP_MUTANT=NAME``) edits the function's source, compiles it in its module's globals and swaps
its code object when the module is imported, in that process and in every process it starts (gloo
ranks, mpirun ranks, subprocess tests).

Outcomes: "caught" (some test failed), "survived" (the tests passed), "not run" (every test was
skipped, e.g. a GPU test on a machine without one), "target not found", or "error (exit N)".
"""

from __future__ import annotations

import argparse
import ast
import datetime
import importlib
import inspect
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any, NamedTuple

ROOT = Path(__file__).resolve().parents[1]
SITE = Path(__file__).resolve().with_name("_mutant_site")
ENV = "POLYAMP_MUTANT"


class Mutant(NamedTuple):
    """One small bug: in ``function`` of ``module``, each ``old`` text replaced by its ``new``."""

    name: str
    module: str  # the dotted import name
    function: str  # the function's qualified name in the module: "f" or "Class.method"
    edits: tuple[tuple[str, str], ...]  # (old, new): every occurrence of old is replaced
    tests: tuple[str, ...]  # pytest arguments: files, node ids, "-k" expressions
    what: str  # the bug, in words
    gpu: bool = False  # only a GPU run can catch it


def _edit(old: str, new: str) -> tuple[tuple[str, str], ...]:
    return ((old, new),)


MUTANTS: tuple[Mutant, ...] = (
    # -- this round (issue 35) -------------------------------------------------------------
    Mutant("trainer-guard-norm-as-sharded", "polyamp._iteration", "Iteration._decision",
           _edit("else self._sent(",  # the rank's values summed over the ranks, as if sharded
                 "else (1 if self.agreement is None else self.agreement.reducer.size) * self._sent("),
           ("tests/distributed/test_trainer_data_parallel.py", "-k", "gloo"),
           "the data-parallel trainer's guard norm sums its replicated squares over the ranks"),
    Mutant("digest-without-backoff-host", "polyamp._agreement", "_host_state",
           (("int(state.backoff_tracker)", "0"), ("int(growth), int(backoff)", "int(growth), 0")),
           ("tests/distributed/test_fingerprint.py",),
           "the fingerprint read on the host leaves out the backoff tracker"),
    Mutant("digest-without-backoff-device", "polyamp.distributed._fingerprint", "Place.fields",
           _edit("growth, backoff]", "growth, growth * 0]"),
           ("tests/distributed/test_fingerprint.py",),
           "the fingerprint built on the device leaves out the backoff tracker"),
    Mutant("one-coefficient-per-rank", "polyamp.distributed._wire", "coefficient",
           _edit("(key & 0xFFFFFFFFFFF) << 20", "0"),
           ("tests/distributed/test_digest.py",),
           "the one-int64 message draws one coefficient per rank for every collective"),
    Mutant("lightning-logs-at-batch", "polyamp.loggers.lightning", "ScalerMetrics.on_train_batch_end",
           _edit("step = trainer.global_step", "step = batch_idx + 1"),
           ("tests/integrations/test_loggers.py", "-k", "lightning"),
           "the Lightning callback logs at batch_idx + 1 instead of trainer.global_step"),
    Mutant("extra-copy-of-the-scale", "polyamp._iteration", "Iteration.decide",
           _edit("decision = self._decision(flag, values, group)",
                 "_s = getattr(self.scaling.state, 'scale', None); "
                 "_s = _s.to('cpu') if hasattr(_s, 'to') else _s; "
                 "decision = self._decision(flag, values, group)"),
           ("tests/test_host_reads.py", "tests/gpu/test_host_reads_cuda.py"),
           "an extra device-to-host copy of the scale in every step decision", gpu=True),
    # -- the last round ----------------------------------------------------------------------
    Mutant("first-tensor-only", "polyamp._scaling", "Scaling.unscale",
           _edit("(arrays, by, found)", "(arrays[:1], by, found)"),
           ("tests/test_engine_overflow.py", "tests/compat/test_torch_overflow.py"),
           "only the first gradient is unscaled and checked"),
    Mutant("first-param-group-only", "polyamp.compat._torch_grads", "_all_grads",
           _edit("for group in groups for g in", "for group in groups[:1] for g in"),
           ("tests/compat/test_torch_optimizers.py", "tests/compat/test_torch_overflow.py"),
           "the torch facade checks the first param group only"),
    Mutant("float-read-in-update", "polyamp._scaling", "Scaling.advance",
           _edit("self.state = backend.update_scale(state, flag, self.config)",
                 "float(backend.to_host(state.scale)); "
                 "self.state = backend.update_scale(state, flag, self.config)"),
           ("tests/test_host_reads.py",),
           "update reads the scale on the host"),
    Mutant("device-path-host-state", "polyamp._agreement", "Agreement._fields",
           _edit("if place.host or isinstance(state, HostState):", "if True:"),
           ("tests/test_host_reads.py",),
           "the agreement's device path reads the state on the host"),
    Mutant("facade-without-floor", "polyamp.backends.torch", "update_scale",
           _edit("torch.clamp_min_(scale, SCALE_FLOOR)", "pass"),
           ("tests/test_scale_floor.py",),
           "torch's fused update backs off below the scale floor"),
    Mutant("guard-ddof-0", "polyamp.guard", "mean_std",
           _edit("/ (n - 1))", "/ n)"),
           ("tests/test_guard.py",),
           "the guard's standard deviation with ddof=0"),
    Mutant("guard-two-sided", "polyamp.guard", "judge",
           _edit("zscores[name] = (value - mean) / std", "zscores[name] = abs(value - mean) / std"),
           ("tests/test_guard.py",),
           "the guard skips values far below the mean too"),
    Mutant("guard-min-history", "polyamp.guard", "judge",
           _edit("len(past) >= guard.history_needed", "len(past) >= 2"),
           ("tests/test_guard.py",),
           "the guard judges before min_history values"),
    Mutant("guard-std-0", "polyamp.guard", "judge",
           _edit("if std > 0 and", "if std >= 0 and"),
           ("tests/test_guard.py",),
           "the guard divides by a zero standard deviation"),
    Mutant("guard-window", "polyamp.guard", "advance",
           _edit("[-guard.window:]", "[-guard.window - 1:]"),
           ("tests/test_guard.py",),
           "the guard's history keeps one value more than its window"),
    Mutant("rule-no-refill", "polyamp.policy", "rule_params",
           _edit("return RuleParams(keeps_count=False, finite_refills=True, growth_delay=0)",
                 "return RuleParams(keeps_count=False, finite_refills=False, growth_delay=0)"),
           ("tests/backends/test_engine_rules.py", "tests/test_policy.py"),
           "torch's and paddle's rules keep the backoff count across finite steps"),
    Mutant("rule-no-growth-delay", "polyamp.policy", "rule_params",
           _edit("growth_delay=1)", "growth_delay=0)"),
           ("tests/backends/test_engine_rules.py", "tests/test_policy.py"),
           "DeepSpeed's rule grows without its one-step delay"),
    Mutant("functional-where-finite-swapped", "polyamp.functional", "where_finite",
           _edit("xp.where(skip, o, n)", "xp.where(skip, n, o)"),
           ("tests/functional/test_api.py", "tests/functional/test_exactness.py"),
           "where_finite keeps the new values on an overflow"),
    Mutant("functional-flag-last-leaf", "polyamp.functional", "unscale",
           _edit("bad = leaf_bad if bad is None else bad | leaf_bad", "bad = leaf_bad"),
           ("tests/functional/test_api.py", "tests/functional/test_exactness.py"),
           "the functional flag is the last gradient's only"),
    Mutant("optax-inner-state-moves", "polyamp.optax", "loss_scaled",
           _edit("inner_state = functional.where_finite(found_inf, inner_state, state.inner_state)",
                 "inner_state = inner_state"),
           ("tests/functional/test_optax.py", "tests/functional/test_review_optax.py"),
           "optax's inner state advances on a skipped step"),
    Mutant("optax-updates-not-zeroed", "polyamp.optax", "loss_scaled",
           _edit("updates = functional.where_finite(found_inf, updates, zeros)", "updates = updates"),
           ("tests/functional/test_optax.py", "tests/functional/test_review_optax.py"),
           "optax applies the updates of a skipped step"),
)

BY_NAME = {m.name: m for m in MUTANTS}


class TargetNotFound(LookupError):
    """The mutant's function, or the text it edits, is not in the code as it is now."""


# -- applying a mutant (in the process that runs the tests) -------------------------------------
def _original(module: Any, qualname: str) -> Any:
    """The plain function behind ``qualname`` in ``module`` (staticmethod, property, wrappers undone)."""
    owner: Any = module
    parts = qualname.split(".")
    for part in parts[:-1]:
        owner = getattr(owner, part, None)
        if owner is None:
            raise TargetNotFound(f"{module.__name__}.{qualname}: no {part!r}")
    found = vars(owner).get(parts[-1]) if isinstance(owner, type) else getattr(owner, parts[-1], None)
    if isinstance(found, (staticmethod, classmethod)):
        found = found.__func__
    if isinstance(found, property):
        found = found.fget
    while hasattr(found, "__wrapped__"):
        found = found.__wrapped__
    if not inspect.isfunction(found):
        raise TargetNotFound(f"{module.__name__}.{qualname}: no such function")
    return found


def patched_code(mutant: Mutant, module: Any) -> tuple[Any, Any]:
    """(the original function, the code object of its mutated source)."""
    func = _original(module, mutant.function)
    source = textwrap.dedent(inspect.getsource(func))
    for old, new in mutant.edits:
        if old not in source:
            raise TargetNotFound(f"{mutant.module}.{mutant.function}: the text {old!r} is gone")
        source = source.replace(old, new)
    tree = ast.parse(source)
    node = tree.body[0]
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        raise TargetNotFound(f"{mutant.module}.{mutant.function}: not a function definition")
    node.decorator_list = []
    namespace: dict[str, Any] = {}
    exec(compile(tree, inspect.getsourcefile(func) or "<mutant>", "exec"), vars(module), namespace)
    code = namespace[node.name].__code__
    if code.co_freevars != func.__code__.co_freevars:
        raise TargetNotFound(f"{mutant.module}.{mutant.function}: its closure cannot be kept")
    return func, code


def apply(mutant: Mutant, module: Any) -> None:
    """Swap the target's code for the mutated code, wherever the function is referenced."""
    func, code = patched_code(mutant, module)
    func.__code__ = code


def install(name: str) -> None:
    """Apply the mutant ``name`` to its module when that is imported (now, if it already is)."""
    mutant = BY_NAME[name]
    if mutant.module in sys.modules:
        _apply_quietly(mutant, sys.modules[mutant.module])
        return
    sys.meta_path.insert(0, _Finder(mutant))


def _apply_quietly(mutant: Mutant, module: Any) -> None:
    try:
        apply(mutant, module)
    except TargetNotFound as exc:
        print(f"polyamp mutant {mutant.name}: target not found ({exc}); running unmutated", file=sys.stderr)


class _Finder:
    """A meta-path finder that applies a mutant right after its module is executed."""

    def __init__(self, mutant: Mutant) -> None:
        self.mutant = mutant

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != self.mutant.module:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                loader, mutant = spec.loader, self.mutant
                exec_module = loader.exec_module

                def exec_then_mutate(module: Any, exec_module: Any = exec_module, mutant: Mutant = mutant
                                     ) -> None:
                    exec_module(module)
                    _apply_quietly(mutant, module)

                loader.exec_module = exec_then_mutate
                sys.meta_path.remove(self)
                return spec
        return None


# -- running (the parent) ------------------------------------------------------------------------
def check(mutant: Mutant) -> str | None:
    """None when the mutant applies to the code as it is, else why not (in a fresh subprocess)."""
    done = subprocess.run([sys.executable, __file__, "--check", mutant.name], capture_output=True,
                          text=True, cwd=ROOT, timeout=300)
    if done.returncode == 0:
        return None
    said = done.stdout.strip() or done.stderr.strip()
    return said.splitlines()[-1] if said else f"exit {done.returncode}"


def run(mutant: Mutant, timeout: float) -> tuple[str, float]:
    """The mutant's outcome and the seconds its tests took."""
    why = check(mutant)
    if why is not None:
        return f"target not found ({why})", 0.0
    env = dict(os.environ, **{ENV: mutant.name})
    env["PYTHONPATH"] = os.pathsep.join([str(SITE), *filter(None, [env.get("PYTHONPATH")])])
    command = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *mutant.tests]
    start = time.monotonic()
    try:
        done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"error (timed out after {timeout:.0f} s)", time.monotonic() - start
    seconds = time.monotonic() - start
    tail = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    if done.returncode == 1:
        return "caught", seconds
    if done.returncode == 0:
        return ("survived" if " passed" in tail else "not run (skipped)"), seconds
    return f"error (exit {done.returncode}: {tail[-80:]})", seconds


def table(rows: list[tuple[Mutant, str, float]]) -> str:
    lines = [f"Mutants run on {datetime.date.today().isoformat()} (`python tools/mutants.py`):", "",
             "| mutant | the bug | tests | outcome |", "|---|---|---|---|"]
    for mutant, outcome, seconds in rows:
        note = " (needs a GPU)" if mutant.gpu and outcome != "caught" else ""
        tests = " ".join(mutant.tests).replace("tests/", "")
        lines.append(f"| `{mutant.name}` | {mutant.what} | `{tests}` | {outcome}{note} ({seconds:.0f} s) |")
    caught = sum(outcome == "caught" for _, outcome, _ in rows)
    lines += ["", f"{caught} of {len(rows)} caught."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="mutants to run (default: all)")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--check", metavar="NAME", help=argparse.SUPPRESS)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per mutant's tests")
    args = parser.parse_args(argv)
    if args.check:
        mutant = BY_NAME[args.check]
        try:
            patched_code(mutant, importlib.import_module(mutant.module))
        except (TargetNotFound, ImportError, OSError) as exc:
            print(exc)
            return 3
        return 0
    unknown = [n for n in args.names if n not in BY_NAME]
    if unknown:
        parser.error(f"unknown mutant(s) {unknown}; known: {', '.join(BY_NAME)}")
    chosen = [BY_NAME[n] for n in args.names] if args.names else list(MUTANTS)
    if args.list:
        for m in chosen:
            print(f"{m.name}: {m.module}.{m.function}: {m.what}; tests: {' '.join(m.tests)}")
        return 0
    rows = []
    for mutant in chosen:
        outcome, seconds = run(mutant, args.timeout)
        print(f"{mutant.name}: {outcome} ({seconds:.0f} s)", flush=True)
        rows.append((mutant, outcome, seconds))
    print()
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
