"""The across-ranks half of LossScaler: one all-reduce per step agrees the flag and checks the ranks.

Every rank sends its flag with a digest of its :mod:`~polyamp.distributed._fingerprint` in the format
``_wire.wire_for`` picks; all skip together, or all raise ``RankMismatchError`` naming the difference.
``polyamp.distributed`` is imported only when a reducer is given.
"""

from __future__ import annotations

import math
import weakref
from typing import TYPE_CHECKING, Any, NamedTuple, NoReturn

import array_api_compat
import numpy as np

from ._digest import content_digest, to_bytes
from ._errors import ConfigError
from ._guard_values import MOST
from ._registry import backend_of
from .config import LossScaleConfig
from .policy import HostState, scale_bits

if TYPE_CHECKING:  # the annotation only: importing polyamp must not import polyamp.distributed
    from .distributed import Reducer

#: The loop every scaler message points to.
LOOP = "stepped = scaler.step(grads, step_fn); scaler.update()"
#: Extra values one agreement carries at most: the user's (``agree_(extra=)``: a clip's pair), then
#: a StepGuard's ``GuardValues`` slots.
USER_EXTRA = 2
MAX_EXTRA = USER_EXTRA + MOST


#: group key -> how many agreements this process made on that group (weakly: a group may go)
_OWNERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_OWNERS_BY_ID: dict[int, list[Any]] = {}  # groups that take no weak reference: id -> [group, count]


def _next_owner(group: Any) -> int:
    """The number of agreements this process made on ``group`` so far (then one more)."""
    try:
        count = _OWNERS.get(group, 0)
        _OWNERS[group] = count + 1
        return count
    except TypeError:  # not weakly referenceable (or unhashable): kept by id, with the group alive
        entry = _OWNERS_BY_ID.setdefault(id(group), [group, 0])
        entry[1] += 1
        return entry[1] - 1


class Agreed(NamedTuple):
    """What :meth:`polyamp.LossScaler.agree_` returns: device arrays, nothing read on the host.

    ``found_inf``: 1 when some rank found an inf/nan this iteration (or the ranks are not
    aligned), else 0 (0-d float32, on the scaler's device; non-zero means every rank skips).
    ``extra``: the ``extra`` given, summed over ranks in rank order (same shape and dtype), or None.
    """

    found_inf: Any
    extra: Any


class _Sent(NamedTuple):
    """A message checked on the device only, kept until :meth:`Agreement.verify` reads it."""

    wire: Any  # its format (a polyamp.distributed._wire.Wire)
    message: Any  # the reduced message
    aligned: Any  # bool of shape (1,) on the device: every rank sent the same fingerprint
    fields: Any  # this rank's fingerprint as sent (host fields, the state's halves)
    state: Any


