"""polyamp.compat.paddle.GradScaler against the real paddle.amp.GradScaler, step for step, on CPU.

paddle's scaler turns itself off off-GPU, so the ``real`` fixture makes its constructor see a
GPU place (it asks the dygraph tracer for ``_expected_place``) and ``scale()`` runs inside
``auto_cast(dtype='float16')``, which paddle checks. paddle's ``_update`` prints
``float(scale)`` of a 1-element tensor, which NumPy 2 refuses: the fixture patches
``paddle.Tensor.__float__`` for the test. Nothing of polyamp is mocked.

Systems driven with the same float32 weights and gradients, one loss-scale decision each:
paddle's scaler + paddle SGD; polyamp's facade + paddle SGD (paddle backend); polyamp's
facade + polyamp.optim.SGD over NumPy; polyamp's facade + torch SGD.
"""

from __future__ import annotations

import types
import warnings
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from polyamp.compat.paddle import GradScaler

import polyamp
from polyamp.optim import SGD

paddle = pytest.importorskip("paddle")

STEPS = 36
INIT = [np.linspace(-1, 1, 12, dtype=np.float32).reshape(4, 3), np.array([0.5, -0.25, 2.0], np.float32)]
OVERFLOW = {0: "inf", 1: "nan", 2: "big", 6: "inf", 10: "nan", 11: "inf", 17: "big", 18: "inf",
            19: "nan", 20: "inf", 27: "-inf", 33: "nan", 34: "inf"}
_BAD = {"inf": np.inf, "-inf": -np.inf, "nan": np.nan, "big": 3e38}  # big: overflows once scaled


def true_grads(step: int, which: int | None = None) -> list[np.ndarray]:
    """The unscaled gradients of ``step``; an overflow (where planned) in param ``which``."""
    rng = np.random.default_rng(step)
    grads = [rng.standard_normal(a.shape).astype(np.float32) for a in INIT]
    if step in OVERFLOW:
        target = grads[step % 2 if which is None else which]
        target.flat[step % target.size] = _BAD[OVERFLOW[step]]
    return grads


@pytest.fixture
def real(monkeypatch):
    """Build real paddle.amp.GradScalers that stay enabled on this CPU-only machine."""
    place = types.SimpleNamespace(
        is_gpu_place=lambda: True, is_xpu_place=lambda: False, is_custom_place=lambda: False
    )
    tracer = types.SimpleNamespace(_expected_place=place)
    monkeypatch.setattr(paddle.amp.grad_scaler, "_dygraph_tracer", lambda: tracer)
    monkeypatch.setattr(paddle.Tensor, "__float__", lambda self: float(self.reshape([-1])[0].item()))

    def make(**kwargs):
        scaler = paddle.amp.GradScaler(**kwargs)
        assert scaler.is_enable()
        return scaler

    return make


class PaddleSystem:
    """paddle parameters and paddle.optimizer.SGD under either scaler."""

    def __init__(self, scaler, lr, n_opt=1):
        self.scaler = scaler
        self.params = [
            paddle.create_parameter(list(a.shape), "float32",
                                    default_initializer=paddle.nn.initializer.Assign(a))
            for a in INIT
        ]
        groups = [self.params] if n_opt == 1 else [[p] for p in self.params]
        self.opts = [paddle.optimizer.SGD(learning_rate=lr, parameters=g) for g in groups]

    def backward(self, grads):
        loss = sum((p * paddle.to_tensor(g)).sum() for p, g in zip(self.params, grads))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "amp_guard can only be enabled on CUDAPlace"
            with paddle.amp.auto_cast(dtype="float16"):
                scaled = self.scaler.scale(loss)
        scaled.backward()
        return scaled

    def weights(self):
        return [p.numpy() for p in self.params]

    def grads(self):
        return [p.grad.numpy() for p in self.params]

    def clear(self):
        for opt in self.opts:
            opt.clear_grad()


class NumpySystem:
    """polyamp.Parameter over NumPy and polyamp.optim.SGD; gradients = true * scale in float32."""

    def __init__(self, scaler, lr, n_opt=1):
        self.scaler = scaler
        self.params = [polyamp.Parameter(a.copy()) for a in INIT]
        groups = [self.params] if n_opt == 1 else [[p] for p in self.params]
        self.opts = [SGD(g, lr=lr) for g in groups]

    def backward(self, grads):
        scale = self.scaler.scale(np.float32(1.0))
        with np.errstate(over="ignore", invalid="ignore"):
            for param, grad in zip(self.params, grads):
                param.grad = grad * scale
        return None

    def weights(self):
        return [p.data.copy() for p in self.params]

    def grads(self):
        return [np.array(p.grad) for p in self.params]

    def clear(self):
        for param in self.params:
            param.grad = None


