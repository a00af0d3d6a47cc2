"""Base class for array-API optimizers with torch.optim's interface and state-dict format."""

from __future__ import annotations

import contextlib
import copy
import numbers
import struct
import sys
from collections import defaultdict
from collections.abc import Callable, Iterable
from itertools import chain
from typing import Any

import array_api_compat

from .._dtypes import computes_float64 as _computes_float64
from .._errors import ConfigError, StateDictError
from ..parameter import Parameter

__all__ = ["Optimizer", "ParamsT"]

ParamsT = Iterable[Parameter] | Iterable[dict[str, Any]]


def _round_to_float32(value: float) -> float:
    """``value`` rounded to the nearest float32, as torch rounds scalar arguments."""
    return struct.unpack("f", struct.pack("f", value))[0]


def fma(a: Any, b: Any, c: Any) -> Any:
    """``a + b * c`` rounded once, as torch's fused kernels do (float32 through float64, where the
    product is exact: ~3x the time of ``a + b * c``); other dtypes round twice."""
    scalar = isinstance(c, numbers.Real)
    if scalar and c == 1:
        return a + b  # one rounding already
    xp = array_api_compat.array_namespace(a)
    if a.dtype != xp.float32 or not _computes_float64(xp, array_api_compat.device(a)):
        return a + b * c
    product = xp.astype(b, xp.float64) * (_round_to_float32(float(c)) if scalar else c)
    return xp.astype(a + product, xp.float32)  # float32 + float64 promotes to float64


def check_nonnegative(name: str, value: float, label: str) -> None:
    """Raise ConfigError (a ValueError) unless ``value >= 0``; NaN fails too. Torch's wording."""
    if not 0.0 <= value:
        raise ConfigError(f"Invalid {label}: {name}={value!r}; expected {name} >= 0")


def write_param(param: Parameter, new: Any) -> None:
    """Store ``new`` into ``param.data`` in place (rebound for immutable arrays, e.g. JAX's)."""
    if array_api_compat.is_writeable_array(param.data):
        param.data[...] = new
    else:
        param.data = new


def _no_autograd() -> contextlib.AbstractContextManager[Any]:
    """torch.no_grad() once torch is imported, so updates of leaf tensors build no graph."""
    torch = sys.modules.get("torch")
    return torch.no_grad() if torch is not None else contextlib.nullcontext()


def _to_param_space(param: Parameter, key: Any, value: Any) -> Any:
    """Copy one loaded state value onto ``param``'s library, device and (float) dtype."""
    if not array_api_compat.is_array_api_obj(value):
        return copy.deepcopy(value)
    if key == "step":
        return float(value)  # torch stores step as a 0-d tensor; polyamp keeps a float
    xp = array_api_compat.array_namespace(param.data)
    if array_api_compat.array_namespace(value) is not xp:
        value = xp.from_dlpack(value)  # another library's array, e.g. a torch checkpoint
    floating = xp.isdtype(param.dtype, ("real floating", "complex floating"))
    dtype = param.dtype if floating else value.dtype
    return xp.asarray(value, dtype=dtype, device=array_api_compat.device(param.data), copy=True)


def _check_same_layout(saved: list[dict[str, Any]], groups: list[dict[str, Any]]) -> None:
    """Raise StateDictError unless ``saved`` matches ``groups`` in group count and sizes."""
    if len(saved) != len(groups):
        raise StateDictError(f"loaded state dict has {len(saved)} parameter groups, but the "
                             f"optimizer has {len(groups)}; build the optimizer with the same groups")
    for i, (s, g) in enumerate(zip(saved, groups, strict=True)):
        if len(s["params"]) != len(g["params"]):
            raise StateDictError(f"loaded state dict's parameter group {i} has {len(s['params'])} params, "
                                 f"but the optimizer's has {len(g['params'])}; build it with the same params")


