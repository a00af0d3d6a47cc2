"""The whole backend plugin contract, one docstring-only hookspec per kernel.

A backend is a plain module of ``@hookimpl`` functions registered under the ``polyamp``
entry-point group (the built-ins too). polyamp binds one plugin's functions directly when
a scaler is built, so a per-step call costs a plain Python call, not a hook dispatch.
Hooks marked *optional* fall back to the generic array-API backend (``backends/array_api.py``),
whose implementations are the defaults. Besides the kernels, the optional hooks say what the core
needs from an array library (host views and reads, small arrays made like another, overflow
counts), so no core module names an array library.

Arrays: ``scale`` is a 0-d float32 array, trackers are 0-d int32 arrays and ``found_inf``
is a 0-d float32 array (non-zero after an overflow), all on the gradients' device.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pluggy

PROJECT = "polyamp"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

REQUIRED_HOOKS = (
    "backend_info",
    "owns_array",
    "full",
    "unscale_and_check",
    "update_scale",
    "read_flag",
)
OPTIONAL_HOOKS = ("scale_array", "all_finite", "cast", "to_host")
# Optional too: what the core needs from an array library beside the kernels (host views and
# reads, small arrays made like another, overflow counts); bound on the Backend like the above.
ARRAY_HOOKS = ("is_host", "host_view", "to_numpy", "from_host", "finite_flags", "overflow_counts",
               "sum_of_squares", "pack", "precision_counts")
# Optional kernels without a generic default: None on the Backend where the plugin lacks them (the
# core then calls the unfused hooks).
FUSED_HOOKS = ("unscale_and_squares", "unscale_and_count", "axis_max")
# Optional, asked of every plugin in turn (not bound on a Backend): the trainer's model steps, and
# the containers of a library's own pytree registry (polyamp.functional).
MODEL_HOOKS = ("model_steps", "map_tree")
# Optional hooks whose default is another hook of the same plugin, not the generic backend's.
OWN_DEFAULT_HOOKS = {"accepts_array": "owns_array", "unscale_and_check_keep": "unscale_and_check"}


@hookspec
def backend_info() -> dict[str, Any]:
    """Describe the backend: ``{"available": bool, "reason": str, "version": str | None}``.

    Called by ``available_backends()`` and when a scaler is built; may import the library.
    Optional key ``"in_place"`` (default True): False for immutable arrays (JAX), which the
    stateful scaler refuses, pointing to ``polyamp.functional``.
    """


@hookspec
def owns_array(array: Any) -> bool:
    """Whether ``array`` belongs to this backend; must not import anything (use sys.modules)."""


@hookspec
def accepts_array(array: Any) -> bool:
    """Whether this backend, once chosen by name, can work on ``array`` (optional).

    Defaults to ``owns_array``. A backend may accept more than it owns, e.g. another library's
    GPU arrays through zero-copy DLPack views; automatic choice still uses ``owns_array`` only.
    Must not import anything.
    """


@hookspec
def unscale_and_check_keep(grads: Sequence[Any], scale: Any, found_inf: Any) -> None:
    """``unscale_and_check`` that leaves every value divided by the scale also on an overflow
    (optional; defaults to ``unscale_and_check``).

    For a kernel that writes something else when it finds inf/nan (paddle's fused kernel writes
    ``grad * 0``, turning inf into NaN and finite values into 0): with ``diagnose=True`` the scaler
    unscales through this hook, so the report on a skipped step sees the values as they were.
    """


@hookspec
def full(value: Any, dtype: str, like: Any) -> Any:
    """A new 0-d array of ``dtype`` ("float32" or "int32") on the device of ``like``."""


@hookspec
def scale_array(array: Any, scale: Any) -> Any:
    """``array * scale`` in ``array``'s own dtype and device (the loss scaling itself)."""


@hookspec
def unscale_and_check(grads: Sequence[Any], scale: Any, found_inf: Any) -> None:
    """Multiply every gradient in place by float32(1 / float64(scale)); OR overflow into found_inf.

    Fused: each gradient is read once; ``found_inf`` is set to 1 when any input value is
    inf or nan, and never cleared. No host synchronisation.
    """


@hookspec
def all_finite(arrays: Sequence[Any]) -> Any:
    """A 0-d boolean array: True when every value of every array is finite (no host read)."""


@hookspec
def cast(array: Any, dtype: str) -> Any:
    """``array`` converted to "float32", "float16" or "bfloat16" (a new array)."""


