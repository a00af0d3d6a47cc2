"""StepGuard across ranks: a spike on one rank is skipped by every rank, in the step's one collective.

Real gloo process groups (2 and 3 ranks) and mpirun -n 3. Each rank holds a shard of one gradient
vector (rank 2 of 3 none) and its own loss; the guard judges the mean of the ranks' losses and the
norm of the whole vector. Every rank must take the same decisions, equal to one process judging the
whole vector and the mean loss (plain-Python reference below); a rank whose guard history differs
makes every rank raise before anything is applied.
"""

from __future__ import annotations

import math
import statistics

import numpy as np
import pytest

N = 40
STEPS = 60
LOSS_SPIKE = (30, 1)  # (step, rank): rank 1 alone reports a huge loss
NORM_SPIKE = (41, 0)  # rank 0 alone has a huge gradient shard
OVERFLOW = (50, 1)
CLIP_FROM = 45  # from here on every rank also clips by the global norm (the user's extra values)
THRESHOLD, WINDOW, MIN_HISTORY = 5.0, 20, 10


def shard_of(rank: int) -> slice:
    return [slice(0, N // 2), slice(N // 2, N), slice(0, 0)][rank]


def true_grad(step: int) -> np.ndarray:
    return np.random.default_rng(step).normal(size=N).astype(np.float32)


def loss_of(step: int, rank: int) -> float:
    value = 2.0 + 0.1 * np.random.default_rng(1000 + step * 7 + rank).normal()
    return value + (100.0 if (step, rank) == LOSS_SPIKE else 0.0)


def guard_run(rank: int, size: int, group: str) -> dict:
    from polyamp import LossScaleConfig, LossScaler, StepGuard, clip_grad_norm_
    from polyamp.distributed import reducer

    red = reducer(group)
    guard = StepGuard(loss_zscore=THRESHOLD, grad_norm_zscore=THRESHOLD, window=WINDOW,
                      min_history=MIN_HISTORY)
    scaler = LossScaler(LossScaleConfig(init_scale=2.0**3, growth_interval=1000), reducer=red, guard=guard)
    out: dict = {"reasons": [], "counts": [], "losses": [], "norms": [], "clip_norms": []}
    for step in range(STEPS):
        full = true_grad(step) * np.float32(scaler.get_scale())
        if (step, rank) == NORM_SPIKE:
            full[shard_of(rank)] *= 50
        if (step, rank) == OVERFLOW:
            full[N - 1] = np.inf
        grads = [full[shard_of(rank)].copy()] if rank < 2 else []
        before = red.collectives
        if step >= CLIP_FROM:
            scaler.unscale_(grads, loss=loss_of(step, rank))
            out["clip_norms"].append(float(clip_grad_norm_(grads, 1e6, scaler=scaler)))
            result = scaler.step(grads, lambda: None)
        else:
            result = scaler.step(grads, lambda: None, loss=loss_of(step, rank))
        scaler.update()
        out["counts"].append(red.collectives - before)
        out["reasons"].append(result.reason)
        out["losses"].append(result.loss)
        out["norms"].append(result.grad_norm)
    out["history"] = scaler.guard_history
    # a rank whose history differs (it resumed from another checkpoint): every rank raises
    sd = scaler.state_dict()
    if rank == size - 1:
        sd["guard"]["loss"] = sd["guard"]["loss"][1:] + [sd["guard"]["loss"][-1]]
        scaler.load_state_dict(sd)
    applied = []
    try:
        scaler.step([np.ones(2, np.float32)] if rank < 2 else [], lambda: applied.append(1), loss=2.0)
        out["mismatch"] = None
    except Exception as exc:  # noqa: BLE001 - reported per rank
        out["mismatch"] = f"{type(exc).__name__}: {exc}"
    out["mismatch_applied"] = applied
    return out


def reference(size: int) -> dict:
    """One process, item 4 written out: the mean loss, the whole vector's norm, applied histories."""
    history: dict[str, list[float]] = {"loss": [], "grad_norm": []}
    out: dict = {"reasons": [], "losses": [], "norms": []}
    for step in range(STEPS):
        full = true_grad(step)
        if NORM_SPIKE[0] == step:
            full[shard_of(NORM_SPIKE[1])] *= 50  # in float32, as the rank does
        full = full.astype(np.float64)
        loss = math.fsum(loss_of(step, r) for r in range(size)) / size
        norm = math.inf if step == OVERFLOW[0] else math.sqrt(math.fsum(full * full))
        z = {}
        if len(history["loss"]) >= MIN_HISTORY:
            for name, value in (("loss", loss), ("grad_norm", norm)):
                z[name] = (value - statistics.mean(history[name])) / statistics.stdev(history[name])
        reason = ("overflow" if step == OVERFLOW[0] else
                  "grad_norm_spike" if z.get("grad_norm", 0) > THRESHOLD else
                  "loss_spike" if z.get("loss", 0) > THRESHOLD else None)
        if reason is None:
            for name, value in (("loss", loss), ("grad_norm", norm)):
                history[name] = (history[name] + [value])[-WINDOW:]
        out["reasons"].append(reason)
        out["losses"].append(loss)
        out["norms"].append(norm)
    return out


def check(results: list[dict], size: int) -> None:
    ref = reference(size)
    assert ref["reasons"][LOSS_SPIKE[0]] == "loss_spike"
    assert ref["reasons"][NORM_SPIKE[0]] == "grad_norm_spike"
    assert ref["reasons"].count(None) == STEPS - 3
    for rank, out in enumerate(results):
        # one collective, clipping included; a new message length (the guard's at step 0, the clip's
        # from CLIP_FROM) is announced once first
        announced = [2 if i in (0, CLIP_FROM) else 1 for i in range(STEPS)]
        assert out["counts"] == announced, (rank, out["counts"])
        assert out["reasons"] == ref["reasons"], (rank, out["reasons"])
        assert out["losses"] == pytest.approx(ref["losses"], rel=1e-13)
        finite = [i for i in range(STEPS) if i != OVERFLOW[0]]
        assert [out["norms"][i] for i in finite] == pytest.approx([ref["norms"][i] for i in finite],
                                                                  rel=1e-12)
        clipped = [i for i in finite if i >= CLIP_FROM]  # the user's norm, agreed beside the guard's values
        assert [out["clip_norms"][i - CLIP_FROM] for i in clipped] == pytest.approx(
            [ref["norms"][i] for i in clipped], rel=1e-12)
        assert math.isinf(out["clip_norms"][OVERFLOW[0] - CLIP_FROM])
        assert out["history"] == results[0]["history"]  # identical on every rank, bitwise
        assert (out["mismatch"] or "").startswith("RankMismatchError"), out["mismatch"]
        assert "StepGuard history" in out["mismatch"] and out["mismatch_applied"] == []


def two_ranks(run_gloo, run_shared) -> dict:
    """The module's 2-rank gloo cases, each run to its end on every rank, in one job (one group)."""
    return run_shared("gloo2", run_gloo, 2, {
        "guard": (guard_run, "torch"), "sharded": (sharded_run,), "trainer": (trainer_run, "torch"),
        "trainer_clean": (trainer_run, "torch", False), "paddle": (paddle_run, "torch"),
    }, pg_timeout=30.0)


def test_a_spike_on_one_rank_is_skipped_by_every_rank_gloo_2_ranks(run_gloo, run_shared):
    check(two_ranks(run_gloo, run_shared)["guard"].results(), 2)


def test_a_spike_on_one_rank_is_skipped_by_every_rank_gloo_3_ranks(run_gloo):
    check(run_gloo(guard_run, 3, "torch").results(), 3)


def test_a_spike_on_one_rank_is_skipped_by_every_rank_mpi(run_mpi):
    check(run_mpi(guard_run, 3, "mpi").results(), 3)


# -- the shells: ShardedGradScaler and the data-parallel trainer -----------------------------------
def sharded_run(rank: int, size: int) -> dict:
    """Each rank owns a shard of the weights; rank 1's loss (and so its gradients) spikes once."""
    import torch
    from polyamp.compat.torch import ShardedGradScaler

    from polyamp import StepGuard

    torch.manual_seed(rank)
    shard = torch.nn.Parameter(torch.full((4,), 0.5))
    opt = torch.optim.SGD([shard], lr=0.01)
    scaler = ShardedGradScaler("cpu", init_scale=8.0, guard=StepGuard(
        loss_zscore=THRESHOLD, grad_norm_zscore=THRESHOLD, window=WINDOW, min_history=MIN_HISTORY))
    out: dict = {"reasons": [], "counts": [], "weights": []}
    for step in range(STEPS):
        x = torch.from_numpy(true_grad(step)[:4].copy())
        loss = ((shard * x).sum() - 1.0) ** 2 * (100.0 if (step, rank) == LOSS_SPIKE else 1.0)
        scaler.scale(loss).backward()
        before = scaler.reducer.collectives if step else 0
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        out["counts"].append(scaler.reducer.collectives - before)
        out["reasons"].append(scaler.last_skip_reason)
    return out


def check_sharded(results: list[dict]) -> None:
    for rank, out in enumerate(results):
        assert out["counts"][1:] == [1] * (STEPS - 1), (rank, out["counts"])
        assert out["reasons"] == results[0]["reasons"]
        assert out["reasons"][LOSS_SPIKE[0]] in ("grad_norm_spike", "loss_spike"), out["reasons"]
        assert out["reasons"].count(None) == STEPS - 1, out["reasons"]


def test_sharded_scaler_a_spike_on_one_rank_is_skipped_by_every_rank_gloo(run_gloo, run_shared):
    check_sharded(two_ranks(run_gloo, run_shared)["sharded"].results())


def trainer_run(rank: int, size: int, group: str, guarded: bool = True) -> dict:
    """Data parallel: rank 1 alone gets a corrupted batch once; every rank skips that step."""
    from polyamp import LossScaleConfig, MixedPrecisionTrainer, Parameter, StepGuard
    from polyamp.distributed import reducer
    from polyamp.optim import SGD

    class Linear:
        def __init__(self) -> None:
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

    model = Linear()
    red = reducer(group)
    trainer = MixedPrecisionTrainer(model, SGD(model.parameters(), lr=0.05), "float16",
                                    LossScaleConfig(init_scale=2.0**4, growth_interval=7), reducer=red,
                                    guard=StepGuard(loss_zscore=THRESHOLD, grad_norm_zscore=THRESHOLD,
                                                    window=WINDOW, min_history=MIN_HISTORY)
                                    if guarded else None)
    out: dict = {"reasons": [], "counts": [], "losses": []}
    for step in range(STEPS):
        if not guarded and step == LOSS_SPIKE[0]:  # the reference: that step left out on every rank
            continue
        rng = np.random.default_rng(step * 10 + rank)
        x = rng.standard_normal((8, 4)).astype(np.float32)
        y = rng.standard_normal((8, 1)).astype(np.float32) * (10 if (step, rank) == LOSS_SPIKE else 1)
        before = red.collectives
        metrics = trainer.train_step(x, y, mse)
        out["counts"].append(red.collectives - before)
        out["reasons"].append(metrics.reason)
        out["losses"].append(metrics.loss)
    out["w"] = model.w.data.copy()
    return out


def check_trainer(results: list[dict]) -> None:
    for rank, out in enumerate(results):
        assert out["counts"] == [2] + [1] * (STEPS - 1), (rank, out["counts"])  # +1: the first step's check
        assert out["reasons"] == results[0]["reasons"]
        assert out["reasons"][LOSS_SPIKE[0]] in ("grad_norm_spike", "loss_spike"), out["reasons"]
        assert out["reasons"].count(None) == STEPS - 1, out["reasons"]
        np.testing.assert_array_equal(out["w"], results[0]["w"])  # the masters stay equal


def test_trainer_a_spike_on_one_rank_is_skipped_by_every_rank_gloo(run_gloo, run_shared):
    guarded = two_ranks(run_gloo, run_shared)["trainer"].results()
    check_trainer(guarded)
    # the loss curve stays on the course of a run that never saw the corrupted batch, bit for bit
    clean = two_ranks(run_gloo, run_shared)["trainer_clean"].results()
    for mine, theirs in zip(guarded, clean):
        kept = [loss for step, loss in enumerate(mine["losses"]) if step != LOSS_SPIKE[0]]
        assert kept == theirs["losses"]
        np.testing.assert_array_equal(mine["w"], theirs["w"])


def test_trainer_a_spike_on_one_rank_is_skipped_by_every_rank_mpi(run_mpi):
    check_trainer(run_mpi(trainer_run, 3, "mpi").results())


def paddle_run(rank: int, size: int, group: str) -> dict:
    """The paddle facade with reducer=: rank 1 alone sees a corrupted batch; both ranks skip it."""
    import warnings

    warnings.simplefilter("ignore")  # paddle's notices
    import paddle
    from polyamp.compat.paddle import GradScaler

    from polyamp import StepGuard
    from polyamp.distributed import reducer

    red = reducer(group)
    paddle.seed(rank)
    model = paddle.nn.Linear(4, 1)
    optimizer = paddle.optimizer.SGD(learning_rate=0.01, parameters=model.parameters())
    scaler = GradScaler(init_loss_scaling=2.0**4, reducer=red, guard=StepGuard(
        loss_zscore=THRESHOLD, grad_norm_zscore=THRESHOLD, window=WINDOW, min_history=MIN_HISTORY))
    out: dict = {"counts": [], "reasons": [], "changed": []}
    for step in range(STEPS):
        rng = np.random.default_rng(step * 10 + rank)
        x = rng.standard_normal((8, 4)).astype(np.float32)
        y = rng.standard_normal((8, 1)).astype(np.float32) * (10 if (step, rank) == LOSS_SPIKE else 1)
        before_weights = model.weight.numpy().copy()
        before = red.collectives
        loss = ((model(paddle.to_tensor(x)) - paddle.to_tensor(y)) ** 2).mean()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.clear_grad()
        out["counts"].append(red.collectives - before)
        out["reasons"].append(scaler.last_skip_reason)
        out["changed"].append(bool((model.weight.numpy() != before_weights).any()))
    return out


def test_paddle_facade_a_spike_on_one_rank_is_skipped_by_every_rank_gloo(run_gloo, run_shared):
    results = two_ranks(run_gloo, run_shared)["paddle"].results()
    for out in results:
        assert out["counts"] == [2] + [1] * (STEPS - 1)  # the first step announces the guard's length
        assert out["reasons"] == results[0]["reasons"]
        assert out["reasons"][LOSS_SPIKE[0]] in ("grad_norm_spike", "loss_spike")
        assert out["reasons"].count(None) == STEPS - 1, out["reasons"]
        assert out["changed"] == [step != LOSS_SPIKE[0] for step in range(STEPS)]  # nothing applied
