"""Overflow forensics in the torch facade: GradScaler(diagnose=), explain(module/optimizer/grads),
name_parameters, last_overflow, the log line, watch_forward, and no extra host read when applied."""

from __future__ import annotations

import logging
import math

import pytest

torch = pytest.importorskip("torch")

from polyamp.compat.torch import GradScaler, ShardedGradScaler, watch_forward  # noqa: E402

from polyamp import OverflowReport  # noqa: E402


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8),
                               torch.nn.ReLU(), torch.nn.Linear(8, 2))


def backward(model: torch.nn.Module, scaler: GradScaler) -> None:
    model.zero_grad()
    scaler.scale(model(torch.ones(3, 4)).sum()).backward()


def test_skipped_step_names_the_layer_from_name_parameters():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradScaler("cpu", diagnose=True)
    scaler.name_parameters(model)
    backward(model, scaler)
    model[2].weight.grad[0, :3] = math.inf
    scaler.step(opt)
    scaler.update()
    report = scaler.last_overflow
    assert isinstance(report, OverflowReport) and report.checked == 6 and report.scale == 2.0**16
    assert [(t.name, t.posinf) for t in report.tensors] == [("2.weight", 3)]
    backward(model, scaler)
    scaler.step(opt)
    assert scaler.last_overflow is None  # applied
    scaler.update()


def test_optimizer_names_without_name_parameters_and_module_names():
    model = make_model()
    opt = torch.optim.SGD([{"params": list(model[0].parameters())},
                           {"params": list(model[2].parameters()) + list(model[4].parameters())}], lr=0.1)
    scaler = GradScaler("cpu", diagnose=True)
    backward(model, scaler)
    model[4].bias.grad[1] = math.nan
    by_opt, by_module = scaler.explain(opt), scaler.explain(model)
    assert [t.name for t in by_opt.tensors] == ["param_groups[1][3]"]
    assert [t.name for t in by_module.tensors] == ["4.bias"]
    assert by_module.scale == 2.0**16 and scaler.last_overflow is None  # explain changes nothing
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert scaler.explain(grads, loss=torch.tensor(math.inf)).loss_finite is False
    assert scaler.explain(list(grads.values()), names=list(grads)).tensors[0].name == "4.bias"


def test_diagnose_is_keyword_only_and_off_by_default():
    assert GradScaler("cpu").last_overflow is None
    with pytest.raises(TypeError):
        GradScaler("cpu", 2.0**16, 2.0, 0.5, 2000, True, None, 1, None, None, True)  # type: ignore[misc]
    with pytest.raises(TypeError, match="diagnose='yes'"):
        GradScaler("cpu", diagnose="yes")  # type: ignore[arg-type]
    sharded = ShardedGradScaler("cpu", diagnose=True)
    assert sharded._diagnose is True and sharded.get_backoff_factor() == 0.5
    disabled = GradScaler("cpu", enabled=False, diagnose=True)
    assert disabled.last_overflow is None and disabled.explain([torch.ones(2)]).scale == 1.0


def test_without_diagnose_no_report(caplog):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradScaler("cpu")
    backward(model, scaler)
    model[0].bias.grad[0] = math.inf
    with caplog.at_level(logging.INFO, logger="polyamp"):
        scaler.step(opt)
        scaler.update()
    assert scaler.last_overflow is None
    assert caplog.records[-1].getMessage().endswith("backed off 65536 -> 32768")


def test_info_line_names_the_tensors(caplog):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradScaler("cpu", diagnose=True)
    scaler.name_parameters(model)
    backward(model, scaler)
    model[0].bias.grad[:2] = math.nan
    model[4].weight.grad[0, 0] = -math.inf
    with caplog.at_level(logging.INFO, logger="polyamp"):
        scaler.step(opt)
        scaler.update()
    assert caplog.records[-1].getMessage().endswith("; inf/nan in 0.bias (2 nan), 4.weight (1 -inf)")


def test_pickled_copy_keeps_diagnose_not_the_names():
    import pickle

    model = make_model()
    scaler = GradScaler("cpu", diagnose=True)
    scaler.name_parameters(model)
    twin = pickle.loads(pickle.dumps(scaler))
    assert twin._diagnose is True and twin._param_names == {}


def _applied_reads(counting_host_reads, diagnose: bool) -> dict[str, int]:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradScaler("cpu", diagnose=diagnose)
    scaler.name_parameters(model)
    backward(model, scaler)
    scaler.step(opt)
    scaler.update()
    backward(model, scaler)
    with counting_host_reads() as counts:
        scaler.step(opt)
        scaler.update()
    return counts


def test_applied_step_reads_nothing_more_with_diagnose(counting_host_reads):
    without = _applied_reads(counting_host_reads, False)
    assert sum(without.values()) == 1  # the skip decision
    assert _applied_reads(counting_host_reads, True) == without


# -- watch_forward ----------------------------------------------------------------------
def test_forward_overflow_in_fp16_linear_under_cpu_autocast():
    model = make_model()
    with torch.no_grad():
        model[2].weight.fill_(3000.0)  # 8 inputs x ~1 x 3000 x ... stays < 65504 in layer 0,
        model[4].weight.fill_(3000.0)  # but layer 4's float16 matmul overflows
    x = torch.full((3, 4), 2.0)
    with torch.autocast("cpu", dtype=torch.float16), watch_forward(model) as watch:
        out = model(x)
    assert out.dtype == torch.float16 and not torch.isfinite(out).all()
    first = watch.first
    assert first is not None and first.name == "4" and first.dtype == "float16"
    assert first.nonfinite == out.numel() - int(torch.isfinite(out).sum())
    assert [r.name for r in watch.records] == ["4", ""]  # call order: the layer, then the model
    assert all(not m._forward_hooks for m in model.modules())  # removed on exit


def test_finite_forward_records_nothing_and_hooks_go_on_exception():
    model = make_model()
    with watch_forward(model) as watch:
        model(torch.ones(2, 4))
    assert watch.first is None and watch.records == []
    with pytest.raises(RuntimeError), watch_forward(model):
        model(torch.ones(2, 5))  # wrong width: the forward raises inside the watch
    assert all(not m._forward_hooks for m in model.modules())


def test_watch_forward_needs_a_module():
    with pytest.raises(TypeError, match="watch_forward needs a torch.nn.Module"):
        watch_forward([1, 2])


def test_an_inf_in_the_last_param_group_only_skips_as_torch_does():
    """Two param groups (weights decayed, biases not): an inf in a bias of the second group alone
    skips the step and backs the scale off, as torch.amp.GradScaler does; the first group is checked
    as well (an inf there alone skips too)."""
    for group, name in ((1, "4.bias"), (0, "0.weight")):
        outcomes = []
        for make in (lambda: torch.amp.GradScaler("cpu", init_scale=2.0**10),
                     lambda: GradScaler("cpu", init_scale=2.0**10)):
            model = make_model()
            named = dict(model.named_parameters())
            weights = [p for n, p in named.items() if n.endswith("weight")]
            biases = [p for n, p in named.items() if n.endswith("bias")]
            opt = torch.optim.SGD([{"params": weights, "weight_decay": 0.01}, {"params": biases}], lr=0.1)
            scaler = make()
            backward(model, scaler)
            named[name].grad.view(-1)[0] = math.inf
            assert any(p is named[name] for p in opt.param_groups[group]["params"])
            before = [p.detach().clone() for p in model.parameters()]
            scaler.step(opt)
            scaler.update()
            unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
            outcomes.append((unchanged, scaler.get_scale()))
        assert outcomes[0] == outcomes[1] == (True, 2.0**9), (name, outcomes)
