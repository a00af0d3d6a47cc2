"""ShardedGradScaler in one process: torch's signature, the disabled type, and clear errors.

Everything that needs a process group runs in tests/distributed/test_sharded*.py.
"""

from __future__ import annotations

import inspect
import pickle
import subprocess
import sys
import warnings

import pytest

torch = pytest.importorskip("torch")
sharded_module = pytest.importorskip("torch.distributed.fsdp.sharded_grad_scaler")
TorchSharded = sharded_module.ShardedGradScaler

from polyamp.compat.torch import GradScaler, ShardedGradScaler  # noqa: E402

from polyamp.distributed import ReducerUnavailableError  # noqa: E402

TORCH_PARAMS = ["device", "init_scale", "backoff_factor", "growth_factor", "growth_interval", "enabled",
                "process_group"]


def test_signature_and_defaults_are_torchs():
    ours = inspect.signature(ShardedGradScaler.__init__).parameters
    theirs = inspect.signature(TorchSharded.__init__).parameters
    assert list(theirs)[1:] == TORCH_PARAMS
    assert list(ours)[1:8] == TORCH_PARAMS
    for name in TORCH_PARAMS:
        assert ours[name].default == theirs[name].default, name
        assert ours[name].kind == theirs[name].kind, name
    assert all(ours[n].kind is inspect.Parameter.KEYWORD_ONLY for n in list(ours)[8:])


def test_positional_order_is_backoff_then_growth_as_in_torch():
    args = ("cpu", 8.0, 0.25, 4.0, 10)
    ours, theirs = ShardedGradScaler(*args), TorchSharded(*args)
    for getter in ("get_backoff_factor", "get_growth_factor", "get_growth_interval"):
        assert getattr(ours, getter)() == getattr(theirs, getter)()
    assert ours.get_backoff_factor() == 0.25 and ours.get_growth_factor() == 4.0
    assert isinstance(ours, GradScaler) and ours.process_group is None


def test_disabled_scaler_is_a_no_op_of_the_sharded_type():
    for scaler in (ShardedGradScaler("cpu", 8.0, 0.25, enabled=False),
                   ShardedGradScaler("cpu", 8.0, 0.25, 2.0, 10, False)):
        assert type(scaler).__name__ == "DisabledShardedGradScaler"
        assert isinstance(scaler, ShardedGradScaler) and not scaler.is_enabled()
        assert scaler.get_backoff_factor() == 0.25 and scaler.reducer is None
        assert scaler.state_dict() == {} and scaler.get_scale() == 1.0
        param = torch.nn.Parameter(torch.ones(2))
        param.grad = torch.full((2,), float("inf"))
        opt = torch.optim.SGD([param], lr=1.0)
        loss = torch.ones(())
        assert scaler.scale(loss) is loss
        scaler.step(opt)  # steps anyway, as torch's disabled scaler
        assert not torch.isfinite(param).any()
        copy = pickle.loads(pickle.dumps(scaler))
        assert type(copy) is type(scaler) and copy.get_backoff_factor() == 0.25
        assert repr(copy) == "ShardedGradScaler(device='cpu', enabled=False)"


def test_cuda_without_cuda_warns_and_disables_as_torch():
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    with pytest.warns(UserWarning, match="CUDA is not available") as ours:
        scaler = ShardedGradScaler()
    with pytest.warns(UserWarning, match="CUDA is not available"):
        theirs = TorchSharded()
    assert not scaler.is_enabled() and not theirs.is_enabled()
    assert "Disabling." in str(ours[0].message)


def test_a_bad_process_group_names_the_argument():
    with pytest.raises(TypeError, match=r"ShardedGradScaler\(process_group=42\).*It accepts"):
        ShardedGradScaler("cpu", process_group=42)


def _scaled(scaler):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler.scale(model(torch.ones(4, 3)).sum()).backward()
    return model, opt


def test_without_a_default_group_the_first_unscale_fails_and_changes_nothing():
    scaler = ShardedGradScaler("cpu", init_scale=4.0)
    model, opt = _scaled(scaler)
    grads = [p.grad.clone() for p in model.parameters()]
    for call in (scaler.unscale_, scaler.step):
        with pytest.raises(ReducerUnavailableError, match=r"process_group=None.*init_process_group"):
            call(opt)
        assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads, strict=True))
    with pytest.raises(ReducerUnavailableError):  # still READY: no "already unscaled"
        scaler.unscale_(opt)


