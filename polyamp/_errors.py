"""polyamp's exceptions, raised at the public boundary and worded for the user.

Every class polyamp raises on purpose, where it is defined (18; ``checkpoint._DuplicateKey`` is
internal and never leaves ``load``)::

    PolyampError                            base of everything polyamp raises on purpose
    ├── ConfigError(ValueError)             a config or argument value is out of range
    │   ├── TorchConfigError(AssertionError)    compat/_torch_state.py: torch's constructor asserts
    │   └── PaddleConfigError(AssertionError)   compat/_paddle_state.py: paddle's argument asserts
    ├── BackendError(RuntimeError)          backend choice went wrong
    │   ├── BackendNotFoundError            the name matches no installed backend
    │   └── BackendUnavailableError         installed, but cannot run here (no device, no library)
    ├── ForeignArrayError(TypeError)        arrays the chosen backend (or a reducer) cannot hold
    ├── ScalerStateError(RuntimeError)      a scaler method called out of order
    │   └── ScaledGradientsError            grads.py: a norm or clip of still-scaled gradients
    ├── MinScaleError(RuntimeError)         an overflow at min_scale with raise_error_at_min_scale=True
    ├── StepGuardError(RuntimeError)        a StepGuard's streak of skipped steps reached its limit
    ├── StateDictError(ValueError)          a state_dict or checkpoint that cannot be loaded
    │   ├── StateDictKeyError(KeyError)         compat/_torch_state.py: a torch state dict lacks a key
    │   └── PaddleStateDictError(KeyError)      compat/_paddle_state.py: a paddle state dict lacks keys
    └── ReducerError(RuntimeError)          distributed/_errors.py: a collective failed
        ├── ReducerTimeoutError(TimeoutError)   a collective did not complete within the timeout
        ├── ReducerUnavailableError         the engine behind a reducer cannot run here
        └── RankMismatchError               the ranks' configs, states or collectives differ

The facades' subclasses are also the builtin type torch or paddle raises there, so code written
for those libraries keeps catching them. Every message names the parameter, the value received
and what to do instead ("Fix: ...").
"""

from __future__ import annotations

TORCH_CPU_ADVICE = (
    "on a machine without an NVIDIA GPU, install torch's CPU build first, from "
    "https://download.pytorch.org/whl/cpu"
)


def install_hint(extra: str) -> str:
    """``pip install 'polyamp[extra]'``: how every message says to install an optional part; torch's
    adds the CPU build's index (else pip pulls several GB of CUDA packages a CPU cannot use)."""
    hint = f"pip install 'polyamp[{extra}]'"
    return f"{hint} ({TORCH_CPU_ADVICE})" if extra == "torch" else hint


class PolyampError(Exception):
    """Base class of the errors polyamp raises on purpose."""


class ConfigError(PolyampError, ValueError):
    """A configuration value is invalid; the message names the field and the value."""


class BackendError(PolyampError, RuntimeError):
    """Choosing or running a backend failed."""


class BackendNotFoundError(BackendError):
    """The requested backend name matches no installed backend plugin."""


class BackendUnavailableError(BackendError):
    """The requested backend is installed but cannot run here."""


class ForeignArrayError(PolyampError, TypeError):
    """The chosen backend cannot hold the arrays it was given."""


class ScalerStateError(PolyampError, RuntimeError):
    """A method was called out of order (e.g. update() with no inf check recorded)."""


class MinScaleError(PolyampError, RuntimeError):
    """An overflow would back off a scale already at min_scale (``raise_error_at_min_scale=True``,
    DeepSpeed's option): the step was skipped and the scale state is unchanged."""


class StepGuardError(PolyampError, RuntimeError):
    """``StepGuard(max_consecutive_skips=N, on_streak="raise")``: N steps in a row were skipped."""


class StateDictError(PolyampError, ValueError):
    """A state_dict or checkpoint is malformed or incompatible."""