class TorchSystem:
    """torch parameters and torch.optim.SGD (foreach=False) under polyamp's facade."""

    def __init__(self, scaler, lr, n_opt=1):
        self.torch = pytest.importorskip("torch")
        self.scaler = scaler
        self.params = [self.torch.nn.Parameter(self.torch.from_numpy(a.copy())) for a in INIT]
        groups = [self.params] if n_opt == 1 else [[p] for p in self.params]
        self.opts = [self.torch.optim.SGD(g, lr=lr, foreach=False) for g in groups]

    def backward(self, grads):
        loss = sum((p * self.torch.from_numpy(g)).sum() for p, g in zip(self.params, grads))
        scaled = self.scaler.scale(loss)
        scaled.backward()
        return scaled

    def weights(self):
        return [p.detach().numpy().copy() for p in self.params]

    def grads(self):
        return [p.grad.numpy().copy() for p in self.params]

    def clear(self):
        for opt in self.opts:
            opt.zero_grad()


def run_step(system, path, grads):
    """One iteration through one of paddle's three ways to step; returns the unscaled gradients."""
    scaled = system.backward(grads)
    scaler, (opt,) = system.scaler, system.opts
    if path == "minimize":
        scaler.minimize(opt, scaled)
    elif path == "step":
        scaler.step(opt)
        scaler.update()
    elif path == "unscale_":
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
    else:  # unscale_ then minimize
        scaler.unscale_(opt)
        scaler.minimize(opt, scaled)
    unscaled = system.grads()
    system.clear()
    return unscaled


def skipped(scaler) -> bool:
    """The step decision: polyamp reports it, paddle keeps it in _cache_found_inf."""
    if isinstance(scaler, GradScaler):
        return scaler.last_step_skipped
    return bool(scaler._cache_found_inf)


def assert_same_state(ours, theirs, where):
    mine, paddles = ours.state_dict(), theirs.state_dict()
    assert mine.keys() == paddles.keys(), where
    assert mine["scale"].dtype == np.float32 and mine["scale"].shape == (1,), where
    np.testing.assert_array_equal(mine.pop("scale"), paddles.pop("scale"), err_msg=where)
    assert mine == paddles, where


def ulps(a: np.ndarray, b: np.ndarray) -> int:
    """The largest distance between ``a`` and ``b`` in float32 units in the last place."""
    ia, ib = (np.where(x.view(np.int32) < 0, np.int32(-2**31) - x.view(np.int32), x.view(np.int32))
              for x in (a, b))
    return int(np.max(np.abs(ia.astype(np.int64) - ib.astype(np.int64))))


def sgd_rounding_bound(lr: float, grad: np.ndarray, theirs: np.ndarray, mine: np.ndarray) -> np.ndarray:
    """How far one SGD step ``p - lr*grad`` can move two systems apart, per element.

    Both start from their own weights and subtract the same float32 ``lr*grad`` (the gradients
    are bitwise equal, checked). The exact arithmetic is the same; only roundings differ:
    paddle's CPU kernel rounds ``lr*grad`` to float32 first (x86: ``vmulps`` then ``vsubps``),
    torch's ``add_(alpha=-lr)`` rounds once where it uses FMA (AVX2, AVX-512) and twice where
    not, polyamp.optim.SGD rounds once through float64. So each new weight is the exact
    ``p - lr*grad`` plus at most: half an ulp of ``lr*grad`` (the product, rounded by at most
    one of the two sides or by both alike, which cancels), half an ulp of the new weight per
    side, and half a float64 ulp where polyamp rounds float64 -> float32 (double rounding).
    In ulps of the parameter that is about one ulp per applied step while ``|lr*grad| <= |p|``.
    Differences carry over from step to step, so the caller sums these bounds.
    """
    product = (np.float32(lr) * grad).astype(np.float32)
    new = np.maximum(np.abs(theirs), np.abs(mine))
    return (0.5 * np.spacing(np.abs(product)).astype(np.float64)
            + np.spacing(new).astype(np.float64)  # half an ulp on each side
            + 0.5 * np.spacing(new.astype(np.float64)))


