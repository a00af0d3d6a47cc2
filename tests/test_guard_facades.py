"""StepGuard through the shells: the torch facade (per optimizer), the paddle facade, the trainer.

A guard-skipped step must equal not stepping at all: the weights and the scale state stay, and the
run continues bit for bit as a run that left that step out.
"""

from __future__ import annotations

import numpy as np
import pytest

from polyamp import LossScaleConfig, MixedPrecisionTrainer, StepGuard
from polyamp.optim import SGD

SPIKE = 25
GUARD = dict(loss_zscore=5.0, grad_norm_zscore=5.0, window=20, min_history=10)


def _batches(n=40, seed=3):
    rng = np.random.default_rng(seed)
    out = []
    for step in range(n):
        x = rng.standard_normal((16, 4)).astype(np.float32)
        y = rng.standard_normal((16, 1)).astype(np.float32)
        out.append((x, y * 100 if step == SPIKE else y))  # a corrupted batch: loss and norm spike
    return out


# -- the torch facade ---------------------------------------------------------------------------
def _torch_run(guarded: bool, leave_out: int | None = None):
    torch = pytest.importorskip("torch")
    import polyamp

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = polyamp.GradScaler("cpu", init_scale=2.0**4, growth_interval=7,
                                guard=StepGuard(**GUARD) if guarded else None)
    reasons, scales = [], []
    for step, (x, y) in enumerate(_batches()):
        if step == leave_out:
            continue
        loss = ((model(torch.from_numpy(x)) - torch.from_numpy(y)) ** 2).mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        reasons.append(scaler.last_skip_reason)
        scales.append(scaler.get_scale())
    return model, scaler, reasons, scales


def test_torch_facade_a_guard_skip_equals_leaving_the_step_out():
    torch = pytest.importorskip("torch")
    model, scaler, reasons, scales = _torch_run(True)
    assert reasons[SPIKE] == "grad_norm_spike" and reasons.count(None) == len(reasons) - 1
    assert scaler.last_step_skipped is False and scaler.skipped_steps == 1
    other, _, _, other_scales = _torch_run(False, leave_out=SPIKE)
    for mine, theirs in zip(model.parameters(), other.parameters()):
        assert torch.equal(mine, theirs)  # bitwise: the same arithmetic, one step left out
    assert scales[:SPIKE] + scales[SPIKE + 1:] == other_scales  # growth progress held at the skip
    assert len(scaler._engine.iteration.histories[0].loss) == GUARD["window"]


def test_torch_facade_judges_each_optimizer_on_its_own_norm_and_sums_the_losses():
    torch = pytest.importorskip("torch")
    import polyamp

    torch.manual_seed(0)
    a, b = torch.nn.Linear(3, 1), torch.nn.Linear(3, 1)
    opts = [torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1)]
    scaler = polyamp.GradScaler("cpu", init_scale=8.0, guard=StepGuard(grad_norm_zscore=5.0, window=10,
                                                                        min_history=5))
    reasons = []
    for step in range(12):
        x = torch.ones(2, 3) * (1 + 0.01 * step)
        factor = 1000.0 if step == 10 else 1.0  # b's gradients alone spike
        first, second = a(x).sum(), b(x).sum() * factor
        scaler.scale(first).backward()
        scaler.scale(second).backward()  # two losses since update(): the guard sees their sum
        row = []
        for opt in opts:
            scaler.step(opt)
            row.append(scaler.last_skip_reason)
        scaler.update()
        for opt in opts:
            opt.zero_grad()
        reasons.append(row)
        verdict = scaler._engine.iteration.guarding.last_verdict
        assert verdict.loss == pytest.approx(first.item() + second.item(), rel=1e-6)
    assert reasons[10] == [None, "grad_norm_spike"] and all(r == [None, None] for i, r in enumerate(reasons)
                                                            if i != 10)
    histories = scaler._engine.iteration.histories
    assert set(histories) == {0, 1} and histories[0] != histories[1]  # each optimizer its own history
    assert max(histories[1].grad_norm) < 10  # b's spike never entered it
    sd = scaler.state_dict()
    again = polyamp.GradScaler("cpu", guard=scaler._engine.guard)
    again.load_state_dict(sd)
    assert again._engine.iteration.histories == histories
    plain = {k: v for k, v in sd.items() if k != "guard"}  # torch's own keys: empty histories
    again.load_state_dict(plain)
    assert again._engine.iteration.histories == {}


