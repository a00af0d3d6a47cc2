"""polyamp.compat.torch.install(): torch's scaler names build polyamp's scalers, until uninstall()."""

from __future__ import annotations

import importlib
import pickle
import subprocess
import sys
import textwrap
import warnings

import pytest

torch = pytest.importorskip("torch")

import polyamp.compat.torch as pt  # noqa: E402
from polyamp.compat._torch_install import TORCH_NAMES  # noqa: E402


def _bindings() -> dict[tuple[str, str], object]:
    out = {}
    for mod_name, name, _kind in TORCH_NAMES:
        try:
            module = importlib.import_module(mod_name)
        except ImportError:
            continue
        if hasattr(module, name):
            out[(mod_name, name)] = getattr(module, name)
    return out


@pytest.fixture
def clean():
    """Each test starts and ends uninstalled (a failing test must not leave torch patched)."""
    before = _bindings()
    pt.uninstall()
    yield before
    pt.uninstall()
    assert _bindings() == before


def test_importing_polyamp_installs_nothing():
    code = textwrap.dedent(
        """
        import polyamp, polyamp.compat.torch, polyamp.compat._torch_install
        import torch, torch.cuda.amp, torch.distributed.fsdp.sharded_grad_scaler as s
        assert torch.amp.GradScaler.__module__ == "torch.amp.grad_scaler", torch.amp.GradScaler
        assert torch.cuda.amp.GradScaler.__module__ == "torch.cuda.amp.grad_scaler"
        assert s.ShardedGradScaler.__module__ == "torch.distributed.fsdp.sharded_grad_scaler"
        assert not polyamp.compat.torch._INSTALLER.installed
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_install_without_torch_says_so_and_installs_nothing():
    code = textwrap.dedent(
        """
        import sys
        sys.modules["torch"] = None  # torch does not import
        import polyamp.compat.torch as pt
        try:
            pt.install()
        except ImportError as exc:
            assert "pip install 'polyamp[torch]'" in str(exc), exc
        else:
            raise AssertionError("install() without torch did not raise")
        assert not pt._INSTALLER.installed
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_install_patches_every_name_and_uninstall_restores_exactly(clean):
    before = clean
    with pt.install() as installation:
        assert installation.owner
        for (mod_name, name), original in before.items():
            stand_in = getattr(importlib.import_module(mod_name), name)
            assert stand_in is not original, (mod_name, name)
            base = pt.ShardedGradScaler if name == "ShardedGradScaler" else pt.GradScaler
            assert issubclass(stand_in, base), (mod_name, name)
        assert isinstance(torch.amp.GradScaler("cpu"), pt.GradScaler)
    assert _bindings() == before


def test_install_twice_and_uninstall_as_a_function(clean):
    before = clean
    first = pt.install()
    with pt.install() as second:  # already installed: this one does not own the installation
        assert not second.owner
    assert torch.amp.GradScaler is not before[("torch.amp", "GradScaler")]
    pt.uninstall()
    pt.uninstall()  # a no-op when not installed
    assert first.owner and _bindings() == before


def test_module_imported_before_and_during_install(clean, tmp_path, monkeypatch):
    """A module's own ``from torch.amp import GradScaler`` is patched; an alias keeps torch's."""
    for name in ("pa_before", "pa_during"):
        (tmp_path / f"{name}.py").write_text(
            "from torch.amp import GradScaler\nfrom torch.amp import GradScaler as TorchGradScaler\n"
            "def make():\n    return GradScaler('cpu')\n"
        )
    monkeypatch.syspath_prepend(str(tmp_path))
    torch_class = torch.amp.GradScaler
    try:
        before = importlib.import_module("pa_before")
        with pt.install():
            during = importlib.import_module("pa_during")
            for module in (before, during):
                assert isinstance(module.make(), pt.GradScaler)
            assert before.TorchGradScaler is torch_class  # an alias is left alone
            assert during.TorchGradScaler is not torch_class  # bound while installed
        for module in (before, during):
            assert module.GradScaler is torch_class and module.TorchGradScaler is torch_class
            assert type(module.make()) is torch_class
    finally:
        sys.modules.pop("pa_before", None)
        sys.modules.pop("pa_during", None)


def test_a_scaler_built_through_torch_trains_as_torch_does(clean):
    """Same skip, backoff and weights as torch's own scaler, with an overflow forced at step 2."""

    def run(make):
        torch.manual_seed(0)
        w = torch.nn.Parameter(torch.randn(4))
        opt = torch.optim.SGD([w], lr=0.1)
        scaler = make()
        scales = []
        for step in range(4):
            opt.zero_grad()
            loss = (w * w).sum() * (float("inf") if step == 2 else 1.0)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
        return w.detach().clone(), scales

    expected = run(lambda: torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=2))
    with pt.install():
        got = run(lambda: torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=2))
        scaler = torch.amp.GradScaler("cpu")
    assert got[1] == expected[1] == [1024.0, 2048.0, 1024.0, 1024.0]
    assert torch.equal(got[0], expected[0])
    assert isinstance(scaler, pt.GradScaler)