def trajectory(real, kwargs, path, lr, steps=STEPS):
    """Drive paddle and the three polyamp systems; check state, decisions and gradients.

    Returns the largest distance to paddle's weights in ulps, per system; asserts that it stays
    within the sum of :func:`sgd_rounding_bound` over the applied steps, element by element.
    """
    theirs = PaddleSystem(real(**kwargs), lr)
    ours = [cls(GradScaler(**kwargs), lr) for cls in (PaddleSystem, NumpySystem, TorchSystem)]
    worst = {"paddle": 0, "numpy": 0, "torch": 0}
    allowed = {name: [np.zeros(a.shape) for a in INIT] for name in worst}
    for step in range(steps):
        grads = true_grads(step)
        reference = run_step(theirs, path, grads)
        for name, system in zip(worst, ours):
            unscaled = run_step(system, path, grads)
            where = f"{name} system, step {step}"
            assert skipped(system.scaler) == skipped(theirs.scaler) == (step in OVERFLOW), where
            assert_same_state(system.scaler, theirs.scaler, where)
            parts = zip(system.weights(), theirs.weights(), unscaled, reference, allowed[name])
            for a, b, g, g_ref, bound in parts:
                if step not in OVERFLOW:  # the same float32 products everywhere: bitwise equal
                    np.testing.assert_array_equal(g, g_ref, err_msg=f"gradients, {where}")
                    bound += sgd_rounding_bound(lr, g, b, a)
                distance = np.abs(a.astype(np.float64) - b.astype(np.float64))
                assert (distance <= bound).all(), (where, distance.max(), bound.max())
                worst[name] = max(worst[name], ulps(a, b))
    return worst


@pytest.mark.parametrize("path", ["minimize", "step", "unscale_", "unscale_minimize"])
@pytest.mark.parametrize("incr_every_n_steps", [1, 3])
@pytest.mark.parametrize("decr_every_n_nan_or_inf", [1, 2, 3])
def test_same_decisions_scales_counters_and_bitwise_parameters(
    real, path, incr_every_n_steps, decr_every_n_nan_or_inf
):
    kwargs = dict(init_loss_scaling=2.0**10, incr_every_n_steps=incr_every_n_steps,
                  decr_every_n_nan_or_inf=decr_every_n_nan_or_inf)
    worst = trajectory(real, kwargs, path, lr=2.0**-4)  # lr * grad exact: one rounding everywhere
    assert worst == {"paddle": 0, "numpy": 0, "torch": 0}


@pytest.mark.parametrize("path", ["minimize", "step"])
def test_non_power_of_two_factors_and_lr(real, path):
    """Ratios that round differently in float32 and float64, and lr=0.01, where lr*grad rounds.

    Decisions, scales, counters and gradients are bitwise equal (the same float32 operations
    everywhere); paddle's SGD against itself too. NumPy's and torch's SGD may round ``p - lr*grad``
    once where paddle's rounds ``lr*grad`` first: their weights are held to the bound derived
    from that arithmetic (in :func:`trajectory`), not to bitwise equality.
    """
    kwargs = dict(init_loss_scaling=1000.0, incr_ratio=1.1, decr_ratio=0.3,
                  incr_every_n_steps=2, decr_every_n_nan_or_inf=2)
    worst = trajectory(real, kwargs, path, lr=0.01)
    assert worst["paddle"] == 0  # same kernels: bitwise


def round_to_float32(exact: Fraction) -> np.float32:
    """``exact`` rounded once to the nearest float32 (ties to even), without a float64 detour."""
    guess = np.float32(float(exact))
    candidates = [np.nextafter(guess, np.float32(-np.inf)), guess, np.nextafter(guess, np.float32(np.inf))]
    return min(candidates, key=lambda c: (abs(Fraction(float(c)) - exact), int(c.view(np.int32)) & 1))


