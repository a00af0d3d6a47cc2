"""One device sync per applied step on CUDA tensors: the skip decision's one read, and no copy of
the scale (or anything else) to the CPU besides it.

The CPU suite (tests/test_host_reads.py) counts the same reads, but there a ``.to("cpu")`` or
``.cpu()`` of a CPU tensor is no copy and costs nothing, so it counts as no read: an extra
device-to-host copy of the scale in every step decision passes on a CPU. Only here, where that
copy is a device sync, can it be held. Skipped, with the reason, where CUDA is absent.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from polyamp.compat.torch import GradScaler, ShardedGradScaler  # noqa: E402

from polyamp import LossScaleConfig, LossScaler, StepGuard  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none found)"),
]

DEVICE = "cuda"


def syncs(counts: dict) -> int:
    """The device syncs among the reads counted: scalar reads and copies to the CPU (``.numpy()``
    and ``.tolist()`` of the CPU copy read host memory; of a CUDA tensor they raise)."""
    return counts["_local_scalar_dense"] + counts["copy_to_cpu"]


def _grads():
    return [torch.full((3,), 2.0, device=DEVICE), torch.ones(2, dtype=torch.float64, device=DEVICE)]


def engine_reads(host_reads, scaler, steps=4, loss=False):
    counts = []
    for step in range(steps):
        kwargs = {"loss": torch.tensor(1.0 + step % 2, device=DEVICE)} if loss else {}
        with host_reads() as in_step:
            assert scaler.step(_grads(), lambda: None, **kwargs)
        with host_reads() as in_update:
            scaler.update()
        counts.append((syncs(in_step.counts), syncs(in_update.counts)))
    return counts


def test_the_counter_counts_a_copy_of_a_cuda_scalar(host_reads):
    scale = torch.tensor(8.0, device=DEVICE)
    with host_reads() as reads:
        scale.to("cpu")
        scale.cpu()
    assert reads.counts["copy_to_cpu"] == 2 and syncs(reads.counts) == 2


def test_engine_step_reads_the_flag_once_and_copies_nothing(host_reads):
    scaler = LossScaler(LossScaleConfig(init_scale=8.0, growth_interval=2))
    assert engine_reads(host_reads, scaler) == [(1, 0)] * 4  # growth steps included


def test_engine_on_the_device_agreement_reads_once_and_copies_nothing(host_reads, twins):
    scaler = LossScaler(LossScaleConfig(init_scale=8.0, growth_interval=2), reducer=twins())
    assert engine_reads(host_reads, scaler) == [(1, 0)] * 4


def test_a_guarded_step_reads_once_and_copies_nothing(host_reads):
    guard = StepGuard(loss_zscore=50.0, grad_norm_zscore=50.0, window=4, min_history=2)
    scaler = LossScaler(LossScaleConfig(init_scale=8.0, growth_interval=2), guard=guard)
    assert engine_reads(host_reads, scaler, steps=5, loss=True) == [(1, 0)] * 5


@pytest.mark.parametrize("make", [
    lambda twins: GradScaler(DEVICE, init_scale=8.0, growth_interval=2),
    lambda twins: ShardedGradScaler(DEVICE, init_scale=8.0, growth_interval=2, process_group=twins()),
], ids=["torch", "torch-sharded"])
def test_facades_read_once_per_applied_step_and_copy_nothing(host_reads, twins, make):
    scaler = make(twins)
    torch.manual_seed(0)
    single, double = torch.nn.Linear(3, 2).to(DEVICE), torch.nn.Linear(3, 2).double().to(DEVICE)
    opt = torch.optim.SGD([*single.parameters(), *double.parameters()], lr=0.1)
    counts = []
    for _ in range(4):
        x = torch.ones(1, 3, device=DEVICE)
        scaler.scale(single(x).sum() + double(x.double()).sum().float()).backward()
        with host_reads() as in_step:
            scaler.step(opt)
        with host_reads() as in_update:
            scaler.update()
        opt.zero_grad()
        counts.append((syncs(in_step.counts), syncs(in_update.counts)))
    assert counts == [(1, 0)] * 4
