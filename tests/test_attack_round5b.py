"""Attack round 5b on issues 32 and 34: what a user can hand the new parts. Each case failed (a raw
exception, a refusal of a valid state, a late failure or a wrong Fix) before its fix."""

from __future__ import annotations

import numpy as np
import pytest

import polyamp
from polyamp import LossScaleConfig, LossScaler, StateDictError
from polyamp.cli import main

torch = pytest.importorskip("torch")


# -- polyamp advise: tensors without NumPy values -------------------------------------------------
@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support")
@pytest.mark.parametrize("make", [lambda: torch.ones(3).to_sparse(), lambda: torch.ones(2, 2).to_sparse_csr(),
                                  lambda: torch.ones(3, device="meta")], ids=["coo", "csr", "meta"])
def test_advise_refuses_sparse_and_meta_tensors_in_one_line(tmp_path, capsys, make):
    path = tmp_path / "grads.pt"
    torch.save({"w": make()}, path)
    assert main(["advise", str(path)]) == 2  # was a TypeError traceback from Tensor.numpy()
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("polyamp advise: error:")
    assert "'w'" in err and "to_dense().cpu()" in err


def test_advise_refusing_a_pickle_says_how_to_save_gradients_not_a_scaler_state(tmp_path, capsys):
    path = tmp_path / "grads.pkl"
    path.write_bytes(b"\x80\x04\x95\x05\x00\x00\x00\x00\x00\x00\x00\x8c\x02os\x94.")  # a pickle of a global
    assert main(["advise", str(path)]) == 2
    err = capsys.readouterr().err
    assert "np.savez" in err and "scaler.state_dict()" not in err  # the Fix was inspect's


# -- Megatron-Core / DeepSpeed scaler state --------------------------------------------------------
def _megatron_scaler() -> LossScaler:
    return LossScaler(LossScaleConfig(rule="megatron", backoff_interval=2), backend="numpy")


def _deepspeed_scaler() -> LossScaler:
    return LossScaler(LossScaleConfig(rule="deepspeed", backoff_interval=2, growth_interval=1000,
                                      min_scale=1.0, raise_error_at_min_scale=True), backend="numpy")


MEGATRON = {"scale": 65536.0, "growth_tracker": 3, "hysteresis_tracker": 2}
DEEPSPEED = {"cur_scale": 65536.0, "cur_iter": 10, "last_overflow_iter": 4, "cur_hysteresis": 2,
             "scale_window": 1000, "delayed_shift": 2, "min_scale": 1, "dynamic": True}


@pytest.mark.parametrize("scaler, state, key", [
    (_megatron_scaler, {**MEGATRON, "scale": 10**400}, "scale"),  # was OverflowError from float()
    (_deepspeed_scaler, {**DEEPSPEED, "cur_scale": 10**400}, "cur_scale"),
    (_deepspeed_scaler, {**DEEPSPEED, "cur_scale": 1e300}, "cur_scale"),  # named state_dict['scale']
    (_megatron_scaler, {**MEGATRON, "scale": 1e-40}, "scale"),
    (_deepspeed_scaler, {**DEEPSPEED, "scale_window": np.array([1000, 1000])}, "scale_window"),  # ValueError
    (_deepspeed_scaler, {**DEEPSPEED, "scale_window": torch.tensor([1000, 5])},
     "scale_window"),  # RuntimeError
    (_deepspeed_scaler, {**DEEPSPEED, "min_scale": np.ones(2)}, "min_scale"),
], ids=["megatron-10**400", "deepspeed-10**400", "deepspeed-1e300", "megatron-tiny", "array-setting",
        "tensor-setting", "array-min-scale"])
def test_foreign_state_refuses_odd_values_naming_the_key_and_changes_nothing(scaler, state, key):
    scaler = scaler()
    before = scaler.state_dict()
    with pytest.raises(StateDictError, match=f"\\[{key!r}\\]") as caught:
        scaler.load_state_dict(state)
    assert "Fix:" in str(caught.value)
    assert scaler.state_dict() == before


def test_deepspeed_state_with_numpy_bools_loads():
    scaler = _deepspeed_scaler()  # np.True_ is not True: read as "a static scale" and refused
    scaler.load_state_dict({**DEEPSPEED, "dynamic": np.bool_(True),
                            "raise_error_at_min_scale": np.bool_(True)})
    assert scaler.state_dict()["scale"] == 65536.0 and scaler.state_dict()["growth_tracker"] == 5


# -- jax: axis_name of a wrong type ----------------------------------------------------------------
@pytest.mark.parametrize("axis_name", [["i"], 0], ids=["list", "int"])
def test_unscale_refuses_an_axis_name_that_names_no_axis_by_type(axis_name):
    jax = pytest.importorskip("jax")
    import polyamp.functional as F

    state = F.init(like=jax.numpy.zeros(1))
    with pytest.raises(polyamp.ConfigError, match="axis_name=") as caught:
        jax.pmap(lambda g: F.unscale(state, [g], axis_name=axis_name), axis_name="i")(jax.numpy.ones((1, 1)))
    assert "Fix:" in str(caught.value)  # a list: jax's TypeError about __hash__; 0: "out-of-bounds" axes


# -- loggers: bad settings refused when built, not at the first logging step mid-run ---------------
@pytest.mark.parametrize("kwargs", [{"prefix": None}, {"prefix": 3}, {"diagnose": "no"}])
def test_lightning_scaler_metrics_checks_its_settings_when_built(kwargs):
    pytest.importorskip("lightning")
    from polyamp.loggers.lightning import ScalerMetrics

    name = next(iter(kwargs))
    with pytest.raises(TypeError, match=f"ScalerMetrics\\({name}=") as caught:
        ScalerMetrics(**kwargs)
    assert "Fix:" in str(caught.value)


def test_scaler_metrics_writer_checks_diagnose_when_built(tmp_path):
    from polyamp.loggers.tensorboard import ScalerMetricsWriter

    class Writer:
        def add_scalar(self, *args):
            pass

    with pytest.raises(TypeError, match="diagnose='no'"):
        ScalerMetricsWriter(LossScaler(), writer=Writer(), diagnose="no")
