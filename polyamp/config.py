"""The loss-scale configuration: a frozen, validated dataclass shared by every backend."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, Literal

import numpy as np

from ._errors import ConfigError

ProductDtype = Literal["float64", "float32"]
Rule = Literal["torch", "paddle", "megatron", "deepspeed"]

#: Each rule's own precision of scale * factor (docs/rule.md): the engine's arithmetic.
RULE_PRODUCTS: dict[str, ProductDtype] = {
    "torch": "float64", "paddle": "float32", "megatron": "float32", "deepspeed": "float64",
}

#: The scale's range: float32's smallest normal (backoff stops there: a scale of 0 would turn the
#: unscaled weights into NaN) to its largest finite value.
SCALE_FLOOR = 2.0**-126
SCALE_CEILING = float(np.finfo(np.float32).max)


@dataclass(frozen=True)
class LossScaleConfig:
    """How the loss scale moves: ``rule`` picks the fp16 engine whose update it is (docs/rule.md).

    ``rule``: "torch", "paddle", "megatron" (``backoff_interval`` is its hysteresis) or "deepspeed"
    (``backoff_interval`` is ``delayed_shift``, ``growth_interval`` ``scale_window``).
    ``product_dtype``: the precision of scale*factor before rounding to float32 (None: the rule's
    own). ``consecutive_hysteresis`` and ``raise_error_at_min_scale`` are DeepSpeed's options only.
    """

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    backoff_interval: int = 1
    min_scale: float | None = None
    max_scale: float | None = None
    dynamic: bool = True
    product_dtype: ProductDtype | None = None
    rule: Rule = "torch"
    consecutive_hysteresis: bool = False
    raise_error_at_min_scale: bool = False

    def __post_init__(self) -> None:
        for name in _NUMBER_FIELDS:  # NumPy scalars stored as Python numbers: the config stays JSON-able
            object.__setattr__(self, name, _plain(getattr(self, name), integral=name.endswith("_interval")))
        check_scale("init_scale", self.init_scale)
        _check_number("growth_factor", self.growth_factor)
        if not self.growth_factor > 1.0 or not math.isfinite(self.growth_factor):
            raise ConfigError(f"growth_factor must be a finite number > 1, got growth_factor="
                              f"{self.growth_factor!r}. Fix: pass e.g. growth_factor=2.0")
        _check_number("backoff_factor", self.backoff_factor)
        if not 0.0 < self.backoff_factor < 1.0:
            raise ConfigError(f"backoff_factor must be in (0, 1), got backoff_factor="
                              f"{self.backoff_factor!r}. Fix: pass e.g. backoff_factor=0.5")
        _check_interval("growth_interval", self.growth_interval)
        _check_interval("backoff_interval", self.backoff_interval)
        _check_bounds(self.min_scale, self.max_scale)
        if not isinstance(self.dynamic, bool):
            raise ConfigError(f"dynamic must be True or False, got dynamic={short_repr(self.dynamic)}. "
                              "Fix: pass dynamic=True (the scale moves) or dynamic=False (a fixed scale)")
        if self.product_dtype not in (None, "float64", "float32"):
            raise ConfigError(
                "product_dtype must be None (the rule's own), 'float64' (torch) or 'float32' (paddle), got "
                f"product_dtype={short_repr(self.product_dtype)}. Fix: leave product_dtype unset (None), or "
                "pass product_dtype='float64' or 'float32'")
        _check_rule(self)

    @property
    def products(self) -> ProductDtype:
        """The precision scale*factor is formed in: ``product_dtype``, else the rule's own."""
        return self.product_dtype or RULE_PRODUCTS[self.rule]

    def replace(self, **changes: Any) -> LossScaleConfig:
        """A copy with some fields changed, validated like a new config."""
        return replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """Every field by name."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LossScaleConfig:
        """Rebuild a config from :meth:`to_dict`; unknown keys are an error, missing ones default."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown LossScaleConfig field(s) {unknown}; expected some of "
                              f"{sorted(known)}. Fix: drop or rename those keys (a dict from "
                              "LossScaleConfig.to_dict() has only known ones)")
        return cls(**data)


def _check_bounds(min_scale: float | None, max_scale: float | None) -> None:
    """Each bound a valid scale, and ``min_scale <= max_scale`` where both are set."""
    for name, value in (("min_scale", min_scale), ("max_scale", max_scale)):
        if value is not None:
            check_scale(name, value)
    if min_scale is not None and max_scale is not None and min_scale > max_scale:
        raise ConfigError(f"min_scale must be <= max_scale, got min_scale={min_scale!r} and max_scale="
                          f"{max_scale!r}. Fix: pass a min_scale no larger than max_scale, or leave one None")


