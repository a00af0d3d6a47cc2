"""MixedPrecisionTrainer(reducer=...): data parallel on gloo (2 and 3 ranks) and mpirun -n 3.

Every rank trains the same linear model (an ArrayModel over NumPy, and a torch nn.Linear on
gloo 2) on its shard of one batch; one all-reduce per step averages the float32 gradients.
Checked: masters bitwise equal on every rank; within a bound derived from float32 rounding of
one process trained on the whole batch; an inf in one rank's shard skips the step everywhere;
exactly one collective per step (two at the first: the config check), clipping included.
"""

from __future__ import annotations

import numpy as np

B, D, K = 24, 4, 2  # batch (divisible by 2 and 3), inputs, outputs
STEPS, LR, BAD_STEP = 6, 2.0**-3, 2
U = 2.0**-24  # float32 unit roundoff
INIT_SCALE, GROWTH = 2.0**8, 2


def data() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(7)
    x = rng.standard_normal((B, D)).astype(np.float32)
    t = rng.standard_normal((B, K)).astype(np.float32)
    w0 = (rng.standard_normal((D, K)) * 0.5).astype(np.float32)
    return x, t, w0


def batch_at(step: int) -> tuple[np.ndarray, np.ndarray]:
    """The whole batch of ``step``: at BAD_STEP its last row (the last rank's shard) holds an inf."""
    x, t, _ = data()
    x = x.copy()
    if step == BAD_STEP:
        x[B - 1, 0] = np.inf
    return x, t


class Linear:
    """``y = x @ w`` as a polyamp.ArrayModel: gradient ``x.T @ grad_output``."""

    def __init__(self, w: np.ndarray) -> None:
        from polyamp import Parameter

        self.w = Parameter(w.copy())
        self._x = None

    def parameters(self) -> list:
        return [self.w]

    def forward(self, x, compute_dtype):
        self._x = x
        with np.errstate(invalid="ignore", over="ignore"):  # the overflows the tests inject
            return x @ self.w.data.astype(x.dtype)

    def backward(self, grad_output) -> None:
        with np.errstate(invalid="ignore", over="ignore"):
            self.w.grad[...] = self._x.T @ grad_output


def half_mse(output, target):
    """``sum((y - t)**2) / (2 n)``, the mean over this shard, and its gradient ``(y - t) / n``."""
    diff = output.astype(np.float32) - target
    n = np.float32(output.shape[0])
    with np.errstate(invalid="ignore"):
        return np.sum(diff * diff) / (2 * n), diff / n


