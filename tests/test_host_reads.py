"""One host read per applied step, counted at torch's dispatch level around public calls.

The counter (``host_reads``, tests/conftest.py) sees every way a tensor's value reaches the host:
``_local_scalar_dense`` (``.item()``, ``float``/``int``/``bool``/``__index__``), copies to the CPU,
``.numpy()``/``np.asarray`` and ``.tolist()``. With a reducer, the agreement runs its GPU-side
path (the fingerprint built and checked on the device) for device arrays; it is forced here on
CPU tensors, as in tests/distributed/test_fingerprint.py. On CPU tensors the host path reads
CPU scalars freely (no device to wait for), so counts are asserted on the device-side path.

Where this counter stops: a ``.to("cpu")``/``.cpu()`` of a CPU tensor is no copy and is counted as
nothing (rightly: on a CPU it costs nothing), so an extra device-to-host copy of the scale in a
step decision passes here. tests/gpu/test_host_reads_cuda.py counts the same steps on CUDA tensors,
where that copy is a sync.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from polyamp.compat.paddle import GradScaler as PaddleGradScaler  # noqa: E402
from polyamp.compat.torch import GradScaler, ShardedGradScaler  # noqa: E402

from polyamp import LossScaleConfig, LossScaler  # noqa: E402
from polyamp.distributed import Reducer  # noqa: E402


@pytest.fixture
def device_side(monkeypatch):
    """The agreement's device-side path on CPU tensors (how tests/distributed/test_fingerprint.py
    forces it; if the agreement module is renamed, update it there and here)."""
    import polyamp._agreement as agreement

    monkeypatch.setattr(agreement, "_on_host", lambda *args: False)


def test_the_counter_sees_every_kind_of_read(host_reads):
    t, v = torch.tensor(3.0), torch.ones(3)
    reads = {
        "item": lambda: t.item(), "float": lambda: float(t), "int": lambda: int(t), "bool": lambda: bool(t),
        "index": lambda: [0, 1, 2, 3][t.int()], "tolist": lambda: v.tolist(), "numpy": lambda: v.numpy(),
        "asarray": lambda: np.asarray(v), "from meta": lambda: torch.empty(2, device="meta").to("cpu"),
    }
    for name, read in reads.items():
        with host_reads() as counter:
            try:
                read()
            except NotImplementedError:  # a meta tensor has no data: the copy is counted before that
                pass
        assert counter.count == 1, name
    with host_reads() as counter:
        (v * 2 + t).sum()
        v.cpu()  # already on the CPU: no copy
    assert counter.count == 0
    assert v.tolist() == [1.0, 1.0, 1.0]  # the patches are gone


def _grads():
    return [torch.full((3,), 2.0), torch.ones(2, dtype=torch.float64)]


def _engine_reads(host_reads, scaler, steps=4):
    counts = []
    for _ in range(steps):
        with host_reads() as counter:
            assert scaler.step(_grads(), lambda: None)
        with host_reads() as in_update:
            scaler.update()
        counts.append((counter.count, in_update.count))
    return counts


def test_engine_reads_once_per_applied_step_on_the_device_side_agreement(host_reads, device_side, twins):
    scaler = LossScaler(LossScaleConfig(init_scale=8.0, growth_interval=2), reducer=twins())
    assert _engine_reads(host_reads, scaler) == [(1, 0)] * 4  # growth steps included


def test_engine_reads_once_per_applied_step_without_a_reducer(host_reads):
    scaler = LossScaler(LossScaleConfig(init_scale=8.0, growth_interval=2))
    assert _engine_reads(host_reads, scaler) == [(1, 0)] * 4


def _facade_reads(host_reads, scaler, steps=4):
    torch.manual_seed(0)
    single, double = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2).double()  # two dtypes
    opt = torch.optim.SGD([*single.parameters(), *double.parameters()], lr=0.1)
    counts = []
    for _ in range(steps):
        x = torch.ones(1, 3)
        scaler.scale(single(x).sum() + double(x.double()).sum().float()).backward()
        with host_reads() as in_step:
            scaler.step(opt)
        with host_reads() as in_update:
            scaler.update()
        opt.zero_grad()
        counts.append((in_step.count, in_update.count))
    return counts


@pytest.mark.parametrize("make", [
    lambda twins: GradScaler("cpu", init_scale=8.0, growth_interval=2),
    lambda twins: ShardedGradScaler("cpu", init_scale=8.0, growth_interval=2, process_group=twins()),
    lambda twins: PaddleGradScaler(init_loss_scaling=8.0, incr_every_n_steps=2, reducer=twins()),
], ids=["torch", "torch-sharded", "paddle"])
def test_facades_read_once_per_applied_step_on_the_device_side_agreement(host_reads, device_side, make,
                                                                         twins):
    assert _facade_reads(host_reads, make(twins)) == [(1, 0)] * 4


def _guarded_reads(host_reads, scaler, steps=6):
    """Reads per step and per update with a StepGuard (loss and norm rules), the loss a tensor."""
    counts = []
    for step in range(steps):
        grads = _grads()
        if step == steps - 1:
            grads[0] *= 1000  # beyond max_grad_norm: a guard skip costs no read either
        loss = torch.tensor(1.0 + step % 2, requires_grad=True) * 2
        with host_reads() as counter:
            result = scaler.step(grads, lambda: None, loss=loss)
        with host_reads() as in_update:
            scaler.update()
        counts.append((counter.count, in_update.count, result.reason))
    return counts


def _guard():
    from polyamp import StepGuard

    return StepGuard(loss_zscore=50.0, grad_norm_zscore=50.0, max_grad_norm=100.0, window=4, min_history=2)


class Alone(Reducer):
    """One rank: its own slots are the message (twins' sum would not keep per-rank slots of a MAX)."""

    def __init__(self):
        super().__init__("alone", 0, 1, None)

    def _prepare(self, array):
        return array

    def _allreduce(self, buffer, op):
        pass  # a sum or max over one rank

    def _barrier(self):
        pass


def test_a_guarded_step_reads_once_on_the_device_side_agreement(host_reads, device_side):
    scaler = LossScaler(LossScaleConfig(init_scale=8.0, growth_interval=2), reducer=Alone(), guard=_guard())
    counts = _guarded_reads(host_reads, scaler)
    # the first step's announcement of the guard's message length is checked at once: one read more, once
    assert counts == [(2, 0, None)] + [(1, 0, None)] * 4 + [(1, 0, "grad_norm_limit")]


def test_a_guarded_step_reads_once_without_a_reducer(host_reads):
    scaler = LossScaler(LossScaleConfig(init_scale=8.0, growth_interval=2), guard=_guard())
    counts = _guarded_reads(host_reads, scaler)
    assert counts == [(1, 0, None)] * 5 + [(1, 0, "grad_norm_limit")]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"], ids=["fused", "unfused"])
@pytest.mark.parametrize("reducer", [False, True], ids=["alone", "reducer"])
def test_a_metered_sample_step_reads_once_more_and_other_steps_as_without_a_meter(
        host_reads, device_side, reducer, dtype):
    """Issue 33, item 5: a sample step (steps 0 and 3) makes one extra host read (the report's), a
    non-sample step none. float32/float64 CPU gradients take the fused kernel (on their memory
    through DLPack, where a CPU tensor's values need no read), bfloat16 torch's unscale and the
    counts' array-API passes."""
    from polyamp import PrecisionMeter

    kind = getattr(torch, dtype)
    config = LossScaleConfig(init_scale=8.0, growth_interval=2)
    plain = LossScaler(config, reducer=Alone() if reducer else None)
    metered = LossScaler(config, reducer=Alone() if reducer else None, meter=PrecisionMeter(every=3))
    counts = {}
    for name, scaler in (("plain", plain), ("metered", metered)):
        counts[name] = []
        for _ in range(6):
            grads = [g.to(kind) for g in _grads()]
            with host_reads() as counter:
                assert scaler.step(grads, lambda: None)
                scaler.update()
            counts[name].append(counter.count)
    assert counts["plain"] == [1] * 6
    # with a reducer the first sample step also announces its longer message (the agreement's check
    # that every rank sends as many values, once per change of length): one read more, that step only
    assert counts["metered"] == [3 if reducer else 2, 1, 1, 2, 1, 1]
    assert metered.last_precision.step == 3 and metered.last_precision.tensors[0].numel == 3