def test_torch_facade_optimizers_stepped_in_separate_iterations_keep_their_own_histories():
    """Review: the history key was the optimizer's place in the current iteration, so two
    optimizers each stepped in its own iteration (a GAN's D then G, each with update()) shared one
    history: b's norms (~100) hid a's 50x spike. Keyed by first step now, across iterations,
    unpickling and load_state_dict."""
    torch = pytest.importorskip("torch")
    import pickle

    import polyamp

    a, b = torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(4))
    opts = {"a": torch.optim.SGD([a], lr=0.0), "b": torch.optim.SGD([b], lr=0.0)}
    scaler = polyamp.GradScaler("cpu", init_scale=8.0,
                                guard=StepGuard(grad_norm_zscore=5.0, window=20, min_history=5))

    def iteration(scaler, name, factor):
        param = a if name == "a" else b
        scaler.scale((param * factor).sum() / 2).backward()  # gradient norm: factor
        scaler.step(opts[name])
        scaler.update()
        opts[name].zero_grad()
        return scaler.last_skip_reason

    reasons = []
    for it in range(12):
        for name, size in (("a", 1.0), ("b", 100.0)):
            reasons.append(iteration(scaler, name, size * (1 + 0.01 * (it % 3))))
    assert reasons == [None] * 24
    histories = scaler._engine.iteration.histories
    assert set(histories) == {0, 1} and max(histories[0].grad_norm) < 2 < 99 < min(histories[1].grad_norm)
    for copy in (scaler, pickle.loads(pickle.dumps(scaler))):  # the order of first step restarts
        assert iteration(copy, "a", 50.0) == "grad_norm_spike"  # judged against a's own history
        assert iteration(copy, "b", 101.0) is None
    again = polyamp.GradScaler("cpu", guard=scaler._engine.guard)
    again.load_state_dict(scaler.state_dict())
    assert iteration(again, "a", 50.0) == "grad_norm_spike"
    assert again._engine.iteration.histories[1] == scaler._engine.iteration.histories[1]


def test_torch_facade_without_a_guard_reports_overflow_only():
    torch = pytest.importorskip("torch")
    import polyamp

    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.1)
    scaler = polyamp.GradScaler("cpu", init_scale=4.0)
    assert scaler.last_skip_reason is None
    scaler.scale(p.sum()).backward()
    p.grad[0] = float("inf")
    scaler.step(opt)
    scaler.update()
    assert scaler.last_step_skipped and scaler.last_skip_reason == "overflow"


# -- the paddle facade --------------------------------------------------------------------------
def _paddle_run(guarded: bool, leave_out: int | None = None):
    paddle = pytest.importorskip("paddle")
    from polyamp.compat.paddle import GradScaler

    paddle.seed(0)
    model = paddle.nn.Linear(4, 1)
    opt = paddle.optimizer.SGD(learning_rate=0.05, parameters=model.parameters())
    scaler = GradScaler(init_loss_scaling=2.0**4, incr_every_n_steps=7,
                        guard=StepGuard(**GUARD) if guarded else None)
    reasons, scales = [], []
    for step, (x, y) in enumerate(_batches()):
        if step == leave_out:
            continue
        loss = ((model(paddle.to_tensor(x)) - paddle.to_tensor(y)) ** 2).mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.clear_grad()
        reasons.append(scaler.last_skip_reason)
        scales.append(float(scaler.state_dict()["scale"][0]))
    return model, scaler, reasons, scales