@pytest.mark.parametrize("size", [7, 12, 64, 1000])  # paddle: a JIT kernel when size % 8 == 0
def test_sgd_kernels_differ_only_in_rounding_lr_times_grad(size):
    """The premise of :func:`sgd_rounding_bound`: each SGD computes ``p - lr*grad`` with float32 lr.

    paddle's, torch's and polyamp's results are each, element by element, the exact value rounded
    once, or rounded after rounding ``lr*grad`` (which one depends on the kernel and the CPU).
    """
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(size)
    p = rng.standard_normal(size).astype(np.float32)
    g = (rng.standard_normal(size) * 10).astype(np.float32)
    lr = np.float32(0.01)
    once = np.array([round_to_float32(Fraction(float(a)) - Fraction(float(lr)) * Fraction(float(b)))
                     for a, b in zip(p, g)])
    twice = p - lr * g  # float32 product, then float32 difference
    assert (once != twice).any()  # the inputs tell the two apart
    outputs = {}
    param = paddle.create_parameter([size], "float32", default_initializer=paddle.nn.initializer.Assign(p))
    (param * paddle.to_tensor(g)).sum().backward()
    paddle.optimizer.SGD(learning_rate=0.01, parameters=[param]).step()
    outputs["paddle"] = param.numpy()
    weight = torch.nn.Parameter(torch.from_numpy(p.copy()))
    weight.grad = torch.from_numpy(g.copy())
    torch.optim.SGD([weight], lr=0.01, foreach=False).step()
    outputs["torch"] = weight.detach().numpy()
    mine = polyamp.Parameter(p.copy(), g.copy())
    SGD([mine], lr=0.01).step()
    outputs["polyamp"] = mine.data
    for name, out in outputs.items():
        assert ((out == once) | (out == twice)).all(), name


@pytest.mark.parametrize("path", ["minimize", "step", "unscale_"])
def test_fixed_scale_skips_overflows_and_never_moves(real, path):
    kwargs = dict(init_loss_scaling=512.0, incr_every_n_steps=1, use_dynamic_loss_scaling=False)
    worst = trajectory(real, kwargs, path, lr=2.0**-4, steps=12)
    assert worst == {"paddle": 0, "numpy": 0, "torch": 0}


@pytest.mark.parametrize("cls", [PaddleSystem, NumpySystem])
def test_two_optimizers_update_uses_the_last_steps_flag(real, cls):
    """paddle remembers one flag: update() after step(opt1), step(opt2) sees opt2's only."""
    kwargs = dict(init_loss_scaling=2.0**10, incr_every_n_steps=2, decr_every_n_nan_or_inf=1)
    theirs, ours = PaddleSystem(real(**kwargs), 0.0625, 2), cls(GradScaler(**kwargs), 0.0625, 2)
    for step in range(20):
        grads = true_grads(step, which=step % 2)
        for system in (theirs, ours):
            system.backward(grads)
            for opt in system.opts:
                system.scaler.step(opt)
            system.scaler.update()
            system.clear()
        assert_same_state(ours.scaler, theirs.scaler, f"step {step}")
        for a, b in zip(ours.weights(), theirs.weights()):
            np.testing.assert_array_equal(a, b)


def test_unscale_both_then_step_uses_the_last_unscale(real):
    """unscale_(opt1), unscale_(opt2), step(opt1): paddle's step reads opt2's flag; so does polyamp."""
    kwargs = dict(init_loss_scaling=2.0**10, incr_every_n_steps=3)
    theirs, ours = PaddleSystem(real(**kwargs), 0.0625, 2), PaddleSystem(GradScaler(**kwargs), 0.0625, 2)
    for step in range(12):
        grads = true_grads(step, which=1)  # overflows only in the second optimizer's parameter
        for system in (theirs, ours):
            system.backward(grads)
            for opt in system.opts:
                system.scaler.unscale_(opt)
            for opt in system.opts:
                system.scaler.step(opt)
            system.scaler.update()
            system.clear()
        assert_same_state(ours.scaler, theirs.scaler, f"step {step}")
        for a, b in zip(ours.weights(), theirs.weights()):
            np.testing.assert_array_equal(a, b)
        if step in OVERFLOW:  # both skipped, though the first optimizer's gradients were finite
            assert ours.scaler.last_step_skipped


def test_checkpoints_move_both_ways_and_continue_identically(real):
    kwargs = dict(init_loss_scaling=2.0**10, incr_every_n_steps=3, decr_every_n_nan_or_inf=2)
    theirs, ours = PaddleSystem(real(**kwargs), 0.0625), PaddleSystem(GradScaler(**kwargs), 0.0625)
    for step in range(9):
        for system in (theirs, ours):
            run_step(system, "minimize", true_grads(step))
    paddle_from_ours, ours_from_paddle = real(), GradScaler()
    paddle_from_ours.load_state_dict(ours.scaler.state_dict())
    ours_from_paddle.load_state_dict(theirs.scaler.state_dict())
    ours.scaler, theirs.scaler = ours_from_paddle, paddle_from_ours
    for step in range(9, 24):
        for system in (theirs, ours):
            run_step(system, "step", true_grads(step))
        assert_same_state(ours.scaler, theirs.scaler, f"step {step}")
    assert ours.scaler.get_init_loss_scaling() == theirs.scaler.get_init_loss_scaling()