@hookspec
def update_scale(state: Any, found_inf: Any, config: Any) -> Any:
    """Advance the scale state by one step on the device and return the new state.

    ``state`` is a ``polyamp.policy.LossScaleState``; the kernel must agree with
    ``polyamp.policy.next_host_state`` on every state within ``polyamp.policy.tracker_limits``
    (the engine keeps its state there). It may update the arrays in place and return them.
    """


@hookspec
def read_flag(found_inf: Any) -> bool:
    """Read ``found_inf`` on the host: the one device synchronisation of a step."""


@hookspec
def to_host(array: Any) -> float | int:
    """A 0-d array as a Python number (for state_dict and logging; synchronises)."""


@hookspec
def is_host(array: Any) -> bool:
    """Whether ``array``'s memory is host memory, so reading it costs no device sync (optional).

    No copy, no sync. Default: NumPy arrays are; others are when DLPack says kDLCPU.
    """


@hookspec
def host_view(array: Any) -> Any:
    """A NumPy view of ``array``'s memory when it lives on the CPU, else None (optional).

    No copy, no sync: writes to the view change ``array`` (the agreement fills a host buffer in
    place). Default: ``np.from_dlpack`` where :func:`is_host` holds, else None.
    """


@hookspec
def to_numpy(array: Any) -> Any:
    """A small array's values as a NumPy array of its shape (optional; one host read: a sync on a
    device). It may be a view of host memory: read it, never write it. Dtypes NumPy lacks (e.g.
    a library's bfloat16) come as float32. Default: ``np.from_dlpack``, else ``np.asarray``.
    """


@hookspec
def from_host(values: Any, like: Any, dtype: Any) -> Any:
    """A NEW array of ``like``'s library on ``like``'s device holding host ``values`` (optional).

    ``values`` is a NumPy array (its shape kept; e.g. a 0-d float32 flag or a small float64
    vector); ``dtype`` is a dtype of ``like``'s library (e.g. another array's ``.dtype``), or None
    for ``values``' own. Never a view of ``values`` (the caller reuses its buffer). Default:
    ``xp.asarray(values, dtype=..., device=device(like), copy=True)`` through array-api-compat.
    """


@hookspec
def finite_flags(arrays: Sequence[Any]) -> list[bool]:
    """Per array (floating, non-empty), whether every value is finite, as host bools (optional).

    For overflow reports: one pass per array, flags read at once per device. Default: one
    ``all(isfinite(a))`` per array, stacked and read once per device.
    """


@hookspec
def overflow_counts(array: Any) -> tuple[int, int, int, float]:
    """``(nan, +inf, -inf, largest finite |value|)`` of one floating array (optional).

    Vectorised passes and one host read; 0.0 as the largest when nothing is finite; ``array`` is
    not changed. Default: array-API passes, read through :func:`to_numpy`.
    """


@hookspec
def sum_of_squares(arrays: Sequence[Any]) -> Any:
    """The sum of the squares of every value of ``arrays`` (floating, at least one), 0-d on their
    device, in float64 where the device computes it (optional; a StepGuard's gradient norm).

    No host read, no change to ``arrays``. Accurate to about 2**-24 relative (a backend may square
    and sum chunks in float32 before adding them in float64); a sum beyond float32's range may
    read inf. Default: the array-API passes of ``polyamp.grads`` (float64 copies in chunks).
    """


@hookspec
def precision_counts(grads: Sequence[Any], scale: Any, bounds: Sequence[Any]) -> tuple[Any, Any]:
    """``(counts, extremes)``: a :class:`polyamp.PrecisionMeter`'s exact counts of ``grads`` (the
    unscaled gradients, non-empty, on one device) for each target's ``bounds``
    (``polyamp._precision_targets.Bounds``), as :mod:`polyamp._precision_counts` defines them
    (optional). ``scale`` is the loss scale (a 0-d array or a number).

    Two flat arrays on the gradients' device, no host read, ``grads`` unchanged: ``counts`` int64
    and ``extremes`` float64 (a device without them is refused with ConfigError). Default: that
    module's vectorised array-API passes.
    """


@hookspec
def unscale_and_squares(grads: Sequence[Any], scale: Any, found_inf: Any) -> Any:
    """:func:`unscale_and_check`, and the sum of squares of the unscaled values (0-d, as
    :func:`sum_of_squares`), in the same pass over each gradient (optional; a StepGuard's norm).

    The gradients end bitwise as :func:`unscale_and_check` leaves them. Where a plugin lacks it,
    polyamp calls ``unscale_and_check`` then ``sum_of_squares``.
    """