def test_fp16_gradients_are_allowed_unlike_gradscaler():
    half = torch.nn.Parameter(torch.ones(2, dtype=torch.float16))
    half.grad = torch.ones(2, dtype=torch.float16)
    opt = torch.optim.SGD([half], lr=1.0)
    plain = GradScaler("cpu")
    plain.scale(torch.ones(()))
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
        plain.unscale_(opt)
    sharded = ShardedGradScaler("cpu")
    sharded.scale(torch.ones(()))
    with pytest.raises(ReducerUnavailableError):  # gets past the FP16 check to the group
        sharded.unscale_(opt)


def test_building_one_imports_no_torch():
    code = ("import sys\nfrom polyamp.compat.torch import ShardedGradScaler\n"
            "s = ShardedGradScaler('cpu', backend='numpy')\nprint('torch' in sys.modules, s.process_group)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False None"


def test_repr_names_the_group():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scaler = ShardedGradScaler("cpu")
    assert repr(scaler).startswith("ShardedGradScaler(device='cpu', process_group=None, engine=LossScaler(")


class MyScaler(ShardedGradScaler):
    """A user subclass with an attribute of its own."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.note = "mine"


def test_pickle_round_trip_and_user_subclasses():
    scaler = MyScaler("cpu", 8.0, 0.25, 4.0, 10)
    copy = pickle.loads(pickle.dumps(scaler))
    assert type(copy) is MyScaler and copy.note == "mine" and copy.process_group is None
    assert copy.state_dict() == scaler.state_dict() == {"scale": 8.0, "growth_factor": 4.0,
                                                         "backoff_factor": 0.25, "growth_interval": 10,
                                                         "_growth_tracker": 0}
    off = MyScaler("cpu", 8.0, 0.25, enabled=False)
    assert isinstance(off, MyScaler) and not off.is_enabled() and off.get_backoff_factor() == 0.25
    assert type(pickle.loads(pickle.dumps(off))) is type(off)


# -- whose flag: what every rank of a sharded job shares, whatever its shard holds --------------
def _sgd(*shapes, dtype=torch.float32):
    return torch.optim.SGD([torch.nn.Parameter(torch.ones(s, dtype=dtype)) for s in shapes], lr=0.1)


def test_an_optimizer_is_named_by_its_place_and_class_not_its_shard():
    from polyamp.compat._torch_sharded import Places

    # two ranks' first optimizers: other counts, shapes, dtypes and param groups, one identity
    rank0, rank1 = Places(), Places()
    mine = _sgd(4, (3, 2))
    mine.add_param_group({"params": [torch.nn.Parameter(torch.ones(5, dtype=torch.float16))]})
    theirs = _sgd(7, dtype=torch.float64)
    assert rank0.identity(mine, None) == rank1.identity(theirs, None) != 0
    assert rank0.identity(mine, None) == rank0.identity(mine, None)  # the same optimizer keeps its place
    # the second stepped is told from the first; another class at the same place too
    second = rank0.identity(_sgd(2), None)
    assert second != rank0.identity(mine, None) and second == rank1.identity(_sgd(3), None)
    adam = torch.optim.Adam([torch.nn.Parameter(torch.ones(2))])
    assert Places().identity(adam, None) != Places().identity(_sgd(2), None)
    # a group added later keeps the optimizer's place
    mine.add_param_group({"params": [torch.nn.Parameter(torch.ones(1))]})
    assert rank0.identity(mine, None) == rank1.identity(theirs, None)
    assert Places().identity(None, None) == 0


def test_an_optimizer_built_after_one_died_gets_the_next_place():
    from polyamp.compat._torch_sharded import Places

    places, other = Places(), Places()
    places.identity(_sgd(2), None)  # dies at once: its id may be given to the next optimizer
    other.identity(_sgd(2), None)
    fresh = _sgd(2)
    assert places.identity(fresh, None) == other.identity(_sgd(5), None) != Places().identity(fresh, None)


def test_places_restart_on_load_state_dict_and_unpickling_not_on_a_failed_load():
    scaler, first, second = ShardedGradScaler("cpu"), _sgd(2), _sgd(3)
    scaler._places.identity(first, None)
    at_one = scaler._places.identity(second, None)
    with pytest.raises(ValueError, match="scale must be a number"):  # StateDictError
        scaler.load_state_dict({**scaler.state_dict(), "scale": "big"})
    assert scaler._places.identity(second, None) == at_one  # a failed load changes nothing
    at_zero = ShardedGradScaler("cpu")._places.identity(second, None)
    for restarted in (pickle.loads(pickle.dumps(scaler)), scaler):
        if restarted is scaler:
            scaler.load_state_dict(scaler.state_dict())
        assert restarted._places.identity(second, None) == at_zero != at_one