def _error(scaler, verb, optimizer):
    with pytest.raises(Exception) as info:
        getattr(scaler, verb)(optimizer)
    return type(info.value), str(info.value)


@pytest.mark.parametrize("sequence", [
    ("unscale_", "unscale_"), ("step", "unscale_"), ("step", "step"), ("unscale_", "step", "step"),
])
def test_state_machine_errors_match_paddles(real, sequence):
    errors = []
    for scaler in (real(), GradScaler()):
        system = PaddleSystem(scaler, 0.1)
        system.backward(true_grads(3))
        for verb in sequence[:-1]:
            getattr(scaler, verb)(system.opts[0])
        errors.append(_error(scaler, sequence[-1], system.opts[0]))
    assert errors[0][0] is RuntimeError and errors[1][0] is RuntimeError
    assert errors[1][1] == errors[0][1]


@pytest.mark.parametrize("verb", ["step", "minimize"])
@pytest.mark.parametrize("scaled_before", [False, True])
def test_a_step_on_unscaled_gradients_matches_paddle(real, verb, scaled_before):
    """Issue 32 item 15, decided: paddle's own behaviour. paddle's scaler divides gradients that
    scale() never scaled by the scale and applies them (it holds no record of scale() calls); the
    facade does exactly that, bit for bit, first thing or after a scaled iteration
    (docs/coming-from-paddle.md)."""
    systems = [PaddleSystem(scaler, 0.5) for scaler in (real(), GradScaler())]
    for system in systems:
        if scaled_before:
            run_step(system, "step", true_grads(3))
        before = system.weights()
        grads = true_grads(4)
        loss = sum((p * paddle.to_tensor(g)).sum() for p, g in zip(system.params, grads))
        loss.backward()  # no scale()
        scaler, (opt,) = system.scaler, system.opts
        if verb == "minimize":
            scaler.minimize(opt, loss)
        else:
            scaler.step(opt)
            scaler.update()
        scale = np.float32(2.0**16)
        for w, old, g in zip(system.weights(), before, grads):  # applied, divided by the scale
            np.testing.assert_allclose(w, old - 0.5 * g / scale, rtol=0, atol=1e-6)
            assert not np.array_equal(w, old)
        system.clear()
    theirs, ours = systems
    for mine, paddles in zip(ours.weights(), theirs.weights()):
        np.testing.assert_array_equal(mine, paddles)
    assert_same_state(ours.scaler, theirs.scaler, "after a step on unscaled gradients")


def test_a_loss_guard_refuses_a_step_without_a_scaled_loss():
    from polyamp import StepGuard

    system = PaddleSystem(GradScaler(guard=StepGuard(loss_zscore=6.0)), 0.5)
    before = system.weights()
    loss = sum((p * paddle.to_tensor(g)).sum() for p, g in zip(system.params, true_grads(4)))
    loss.backward()
    with pytest.raises(TypeError, match="got no loss"):
        system.scaler.step(system.opts[0])
    for w, old in zip(system.weights(), before):
        np.testing.assert_array_equal(w, old)


def test_fixed_scale_allows_step_twice_as_paddle_does(real):
    for scaler in (real(use_dynamic_loss_scaling=False), GradScaler(use_dynamic_loss_scaling=False)):
        system = PaddleSystem(scaler, 0.1)
        system.backward(true_grads(3))
        scaler.step(system.opts[0])
        scaler.step(system.opts[0])  # paddle resets the stages in step() when the scale is fixed
        scaler.update()
        assert not scaler.is_use_dynamic_loss_scaling()


def test_update_without_step_and_repeated_update_match_paddle(real):
    """paddle counts update() with no step as finite and reuses the last step's flag."""
    kwargs = dict(init_loss_scaling=2.0**10, incr_every_n_steps=2, decr_every_n_nan_or_inf=1)
    theirs, ours = PaddleSystem(real(**kwargs), 0.0625), PaddleSystem(GradScaler(**kwargs), 0.0625)
    for system in (theirs, ours):
        system.scaler.update()
        run_step(system, "step", true_grads(0))  # an overflow
        system.scaler.update()
        system.scaler.update()
    assert_same_state(ours.scaler, theirs.scaler, "after repeated updates")
    assert ours.scaler.state_dict()["scale"][0] == 2.0**7