def _check_rule(config: LossScaleConfig) -> None:
    """``rule`` is known, its product precision is the engine's, DeepSpeed's options only with it."""
    if not isinstance(config.rule, str) or config.rule not in RULE_PRODUCTS:
        raise ConfigError(f"rule must be one of {', '.join(map(repr, RULE_PRODUCTS))}, got rule="
                          f"{short_repr(config.rule)}. Fix: pass e.g. rule='torch' (the default).")
    own = RULE_PRODUCTS[config.rule]
    if config.rule != "torch" and config.product_dtype not in (None, own):
        raise ConfigError(
            f"rule={config.rule!r} forms scale*factor in {own}, got product_dtype={config.product_dtype!r}. "
            f"Fix: leave product_dtype unset (None), or use rule='torch' with product_dtype="
            f"{config.product_dtype!r}.")
    for name in ("consecutive_hysteresis", "raise_error_at_min_scale"):
        value = getattr(config, name)
        if not isinstance(value, bool):
            raise ConfigError(f"{name} must be True or False, got {name}={short_repr(value)}. "
                              f"Fix: pass {name}=True or {name}=False")
        if value and config.rule != "deepspeed":
            raise ConfigError(f"{name} is DeepSpeed's option, got {name}=True with rule={config.rule!r}. "
                              f"Fix: pass rule='deepspeed', or leave {name}=False.")


def config_from(config: LossScaleConfig | None, fields_given: dict[str, Any], caller: str) -> LossScaleConfig:
    """The config of ``caller(config=None, **fields)``: ``config``, or one built from the fields
    (not both: which would win is unclear)."""
    if not fields_given:
        return LossScaleConfig() if config is None else config
    known = [f.name for f in fields(LossScaleConfig)]
    unknown = [name for name in fields_given if name not in known]
    if unknown:
        raise TypeError(f"{caller}() got unexpected keyword argument(s) {', '.join(map(repr, unknown))}; "
                        f"valid keywords: config= or the LossScaleConfig fields {', '.join(known)}")
    if config is not None:
        raise TypeError(
            f"{caller}() got both config= and the config field(s) {', '.join(fields_given)}. Fix: pass one "
            f"of them, e.g. config=config.replace({', '.join(f'{k}=...' for k in fields_given)})")
    return LossScaleConfig(**fields_given)


_NUMBER_FIELDS = ("init_scale", "growth_factor", "backoff_factor", "growth_interval", "backoff_interval",
                  "min_scale", "max_scale")


def _plain(value: Any, integral: bool) -> Any:
    """A NumPy scalar or 0-d array as the Python number it holds (int for an interval); anything
    else as it is, for the checks to judge (a float interval or a NumPy bool is still refused)."""
    if isinstance(value, np.ndarray) and value.ndim == 0:
        value = value[()]
    if isinstance(value, np.integer):
        return int(value) if integral else float(value)
    if isinstance(value, np.floating) and not integral:
        return float(value)
    return value


#: The example value each message suggests (the defaults).
_EXAMPLES = {"growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000, "backoff_interval": 1}


def _check_number(name: str, value: Any) -> None:
    if not is_real(value):
        example = _EXAMPLES.get(name, 2.0)
        raise ConfigError(f"{name} must be a real number, got {name}={short_repr(value)}. "
                          f"Fix: pass a float (within float64's range), e.g. {name}={example!r}")


def is_real(value: Any) -> bool:
    """Whether ``value`` is an int or float (not a bool) that ``float()`` takes."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and fits_float(value)


def fits_float(value: Any) -> bool:
    """Whether ``float(value)`` exists (an int beyond float64's range, e.g. 10**400, has none)."""
    try:
        float(value)
    except OverflowError:
        return False
    return True


def check_scale(name: str, value: Any, error: type[Exception] = ConfigError) -> float:
    """``value`` as a float when it is a positive normal float32 value (else gradients turn inf or
    NaN); else ``error`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise error(f"{name} must be a real number, got {name}={short_repr(value)} ({type(value).__name__}). "
                    f"Fix: pass a float, e.g. {name}=65536.0")
    number = float(value) if fits_float(value) else math.inf  # an int beyond float64, e.g. 10**400
    if not (math.isfinite(number) and SCALE_FLOOR <= number <= SCALE_CEILING):
        raise error(f"{name} must be a positive normal float32 value, between 2**-126 (~1.18e-38) and "
                    f"~3.40e38, got {name}={short_repr(value)}. Fix: pass e.g. {name}=65536.0")
    return number


#: Intervals are compared with the device trackers as int64 (torch, paddle): at most 2**63 - 1.
INTERVAL_LIMIT = 2**63


def _check_interval(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be an int >= 1, got {name}={short_repr(value)}. "
                          f"Fix: pass a whole number of steps, e.g. {name}={_EXAMPLES[name]}")
    if value >= INTERVAL_LIMIT:
        raise ConfigError(f"{name} must be an int below 2**63 (the device compares it as int64), got {name}="
                          f"{short_repr(value)}. Fix: pass e.g. {name}=2**31, which the int32 trackers "
                          "never reach.")


def short_repr(value: Any, limit: int = 40) -> str:
    """``repr(value)`` cut to ``limit`` characters, so a 400-digit int cannot flood a message."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 12]}...({len(text)} chars)"


#: The config of a scaler that does not scale (a guard-only scaler, the trainer without loss scaling).
FIXED_ONE = LossScaleConfig(init_scale=1.0, dynamic=False)
