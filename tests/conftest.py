"""Shared fixtures: a backend fixture over every backend that can run here, and array makers;
the suite's parallel layout (pytest-xdist) and its hypothesis profiles."""

from __future__ import annotations

import contextlib
import os

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


# -- running in parallel (README's `python -m pytest -n auto`) ----------------------------------------
#: Fixtures that start several processes (gloo ranks, a job under mpirun).
RANK_FIXTURES = frozenset({"run_gloo", "run_mpi"})


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """``-n N`` without ``--dist`` distributes as ``--dist loadgroup`` (xdist's own default is
    ``load``, which ignores the groups below). Without pytest-xdist nothing changes."""
    if getattr(config.option, "numprocesses", None) and getattr(config.option, "dist", None) == "no":
        config.option.dist = "loadgroup"


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """(xdist's controller) A worker parses the command line again, where ``--dist`` may be absent:
    it is told the mode chosen above."""
    node.workerinput["polyamp_dist"] = node.config.option.dist


def pytest_configure(config):
    if getattr(config, "workerinput", {}).get("polyamp_dist") == "loadgroup":
        config.option.loadgroup = True  # the worker names each test's group, as xdist does for --dist


@pytest.hookimpl(tryfirst=True)  # before xdist's worker reads the groups
def pytest_collection_modifyitems(config, items):
    """Tests that start several processes (a ``run_gloo``/``run_mpi`` job, or marked ``ranks``) run
    one at a time on one xdist worker (``xdist_group("ranks")``): jobs never share the 2 cores
    with each other, and a free port is never raced for by two jobs. The others spread over the
    workers."""
    for item in items:
        if RANK_FIXTURES.intersection(getattr(item, "fixturenames", ())) or item.get_closest_marker("ranks"):
            item.add_marker(pytest.mark.ranks)  # -m "not ranks" leaves every one out
            item.add_marker(pytest.mark.xdist_group("ranks"))


# -- hypothesis: "quick" by default, "slow" (nightly, before a release) with every test's full count ---
#: A costly property test asks for ``n * settings.default.max_examples // 100`` examples: its full
#: ``n`` under "slow", a quarter under "quick" (the default). Choose with ``--hypothesis-profile slow``
#: (hypothesis's own option) or POLYAMP_HYPOTHESIS_PROFILE=slow.
PROFILE_ENV_VAR = "POLYAMP_HYPOTHESIS_PROFILE"


def _register_profiles() -> None:
    try:
        from hypothesis import settings
    except ImportError:  # the suite's property tests skip without it
        return
    settings.register_profile("slow", max_examples=100)  # hypothesis's own default: the full counts
    settings.register_profile("quick", max_examples=25)
    settings.load_profile(os.environ.get(PROFILE_ENV_VAR, "quick"))


_register_profiles()


BACKENDS = ["numpy", "torch", "array_api", "cupy", "paddle"]
_LEFT_OUT: dict[str, str] = {}  # backend -> why the per-backend tests leave it out here


def _runnable_backends() -> list[str]:
    """The BACKENDS that can run here, read once (when a collected test asks for ``backend_name``)."""
    if not hasattr(_runnable_backends, "names"):
        infos = {i.name: i for i in polyamp.available_backends()}
        for name in BACKENDS:
            info = infos.get(name)
            if info is None or not info.available:
                _LEFT_OUT[name] = info.reason if info else "not installed"
        _runnable_backends.names = [n for n in BACKENDS if n not in _LEFT_OUT]
    return _runnable_backends.names


def pytest_generate_tests(metafunc):
    """A test taking ``backend_name`` runs once per backend that can run here. The others are
    reported once at the end of the run, with the reason, not as one skip per test."""
    if "backend_name" in metafunc.fixturenames:
        metafunc.parametrize("backend_name", _runnable_backends(), indirect=True)


def pytest_terminal_summary(terminalreporter):
    for name, reason in _LEFT_OUT.items():
        terminalreporter.write_line(f"per-backend tests left out backend {name!r}: {reason}")


@pytest.fixture
def backend_name(request):
    """Each backend that can run on this machine (``pytest_generate_tests`` picks them)."""
    if request.param == "cupy":
        request.applymarker(pytest.mark.gpu)
    return request.param


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


