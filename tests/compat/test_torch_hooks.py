"""Subclasses overriding torch's ``_unscale_grads_`` / ``_maybe_opt_step`` have them called as torch does."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import polyamp.compat.torch as pt  # noqa: E402

TORCH_SCALER = torch.amp.GradScaler  # torch's own, bound before anything installs


class ArgsSGD(torch.optim.SGD):
    """SGD whose step takes extra arguments, to see that step() passes them through."""

    def step(self, tag=None, *, extra=None):  # noqa: D102
        super().step()
        return (tag, extra)


def _flags(per_device):
    return {str(device): float(flag) for device, flag in per_device.items()}


class Logging:
    """Logs what torch hands the two hooks (types, values), then defers to the class underneath."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.log = []

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        entry = ["_unscale_grads_", type(optimizer).__name__, type(inv_scale).__name__, inv_scale.dtype,
                 tuple(inv_scale.shape), float(inv_scale), type(found_inf).__name__, found_inf.dtype,
                 float(found_inf), allow_fp16]
        out = super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
        self.log.append([*entry, float(found_inf), _flags(out), [v is found_inf for v in out.values()]])
        return out

    def _maybe_opt_step(self, optimizer, optimizer_state, *args, **kwargs):
        self.log.append(["_maybe_opt_step", type(optimizer).__name__, sorted(optimizer_state),
                         optimizer_state["stage"].name, _flags(optimizer_state["found_inf_per_device"]),
                         args, kwargs])
        return super()._maybe_opt_step(optimizer, optimizer_state, *args, **kwargs)


def _train(scaler, explicit_unscale_at=1):
    """Two optimizers (one fused Adam, one SGD taking arguments), overflow at step 2; the log,
    what step() returned, the scales and the weights."""
    torch.manual_seed(0)
    wa, wb, wf = (torch.nn.Parameter(torch.randn(3)) for _ in range(3))
    sgd = ArgsSGD([wa], lr=0.1)
    plain = torch.optim.SGD([wb], lr=0.1)
    fused = torch.optim.Adam([wf], lr=0.1, fused=True)
    returned, scales = [], []
    for it in range(4):
        for opt in (sgd, plain, fused):
            opt.zero_grad()
        loss = (wa * wa).sum() * (float("inf") if it == 2 else 1.0) + (wb * 3).sum() + (wf * wf).sum()
        scaler.scale(loss).backward()
        if it == explicit_unscale_at:
            scaler.unscale_(sgd)
        returned.append(scaler.step(sgd, f"t{it}", extra=it))
        returned.append(scaler.step(plain))
        returned.append(scaler.step(fused))
        scaler.update()
        scales.append(scaler.get_scale())
    return scaler.log, returned, scales, [w.detach().clone() for w in (wa, wb, wf)]


@pytest.fixture
def installed():
    pt.uninstall()
    with pt.install():
        yield
    pt.uninstall()


def test_overrides_are_called_with_torchs_arguments_and_call_log(installed):
    class Hooked(Logging, torch.amp.GradScaler):  # defined while installed: polyamp's stand-in
        pass

    class TorchHooked(Logging, TORCH_SCALER):
        pass

    assert issubclass(Hooked, pt.GradScaler) and not issubclass(TorchHooked, pt.GradScaler)
    got = _train(Hooked("cpu", init_scale=2.0**10, growth_interval=2))
    expected = _train(TorchHooked("cpu", init_scale=2.0**10, growth_interval=2))
    assert len(expected[0]) == 4 * 5  # per iteration: 2 x (unscale, step) and the fused check
    assert got[0] == expected[0]
    assert got[1:3] == expected[1:3]
    for mine, theirs in zip(got[3], expected[3]):
        assert torch.equal(mine, theirs)