class Optimizer:
    """Base class as torch.optim.Optimizer (code and checkpoints carry over); subclasses define _update."""

    def __init__(self, params: ParamsT, defaults: dict[str, Any]) -> None:
        if isinstance(params, (Parameter, dict, set)) or array_api_compat.is_array_api_obj(params):
            raise TypeError("params must be an ordered iterable of Parameters or of dicts (param "
                            f"groups), got {type(params).__qualname__}; pass a list, e.g. [param]")
        self._check_hyperparameters(defaults)
        self.defaults = defaults
        self.state: defaultdict[Parameter, dict[str, Any]] = defaultdict(dict)
        self.param_groups: list[dict[str, Any]] = []
        groups = list(params)
        if not groups:
            raise ConfigError("optimizer got an empty parameter list; pass at least one Parameter")
        if not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        for group in groups:
            self.add_param_group(group)

    def _check_hyperparameters(self, group: dict[str, Any]) -> None:
        """Raise ValueError for an invalid hyper-parameter; subclasses override."""

    def _update(self, param: Parameter, state: dict[str, Any], group: dict[str, Any]) -> None:
        """Apply one optimisation step to ``param``; subclasses override."""
        raise NotImplementedError(f"{type(self).__qualname__} must implement _update")

    def __repr__(self) -> str:
        lines = [f"{type(self).__name__} ("]
        for i, group in enumerate(self.param_groups):
            lines.append(f"Parameter Group {i}")
            lines += [f"    {k}: {v}" for k, v in sorted(group.items()) if k != "params"]
        return "\n".join([*lines, ")"])

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group of parameters with its own hyper-parameters; missing ones take defaults."""
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict, got {type(param_group).__qualname__}; "
                            "use {'params': [...], 'lr': ...}")
        params = param_group["params"]
        if isinstance(params, set):
            raise TypeError("optimizer parameters must be an ordered collection, but got "
                            "a set, whose order changes between runs; use a list instead")
        params = [params] if isinstance(params, Parameter) else list(params)
        for p in params:
            if not isinstance(p, Parameter):
                raise TypeError("optimizer can only optimize Parameters, but one of the params is "
                                f"{type(p).__module__}.{type(p).__qualname__}; wrap it: Parameter(array)")
        group = {**param_group, "params": params}
        for name, default in self.defaults.items():
            group.setdefault(name, default)
        self._check_hyperparameters(group)
        seen = {id(p) for g in self.param_groups for p in g["params"]}
        if len({id(p) for p in params}) != len(params) or seen & {id(p) for p in params}:
            raise ConfigError("some parameters appear more than once in the optimizer's "
                              "param groups; list each Parameter exactly once")
        self.param_groups.append(group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset every gradient: to None (default, frees memory) or to zeros in place."""
        for p in chain.from_iterable(g["params"] for g in self.param_groups):
            if p.grad is None or set_to_none:
                p.grad = None
            elif array_api_compat.is_writeable_array(p.grad):
                p.grad[...] = 0
            else:
                p.grad = array_api_compat.array_namespace(p.grad).zeros_like(p.grad)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Update every parameter that has a gradient; return ``closure()``'s loss, if given."""
        loss = closure() if closure is not None else None
        with _no_autograd():
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        self._update(p, self.state[p], group)
        return loss

    def state_dict(self) -> dict[str, Any]:
        """The state in torch's format, parameters as indices; arrays shared (steps replace them)."""
        index: dict[int, int] = {}
        groups = []
        for group in self.param_groups:
            for p in group["params"]:
                index.setdefault(id(p), len(index))
            packed = {k: v for k, v in group.items() if k != "params"}
            packed["params"] = [index[id(p)] for p in group["params"]]
            groups.append(packed)
        state = {  # params never stepped (or stateless, e.g. SGD without momentum) are omitted
            (index[id(k)] if isinstance(k, Parameter) else k): dict(v)
            for k, v in self.state.items()
            if v
        }
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore state saved by ``state_dict`` (polyamp's or torch's), copied onto each parameter's
        library, device and dtype."""
        saved_groups = copy.deepcopy(state_dict["param_groups"])
        _check_same_layout(saved_groups, self.param_groups)
        id_map = dict(zip(chain.from_iterable(g["params"] for g in saved_groups),
                          chain.from_iterable(g["params"] for g in self.param_groups), strict=True))
        state: defaultdict[Any, dict[str, Any]] = defaultdict(dict)
        for key, value in state_dict["state"].items():
            if key in id_map:
                param = id_map[key]
                state[param] = {k: _to_param_space(param, k, v) for k, v in value.items()}
            else:
                state[key] = copy.deepcopy(value)
        for saved, group in zip(saved_groups, self.param_groups, strict=True):
            saved["params"] = group["params"]
            for name, default in self.defaults.items():
                saved.setdefault(name, default)
            self._check_hyperparameters(saved)
        self.state = state
        self.param_groups = saved_groups