def train(rank: int, size: int, reducer, kind: str = "numpy", max_grad_norm=None, guard=None) -> dict:
    """STEPS steps on this rank's shard (the whole batch when ``reducer`` is None)."""
    from polyamp import LossScaleConfig, MixedPrecisionTrainer

    _, _, w0 = data()
    rows = slice(rank * B // size, (rank + 1) * B // size)
    config = LossScaleConfig(init_scale=INIT_SCALE, growth_interval=GROWTH)
    if kind == "numpy":
        from polyamp.optim import SGD

        model = Linear(w0)
        trainer = MixedPrecisionTrainer(model, SGD(model.parameters(), lr=LR), "float32", config,
                                        max_grad_norm=max_grad_norm, reducer=reducer, guard=guard)
        loss_fn, as_input, weights = half_mse, (lambda a: a), (lambda: model.w.data.copy())
    else:
        import torch

        model = torch.nn.Linear(D, K, bias=False)
        with torch.no_grad():
            model.weight.copy_(torch.from_numpy(w0.T.copy()))
        trainer = MixedPrecisionTrainer(model, torch.optim.SGD(model.parameters(), lr=LR), "float32",
                                        config, max_grad_norm=max_grad_norm, reducer=reducer)

        def loss_fn(output, target):
            return ((output - target) ** 2).sum() / (2 * output.shape[0])

        as_input, weights = torch.from_numpy, (lambda: model.weight.detach().numpy().T.copy())
    out: dict = {"skipped": [], "scales": [], "counts": [], "norms": [], "weights": [weights()],
                 "guard_norms": []}
    for step in range(STEPS):
        x, t = batch_at(step)
        before = reducer.collectives if reducer is not None else 0
        metrics = trainer.train_step(as_input(x[rows].copy()), as_input(t[rows].copy()), loss_fn)
        out["counts"].append((reducer.collectives if reducer is not None else 0) - before)
        out["skipped"].append(metrics.skipped)
        out["scales"].append(metrics.loss_scale)
        out["norms"].append(metrics.grad_norm)
        out["guard_norms"].append(metrics.grad_norm if metrics.verdict is None else metrics.verdict.grad_norm)
        out["weights"].append(weights())
    return out


def data_parallel(rank: int, size: int, group: str, kinds: tuple[str, ...]) -> dict:
    from polyamp.distributed import reducer

    red = reducer(group)
    runs = {kind: train(rank, size, red, kind) for kind in kinds}
    runs["clipped"] = train(rank, size, red, "numpy", max_grad_norm=0.5)
    runs["guarded"] = train(rank, size, red, "numpy", guard=norm_guard())
    return runs


def norm_guard():
    """A guard that judges every step's gradient norm but never skips for it."""
    from polyamp import StepGuard

    return StepGuard(grad_norm_zscore=1e9, window=4, min_history=2)


def sgd_bound(weights: list[np.ndarray], skipped: list[bool]) -> list[float]:
    """How far two float32 runs of this SGD on the same data can drift apart, step by step.

    Each computed gradient is within c*u*S of the exact one (S = |x|.T (|x||w| + |t|) / B, one
    term per rounding: the forward dot (D terms), the subtraction, the division by n, the
    backward sum over at most B terms, the division by the world size and the all-reduce's
    sum: c = D + B + 4), the exact gradient moves by at most L*e for weights e apart
    (L = max row sum of |x|.T|x| / B), and each run's update rounds once (u*|w|):
    e' <= e + lr*(2*c*u*S + L*e) + 2*u*|w'|. Skipped steps change nothing.
    """
    x, t, _ = data()
    x, t = x.astype(np.float64), t.astype(np.float64)
    c = D + B + 4
    lip = (np.abs(x).T @ np.abs(x) / B).sum(axis=1).max()
    bounds, e = [0.0], 0.0
    for step, skip in enumerate(skipped):
        w = weights[step].astype(np.float64)
        if not skip:
            s = (np.abs(x).T @ (np.abs(x) @ np.abs(w) + np.abs(t)) / B).max()
            e = e + LR * (2 * c * U * s + lip * e) + 2 * U * np.abs(weights[step + 1]).max()
        bounds.append(e)
    return bounds


def check_runs(results: list[dict], kinds: tuple[str, ...]) -> None:
    reference = train(0, 1, None)
    assert reference["skipped"] == [s == BAD_STEP for s in range(STEPS)]
    assert len(set(reference["scales"])) > 1  # the scale moved: grew, backed off at the inf
    bounds = sgd_bound(reference["weights"], reference["skipped"])
    for kind in kinds:
        first = results[0][kind]
        for out in (r[kind] for r in results):
            assert out["counts"] == [2] + [1] * (STEPS - 1), (kind, out["counts"])
            assert out["skipped"] == reference["skipped"] and out["scales"] == reference["scales"]
            for mine, ref, bound in zip(out["weights"], reference["weights"], bounds):
                assert np.abs(mine.astype(np.float64) - ref).max() <= bound, (kind, bound)
            for step in range(STEPS + 1):  # bitwise equal on every rank, every step
                np.testing.assert_array_equal(out["weights"][step], first["weights"][step])
    clipped = [r["clipped"] for r in results]
    for out in clipped:
        assert out["counts"] == [2] + [1] * (STEPS - 1)  # clipping sends nothing more
        assert out["skipped"] == reference["skipped"]
        np.testing.assert_array_equal(out["norms"], clipped[0]["norms"])  # one norm on every rank
        for step in range(STEPS + 1):
            np.testing.assert_array_equal(out["weights"][step], clipped[0]["weights"][step])
    assert max(clipped[0]["norms"][i] for i in range(STEPS) if i != BAD_STEP) > 0.5  # it did clip
    check_guard_norms([r["guarded"] for r in results])


def check_guard_norms(guarded: list[dict]) -> None:
    """The guard judges the norm of the summed (replicated) gradients: the trainer's own norm on
    every rank, and one process's norm on the whole batch, whatever the number of ranks (squares
    summed over the ranks as if the gradients were sharded would grow it by sqrt(ranks))."""
    single = train(0, 1, None, guard=norm_guard())
    assert single["skipped"] == [s == BAD_STEP for s in range(STEPS)]
    for out in guarded:
        assert out["skipped"] == single["skipped"]
        for step in range(STEPS):
            if step == BAD_STEP:
                continue
            got, ref = out["guard_norms"][step], single["guard_norms"][step]
            assert got == out["norms"][step] or abs(got - out["norms"][step]) <= 1e-5 * ref, (step, got)
            assert abs(got - ref) <= 1e-4 * ref, (step, got, ref)


def test_data_parallel_on_two_gloo_ranks_numpy_and_torch(run_gloo):
    check_runs(run_gloo(data_parallel, 2, "torch", ("numpy", "torch")).results(), ("numpy", "torch"))


def test_data_parallel_on_three_gloo_ranks(run_gloo):
    check_runs(run_gloo(data_parallel, 3, "torch", ("numpy",)).results(), ("numpy",))


def test_data_parallel_under_mpirun(run_mpi):
    check_runs(run_mpi(data_parallel, 3, "mpi", ("numpy",)).results(), ("numpy",))


# -- an independent reference: torch DDP + torch.amp.GradScaler --------------------------------------
def mlp():
    """A two-layer network, the same initial weights on every rank (seeded)."""
    import torch

    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(D, 8), torch.nn.Tanh(), torch.nn.Linear(8, K))