class Agreement:
    """A reducer plus the position of the next agreement: what ``LossScaler(reducer=...)`` holds.

    A mismatch raises at once where the message lives on the host; on a GPU it makes the agreed
    flag 1 (no rank applies the step) and :meth:`verify` names it once the skip decision read the flag.
    """

    def __init__(self, group: Any) -> None:
        # only here: `import polyamp` stays free of polyamp.distributed
        from .distributed import RankMismatchError, _fingerprint, _wire, reducer
        from .distributed._agree import config_fingerprint, to_host_array

        self.reducer: Reducer = reducer(group)
        # whose flags: the n-th agreement this process made on this group (ranks build their scalers
        # alike), so two scalers on one group whose steps are swapped on one rank are found
        self.owner = _next_owner(self.reducer.group_key())
        self.iterations = 0  # iterations ended (update() calls) since this agreement was made
        self.collective = 0  # agreements so far in this iteration
        self._fp, self._wire, self._mismatch = _fingerprint, _wire, RankMismatchError
        self._crc, self._host_read = config_fingerprint, to_host_array
        self._sent: list[_Sent] = []  # this iteration's messages checked on the device only
        self._host = _fingerprint.Place(_fingerprint.HOST.xp, "cpu", host=True)  # its buffers are ours
        self._places: dict[Any, Any] = {}  # (xp, device) -> its Place
        self._config: tuple[LossScaleConfig, int] | None = None  # the last config and its crc
        self._owners: dict[int, int] = {}  # a caller's whose -> its digest with self.owner
        self._length = 0  # the extra values of the last message (a change is announced first)
        self._metered = False  # a meter's first sample was announced
        self._wires: dict[tuple[int, bool, int], Any] = {}  # (extras, payload, id(place)) -> its wire

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

    def forget_meter(self) -> None:
        """A loaded checkpoint may move a meter's phase: its next sample is announced again."""
        self._metered = False

    def end_iteration(self) -> None:
        """The scaler's update() ended an iteration: the next agreement is its first."""
        self.iterations += 1
        self.collective = 0
        self._sent.clear()

    # -- the one collective ---------------------------------------------------------
    def flag(self, found_inf: Any, config: LossScaleConfig, state: Any, *, whose: int = 0) -> Any:
        """A 0-d float32 array: 1 when ``found_inf`` is non-zero on some rank, else 0 (one collective)."""
        if self._length:  # after a longer message: announced
            return self.flag_and_extra(found_inf, None, config, state, whose=whose).found_inf
        return self._agree(found_inf, None, config, state, 0, 0, whose).found_inf

    def flag_and_extra(
        self, found_inf: Any, extra: Any, config: LossScaleConfig, state: Any, *, payload: int = 0,
        whose: int = 0, maxed: tuple[bool, ...] = (), metered: int = 0,
    ) -> Agreed:
        """Whether some rank found an inf/nan, and ``extra`` (at most MAX_EXTRA values, plus ``metered``
        of a precision meter's) summed over ranks (by their max where ``maxed``), in ONE collective.

        Returns new arrays: the flag (0 or 1, also 1 on a device-found mismatch) as float32 on
        ``extra``'s (else the flag's) device, and ``extra`` summed in its dtype and shape.
        """
        extras = 0 if extra is None else _size(extra)
        check_extra(extra, MAX_EXTRA + metered)
        # a message of another length than the last is announced first; a meter's slots come and go on
        # its schedule (its settings are in whose), so only its first sample is announced
        if extras - metered != self._length or (metered and not self._metered):
            known = metered if self._metered else 0  # an announced meter's slots are in this step's format
            self._metered = self._metered or bool(metered)
            self._announce(found_inf if extra is None else extra, config, state, payload, extras, whose,
                           extras - metered, known)
        return self._agree(found_inf, extra, config, state, payload, extras, whose, maxed)

    def _agree(self, found_inf: Any, extra: Any, config: LossScaleConfig, state: Any, payload: int,
               extras: int, whose: int, maxed: tuple[bool, ...] = ()) -> Agreed:
        """:meth:`flag_and_extra`'s one collective; ``extras`` is the count its fingerprint names."""
        host = self._next(config, payload, extras, whose)
        like = found_inf if extra is None else extra
        on_host = _on_host(found_inf, extra, state) or not _speaks_array_api(like)
        if on_host:  # 0-d in host memory: reading it costs no sync; non-zero (NaN too) as read_flag
            found_inf = float(found_inf) != 0
            values = None if extra is None else _host(extra)
        else:
            values = extra
        wire = self._wire_for(None if on_host else like, host, 0 if extra is None else _size(extra))
        wire.maxed = maxed
        fields = self._fields(wire.place, host, state)
        message = self._reduce(wire, wire.send(fields, found_inf, values))
        return self._judge(wire, message, fields, state, like, extra, found_inf is False)

    def _announce(self, like: Any, config: LossScaleConfig, state: Any, payload: int, extras: int,
                  whose: int, length: int, known: int = 0) -> None:
        """Before the first message of a new length, one message of the LAST length naming the new
        one, checked at once (one read on a GPU): ranks whose lengths differ raise RankMismatchError
        on every rank instead of meeting in collectives of different sizes (which abort the transport)."""
        last, self._length = self._length, length  # ``length``: the extras outside a meter's schedule
        mark = len(self._sent)
        self._agree(_new_flag(like, 0.0), _zeros(like, last + known), config, state, payload, extras, whose)
        self.verify()
        del self._sent[mark:]

    def sum_payload_(self, storage: Any, payload: int, config: LossScaleConfig, state: Any, *,
                     whose: int = 0) -> Any:
        """Sum ``storage`` (the trainer's flat gradients, ``BITS`` spare values after ``payload``) in
        place, with the fingerprint: one SUM collective. Returns None when checked on the host (it
        raised if the ranks differ), else a 0-d float32 device flag, 1 when they differ."""
        host = self._next(config, payload, 0, whose)
        view = _host_view(storage)
        on_host = view is not None and _on_host(None, None, state)
        message = view if on_host else storage  # the host path writes and reads its NumPy view
        wire = self._wire_for(None if on_host else storage, host, 0, payload=True)
        fields = self._fields(wire.place, host, state)
        wire.send(fields, None, message)
        self._reduce(wire, storage)
        return self._judge(wire, message, fields, state, storage, None).found_inf

    def _wire_for(self, like: Any, host: list[int], extras: int, payload: bool = False) -> Any:
        """The next collective's wire format, built where ``like`` lives (None: in host memory)."""
        fp, red = self._fp, self.reducer
        place = self._host
        if like is not None:
            xp, device = array_api_compat.array_namespace(like), array_api_compat.device(like)
            place = self._places.get((xp, device))
            if place is None:
                place = self._places[(xp, device)] = fp.Place(xp, device)
        wire = self._wires.get((extras, payload, id(place)))  # places are kept: their ids stay theirs
        if wire is None:
            kind = self._wire.wire_for(red.size, extras, payload)
            wire = self._wires[(extras, payload, id(place))] = kind(place, red.rank, red.size, host[3])
        wire.key, wire.maxed = host[3], ()
        return wire

    def _fields(self, place: Any, host: list[int], state: Any) -> Any:
        """This rank's fingerprint where its message is built (the state's words on its device); None
        in a group of one, where no rank can differ (every format's check passes whatever it carries)."""
        if self.reducer.size == 1:
            return None
        if place.host or isinstance(state, HostState):
            return place.fields([*host, *_host_state(state)])
        return place.fields(host, tuple(state))

    def _reduce(self, wire: Any, message: Any) -> Any:
        return (self.reducer.allreduce_sum_ if wire.op == "sum" else self.reducer.allreduce_max_)(message)

    def _judge(self, wire: Any, message: Any, fields: Any, state: Any, like: Any, extra: Any,
               clean: bool = False) -> Agreed:
        """The reduced message's verdict, the same on every rank (see the class docstring); ``clean``:
        ``like`` was read as 0."""
        read = wire.read(message)
        if wire.place.host:
            if not read.aligned:
                self._explain(wire, message, fields, state)
            if read.flag is None:
                flag = None
            elif clean and extra is None and not read.flag and _is_plain_flag(like):
                flag = like  # a 0 flag that stays 0 stands as the agreed one (no new array per step)
            else:
                flag = _new_flag(like, 1.0 if read.flag else 0.0)
            return Agreed(flag, None if extra is None else _new_like(extra, read.extra))
        xp = wire.place.xp
        self._sent.append(_Sent(wire, message, xp.reshape(read.aligned, (1,)), fields, state))
        differ = xp.logical_not(read.aligned)
        flag = xp.astype(differ if read.flag is None else xp.logical_or(read.flag, differ), xp.float32)
        if extra is None:
            return Agreed(flag, None)
        return Agreed(flag, xp.reshape(xp.astype(read.extra, extra.dtype), extra.shape))

    # -- checking -------------------------------------------------------------------
    def verify(self) -> None:
        """After a skip: RankMismatchError if this iteration's messages show ranks that differ (a host
        sync, only on skipped steps)."""
        for sent in self._sent:
            if not self._host_read(sent.aligned)[0]:
                self._explain(sent.wire, sent.message, sent.fields, sent.state)

    def _explain(self, wire: Any, message: Any, fields: Any, state: Any) -> NoReturn:
        """The ranks differ: the wire names what differs (on every rank), then RankMismatchError."""
        mine = list(fields.host) if fields.state is None else [*fields.host, *_host_state(state)]
        red = self.reducer
        what = wire.explain(red, message, self._fp.Fingerprint(*mine))
        red.retire(f"an agreement found the ranks misaligned ({what})")
        raise self._mismatch(
            f"{red.describe()}: the ranks are not aligned, so no rank applies this step: {what}. "
            f"{_fix(what)} The reducer is now retired: restart the ranks (e.g. from the last "
            "checkpoint, loaded on every rank)."
        )

    def _next(self, config: LossScaleConfig, payload: int, extras: int, whose: int) -> list[int]:
        """The host fields of the next agreement (``_fingerprint.FIELDS`` up to ``whose``)."""
        if self._config is None or self._config[0] is not config:
            self._config = (config, self._crc(config))
        self.collective += 1
        owner = self.owner if not whose else self._owners.get(whose)
        if owner is None:  # a caller's whose seen first: its digest with this agreement's place, kept
            if len(self._owners) >= 256:
                self._owners.clear()
            owner = self._owners[whose] = content_digest(to_bytes(whose), to_bytes(self.owner))
        crc = self._config[1]
        return [crc, self.iterations, self.collective, self.reducer.collectives, payload, extras, owner]


