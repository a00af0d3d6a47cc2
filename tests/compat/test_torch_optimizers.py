"""Optimizers under the facade: self-unscaling ones, host syncs, sparse grads, skip reporting."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from polyamp.compat.torch import GradScaler  # noqa: E402

SCALERS = [torch.amp.GradScaler, GradScaler]


class SelfUnscaling(torch.optim.Optimizer):
    """Takes ``grad_scale``/``found_inf`` from the scaler (torch's protocol) and records them."""

    def __init__(self, params):
        super().__init__(params, {"lr": 0.5})
        self._step_supports_amp_scaling = True
        self.seen = []

    def step(self, closure=None):
        grad_scale, found_inf = getattr(self, "grad_scale", None), self.found_inf
        self.seen.append((None if grad_scale is None else grad_scale.clone(), found_inf.clone()))
        if found_inf.item():
            return "skipped"
        for group in self.param_groups:
            for p in group["params"]:
                p.data.add_(p.grad / (1.0 if grad_scale is None else grad_scale), alpha=-0.5)
        return "stepped"


class TakesTheScaler(torch.optim.SGD):
    """The deprecated protocol: step(grad_scaler=...) receives the scaler itself."""

    _step_supports_amp_scaling = True

    def step(self, closure=None, grad_scaler=None):
        self.got = grad_scaler
        return "custom"


def run(cls, opt_cls, overflow=False, unscale_first=False, **opt_kwargs):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = opt_cls(model.parameters(), **opt_kwargs)
    scaler = cls("cpu", init_scale=8.0)
    loss = model(torch.ones(1, 3)).sum() * (math.inf if overflow else 1.0)
    scaler.scale(loss).backward()
    if unscale_first:
        scaler.unscale_(opt)
    returned = scaler.step(opt)
    scaler.update()
    return scaler, model, opt, returned


@pytest.mark.parametrize("overflow", [False, True])
@pytest.mark.parametrize("unscale_first", [False, True])
def test_self_unscaling_optimizer_gets_what_torch_gives(overflow, unscale_first):
    runs = [run(cls, SelfUnscaling, overflow, unscale_first) for cls in SCALERS]
    (s1, m1, o1, r1), (s2, m2, o2, r2) = runs
    assert r1 == r2 == ("skipped" if overflow else "stepped")
    (scale1, found1), (scale2, found2) = o1.seen[0], o2.seen[0]
    assert torch.equal(found1, found2) and found2.item() == float(overflow)
    assert (scale1 is None) == (scale2 is None) == unscale_first
    assert scale2 is None or torch.equal(scale1, scale2)
    assert not hasattr(o2, "grad_scale") and not hasattr(o2, "found_inf")
    assert s1.get_scale() == s2.get_scale() == (4.0 if overflow else 8.0)
    assert all(torch.equal(a, b) for a, b in zip(m1.parameters(), m2.parameters(), strict=True))
    assert s2.last_step_skipped is overflow and s2.skipped_steps == int(overflow)


def test_the_deprecated_grad_scaler_keyword_gets_the_scaler():
    for cls in SCALERS:
        with pytest.warns(FutureWarning, match="stop passing itself"):
            scaler, _, opt, returned = run_without_update(cls)
        assert returned == "custom" and opt.got is scaler


def run_without_update(cls):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = TakesTheScaler(model.parameters(), lr=0.1)
    scaler = cls("cpu")
    scaler.scale(model(torch.ones(1, 3)).sum()).backward()
    return scaler, model, opt, scaler.step(opt)


def _reads(host_reads, fn):
    with host_reads() as counter:
        fn()
    return counter.count


@pytest.mark.parametrize("cls", SCALERS, ids=["torch", "polyamp"])
def test_one_host_read_per_iteration_and_only_in_step(cls, host_reads):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = cls("cpu")
    assert _reads(host_reads, lambda: scaler.scale(model(torch.ones(1, 3)).sum()).backward()) == 0
    assert _reads(host_reads, lambda: scaler.unscale_(opt)) == 0
    assert _reads(host_reads, lambda: scaler.step(opt)) == 1
    assert _reads(host_reads, scaler.update) == 0


def test_fused_adam_steps_without_any_host_read(host_reads):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.1, fused=True)
    assert opt._step_supports_amp_scaling
    scaler = GradScaler("cpu")
    for overflow in (False, True, False):
        loss = model(torch.ones(1, 3)).sum() * (math.inf if overflow else 1.0)
        scaler.scale(loss).backward()
        assert _reads(host_reads, lambda: (scaler.step(opt), scaler.update())) == 0
        opt.zero_grad()
    assert scaler.skipped_steps == 1 and scaler.last_step_skipped is False
    assert opt.state[model.weight]["step"].item() == 2