class HostReads:
    """``with HostReads() as reads:`` counts torch's reads of tensor values by the host in the block.

    At the dispatch level (a ``TorchDispatchMode``): ``aten._local_scalar_dense``, the op behind
    ``.item()``, ``float(t)``, ``int(t)``, ``bool(t)``, ``t.__index__()`` (each a device sync), and
    copies from another device to the CPU (``.cpu()``, ``.to("cpu")``, ``copy_``). ``.numpy()``
    (and so ``np.asarray(t)``/``__array__``) and ``.tolist()`` read memory without dispatching an
    op, so they are counted where Python calls them. ``reads.counts`` says which kind; ``reads.count``
    is the total. Black-box: nothing of polyamp is patched.
    """

    def __init__(self):
        self.counts = {"_local_scalar_dense": 0, "copy_to_cpu": 0, "numpy": 0, "tolist": 0}
        self._undo = []

    @property
    def count(self) -> int:
        return sum(self.counts.values())

    def __enter__(self):
        torch = pytest.importorskip("torch")
        from torch.utils._python_dispatch import TorchDispatchMode

        counts, aten = self.counts, torch.ops.aten

        def on_cpu(device) -> bool:
            return device is not None and torch.device(device).type == "cpu"

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                if func is aten._local_scalar_dense.default:
                    counts["_local_scalar_dense"] += 1
                elif func is aten._to_copy.default and on_cpu(kwargs.get("device")) and not args[0].is_cpu:
                    counts["copy_to_cpu"] += 1
                elif func is aten.copy_.default and args[0].is_cpu and not args[1].is_cpu:
                    counts["copy_to_cpu"] += 1
                return func(*args, **kwargs)

        for name in ("numpy", "tolist"):
            original, base = torch.Tensor.__dict__.get(name), getattr(torch.Tensor, name)

            def counted(tensor, *args, _name=name, _base=base, **kwargs):
                counts[_name] += 1
                return _base(tensor, *args, **kwargs)

            setattr(torch.Tensor, name, counted)
            self._undo.append((name, original))
        self._mode = Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        import torch

        self._mode.__exit__(*exc)
        for name, original in reversed(self._undo):
            if original is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, original)
        self._undo.clear()
        return False


@pytest.fixture
def counting_host_reads():
    """``with counting_host_reads() as counts:`` counts torch's host reads inside the block, by
    kind (a dict; :class:`HostReads`). Skips without torch."""
    pytest.importorskip("torch")

    @contextlib.contextmanager
    def count():
        with HostReads() as reads:
            yield reads.counts

    return count


@pytest.fixture
def host_reads():
    """``with host_reads() as reads:`` ... ``reads.count``: every host read of a torch tensor's
    value in the block (:class:`HostReads`). Skips without torch."""
    pytest.importorskip("torch")
    return HostReads


@pytest.fixture
def lanes(monkeypatch):
    """(f, digest) of every one-value agreement message as it is built, ``f * B + (c * D mod Q)``; none
    in a group of one rank, which sends its flag alone (``c`` would be 0 there)."""
    from polyamp.distributed import _wire

    seen: list[tuple[float, int]] = []
    real = _wire.lane

    def record(share, found, rank, ranks, key):
        seen.append((1.0 if found else 0.0, int(share)))
        return real(share, found, rank, ranks, key)

    monkeypatch.setattr(_wire, "lane", record)
    return seen


def _twins_class():
    from polyamp.distributed import Reducer
    from polyamp.distributed import _wire as wire

    class Twins(Reducer):
        """Rank 0 of ``size`` ranks that all hold its values: each reduction is what those ranks'
        messages reduce to (a MAX: its own, each rank's extra-value slots holding its values; a SUM:
        ``size`` times its own, exact for a power of two;
        the one-value message: every rank's ``f * B + (c_r * D mod Q)``, ``D`` recovered from its own
        ``c_0``). Keeps ``(op, shape, dtype)`` of what it was sent."""

        def __init__(self, size: int = 2) -> None:
            super().__init__("twins", 0, size, None)
            self.sent: list[tuple] = []

        def _prepare(self, array):
            return array

        def _allreduce(self, buffer, op):
            self.sent.append((op, buffer.shape, str(buffer.dtype)))
            if op == "max" and buffer.shape[0] > wire.HEAD:  # the other ranks' slots: its own values
                slots = buffer[wire.HEAD:].reshape(self.size, -1)
                slots[1:] = slots[0]
            if op != "sum":
                return
            if str(buffer.dtype).endswith("int64") and tuple(buffer.shape) == (1,):  # NumPy or a device
                # computed where the buffer lives, with no host read (tests count the library's)
                key, n = self.collectives - 1, self.size  # the reducer's count when the message was built
                flag, v = buffer // wire.B, buffer % wire.B
                c0 = wire.coefficient(0, n, key)  # v = c_0 * D mod Q (c_0 is 0 in a group of one)
                share = wire.mulmod(pow(c0, -1, wire.Q), v) if c0 else v
                total = flag * (n * wire.B)
                for r in range(n):
                    total = total + wire.mulmod(wire.coefficient(r, n, key), share)
                buffer[...] = total
            else:
                buffer *= self.size

        def _barrier(self):
            pass

    return Twins


@pytest.fixture
def twins():
    """``twins(size)``: a reducer standing for ``size`` ranks that all hold this rank's values."""
    return _twins_class()