def test_paddle_facade_a_guard_skip_equals_leaving_the_step_out():
    model, scaler, reasons, scales = _paddle_run(True)
    assert reasons[SPIKE] == "grad_norm_spike" and reasons.count(None) == len(reasons) - 1
    other, _, _, other_scales = _paddle_run(False, leave_out=SPIKE)
    for mine, theirs in zip(model.parameters(), other.parameters()):
        np.testing.assert_array_equal(mine.numpy(), theirs.numpy())
    assert scales[:SPIKE] + scales[SPIKE + 1:] == other_scales
    sd = scaler.state_dict()
    assert len(sd["guard"]["loss"]) == GUARD["window"]
    from polyamp.compat.paddle import GradScaler

    again = GradScaler(guard=StepGuard(**GUARD))
    again.load_state_dict(sd)
    assert again.engine.guard_history == scaler.engine.guard_history


# -- the trainer --------------------------------------------------------------------------------
class Linear:
    """``x @ w`` in float32 with its own backward (the trainer's ArrayModel)."""

    def __init__(self) -> None:
        from polyamp import Parameter

        self.w = Parameter(np.full((4, 1), 0.1, np.float32))

    def parameters(self):
        return [self.w]

    def forward(self, x, compute_dtype):
        self.x = x.astype(np.float32)
        return (self.x @ self.w.data).astype(compute_dtype)

    def backward(self, grad_output):
        self.w.grad[...] = self.x.T @ grad_output.astype(np.float32)


def mse(output, target):
    err = output.astype(np.float32) - target
    return np.mean(err * err), 2 * err / err.size


def _trainer_run(guarded: bool, leave_out: int | None = None, dtype: str = "float16"):
    model = Linear()
    config = LossScaleConfig(init_scale=2.0**8, growth_interval=7) if dtype == "float16" else \
        LossScaleConfig(init_scale=1.0, dynamic=False)
    trainer = MixedPrecisionTrainer(model, SGD(model.parameters(), lr=0.05), dtype, config,
                                    guard=StepGuard(**GUARD) if guarded else None)
    metrics = [trainer.train_step(x, y, mse) for step, (x, y) in enumerate(_batches()) if step != leave_out]
    return model, metrics


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_trainer_a_guard_skip_equals_leaving_the_step_out(dtype):
    model, metrics = _trainer_run(True, dtype=dtype)
    assert [m.reason for m in metrics].count(None) == len(metrics) - 1
    assert metrics[SPIKE].skipped and metrics[SPIKE].reason == "grad_norm_spike"
    other, other_metrics = _trainer_run(False, leave_out=SPIKE, dtype=dtype)
    np.testing.assert_array_equal(model.w.data, other.w.data)
    kept = [m.loss_scale for i, m in enumerate(metrics) if i != SPIKE]
    assert kept == [m.loss_scale for m in other_metrics]


def test_trainer_without_loss_scaling_is_guard_only():
    """bf16 without scaling and a guard: the scale fixed at 1, a gradient past the limit skipped."""
    model = Linear()
    trainer = MixedPrecisionTrainer(model, SGD(model.parameters(), lr=0.05), "float32", loss_scaling=False,
                                    guard=StepGuard(max_grad_norm=1.0))
    x = np.ones((16, 4), np.float32)
    before = model.w.data.copy()
    spike = trainer.train_step(x, np.full((16, 1), 1e6, np.float32), mse)
    assert spike.skipped and spike.reason == "grad_norm_limit" and spike.loss_scale == 1.0
    np.testing.assert_array_equal(model.w.data, before)  # the norm 1e6-ish gradient never applied
    fine = trainer.train_step(x, np.full((16, 1), 0.5, np.float32), mse)
    assert not fine.skipped and fine.loss_scale == 1.0 and trainer.loss_scale == 1.0
    assert not np.array_equal(model.w.data, before) and trainer.skipped_steps == 1


def _torch_spike(scaler, torch):
    """One step with a gradient of norm ~1.4e6, then one with a small gradient: (applied?, applied?)."""
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([p], lr=1.0)
    applied = []
    for size in (1e6, 0.1):
        scaler.scale((p * size).sum()).backward()
        scaler.step(opt)
        scaler.update()
        applied.append(bool(p.abs().sum() > 0))
        opt.zero_grad()
    return applied, scaler