@hookspec
def unscale_and_count(grads: Sequence[Any], scale: Any, found_inf: Any,
                      bounds: Sequence[Any]) -> tuple[Any, Any]:
    """:func:`unscale_and_check`, and :func:`precision_counts` of the unscaled values for ``bounds``,
    in the same pass over each gradient (optional; a :class:`polyamp.PrecisionMeter`'s sample step).

    ``scale`` is both the divisor and the "loss" targets' scale. The gradients end bitwise as
    :func:`unscale_and_check` leaves them and ``(counts, extremes)`` are bitwise
    :func:`precision_counts`' of them, with no host read (a device kernel reads ``scale`` on the
    device). An "amax" target may take a second, read-only pass. Where a plugin lacks it, polyamp
    calls ``unscale_and_check`` then ``precision_counts`` (the default, two passes).
    """


@hookspec
def pack(values: Sequence[Any], like: Any) -> Any:
    """A NEW 1-d array on ``like``'s device holding ``values`` (arrays of this library with one
    value or more, flattened, in order), in float64 where the device computes it (optional).

    No host read: it lets a guard's loss and norm ride in the step's one collective and one read.
    Default: ``concat`` of the flattened values through array-api-compat.
    """


@hookspec
def axis_max(array: Any, axis_name: Any) -> Any:
    """The maximum of ``array`` over the named mapped axis ``axis_name`` (JAX's ``lax.pmax`` under
    ``pmap`` / ``shard_map``): one collective in the traced program (optional; libraries with named
    axes only). ``polyamp.functional.unscale(..., axis_name=)`` agrees its flag with it.
    """


@hookspec(firstresult=True)
def map_tree(fn: Any, tree: Any, rest: Any) -> Any:
    """``(mapped,)`` when ``tree`` is a container of this library's own pytree registry (``fn``
    applied leaf by leaf to it and the trees in ``rest``), else None (optional).

    ``polyamp.functional`` walks dicts, lists and tuples itself and asks each plugin in turn about
    any other object that is not an array; none answering makes it a leaf. Must not import the
    library (use sys.modules): an object of a library not loaded cannot be its container.
    """


@hookspec(firstresult=True)
def model_steps(model: Any, dtype: str) -> Any:
    """The trainer's forward/backward for a model of this library, or None (optional).

    ``MixedPrecisionTrainer`` asks each plugin in turn; the first non-None answer runs the
    model (an object with ``params`` and ``forward_backward(input, target, loss_fn, scaler,
    ranks)``). Must not import the library to look at ``model`` (use sys.modules). Default:
    None from every plugin: the model follows ``polyamp.ArrayModel``.
    """


# --- Reducers (polyamp.distributed) -------------------------------------------------------------
#: The entry-point group of reducer plugins (built-in and third-party alike). It is not the
#: backends' group, so the backend registry never loads a reducer plugin as a backend.
REDUCER_GROUP = "polyamp.reducers"
REDUCER_HOOKS = ("make_reducer",)


class ReducerSpec:
    """The reducer plugin contract: a module of ``@hookimpl`` functions under ``REDUCER_GROUP``.

    A namespace of its own, so the backend registry (which adds this module's top-level specs)
    does not see it. polyamp asks plugins in turn; built-ins are ``trylast``, so a third-party
    plugin may claim an object before them. The specs are staticmethods (the marker under
    ``@staticmethod``): pluggy 1.7 deprecates class-level specs whose first parameter is not self,
    and 1.3-1.6 read the marker from the plain function.
    """

    @staticmethod
    @hookspec(firstresult=True)
    def make_reducer(group: Any, timeout: float | None) -> Any:
        """A ``polyamp.distributed.Reducer`` over ``group``, or None when this plugin does not accept it.

        ``timeout`` (seconds, already validated; None: the plugin's default) bounds every
        collective. Must not import a library just to look at ``group`` (use sys.modules); may
        import it when ``group`` is a name this plugin owns (e.g. "mpi"). Raise, naming the
        value and the fix, when ``group`` is this plugin's kind but unusable.
        """

    @staticmethod
    @hookspec
    def reducer_accepts() -> str:
        """One line saying which objects ``make_reducer`` accepts, for error messages (optional)."""
