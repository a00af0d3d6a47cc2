"""CUDA torch tensors through the cupy backend: zero-copy DLPack views, bitwise equal to torch.

Every test carries the ``gpu`` mark and skips with the reason where cupy or torch's CUDA
cannot run.
"""

from __future__ import annotations

import copy

import pytest
from polyamp.backends import cupy as cupy_backend

import polyamp
from polyamp import LossScaleConfig, LossScaler

pytestmark = pytest.mark.gpu
_INFO = cupy_backend.backend_info()
if not _INFO["available"]:
    pytest.skip(f"cupy backend unavailable: {_INFO['reason']}", allow_module_level=True)
torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("torch was built without CUDA or sees no device", allow_module_level=True)

import cupy  # noqa: E402

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
INT_VIEW = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def cuda_grads(dtype, seed=0, nonfinite=True):
    """Gradients of many sizes (inf and nan in places, if asked) on the current CUDA device."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    grads = [torch.randn(n, device="cuda", generator=gen).mul_(1e3).to(dtype)
             for n in (0, 1, 7, 4096, 16384 + 5, 100_003)]
    if nonfinite:
        grads[3][11] = float("inf")
        grads[5][-1] = float("nan")
    grads.append(torch.randn(64, 33, device="cuda", generator=gen).to(dtype).t())  # strided
    return grads


def assert_bitwise(got, want):
    assert got.dtype == want.dtype and got.shape == want.shape
    bits = INT_VIEW[got.element_size()]
    assert torch.equal(got.contiguous().view(bits), want.contiguous().view(bits))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("scale", [65536.0, 3.0, 1.0])
def test_unscale_is_torch_bitwise_and_in_place(dtype, scale):
    if dtype == torch.bfloat16 and torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("torch rounds bfloat16 nan differently before sm_80")
    ours = cuda_grads(dtype)
    theirs = [g.clone() for g in ours]
    ids = [id(g) for g in ours]
    backend = polyamp.get_backend("cupy")
    state = backend.full(scale, "float32", ours[0])
    found = backend.full(0.0, "float32", state)
    backend.unscale_and_check(ours, state, found)
    torch_found = torch.zeros((), device="cuda")
    inv = torch.full((), scale, device="cuda").double().reciprocal().float()
    torch._amp_foreach_non_finite_check_and_unscale_(theirs, torch_found, inv)
    for got, want in zip(ours, theirs, strict=True):
        assert_bitwise(got, want)
    assert [id(g) for g in ours] == ids and float(found.get()) == float(torch_found) == 1.0
    assert isinstance(found, cupy.ndarray)


def test_polyamp_backend_env_sends_cuda_tensors_to_cupy(monkeypatch):
    monkeypatch.setenv("POLYAMP_BACKEND", "cupy")
    ours = LossScaler(LossScaleConfig(growth_interval=1))
    monkeypatch.delenv("POLYAMP_BACKEND")
    theirs = LossScaler(LossScaleConfig(growth_interval=1), backend="torch")
    grads = cuda_grads(torch.float16, seed=1, nonfinite=False)  # finite: the scale grows
    copies = [g.clone() for g in grads]
    ours.step(grads, lambda: None)
    theirs.step(copies, lambda: None)
    ours.update()
    theirs.update()
    assert ours.backend.name == "cupy" and isinstance(ours.state.scale, cupy.ndarray)
    for got, want in zip(grads, copies, strict=True):
        assert_bitwise(got, want)
    assert ours.get_scale() == theirs.get_scale() == 2.0**17


def test_scale_keeps_torch_autograd():
    scaler = LossScaler(backend="cupy")
    weight = torch.ones(3, device="cuda", requires_grad=True)
    loss = (weight * 2).sum()
    scaled = scaler.scale(loss)
    assert isinstance(scaled, torch.Tensor) and scaled.grad_fn is not None
    scaled.backward()
    assert torch.equal(weight.grad, torch.full((3,), 2.0 * 65536, device="cuda"))


def _train(model, opt, scaler, batches, blow_up, clip_every):
    """Yield (scale, skipped) after each step of an autocast fp16 training loop."""
    for step, x in enumerate(batches):
        opt.zero_grad()
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(x).float().pow(2).mean()
        if step in blow_up:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        if step % clip_every == 0:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        yield scaler.get_scale()


def test_grad_scaler_parity_with_torch_amp():
    from polyamp.compat.torch import GradScaler

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 4)).cuda()
    twin = copy.deepcopy(model)
    batches = [torch.randn(8, 16, device="cuda") for _ in range(30)]
    blow_up = {4, 5, 11, 20}
    ref_scaler = torch.amp.GradScaler("cuda", init_scale=2.0**10, growth_interval=3)
    our_scaler = GradScaler("cuda", init_scale=2.0**10, growth_interval=3, backend="cupy")
    ref = _train(model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                 ref_scaler, batches, blow_up, 3)
    ours = _train(twin, torch.optim.SGD(twin.parameters(), lr=0.01, momentum=0.9),
                  our_scaler, batches, blow_up, 3)
    for step, (want, got) in enumerate(zip(ref, ours, strict=True)):
        assert got == want, step
        assert our_scaler.last_step_skipped is (step in blow_up)
        for p, q in zip(model.parameters(), twin.parameters(), strict=True):
            assert torch.equal(p, q), step
    assert our_scaler.skipped_steps == len(blow_up)
    assert our_scaler.state_dict() == ref_scaler.state_dict()
    assert isinstance(our_scaler.engine.state.scale, cupy.ndarray)