def check_extra(extra: Any, most: int = USER_EXTRA) -> None:
    """Refuse ``extra`` with more than ``most`` values (ConfigError; nothing is sent)."""
    extras = 0 if extra is None else _size(extra)
    if extras > most:
        raise ConfigError(
            f"agree_(extra=...) carries at most {most} values in the step's collective, got "
            f"{extras} (shape {tuple(extra.shape)}). Fix: send e.g. a sum of squares pair."
        )


def _fix(what: str) -> str:
    if "collectives are not aligned" in what:
        return ("Fix: every rank must issue the same agreements in the same order: step (or unscale_) "
                "the same optimizers on every rank, update() once per iteration on every rank, and give "
                "each scaler its own process group.")
    if "config" in what:
        return "Fix: build the scaler with the same config on every rank."
    if "values summed" in what:
        return "Fix: every rank must train the same model (the same number of gradient values)."
    if "the flag of scaler/optimizer" in what:
        return ("Fix: every rank must step the same optimizers in the same order, build every rank's "
                "StepGuard and PrecisionMeter alike (or none: a meter's settings and sampling phase are part "
                "of the flag's identity) and give a loss on every rank or on none, give every rank the same "
                "StepGuard history (load the same checkpoint on every rank: a guard's histories of applied "
                "steps and its streak are part of the flag's identity), build its scalers in "
                "the same order, and give a data-parallel trainer the same max_grad_norm (two optimizers "
                "of one class over plain tensors, swapped from their first step, cannot be told apart: "
                "keep their order the same on every rank).")
    if "extra values agreed" in what:
        return ("Fix: clip (global_norm / clip_grad_norm_ with scaler=) on every rank alike, or on none, and "
                "build every rank's scaler with the same StepGuard (its values ride in the same message), "
                "or with none, and with the same PrecisionMeter or none (on its sample steps its counts "
                "ride there too, per gradient: give every rank as many gradients, empty ones included).")
    return ("Fix: load the same checkpoint on every rank (or none), and call set_scale, load_state_dict "
            "or update(new_scale) on every rank alike.")