def torch_half_mse(output, target):
    return ((output - target) ** 2).sum() / (2 * output.shape[0])


def trainer_and_ddp(rank: int, size: int) -> dict:
    """The same model, data and steps through MixedPrecisionTrainer(reducer=) and through torch
    DDP + torch.amp.GradScaler, on this rank's shard; per step: skipped, scale, weights."""
    import torch
    import torch.distributed as dist

    from polyamp import LossScaleConfig, MixedPrecisionTrainer
    from polyamp.distributed import reducer

    rows = slice(rank * B // size, (rank + 1) * B // size)
    model = mlp()
    trainer = MixedPrecisionTrainer(model, torch.optim.SGD(model.parameters(), lr=LR), "float32",
                                    LossScaleConfig(init_scale=INIT_SCALE, growth_interval=GROWTH),
                                    reducer=reducer("torch"))
    ddp = torch.nn.parallel.DistributedDataParallel(mlp())
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE, growth_interval=GROWTH)
    out: dict = {"polyamp": [], "torch": []}
    for step in range(STEPS):
        x, t = (torch.from_numpy(a[rows].copy()) for a in batch_at(step))
        metrics = trainer.train_step(x, t, torch_half_mse)
        out["polyamp"].append((metrics.skipped, metrics.loss_scale,
                               [p.detach().numpy().copy() for p in model.parameters()]))
        opt.zero_grad()
        scale = scaler.get_scale()
        scaler.scale(torch_half_mse(ddp(x), t)).backward()
        before = [p.detach().clone() for p in ddp.parameters()]
        scaler.step(opt)
        scaler.update()
        skipped = all(torch.equal(a, b) for a, b in zip(before, ddp.parameters()))
        out["torch"].append((skipped, scale, [p.detach().numpy().copy() for p in ddp.module.parameters()]))
    dist.barrier()
    return out


def test_trainer_matches_torch_ddp_and_gradscaler_bitwise(run_gloo):
    """MixedPrecisionTrainer(reducer=) on 2 gloo ranks against DDP + torch.amp.GradScaler: the
    same skips and scales, and bitwise-equal weights on every rank at every step.

    Bitwise because the arithmetic is the same: float32 throughout (no autocast), every scale a
    power of two and 2 ranks, so the trainer's ``scale * (loss / 2)`` and DDP's gradient divided
    by 2 are the same exact multiples of the unscaled gradient (no rounding); each rank's
    backward runs the same kernels on the same shard; the all-reduce adds the same two float32
    values (a + b == b + a); unscaling multiplies by an exact power of two; both step the same
    torch SGD. An inf in the last rank's shard at BAD_STEP must skip that step on both ranks.
    """
    results = run_gloo(trainer_and_ddp, 2).results()
    expected = [s == BAD_STEP for s in range(STEPS)]
    for rank, out in enumerate(results):
        ours, theirs = out["polyamp"], out["torch"]
        assert [s for s, _, _ in theirs] == expected, rank
        assert [s for s, _, _ in ours] == expected, rank
        assert [c for _, c, _ in ours] == [c for _, c, _ in theirs], rank
        assert len({c for _, c, _ in ours}) > 1  # the scale grew and backed off
        for step, ((_, _, mine), (_, _, ref)) in enumerate(zip(ours, theirs, strict=True)):
            for a, b in zip(mine, ref, strict=True):
                np.testing.assert_array_equal(a, b, err_msg=f"rank {rank}, step {step}")
        for step in range(STEPS):
            for a, b in zip(ours[step][2], results[0]["polyamp"][step][2], strict=True):
                np.testing.assert_array_equal(a, b)
