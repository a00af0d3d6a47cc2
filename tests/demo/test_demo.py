"""The demo: MLP backward against torch autograd, exact low-precision rounding, data, short runs."""

from __future__ import annotations

import io

import numpy as np
import pytest

import polyamp
from polyamp.demo import MLP, DemoSettings, backends, report, run_demo, softmax_cross_entropy, spirals
from polyamp.demo._lowp import round_to
from polyamp.demo.run import (
    ACCURACY_TOLERANCE,
    LOSS_TOLERANCE,
    format_table,
    summary,
    within_tolerance,
)
from polyamp.grads import GradBuffer

SIZES = [2, 8, 8, 3]


def _backward(model, x, grad_output, dtype):
    GradBuffer.attach(model.parameters())
    x = x.astype(np.float32 if dtype == "float32" else np.float16)
    model.forward(x, dtype)
    model.backward(grad_output)
    return [p.grad.copy() for p in model.parameters()]


def test_mlp_backward_matches_torch_autograd():
    torch = pytest.importorskip("torch")
    model = MLP(SIZES, seed=3)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((32, 2)).astype(np.float32)
    grad_output = rng.standard_normal((32, 3)).astype(np.float32)
    grads = _backward(model, x, grad_output, "float32")
    weights = [torch.tensor(p.data, requires_grad=True) for p in model.parameters()]
    act = torch.from_numpy(x)
    for i in range(0, len(weights), 2):
        act = act @ weights[i] + weights[i + 1]
        act = torch.relu(act) if i < len(weights) - 2 else act
    act.backward(torch.from_numpy(grad_output))
    for ours, w in zip(grads, weights):
        np.testing.assert_allclose(ours, w.grad.numpy(), rtol=1e-5, atol=1e-6)


