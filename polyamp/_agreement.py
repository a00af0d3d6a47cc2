"""The across-ranks half of LossScaler: one SUM all-reduce per step agrees the overflow flag.

Every rank sums one fixed-size message ``[non-finite count, *extra, *fingerprint bits]``
(``extra``: e.g. the local sum of squares of a global-norm clip) in one collective, so all ranks
see the same count and skip together, and a rank whose config, state or sequence of collectives
differs is found in that same collective (``RankMismatchError`` on every rank). No second
collective, also at the first step. ``polyamp.distributed`` is imported only when a reducer is given.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import array_api_compat
import numpy as np

from ._errors import ConfigError
from ._registry import backend_of
from .config import LossScaleConfig
from .policy import HostState

if TYPE_CHECKING:  # the annotation only: importing polyamp must not import polyamp.distributed
    from .distributed import Reducer

#: The loop every scaler message points to.
LOOP = "stepped = scaler.step(grads, step_fn); scaler.update()"


class Agreed(NamedTuple):
    """What :meth:`polyamp.LossScaler.agree_` returns: device arrays, nothing read on the host.

    ``found_inf``: the iteration's non-finite count summed over ranks (0-d float32, on the
    scaler's device; non-zero means every rank skips). ``extra``: the ``extra`` given, summed
    over ranks (same shape and dtype), or None.
    """

    found_inf: Any
    extra: Any


class Agreement:
    """A reducer plus the position of the next agreement: what ``LossScaler(reducer=...)`` holds.

    Every agreement is ONE SUM all-reduce of a fixed-size message (see
    :mod:`polyamp.distributed._fingerprint`): the non-finite count, up to two extra values, and
    the bits of what must be equal on every rank (config, iteration, collective index, the
    reducer's collective count, payload size, scale and trackers). When the ranks differ, every
    rank raises ``RankMismatchError`` before anything is applied: at once where the message lives
    on the host; on a GPU the mismatch is added to the agreed flag (so no rank can apply the
    step) and named when the skip decision reads it (:meth:`verify`), at no extra sync.
    """

    def __init__(self, group: Any) -> None:
        from .distributed import reducer  # only here: `import polyamp` stays free of it

        self.reducer: Reducer = reducer(group)
        self.iteration = 0  # iterations ended (update() calls) since this agreement was made
        self.collective = 0  # agreements so far in this iteration
        self._sent: list[tuple[Any, ...]] = []  # this iteration's (device sums, host fields, state, encoding)
        self._encoders: dict[Any, Any] = {}  # (device, encoding) -> DeviceEncoder
        self._config: tuple[LossScaleConfig, int] | None = None
        self._message = np.zeros(_message_size(), np.float64)  # the host path's buffer, reused

    def __deepcopy__(self, memo: dict) -> Agreement:
        """A copy of a scaler is a new scaler: same reducer, its own count of iterations."""
        return Agreement(self.reducer)

    @staticmethod
    def payload_spare() -> int:
        """How many values :meth:`sum_payload_` needs after the payload (the fingerprint's bits)."""
        from .distributed import _fingerprint as fp

        return fp.BITS.size

    @property
    def unverified(self) -> bool:
        """Whether this iteration sent a message that was checked on the device only (GPU arrays)."""
        return bool(self._sent)

    def end_iteration(self) -> None:
        """The scaler's update() ended an iteration: the next agreement is its first."""
        self.iteration += 1
        self.collective = 0
        self._sent.clear()

    # -- the one collective ---------------------------------------------------------
    def flag(self, found_inf: Any, config: LossScaleConfig, state: Any) -> Any:
        """A new 0-d float32 array: ``found_inf`` summed over ranks (one collective)."""
        return self.flag_and_extra(found_inf, None, config, state).found_inf

    def flag_and_extra(
        self, found_inf: Any, extra: Any, config: LossScaleConfig, state: Any, *, payload: int = 0
    ) -> Agreed:
        """``found_inf`` and ``extra`` (at most 2 values) summed over ranks in ONE collective.

        ``state`` (the scaler's ``LossScaleState``, or a ``HostState``) is fingerprinted with the
        config, the agreement's position and ``payload`` (a size every rank must share). Returns
        new arrays: the agreed count as float32 on ``extra``'s (else the flag's) device, plus 1
        when the ranks are misaligned where that is found on the device, and ``extra`` summed,
        in its dtype and shape.
        """
        from .distributed import _fingerprint as fp

        if extra is not None and _size(extra) > fp.HEAD - 1:
            raise ConfigError(
                f"agree_(extra=...) carries at most {fp.HEAD - 1} values in the step's collective, got "
                f"{_size(extra)} (shape {tuple(extra.shape)}). Fix: send e.g. a sum of squares pair."
            )
        host = self._next(config, payload=payload)
        like = found_inf if extra is None else extra
        if _on_host(found_inf, extra, state):
            message = self._message  # reused: nothing keeps it past this call
            message[0] = float(found_inf)  # 0-d, in host memory: no sync
            message[1:fp.HEAD] = 0.0
            if extra is not None:
                message[1:1 + _size(extra)] = np.asarray(_host(extra), np.float64).reshape(-1)
            mine = fp.Fingerprint(*host, *_host_state(state))
            message[fp.HEAD:] = fp.encode(mine, fp.BYTES)
            self.reducer.allreduce_sum_(message)
            self._check_now(message[fp.HEAD:], mine, fp.BYTES)
            agreed = _new_flag(like, message[0])
            summed = None if extra is None else _new_like(extra, message[1:1 + _size(extra)], extra)
            return Agreed(agreed, summed)
        return self._on_device(found_inf, extra, host, state, like)

    def _on_device(self, found_inf: Any, extra: Any, host: list[int], state: Any, like: Any) -> Agreed:
        """The message built, summed and checked on the device: no host read (GPU arrays)."""
        from .distributed import _fingerprint as fp

        xp = array_api_compat.array_namespace(like)
        device = array_api_compat.device(like)
        f64 = xp.float64
        if isinstance(found_inf, bool):
            count = xp.full((1,), float(found_inf), dtype=f64, device=device)
        else:
            count = xp.reshape(xp.astype(xp.asarray(found_inf, device=device), f64), (1,))
        pad = xp.zeros(fp.HEAD - 1 - (0 if extra is None else _size(extra)), dtype=f64, device=device)
        parts = [count] if extra is None else [count, xp.reshape(xp.astype(extra, f64), (-1,))]
        encoder = self._encoder(xp, device, fp.BYTES)
        message = xp.concat([*parts, pad, self._encode(encoder, host, state)])
        self.reducer.allreduce_sum_(message)
        sums = message[fp.HEAD:]
        self._sent.append((sums, host, state, fp.BYTES))
        off = xp.astype(encoder.misaligned(sums, self.reducer.size), xp.float32)
        agreed = xp.astype(message[0], xp.float32) + off
        summed = None
        if extra is not None:
            summed = xp.reshape(xp.astype(message[1:1 + _size(extra)], extra.dtype), extra.shape)
        return Agreed(agreed, summed)

    def sum_payload_(self, storage: Any, payload: int, config: LossScaleConfig, state: Any) -> Any:
        """Sum ``storage`` in place: its first ``payload`` values and, after them, the fingerprint.

        For data-parallel gradients (the trainer's flat buffer with ``BITS`` spare values at
        its end): one collective. Returns None when the check ran on the host (it raised if the
        ranks differ), else a 0-d float32 device flag, 1 when they differ (add it to the step's
        overflow check; :meth:`verify` names the difference after a skip).
        """
        from .distributed import _fingerprint as fp

        host = self._next(config, payload=payload)
        view = _host_view(storage)
        if view is not None and _on_host(None, None, state):
            mine = fp.Fingerprint(*host, *_host_state(state))
            view[payload:] = fp.encode(mine, fp.BITS)
            self.reducer.allreduce_sum_(storage)
            self._check_now(view[payload:], mine, fp.BITS)
            return None
        xp = array_api_compat.array_namespace(storage)
        encoder = self._encoder(xp, array_api_compat.device(storage), fp.BITS)
        storage[payload:] = xp.astype(self._encode(encoder, host, state), storage.dtype)
        self.reducer.allreduce_sum_(storage)
        sums = storage[payload:]
        self._sent.append((sums, host, state, fp.BITS))
        return xp.astype(encoder.misaligned(sums, self.reducer.size), xp.float32)

    def _encoder(self, xp: Any, device: Any, encoding: Any) -> Any:
        """The device encoder for ``encoding`` on ``device`` (made once per device)."""
        from .distributed import _fingerprint as fp

        key = (device, encoding)
        if key not in self._encoders:
            self._encoders[key] = fp.DeviceEncoder(xp, device, encoding)
        return self._encoders[key]

    @staticmethod
    def _encode(encoder: Any, host: list[int], state: Any) -> Any:
        """The fingerprint encoded on the encoder's device (float64), computed there: no host read."""
        if isinstance(state, HostState):
            return encoder([*host, *_host_state(state)])
        return encoder(host, *state)

    # -- checking -------------------------------------------------------------------
    def verify(self) -> None:
        """After a skip decision said skip: RankMismatchError if this iteration's messages show
        ranks that differ (reads them: a host sync, only on skipped steps)."""
        from .distributed import _fingerprint as fp
        from .distributed._agree import _to_host

        for sums, host, state, encoding in self._sent:
            self._check_now(_to_host(sums), fp.Fingerprint(*host, *_host_state(state)), encoding)

    def _check_now(self, sums: Any, mine: Any, encoding: Any) -> None:
        from .distributed import RankMismatchError
        from .distributed import _fingerprint as fp

        red = self.reducer
        if not fp.misaligned(sums, red.size, encoding):
            return
        what = fp.describe(sums, red.size, mine, encoding)
        red.retire(f"an agreement found the ranks misaligned ({what})")
        raise RankMismatchError(
            f"{red.describe()}: the ranks are not aligned, so no rank applies this step: {what}. "
            f"{_fix(what)} The reducer is now retired: restart the ranks (e.g. from the last "
            "checkpoint, loaded on every rank)."
        )

    def _next(self, config: LossScaleConfig, payload: int) -> list[int]:
        """The host fields of the next agreement: config, iteration, collective, sequence, payload."""
        from .distributed import config_fingerprint

        if self._config is None or self._config[0] is not config:
            self._config = (config, config_fingerprint(config))
        self.collective += 1
        return [self._config[1], self.iteration, self.collective, self.reducer.collectives, payload]


def _fix(what: str) -> str:
    if "collectives are not aligned" in what:
        return ("Fix: every rank must issue the same agreements in the same order: step (or unscale_) "
                "the same optimizers on every rank, update() once per iteration on every rank, and give "
                "each scaler its own process group.")
    if "config" in what:
        return "Fix: build the scaler with the same config on every rank."
    if "values summed" in what:
        return "Fix: every rank must train the same model (the same number of gradient values)."
    return ("Fix: load the same checkpoint on every rank (or none), and call set_scale, load_state_dict "
            "or update(new_scale) on every rank alike.")


def _message_size() -> int:
    from .distributed import _fingerprint as fp

    return fp.MESSAGE


def _size(array: Any) -> int:
    return int(np.prod(tuple(array.shape)))


def _on_host(found_inf: Any, extra: Any, state: Any) -> bool:
    """Whether the flag, extra and state all live in host memory (reading them costs no sync)."""
    scale = None if state is None or isinstance(state, HostState) else state.scale
    return all(a is None or isinstance(a, bool) or _is_host(a) for a in (found_inf, extra, scale))


def _is_host(array: Any) -> bool:
    """Whether ``array``'s memory is host memory (no copy, no sync): its backend's ``is_host``."""
    if isinstance(array, (np.ndarray, np.generic)):
        return True
    return backend_of(array).is_host(array)


def _host_view(array: Any) -> np.ndarray | None:
    """A NumPy view of ``array``'s memory when it lives on the CPU, else None (no copy, no sync)."""
    if isinstance(array, np.ndarray):
        return array
    if isinstance(array, np.generic):
        return np.asarray(array)
    return backend_of(array).host_view(array)


def _host(array: Any) -> Any:
    if isinstance(array, bool):
        return float(array)
    view = _host_view(array)
    return view if view is not None else array


def _host_state(state: Any) -> tuple[int, int, int]:
    """(scale bits, growth tracker, backoff tracker) as host integers (a sync on a GPU)."""
    from .distributed import _fingerprint as fp

    if isinstance(state, HostState):
        return fp.scale_bits(state.scale), int(state.growth_tracker), int(state.backoff_tracker)
    to_host = backend_of(state[0]).to_host
    scale, growth, backoff = (to_host(a) for a in state)
    return fp.scale_bits(float(scale)), int(growth), int(backoff)


def _new_flag(like: Any, value: float) -> Any:
    """A new 0-d float32 array holding ``value``, in ``like``'s library, in host memory."""
    if isinstance(like, (np.ndarray, np.generic, bool)):
        return np.asarray(value, np.float32)
    return _new_like(like, value, None)


def _new_like(like: Any, values: Any, shape_of: Any) -> Any:
    """A new array in ``like``'s library and device holding host ``values``: 0-d float32 for a
    flag (``shape_of`` None), else with ``shape_of``'s shape and dtype (its backend's ``from_host``)."""
    if shape_of is None:
        return backend_of(like).from_host(np.asarray(values, np.float32), like, None)
    host = np.asarray(values).reshape(tuple(shape_of.shape))
    return backend_of(like).from_host(host, like, shape_of.dtype)