class ModelParallelAgreeing:
    """NeMo's override: found_inf agreed with the other model-parallel ranks inside _maybe_opt_step
    (here the other rank's flag is given: ``other_rank_overflowed``), deciding without super()."""

    other_rank_overflowed = torch.zeros(1)

    def _maybe_opt_step(self, optimizer, optimizer_state, *args, **kwargs):
        found_inf = torch.tensor([sum(v.item() for v in optimizer_state["found_inf_per_device"].values())])
        found_inf = torch.maximum(found_inf, self.other_rank_overflowed)  # all_reduce(MAX) over the group
        self.decisions.append(found_inf.item() == 0)
        return optimizer.step(*args, **kwargs) if found_inf.item() == 0 else None


def _train_agreeing(scaler):
    torch.manual_seed(1)
    w = torch.nn.Parameter(torch.randn(4))
    opt = torch.optim.SGD([w], lr=0.1)
    scaler.decisions = []
    scales = []
    for it in range(5):
        opt.zero_grad()
        scaler.other_rank_overflowed = torch.ones(1) if it in (1, 3) else torch.zeros(1)
        scaler.scale((w * w).sum() * (float("inf") if it == 4 else 1.0)).backward()
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return scaler.decisions, scales, w.detach().clone()


def test_nemo_style_override_deciding_itself_steps_as_on_torch(installed):
    class Agreeing(ModelParallelAgreeing, torch.amp.GradScaler):
        pass

    class TorchAgreeing(ModelParallelAgreeing, TORCH_SCALER):
        pass

    scaler = Agreeing("cpu", init_scale=2.0**8, growth_interval=2)
    got = _train_agreeing(scaler)
    expected = _train_agreeing(TorchAgreeing("cpu", init_scale=2.0**8, growth_interval=2))
    assert got[0] == expected[0] == [True, False, True, False, False]  # the other rank's flags count
    assert got[1] == expected[1]
    assert torch.equal(got[2], expected[2])
    assert scaler.last_step_skipped is True  # the step's own flag, read when asked


def test_override_unscaling_by_itself_is_recorded(installed):
    """An _unscale_grads_ that does not call super (an optimizer's own unscale) gives the flags."""

    class OwnUnscale(torch.amp.GradScaler):
        calls = 0

        def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
            OwnUnscale.calls += 1
            grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)
            return {found_inf.device: found_inf}

    w = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=1.0)
    scaler = OwnUnscale("cpu", init_scale=4.0)
    scaler.scale((w * torch.tensor([1.0, float("inf")])).sum()).backward()
    scaler.step(opt)
    scaler.update()
    assert scaler.last_step_skipped and scaler.get_scale() == 2.0 and torch.equal(w, torch.ones(2))
    opt.zero_grad()
    scaler.scale((w * 3).sum()).backward()
    scaler.unscale_(opt)
    assert torch.equal(w.grad, torch.full((2,), 3.0))  # unscaled by the override's inv_scale
    scaler.step(opt)
    assert not scaler.last_step_skipped and OwnUnscale.calls == 2


def test_override_passing_another_inv_scale_is_refused(installed):
    class Halving(torch.amp.GradScaler):
        def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
            return super()._unscale_grads_(optimizer, inv_scale * 0.5, found_inf, allow_fp16)

    w = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=1.0)
    scaler = Halving("cpu")
    scaler.scale(w.sum()).backward()
    with pytest.raises(ValueError, match=r"Halving\._unscale_grads_.*inv_scale.*Fix:"):
        scaler.unscale_(opt)


def test_name_parameters_with_a_list_names_the_argument():
    """A list of parameters (not the module) is a TypeError naming module=, not an AttributeError."""
    model = torch.nn.Linear(2, 2)
    scaler = pt.GradScaler("cpu")
    with pytest.raises(TypeError, match=r"name_parameters\(module=\.\.\.\).*list.*Fix: pass the model"):
        scaler.name_parameters(list(model.parameters()))
    scaler.name_parameters(model)  # the module itself still works
    assert sorted(scaler._param_names.values()) == ["bias", "weight"]