@settings(max_examples=25 * settings.default.max_examples // 100, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    overflows=st.lists(st.booleans(), min_size=1, max_size=30),
    incr=st.integers(1, 4), decr=st.integers(1, 3),
    ratios=st.sampled_from([(2.0, 0.5), (1.1, 0.3), (3.0, 0.7)]),
    init=st.sampled_from([2.0**10, 1000.0, 3.0]),
    path=st.sampled_from(["minimize", "step", "unscale_"]),
)
def test_random_overflow_sequences_match_paddle(real, overflows, incr, decr, ratios, init, path):
    kwargs = dict(init_loss_scaling=init, incr_ratio=ratios[0], decr_ratio=ratios[1],
                  incr_every_n_steps=incr, decr_every_n_nan_or_inf=decr)
    theirs, ours = PaddleSystem(real(**kwargs), 0.0625), PaddleSystem(GradScaler(**kwargs), 0.0625)
    for step, bad in enumerate(overflows):
        grads = [np.full(a.shape, 0.5, np.float32) for a in INIT]
        grads[0][0, 0] = np.inf if bad else 0.5
        for system in (theirs, ours):
            run_step(system, path, grads)
        assert skipped(ours.scaler) == skipped(theirs.scaler) == bad
        assert_same_state(ours.scaler, theirs.scaler, f"step {step}")
    for a, b in zip(ours.weights(), theirs.weights()):
        np.testing.assert_array_equal(a, b)


def test_dygraph_update_does_not_clamp_at_one(real):
    """paddle's static-graph update_loss_scaling kernel clamps at 1; its dygraph GradScaler does not."""
    theirs = PaddleSystem(real(init_loss_scaling=2.0), 0.0625)
    ours = PaddleSystem(GradScaler(init_loss_scaling=2.0), 0.0625)
    overflow = [np.full(a.shape, np.nan, np.float32) for a in INIT]
    for _ in range(4):
        for system in (theirs, ours):
            run_step(system, "minimize", overflow)
    assert_same_state(ours.scaler, theirs.scaler, "after four overflows")
    assert ours.scaler.state_dict()["scale"][0] == 0.125
    clamped = PaddleSystem(GradScaler(True, 2.0, min_scale=1.0), 0.0625)
    for _ in range(4):
        run_step(clamped, "minimize", overflow)
    assert clamped.scaler.state_dict()["scale"][0] == 1.0


def test_paddle_stores_bad_checkpoint_values_polyamp_refuses_them(real):
    """What docs/coming-from-paddle.md says of paddle's load_state_dict: it keeps what it is given."""
    good = GradScaler(incr_every_n_steps=3).state_dict()
    bad = {**good, "scale": np.array([1024.0, 2048.0], np.float32), "use_dynamic_loss_scaling": "False",
           "incr_count": 10**30}
    theirs = real()
    theirs.load_state_dict(bad)
    assert theirs.get_init_loss_scaling() == 1024.0  # the second element silently dropped
    assert theirs.is_use_dynamic_loss_scaling() == "False" and theirs._incr_count == 10**30
    ours = GradScaler()
    for key in ("scale", "use_dynamic_loss_scaling", "incr_count"):
        with pytest.raises(polyamp.StateDictError, match=key):
            ours.load_state_dict({**good, key: bad[key]})
    assert ours.get_init_loss_scaling() == 2.0**16


def test_minimize_passes_back_any_result_where_paddle_fails_unpacking(real):
    class Odd(paddle.optimizer.SGD):
        def minimize(self, *args, **kwargs):
            super().minimize(*args, **kwargs)
            return "done"

    outcomes = []
    for scaler in (real(init_loss_scaling=4.0), GradScaler(init_loss_scaling=4.0)):
        system = PaddleSystem(scaler, 0.0625)
        system.opts = [Odd(learning_rate=0.0625, parameters=system.params)]
        scaled = system.backward(true_grads(3))
        try:
            outcomes.append(scaler.minimize(system.opts[0], scaled))
        except ValueError as exc:  # too many values to unpack
            outcomes.append(type(exc))
    assert outcomes == [ValueError, "done"]