def test_sparse_gradients_are_unscaled_like_torch():
    grads = []
    for cls in SCALERS:
        torch.manual_seed(0)
        emb = torch.nn.Embedding(6, 3, sparse=True)
        opt = torch.optim.SGD(emb.parameters(), lr=0.1)
        scaler = cls("cpu", init_scale=16.0)
        scaler.scale(emb(torch.tensor([1, 1, 4])).sum()).backward()
        scaler.unscale_(opt)
        grads.append(emb.weight.grad)
    assert grads[1].is_sparse and torch.equal(grads[0].to_dense(), grads[1].to_dense())
    assert grads[1].to_dense()[1].tolist() == [2.0, 2.0, 2.0]


def test_sparse_fp16_gradients_are_coalesced_before_the_check_like_torch():
    found = []
    for cls in SCALERS:
        param = torch.nn.Parameter(torch.zeros(4, dtype=torch.half))
        values = torch.tensor([60000.0, 60000.0, 1.0], dtype=torch.half)
        indices = torch.tensor([[0, 0, 2]])
        param.grad = torch.sparse_coo_tensor(indices, values, (4,), check_invariants=True)
        opt = torch.optim.SGD([param], lr=0.1)
        scaler = cls("cpu")
        scaler.scale(torch.ones(1))
        flags = scaler._check_inf_per_device(opt)
        assert param.grad.is_coalesced()  # duplicates summed: 120000 overflows float16
        found.append([f.item() for f in flags.values()])
    assert found[0] == found[1] == [1.0]


def test_several_optimizers_are_tracked_separately():
    torch.manual_seed(0)
    models = [torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    scaler = GradScaler("cpu", init_scale=8.0)
    scaler.scale(models[0](torch.ones(1, 3)).sum() * math.inf).backward()
    scaler.scale(models[1](torch.ones(1, 3)).sum()).backward()
    before = [m.weight.detach().clone() for m in models]
    scaler.step(opts[0])
    assert scaler.last_step_skipped is True
    scaler.step(opts[1])
    assert scaler.last_step_skipped is False
    scaler.update()
    assert torch.equal(models[0].weight, before[0]) and not torch.equal(models[1].weight, before[1])
    assert scaler.get_scale() == 4.0 and scaler.skipped_steps == 1


def test_last_step_skipped_is_none_before_any_step():
    scaler = GradScaler("cpu")
    assert scaler.last_step_skipped is None and scaler.skipped_steps == 0


def test_a_backoff_is_logged_on_the_polyamp_logger(caplog):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradScaler("cpu", init_scale=8.0, backoff_interval=2)
    with caplog.at_level("INFO", logger="polyamp"):
        for _ in range(2):
            opt.zero_grad()
            scaler.scale(model(torch.ones(1, 3)).sum() * math.inf).backward()
            scaler.step(opt)
            scaler.update()
    assert [r.getMessage() for r in caplog.records] == [
        "overflow in gradients: step skipped, loss scale kept at 8 "
        "(absorbed by backoff_interval=2)",
        "overflow in gradients: step skipped, loss scale backed off 8 -> 4",
    ]