def _size(array: Any) -> int:
    return math.prod(tuple(array.shape))


def _on_host(found_inf: Any, extra: Any, state: Any) -> bool:
    """Whether the flag, extra and state all live in host memory (reading them costs no sync)."""
    if state is not None and not isinstance(state, HostState) and not _is_host(state.scale):
        return False
    for array in (found_inf, extra):
        if array is not None and not isinstance(array, bool) and not _is_host(array):
            return False
    return True


_ARRAY_API: dict[type, bool] = {}  # array type -> whether array_api_compat knows its library


def _speaks_array_api(array: Any) -> bool:
    """Whether array_api_compat knows ``array``'s library, so the message can be built where it lives
    (else in host memory from the values: paddle on a GPU, a read per agreement)."""
    kind = type(array)
    if kind not in _ARRAY_API:
        try:
            _ARRAY_API[kind] = bool(array_api_compat.array_namespace(array))
        except TypeError:
            _ARRAY_API[kind] = False
    return _ARRAY_API[kind]


def _host_state(state: Any) -> tuple[int, int, int]:
    """(scale bits, growth tracker, backoff tracker) as host integers (a sync on a GPU)."""
    if isinstance(state, HostState):
        return scale_bits(state.scale), int(state.growth_tracker), int(state.backoff_tracker)
    scale, growth, backoff = map(float, state)  # 0-d arrays' __float__: a plain read in host memory
    return scale_bits(scale), int(growth), int(backoff)


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
    """Host values of a host array: a free view, else ``to_numpy`` (e.g. a bfloat16 CPU tensor)."""
    view = _host_view(array)
    return view if view is not None else backend_of(array).to_numpy(array)


_FLOAT32: dict[type, Any] = {}  # array type -> its library's float32 dtype


def _is_plain_flag(flag: Any) -> bool:
    """Whether ``flag`` is a 0-d float32 array, so it may stand as an agreed flag of its value."""
    kind = type(flag)
    dtype = _FLOAT32.get(kind)
    if dtype is None:
        if kind is bool:
            return False
        dtype = _FLOAT32[kind] = _new_flag(flag, 0.0).dtype
    return getattr(flag, "dtype", None) == dtype and tuple(getattr(flag, "shape", (1,))) == ()


def _new_flag(like: Any, value: float) -> Any:
    """A new 0-d float32 array holding ``value``, in ``like``'s library, in host memory."""
    if isinstance(like, (np.ndarray, np.generic, bool)):
        return np.asarray(value, np.float32)
    return backend_of(like).full(value, "float32", like)


def _zeros(like: Any, count: int) -> Any:
    """``count`` float64 zeros in ``like``'s library and device (None for none)."""
    if not count:
        return None
    zeros = np.zeros(count, np.float64)
    if isinstance(like, (np.ndarray, np.generic, bool)):
        return zeros
    return backend_of(like).from_host(zeros, like, None)


def _new_like(like: Any, values: Any) -> Any:
    """A new array like ``like`` (library, device, shape, dtype) holding host ``values``."""
    return backend_of(like).from_host(np.asarray(values).reshape(tuple(like.shape)), like, like.dtype)
