"""polyamp.distributed: agree on loss scaling across ranks over engines users already run.

``reducer(x)`` builds a :class:`Reducer` from a torch.distributed process group (or "torch"),
an mpi4py communicator (or "mpi"), a CuPy NCCL communicator, or whatever a plugin of the
``polyamp.reducers`` entry-point group accepts. Importing this package imports no engine.
"""

from ._agree import check_same_config, config_fingerprint
from ._discovery import reducer, register_reducer
from ._errors import RankMismatchError, ReducerError, ReducerTimeoutError, ReducerUnavailableError
from ._reducer import DEFAULT_TIMEOUT, Reducer, check_timeout, wait_until

__all__ = [
    "DEFAULT_TIMEOUT", "RankMismatchError", "Reducer", "ReducerError", "ReducerTimeoutError",
    "ReducerUnavailableError", "check_same_config", "check_timeout", "config_fingerprint", "reducer",
    "register_reducer", "wait_until",
]