@pytest.mark.parametrize("build", ["cpu_disabled", "cuda_without_cuda"])
def test_a_disabled_torch_facade_with_a_guard_is_guard_only(build):
    torch = pytest.importorskip("torch")
    import polyamp

    guard = StepGuard(max_grad_norm=1.0)
    if build == "cpu_disabled":
        scaler = polyamp.GradScaler("cpu", enabled=False, guard=guard)
    else:
        if torch.cuda.is_available():
            pytest.skip("CUDA is available: GradScaler() is enabled here")
        with pytest.warns(UserWarning, match="CUDA is not available"):
            scaler = polyamp.GradScaler(guard=guard)
    applied, scaler = _torch_spike(scaler, torch)
    assert applied == [False, True]  # the 1.4e6 gradient never reached the weights
    assert scaler.get_scale() == 1.0 and scaler.skipped_steps == 1 and scaler.is_enabled()
    assert scaler.metrics()["skipped_steps"] == 1
    copy = __import__("pickle").loads(__import__("pickle").dumps(scaler))
    assert copy.get_scale() == 1.0 and _torch_spike(copy, torch)[0] == [False, True]


def test_a_disabled_facade_without_a_guard_does_nothing():
    torch = pytest.importorskip("torch")
    from polyamp.compat.paddle import GradScaler as PaddleGradScaler

    import polyamp

    scaler = polyamp.GradScaler("cpu", enabled=False)
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.5)
    scaler.scale(p.sum()).backward()
    scaler.step(opt)
    scaler.update()
    assert p.tolist() == [0.5, 0.5] and scaler.last_skip_reason is None and not scaler.is_enabled()
    assert not PaddleGradScaler(enable=False).is_enable()


def test_a_disabled_paddle_facade_with_a_guard_is_guard_only():
    from polyamp.compat.paddle import GradScaler as PaddleGradScaler

    from polyamp import Parameter

    scaler = PaddleGradScaler(enable=False, guard=StepGuard(max_grad_norm=1.0))
    p = Parameter(np.zeros(2, np.float32))
    opt = SGD([p], lr=1.0)
    applied = []
    for size in (1e6, 0.1):
        scaler.scale(np.ones((), np.float32))
        p.grad = np.full(2, size, np.float32)
        scaler.minimize(opt)
        applied.append(bool(np.abs(p.data).sum() > 0))
    assert applied == [False, True] and scaler.skipped_steps == 1
    assert scaler.engine.get_scale() == 1.0 and scaler.get_init_loss_scaling() == 1.0
    assert scaler.last_skip_reason is None and not scaler.is_use_dynamic_loss_scaling()


def test_make_scaler_disabled_with_a_guard_is_guard_only():
    import polyamp

    scaler = polyamp.make_scaler(enabled=False, guard=StepGuard(max_grad_norm=1.0), backend="numpy")
    assert isinstance(scaler, polyamp.LossScaler) and scaler.get_scale() == 1.0
    applied = []
    result = scaler.step([np.full(2, 1e6, np.float32)], lambda: applied.append(1))
    scaler.update()
    assert result.skipped and result.reason == "grad_norm_limit" and not applied
    assert scaler.get_scale() == 1.0


def test_paddle_minimize_with_a_guard_skips_a_spike():
    paddle = pytest.importorskip("paddle")
    from polyamp.compat.paddle import AmpScaler

    paddle.seed(0)
    model = paddle.nn.Linear(4, 1)
    opt = paddle.optimizer.SGD(learning_rate=0.05, parameters=model.parameters())
    scaler = AmpScaler(init_loss_scaling=2.0**4, guard=StepGuard(max_grad_norm=50.0))
    reasons = []
    for x, y in _batches():
        before = model.weight.numpy().copy()
        loss = ((model(paddle.to_tensor(x)) - paddle.to_tensor(y)) ** 2).mean()
        scaler.scale(loss).backward()
        scaler.minimize(opt, scaler.scale(loss) * 0)  # paddle's minimize(optimizer, loss) call shape
        opt.clear_grad()
        reasons.append(scaler.last_skip_reason)
        if reasons[-1] is not None:
            np.testing.assert_array_equal(before, model.weight.numpy())  # nothing applied
    assert reasons[SPIKE] == "grad_norm_limit" and reasons.count(None) == len(reasons) - 1


