"""install() under threads, and isinstance with torch's classes while installed and after uninstall()."""

from __future__ import annotations

import copy
import importlib
import pickle
import threading
import warnings

import pytest

torch = pytest.importorskip("torch")

import polyamp.compat.torch as pt  # noqa: E402
from polyamp.compat._torch_install import TORCH_NAMES  # noqa: E402

import polyamp  # noqa: E402


def _bindings() -> dict[tuple[str, str], object]:
    out = {}
    for mod_name, name, _kind in TORCH_NAMES:
        module = importlib.import_module(mod_name)
        if hasattr(module, name):
            out[(mod_name, name)] = getattr(module, name)
    return out


@pytest.fixture
def clean():
    """Starts and ends uninstalled; the bindings at the start are torch's own classes."""
    pt.uninstall()
    before = _bindings()
    assert all(cls.__module__.startswith("torch.") for cls in before.values()), before
    yield before
    pt.uninstall()
    assert _bindings() == before


def _race(n_threads: int, action) -> list[object]:
    """Run ``action`` on ``n_threads`` threads released together by a barrier; their results."""
    barrier = threading.Barrier(n_threads)
    results: list[object] = [None] * n_threads
    errors: list[BaseException] = []

    def run(i: int) -> None:
        barrier.wait()
        try:
            results[i] = action()
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    return results


def test_threads_racing_install_leave_one_installation_and_torch_restorable(clean):
    before = clean
    for _ in range(30):
        installations = _race(4, pt.install)
        assert sum(inst.owner for inst in installations) == 1  # exactly one installed
        recorded = set(pt._INSTALLER._originals.values())
        assert recorded <= set(before.values()), recorded  # only torch's classes recorded as torch's
        assert all(_bindings()[key] is not cls for key, cls in before.items())
        _race(4, pt.uninstall)
        assert _bindings() == before  # torch's classes back, not a stand-in


def test_threads_racing_install_and_uninstall_end_consistent(clean):
    before = clean
    for _ in range(30):
        _race(4, lambda: pt.install() if threading.get_ident() % 2 else pt.uninstall())
        now = _bindings()
        if pt._INSTALLER.installed:
            assert all(now[key] is not cls for key, cls in before.items())
        else:
            assert now == before
        pt.uninstall()
        assert _bindings() == before


def _sharded(cls):
    return cls("cpu", process_group="gloo")  # the group is resolved at first use only


def _built_through_torch() -> dict[str, object]:
    """Every kind of scaler a trainer builds through torch's names (while installed)."""
    from torch.distributed.fsdp import sharded_grad_scaler

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.cuda/cpu.amp's deprecation
        warnings.simplefilter("ignore", UserWarning)  # a CUDA scaler without CUDA disables itself
        built = {
            "torch.amp": torch.amp.GradScaler("cpu", init_scale=8.0),
            "torch.amp disabled": torch.amp.GradScaler("cpu", enabled=False),
            "torch.cuda.amp": torch.cuda.amp.GradScaler(),
            "torch.cpu.amp": torch.cpu.amp.GradScaler(),
            "fsdp": sharded_grad_scaler.ShardedGradScaler("cpu", process_group=None),
        }
    built.update({f"deepcopy of {k}": copy.deepcopy(v) for k, v in list(built.items())})
    built.update({f"copy of {k}": copy.copy(v) for k, v in list(built.items()) if "copy" not in k})
    return built


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built")
def test_isinstance_of_torch_classes_while_installed_and_after(clean):
    torch_amp = clean[("torch.amp", "GradScaler")]
    torch_cpu = clean[("torch.cpu.amp", "GradScaler")]
    torch_fsdp = clean[("torch.distributed.fsdp.sharded_grad_scaler", "ShardedGradScaler")]
    with pt.install():
        built = _built_through_torch()
        own = {"polyamp.GradScaler": polyamp.GradScaler("cpu"),
               "pt.ShardedGradScaler": pt.ShardedGradScaler("cpu")}
        own.update({f"deepcopy of {k}": copy.deepcopy(v) for k, v in list(own.items())})
        for name, scaler in {**built, **own}.items():
            assert isinstance(scaler, torch.amp.GradScaler), name  # as torch: every scaler is one
            assert isinstance(scaler, pt.GradScaler), name
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        assert isinstance(own["pt.ShardedGradScaler"], ShardedGradScaler)
        assert not isinstance(own["polyamp.GradScaler"], ShardedGradScaler)
        assert not isinstance(own["polyamp.GradScaler"], torch.cpu.amp.GradScaler)  # torch: not either
        assert not isinstance(built["torch.cuda.amp"], torch.cpu.amp.GradScaler)
        assert isinstance(built["torch.cpu.amp"], torch.cpu.amp.GradScaler)
    for name, scaler in built.items():  # after uninstall(): still torch's, as a resume checks
        assert isinstance(scaler, torch_amp), name
        assert isinstance(copy.deepcopy(scaler), torch_amp), name
    assert isinstance(built["torch.cpu.amp"], torch_cpu)
    assert isinstance(built["fsdp"], torch_fsdp) and isinstance(built["deepcopy of fsdp"], torch_fsdp)
    assert built["deepcopy of torch.amp"].get_scale() == 8.0
    assert not isinstance(own["polyamp.GradScaler"], torch_amp)  # polyamp's own class: only while installed


def test_stand_ins_run_polyamp_code_only(clean):
    """polyamp's classes come first: torch's __init__ never runs (no _per_optimizer_states), and a
    private method only torch has is refused instead of running on polyamp's state."""
    with pt.install():
        scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
        module = importlib.import_module("torch.distributed.fsdp.sharded_grad_scaler")
        sharded_class = module.ShardedGradScaler
        sharded = sharded_class("cpu", process_group=None)
    assert not hasattr(scaler, "_per_optimizer_states")
    assert scaler.get_scale() == 4.0
    with pytest.raises(NotImplementedError, match="_amp_update_scale_cpu_.*Fix:"):
        sharded._amp_update_scale_cpu_(torch.zeros(()))


def test_pickle_still_loads_as_polyamp_class_and_user_subclasses_keep_theirs(clean):
    with pt.install():
        scaler = torch.amp.GradScaler("cpu", init_scale=16.0)
        restored = pickle.loads(pickle.dumps(scaler))
        assert type(restored) is pt.GradScaler and restored.get_scale() == 16.0
        mine = _Mine("cpu", init_scale=32.0)
        assert isinstance(mine, torch.amp.GradScaler)
    restored = pickle.loads(pickle.dumps(mine))
    assert type(restored) is _Mine and restored.get_scale() == 32.0


with pt.install():  # defined while installed, as a trainer module imported meanwhile does
    class _Mine(torch.amp.GradScaler):
        pass