def test_per_device_warnings_point_at_the_users_line(clean):
    """The deprecation (and, without CUDA, the disabling) warning names the line that built the scaler,
    as torch's own do: not a line of polyamp's."""
    import inspect

    with pt.install(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = inspect.currentframe().f_lineno + 1
        torch.cuda.amp.GradScaler(init_scale=4.0)
        torch.cpu.amp.GradScaler()
    with warnings.catch_warnings(record=True) as theirs:  # torch's own, for the same call
        warnings.simplefilter("always")
        torch.cpu.amp.GradScaler()
    expected = [("cuda", "deprecated", line), ("cpu", "deprecated", line + 1)]
    if not torch.cuda.is_available():
        expected.append(("cuda", "CUDA is not available", line))
    for device, says, lineno in expected:
        (w,) = [w for w in caught if f"torch.{device}.amp.GradScaler" in str(w.message)
                and says in str(w.message)]
        assert (w.filename, w.lineno) == (__file__, lineno), (str(w.message), w.filename, w.lineno)
    (torch_own,) = [w for w in theirs if issubclass(w.category, FutureWarning)]
    assert torch_own.filename == __file__  # what torch does, which polyamp's stand-in matches


def test_per_device_classes_keep_torch_signature_and_warnings(clean):
    with pt.install(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cpu = torch.cpu.amp.GradScaler(4.0, growth_interval=3)
        cuda = torch.cuda.amp.GradScaler(init_scale=4.0)
    assert isinstance(cpu, pt.GradScaler) and cpu._device == "cpu"
    assert (cpu.get_scale(), cpu.get_growth_interval()) == (4.0, 3)
    messages = [str(w.message) for w in caught]
    assert any("torch.cpu.amp.GradScaler(args...)` is deprecated" in m for m in messages)
    if not torch.cuda.is_available():  # torch's rule: a CUDA scaler without CUDA disables itself
        assert not cuda.is_enabled() and isinstance(cuda, pt.GradScaler)
        assert any("CUDA is not available" in m for m in messages)


def test_stand_ins_pickle_as_polyamp_classes(clean):
    with pt.install(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.cpu.amp's deprecation
        scalers = [torch.amp.GradScaler("cpu", init_scale=8.0), torch.cpu.amp.GradScaler(),
                   torch.amp.GradScaler("cpu", enabled=False)]
    restored = [pickle.loads(pickle.dumps(s)) for s in scalers]  # loads with nothing installed
    assert type(restored[0]) is pt.GradScaler and restored[0].get_scale() == 8.0
    assert type(restored[1]) is pt.GradScaler
    assert not restored[2].is_enabled() and isinstance(restored[2], pt.GradScaler)


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built")
def test_sharded_grad_scaler_name(clean):
    from torch.distributed.fsdp import sharded_grad_scaler

    with pt.install():
        assert issubclass(sharded_grad_scaler.ShardedGradScaler, pt.ShardedGradScaler)
    assert sharded_grad_scaler.ShardedGradScaler.__module__ == sharded_grad_scaler.__name__