def _float16_reference(weights, x, grad_output):
    """The MLP's float16 math with real float16 arrays: the same ops, rounded at the same points."""
    f16, f32 = np.float16, np.float32
    w16 = [w.astype(f16) for w in weights]
    acts = [x.astype(f16)]
    for i in range(0, len(w16), 2):
        z = acts[-1].astype(f32) @ w16[i].astype(f32) + w16[i + 1].astype(f32)
        acts.append((np.maximum(z, 0) if i < len(w16) - 2 else z).astype(f16))
    delta, grads = grad_output.astype(f16), [None] * len(w16)
    for i in reversed(range(0, len(w16), 2)):
        grads[i] = (acts[i // 2].astype(f32).T @ delta.astype(f32)).astype(f16)
        grads[i + 1] = delta.astype(f32).sum(axis=0).astype(f16)
        if i:
            back = delta.astype(f32) @ w16[i].astype(f32).T
            delta = np.where(acts[i // 2] > 0, back, 0).astype(f16)
    return [g.astype(f32) for g in grads]


def test_mlp_float16_backward_equals_float16_storage_and_underflows():
    model = MLP(SIZES, seed=3)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((64, 2)).astype(np.float32)
    grad_output = (rng.standard_normal((64, 3)) * 1e-3).astype(np.float16)
    half = _backward(model, x, grad_output, "float16")
    expected = _float16_reference([p.data for p in model.parameters()], x, grad_output)
    for ours, ref in zip(half, expected):
        np.testing.assert_array_equal(ours, ref)  # bit for bit, subnormals included
    tiny = (grad_output * 1e-6).astype(np.float16)  # below 2**-25: rounds to zero in float16
    assert all(not g.any() for g in _backward(model, x, tiny, "float16"))
    assert all(g.any() for g in _backward(model, x, grad_output.astype(np.float32) * 1e-6, "float32"))


def test_mlp_masters_are_views_of_one_float32_array():
    model = MLP(SIZES, seed=0)
    params = model.parameters()
    assert all(p.dtype == np.float32 for p in params)
    base = params[0].data.base
    assert base is not None and all(p.data.base is base for p in params)
    out = model.forward(np.zeros((4, 2), np.float16), "float16")
    assert out.dtype == np.float16 and out.shape == (4, 3)
    with pytest.raises(polyamp.ConfigError, match="sizes"):
        MLP([2])


def test_round_to_float16_is_bit_exact():
    bits = np.arange(0, 2**32, 997, dtype=np.uint64).astype(np.uint32)
    edges = np.array([65504, 65519.99, 65520, -65520, 2.0**-25, 3 * 2.0**-26, -1e-30, 2.0**-14,
                      2.0**-14 - 2.0**-25, np.inf, -np.inf, 1e-45], np.float32)
    x = np.concatenate([bits.view(np.float32), edges])
    with np.errstate(all="ignore"):
        expected = x.astype(np.float16).astype(np.float32)
    got = round_to(x, "float16")
    same = (got.view(np.uint32) == expected.view(np.uint32)) | (np.isnan(got) & np.isnan(expected))
    assert same.all(), x[~same][:5]


def test_round_to_bfloat16_and_float32():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    x = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    assert round_to(x, "float32") is x
    np.testing.assert_array_equal(round_to(x, "bfloat16"), x.astype(ml_dtypes.bfloat16).astype(np.float32))


def test_softmax_cross_entropy_matches_torch():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((16, 3)).astype(np.float32)
    labels = rng.integers(0, 3, 16)
    loss, grad = softmax_cross_entropy(logits, labels, normalizer=64)
    t_logits = torch.tensor(logits, requires_grad=True)
    t_loss = torch.nn.functional.cross_entropy(t_logits, torch.from_numpy(labels), reduction="sum") / 64
    t_loss.backward()
    assert float(loss) == pytest.approx(t_loss.item(), rel=1e-6)
    np.testing.assert_allclose(grad, t_logits.grad.numpy(), rtol=1e-5, atol=1e-8)


def test_spirals_are_deterministic_and_checked():
    x, y = spirals(300, seed=4)
    x2, y2 = spirals(300, seed=4)
    assert x.shape == (300, 2) and x.dtype == np.float32 and y.dtype == np.int64
    assert np.array_equal(x, x2) and np.array_equal(y, y2) and set(y.tolist()) == {0, 1, 2}
    assert float(np.abs(x).max()) <= 1.0 + 1e-6
    with pytest.raises(polyamp.ConfigError, match="classes"):
        spirals(10, classes=1)
    with pytest.raises(polyamp.ConfigError, match="n must"):
        spirals(0)


SHORT = DemoSettings(steps=60, batch=1024, hidden=32, test_size=2000)


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_short_demo_polyamp_matches_float32_and_plain_float16_does_not(backend):
    """Tolerance: final per-sample loss within LOSS_TOLERANCE, test accuracy within ACCURACY_TOLERANCE."""
    if backend == "torch":
        pytest.importorskip("torch")
    reference, unscaled, scaled = run_demo(SHORT.replace(backend=backend))
    assert reference.accuracy > 0.9  # float32 learned the spirals
    assert abs(scaled.final_loss - reference.final_loss) <= LOSS_TOLERANCE
    assert abs(scaled.accuracy - reference.accuracy) <= ACCURACY_TOLERANCE
    assert within_tolerance(scaled, reference) and not within_tolerance(unscaled, reference)
    assert unscaled.final_loss > reference.final_loss + 0.5 and unscaled.accuracy < 0.7
    assert unscaled.zero_grad_fraction > 0.5 > reference.zero_grad_fraction
    assert scaled.final_scale > 2.0**16 and unscaled.final_scale == 1.0
    assert len(scaled.losses) == len(scaled.scales) == len(scaled.skipped) == SHORT.steps


def test_short_bfloat16_demo_needs_no_scaling():
    pytest.importorskip("ml_dtypes")
    results = run_demo(SHORT.replace(dtype="bfloat16", steps=40))
    reference, unscaled, scaled = results
    assert within_tolerance(unscaled, reference) and within_tolerance(scaled, reference)
    # the output says why: bfloat16 has float32's range
    assert summary(results).splitlines()[-1].startswith("bfloat16 has float32's exponent range (8 bits)")


def test_table_summary_and_plot(tmp_path):
    results = run_demo(SHORT.replace(steps=5, batch=256, test_size=100))
    table = format_table(results)
    assert table.splitlines()[0].split()[:3] == ["run", "final", "loss"]
    assert "float16, no loss scaling" in table and "float16 + polyamp" in table
    assert "does NOT match" in summary(results)
    pytest.importorskip("matplotlib")
    path = tmp_path / "plot.png"
    report.write_plot(results, str(path), "title")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


def test_missing_optional_dependencies(monkeypatch, tmp_path):
    monkeypatch.setitem(__import__("sys").modules, "tqdm", None)
    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)
    stream = io.StringIO()
    tick = report.progress_factory(stream=stream)("float32", 20)
    for _ in range(20):
        tick(0.5)
    assert stream.getvalue().count("float32: step") == 10 and "20/20" in stream.getvalue()
    with pytest.raises(ImportError, match=r"polyamp\[demo\]"):
        report.write_plot([], str(tmp_path / "x.png"), "t")


def test_settings_and_backends_are_checked():
    with pytest.raises(polyamp.ConfigError, match="global_batch"):
        DemoSettings(batch=10, global_batch=5)
    with pytest.raises(polyamp.ConfigError, match="dtype"):
        DemoSettings(dtype="float32")
    with pytest.raises(polyamp.ConfigError, match="steps"):
        DemoSettings(steps=0)
    with pytest.raises(polyamp.BackendNotFoundError, match="jax"):
        backends.get("jax")


def test_environment_naming_a_backend_the_demo_cannot_train_imports_nothing():
    """POLYAMP_BACKEND=jax (installed, not a demo backend) is refused before jax is imported."""
    import subprocess
    import sys

    code = (
        "import os, sys; os.environ['POLYAMP_BACKEND'] = 'jax'\n"
        "from polyamp.demo import backends\n"
        "try:\n    backends.chosen(None)\nexcept Exception as exc:\n    print(type(exc).__name__, exc)\n"
        "print(','.join(m for m in ('torch', 'jax', 'paddle', 'cupy') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    refusal, imported = out.stdout.splitlines()
    assert refusal.startswith("BackendNotFoundError POLYAMP_BACKEND=jax names a backend the demo")
    assert "Fix:" in refusal and imported == ""


def test_unavailable_backend_names_itself_the_reason_and_the_alternatives():
    if backends._why_unavailable("cupy") is None:
        pytest.skip("cupy can run here")
    with pytest.raises(polyamp.BackendUnavailableError) as info:
        run_demo(SHORT.replace(backend="cupy"))
    message = str(info.value)
    assert "'cupy' is not available" in message and "one available here: numpy" in message
    assert backends._why_unavailable("cupy") in message


def test_demo_command_without_matplotlib_says_how_to_get_the_plot(monkeypatch, capsys, tmp_path):
    from polyamp.cli import build_parser
    from polyamp.demo import command

    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)
    args = build_parser().parse_args(["demo", "--steps", "3", "--batch", "128", "--no-progress",
                                      "--output", str(tmp_path / "x.png")])
    assert command.main(args) == 0
    out = capsys.readouterr().out
    assert "no plot written: matplotlib is not installed (pip install 'polyamp[demo]')" in out
    assert not (tmp_path / "x.png").exists()


@pytest.mark.parametrize("seed", [-1, 1.5, True])
def test_seed_must_be_a_non_negative_int(seed):
    with pytest.raises(polyamp.ConfigError, match=rf"seed must be an int >= 0 .*got seed={seed!r}"):
        DemoSettings(seed=seed)
