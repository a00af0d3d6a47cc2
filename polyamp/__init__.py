"""polyamp: dynamic loss scaling and mixed precision over NumPy, CuPy and PyTorch arrays.

Importing polyamp imports neither torch nor cupy; backends are found when a scaler is built.
"""

from ._errors import (
    BackendError,
    BackendNotFoundError,
    BackendUnavailableError,
    ConfigError,
    ForeignArrayError,
    PolyampError,
    StateDictError,
)
from ._registry import available_backends, get_backend, register_backend
from .backend import Backend, BackendInfo
from .config import LossScaleConfig
from .engine import LossScaler, ScalerStateError, StepResult
from .grads import GradBuffer, ScaledGradientsError, clip_grad_norm_, global_norm
from .noop import NoOpLossScaler
from .overflow import OverflowReport, TensorOverflow, explain_overflow
from .parameter import Parameter
from .policy import HostState, LossScaleState, next_host_state, next_state
from .trainer import ArrayLossFn, ArrayModel, MixedPrecisionTrainer, StepMetrics

__version__ = "0.1.0"

__all__ = [
    "ArrayLossFn",
    "ArrayModel",
    "Backend",
    "BackendError",
    "BackendInfo",
    "BackendNotFoundError",
    "BackendUnavailableError",
    "ConfigError",
    "ForeignArrayError",
    "GradBuffer",
    "GradScaler",
    "HostState",
    "LossScaleConfig",
    "LossScaleState",
    "LossScaler",
    "MixedPrecisionTrainer",
    "NoOpLossScaler",
    "OverflowReport",
    "Parameter",
    "PolyampError",
    "ScaledGradientsError",
    "ScalerStateError",
    "StateDictError",
    "StepMetrics",
    "StepResult",
    "TensorOverflow",
    "available_backends",
    "clip_grad_norm_",
    "explain_overflow",
    "get_backend",
    "global_norm",
    "make_scaler",
    "next_host_state",
    "next_state",
    "register_backend",
    "__version__",
]


def make_scaler(
    config: LossScaleConfig | None = None, backend: str | None = None, enabled: bool = True
) -> LossScaler | NoOpLossScaler:
    """A :class:`LossScaler`, or the :class:`NoOpLossScaler` when ``enabled`` is False."""
    return (LossScaler if enabled else NoOpLossScaler)(config, backend)


def __getattr__(name: str):  # lazy: the facade and polyamp.optim stay out of a bare import
    if name == "GradScaler":
        from polyamp.compat.torch import GradScaler

        return GradScaler
    if name == "optim":  # as torch.optim after `import torch`
        import importlib

        return importlib.import_module("polyamp.optim")
    raise AttributeError(f"module 'polyamp' has no attribute {name!r}")