def test_a_pickled_engine_keeps_its_guard_and_histories():
    import pickle

    from polyamp import LossScaler

    scaler = LossScaler(guard=StepGuard(grad_norm_zscore=3.0, window=4, min_history=2))
    for value in (0.5, 0.25, 1.0):
        scaler.step([np.full(2, value * 65536, np.float32)], lambda: None)
        scaler.update()
    copy = pickle.loads(pickle.dumps(scaler))
    assert copy.guard == scaler.guard and copy.guard_history == scaler.guard_history
    assert copy.guard_history.streak == 1 and len(copy.guard_history.grad_norm) == 2  # the third: a spike


def test_the_facades_refuse_a_loss_guard_without_a_scaled_loss():
    torch = pytest.importorskip("torch")
    import polyamp

    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.5)
    scaler = polyamp.GradScaler("cpu", init_scale=4.0, guard=StepGuard(loss_zscore=3.0))
    scaler.scale(torch.ones(3))  # three values: no loss is recorded (the state exists now)
    p.grad = torch.full((2,), 4.0)
    with pytest.raises(TypeError, match=r"GradScaler.step\(\) got no loss.*Fix: scale the loss"):
        scaler.step(opt)
    assert p.grad.tolist() == [4.0, 4.0] and p.tolist() == [1.0, 1.0]  # nothing unscaled or applied


def test_a_fused_optimizer_is_judged_by_the_guard_too():
    torch = pytest.importorskip("torch")
    import polyamp

    p = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.Adam([p], lr=0.1, fused=True)  # takes grad_scale/found_inf itself without a guard
    scaler = polyamp.GradScaler("cpu", init_scale=4.0, guard=StepGuard(max_grad_norm=10.0))
    for value, expected in ((1.0, None), (100.0, "grad_norm_limit")):
        before = p.detach().clone()
        scaler.scale((p * value).sum()).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        assert scaler.last_skip_reason == expected
        assert torch.equal(before, p.detach()) is (expected is not None)


def test_make_scaler_guard_only_refuses_settings_it_would_not_use():
    import polyamp

    with pytest.raises(polyamp.ConfigError, match=r"guard-only.*init_scale would not be used.*Fix: "):
        polyamp.make_scaler(enabled=False, guard=StepGuard(max_grad_norm=1.0), init_scale=1024.0)


# -- issue 34, item 5: under fp16 an overflow still says whether its loss was a spike -------------
def test_torch_facade_under_fp16_autocast_tells_a_bad_batch_from_a_scale_too_high():
    torch = pytest.importorskip("torch")
    import polyamp

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = polyamp.GradScaler("cpu", init_scale=2.0**12, growth_interval=1000, diagnose=True,
                                guard=StepGuard(loss_zscore=5.0, window=20, min_history=10))
    seen = {}
    for step, (x, y) in enumerate(_batches()):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.mse_loss(model(torch.from_numpy(x)), torch.from_numpy(y))
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        if scaler.last_step_skipped:
            report = scaler.last_overflow
            words = "The loss itself was a spike" in report.diagnosis
            seen[step] = (scaler.last_skip_reason, report.loss_spike, words)
    # the corrupted batch overflows float16 first; its loss (float32) is still judged a spike
    assert seen == {SPIKE: ("overflow", True, True)}


def test_trainer_fp16_overflow_reports_the_loss_spike():
    model = Linear()
    trainer = MixedPrecisionTrainer(model, SGD(model.parameters(), lr=0.05), "float16",
                                    LossScaleConfig(init_scale=2.0**13, growth_interval=1000),
                                    guard=StepGuard(loss_zscore=5.0, window=20, min_history=10))
    with np.errstate(over="ignore", invalid="ignore"):  # the overflow the scaler catches
        metrics = [trainer.train_step(x, y, mse) for x, y in _batches()]
    skipped = {i: (m.reason, m.loss_spike) for i, m in enumerate(metrics) if m.skipped}
    assert skipped == {SPIKE: ("overflow", True)}
    assert [m.loss_spike for m in metrics[SPIKE + 1:]] == [False] * (len(metrics) - SPIKE - 1)
