"""The whole backend plugin contract, one docstring-only hookspec per hook (docs/writing-a-backend.md).

A backend is a module of ``@hookimpl`` functions under the ``polyamp`` entry-point group. polyamp
binds one plugin's functions when a scaler is built, so a per-step call is a plain Python call.
*Optional* hooks default to the generic array-API backend's (``backends/array_api.py``). Arrays:
``scale`` is 0-d float32, trackers 0-d int32, ``found_inf`` 0-d float32 (non-zero after an
overflow), all on the gradients' device.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pluggy

PROJECT = "polyamp"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

REQUIRED_HOOKS = ("backend_info", "owns_array", "full", "unscale_and_check", "update_scale", "read_flag")
OPTIONAL_HOOKS = ("scale_array", "all_finite", "cast", "to_host")
# Optional too: what the core needs from an array library beside the kernels.
ARRAY_HOOKS = ("is_host", "host_view", "to_numpy", "from_host", "finite_flags", "overflow_counts",
               "sum_of_squares", "pack", "precision_counts")
# Optional kernels without a generic default: None on the Backend where the plugin lacks them.
FUSED_HOOKS = ("unscale_and_squares", "unscale_and_count", "axis_max")
# Optional hooks whose default is another hook of the same plugin.
OWN_DEFAULT_HOOKS = {"accepts_array": "owns_array", "unscale_and_check_keep": "unscale_and_check"}


@hookspec
def backend_info() -> dict[str, Any]:
    """``{"available": bool, "reason": str, "version": str | None}``, reported, never raised; may
    import the library. ``"in_place": False`` marks immutable arrays (JAX), which the scaler refuses."""


@hookspec
def owns_array(array: Any) -> bool:
    """Whether ``array`` belongs to this backend; must not import anything (use sys.modules)."""


@hookspec
def accepts_array(array: Any) -> bool:
    """Whether this backend, once chosen by name, can work on ``array`` (optional; default
    ``owns_array``; e.g. another library's GPU arrays through DLPack). Must not import anything."""


@hookspec
def unscale_and_check_keep(grads: Sequence[Any], scale: Any, found_inf: Any) -> None:
    """``unscale_and_check`` leaving every value divided by the scale even on an overflow (paddle's
    kernel writes ``grad * 0``), for ``diagnose=True`` (optional; default ``unscale_and_check``)."""


@hookspec
def full(value: Any, dtype: str, like: Any) -> Any:
    """A new 0-d array of ``dtype`` ("float32" or "int32") on the device of ``like``."""


@hookspec
def scale_array(array: Any, scale: Any) -> Any:
    """``array * scale`` in ``array``'s own dtype and device (the loss scaling itself)."""


@hookspec
def unscale_and_check(grads: Sequence[Any], scale: Any, found_inf: Any) -> None:
    """Multiply every gradient in place by float32(1 / float64(scale)), reading each once; set
    ``found_inf`` to 1 when any input value is inf or nan, never clear it. No host synchronisation."""


@hookspec
def all_finite(arrays: Sequence[Any]) -> Any:
    """A 0-d boolean array: True when every value of every array is finite (no host read)."""


@hookspec
def cast(array: Any, dtype: str) -> Any:
    """``array`` converted to "float32", "float16" or "bfloat16" (a new array)."""


@hookspec
def update_scale(state: Any, found_inf: Any, config: Any) -> Any:
    """The next ``polyamp.policy.LossScaleState`` on the device (the arrays may be updated in place),
    equal to ``policy.next_host_state`` on every state within ``policy.tracker_limits``."""


@hookspec
def read_flag(found_inf: Any) -> bool:
    """Read ``found_inf`` on the host: the one device synchronisation of a step."""


@hookspec
def to_host(array: Any) -> float | int:
    """A 0-d array as a Python number (for state_dict and logging; synchronises)."""


@hookspec
def is_host(array: Any) -> bool:
    """Whether ``array``'s memory is host memory, so reading it costs no sync (optional; no copy)."""


@hookspec
def host_view(array: Any) -> Any:
    """A NumPy view of ``array``'s memory when it lives on the CPU (writes go through), else None
    (optional; no copy, no sync)."""


@hookspec
def to_numpy(array: Any) -> Any:
    """A small array's values as NumPy, its shape kept (optional; one host read). It may be a view:
    never write it. Dtypes NumPy lacks (a library's bfloat16) may come as float32."""


@hookspec
def from_host(values: Any, like: Any, dtype: Any) -> Any:
    """A NEW array (never a view) on ``like``'s library and device holding NumPy ``values``, its shape
    kept, in ``dtype`` (one of that library's, or None for ``values``') (optional)."""


@hookspec
def finite_flags(arrays: Sequence[Any]) -> list[bool]:
    """Per array (floating, non-empty), whether every value is finite, as host bools read once per
    device (optional; the overflow report)."""


@hookspec
def overflow_counts(array: Any) -> tuple[int, int, int, float]:
    """``(nan, +inf, -inf, largest finite |value|)`` of one floating array, one host read, 0.0 as the
    largest when nothing is finite, ``array`` unchanged (optional)."""


@hookspec
def sum_of_squares(arrays: Sequence[Any]) -> Any:
    """The sum of the squares of every value of ``arrays`` (floating, at least one): 0-d on their
    device, in float64 where it computes it, about 2**-24 relative (past float32's range it may read
    inf); no host read, ``arrays`` unchanged (optional; a StepGuard's norm)."""


@hookspec
def precision_counts(grads: Sequence[Any], scale: Any, bounds: Sequence[Any]) -> tuple[Any, Any]:
    """``(counts, extremes)`` of the unscaled ``grads`` (non-empty, one device) for each target's
    ``bounds``, as :mod:`polyamp._precision_counts` defines them: flat int64 and float64 arrays on the
    gradients' device (a device without them: ConfigError), no host read (optional)."""


@hookspec
def unscale_and_squares(grads: Sequence[Any], scale: Any, found_inf: Any) -> Any:
    """:func:`unscale_and_check` and :func:`sum_of_squares` of the results in one pass, the gradients
    bitwise as ``unscale_and_check`` leaves them (optional; else the two hooks are called)."""


@hookspec
def unscale_and_count(grads: Sequence[Any], scale: Any, found_inf: Any,
                      bounds: Sequence[Any]) -> tuple[Any, Any]:
    """:func:`unscale_and_check` and :func:`precision_counts` of the results in one pass (an "amax"
    target may take a second read-only one), both bitwise as the two hooks', no host read; ``scale``
    is also the "loss" targets' scale (optional; else the two hooks are called)."""


@hookspec
def pack(values: Sequence[Any], like: Any) -> Any:
    """A NEW 1-d array on ``like``'s device holding ``values`` (this library's arrays) flattened in
    order, in float64 where the device computes it, no host read (optional)."""


@hookspec
def axis_max(array: Any, axis_name: Any) -> Any:
    """The maximum of ``array`` over the named mapped axis ``axis_name`` in one collective (JAX's
    ``lax.pmax``; optional, libraries with named axes only)."""


@hookspec(firstresult=True)
def map_tree(fn: Any, tree: Any, rest: Any) -> Any:
    """``(mapped,)`` when ``tree`` is a container of this library's pytree registry (``fn`` mapped
    over it and ``rest``), else None (optional). Must not import the library (use sys.modules)."""


@hookspec(firstresult=True)
def model_steps(model: Any, dtype: str) -> Any:
    """The trainer's forward/backward for a model of this library (an object with ``params`` and
    ``forward_backward(input, target, loss_fn, scaler, ranks)``), else None (optional). Must not
    import the library to look at ``model`` (use sys.modules)."""


# --- Reducers (polyamp.distributed) -------------------------------------------------------------
#: The entry-point group of reducer plugins: not the backends', so neither registry loads the other's.
REDUCER_GROUP = "polyamp.reducers"
REDUCER_HOOKS = ("make_reducer",)


class ReducerSpec:
    """The reducer plugin contract (a namespace, unseen by the backend registry); built-ins are
    ``trylast``. Staticmethod specs, the marker under ``@staticmethod``: pluggy 1.7 deprecates
    class-level specs without self, and 1.3-1.6 read the marker from the plain function."""

    @staticmethod
    @hookspec(firstresult=True)
    def make_reducer(group: Any, timeout: float | None) -> Any:
        """A ``polyamp.distributed.Reducer`` over ``group``, every collective bounded by ``timeout``
        (seconds, validated; None: the plugin's default), or None when this plugin does not accept ``group``
        (looked up in sys.modules, never imported for it). Raise, naming the value and the fix, when
        ``group`` is this plugin's kind but unusable."""

    @staticmethod
    @hookspec
    def reducer_accepts() -> str:
        """One line saying which objects ``make_reducer`` accepts, for error messages (optional)."""
