"""The across-ranks half of LossScaler: one all-reduce per step agrees the flag and checks the ranks.

Every rank sends its flag (1 when it found an inf/nan) with a digest of what must be equal on every
rank (config, position, scale and trackers; see :mod:`polyamp.distributed._fingerprint`): ONE
int64 summed (no extra values, at most 1023 ranks; on the host or, from the state arrays, on the
device), else ``[4*d + f, f - 4*d]`` and
its own slots for ``extra`` values (a global-norm clip's sum of squares) with MAX. All ranks see
the same reduced values and reach the same verdict: skip together, or, when the digests differ,
run a second collective that names the difference and raise ``RankMismatchError`` on every rank.
``polyamp.distributed`` is imported only when a reducer is given.
"""

from __future__ import annotations

import math
import struct
import weakref
import zlib
from typing import TYPE_CHECKING, Any, NamedTuple, NoReturn

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
#: Extra values one agreement carries at most (each rank sends them in slots of its own): the
#: user's (``agree_(extra=)``, at most USER_EXTRA: a clip's sum-of-squares pair) and then a StepGuard's
#: (the loss and the gradients' sum of squares).
USER_EXTRA = 2
MAX_EXTRA = USER_EXTRA + 2


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

    reduced: Any  # the one value summed, the head's a + b, or the bits summed (a gradient buffer)
    host: list[int]  # the host fields
    state: Any
    kind: str  # "lane" (one int64, SUM), "head" (MAX, digest) or "bits" (a gradient buffer, SUM)


class Agreement:
    """A reducer plus the position of the next agreement: what ``LossScaler(reducer=...)`` holds.

    Every agreement is ONE all-reduce: an int64 SUM, or a MAX of ``[4d + f, f - 4d, *extra slots]``
    (see :mod:`polyamp.distributed._fingerprint`); its digest covers what must be equal on every rank
    (config, iteration, collective index, the reducer's collective count, payload size, how many
    extra values, scale and trackers). When the digests differ, every rank runs a second
    collective that names the difference and raises ``RankMismatchError`` before anything is
    applied: at once where the message lives on the host; on a GPU the mismatch makes the agreed
    flag 1 (so no rank can apply the step) and :meth:`verify` names it when the skip decision has
    read the flag.
    """

    def __init__(self, group: Any) -> None:
        # only here: `import polyamp` stays free of polyamp.distributed
        from .distributed import RankMismatchError, _fingerprint, reducer
        from .distributed._agree import _on_device_of, _to_host, config_fingerprint

        self.reducer: Reducer = reducer(group)
        # whose flags: the n-th agreement this process made on this group (ranks build their scalers
        # alike), so two scalers on one group whose steps are swapped on one rank are found
        self.owner = _next_owner(self.reducer.group_key())
        self.iteration = 0  # iterations ended (update() calls) since this agreement was made
        self.collective = 0  # agreements so far in this iteration
        self._fp, self._mismatch, self._crc = _fingerprint, RankMismatchError, config_fingerprint
        self._to_host, self._on_device_of = _to_host, _on_device_of
        self._sent: list[_Sent] = []  # this iteration's messages checked on the device only
        self._devices: dict[Any, Any] = {}  # (device, kind) -> DeviceDigest, DeviceLane or DeviceEncoder
        self._config: tuple[LossScaleConfig, int, int, int, int] | None = None  # config, crc, its shares
        self._messages: dict[int, np.ndarray] = {}  # the host path's buffers by size, reused
        self._one = np.zeros(1, np.int64)  # the one-value message's buffer, reused

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
    def flag(self, found_inf: Any, config: LossScaleConfig, state: Any, *, whose: int = 0) -> Any:
        """A new 0-d float32 array: 1 when ``found_inf`` is non-zero on some rank, else 0 (one collective)."""
        return self.flag_and_extra(found_inf, None, config, state, whose=whose).found_inf

    def flag_and_extra(
        self, found_inf: Any, extra: Any, config: LossScaleConfig, state: Any, *, payload: int = 0,
        whose: int = 0,
    ) -> Agreed:
        """Whether some rank found an inf/nan, and ``extra`` (at most MAX_EXTRA values) summed over ranks,
        in ONE collective.

        ``state`` (the scaler's ``LossScaleState``, or a ``HostState``) is digested with the config,
        the agreement's position, ``payload`` (a size every rank must share) and the number of
        extra values. Returns new arrays: the agreed flag (0 or 1) as float32 on ``extra``'s (else
        the flag's) device, 1 also when the ranks are misaligned where that is found on the
        device, and ``extra`` summed in rank order, in its dtype and shape.
        """
        extras = 0 if extra is None else _size(extra)
        check_extra(extra, MAX_EXTRA)
        host = self._next(config, payload, extras, whose)
        like = found_inf if extra is None else extra
        if not _on_host(found_inf, extra, state):
            return self._on_device(found_inf, extra, host, state, like)
        return self._host_path(found_inf, extra, extras, host, state, like)

    def _host_path(self, found_inf: Any, extra: Any, extras: int, host: list[int], state: Any,
                   like: Any) -> Agreed:
        """The message built, reduced and judged in host memory (NumPy, CPU tensors): no sync."""
        fp, red = self._fp, self.reducer
        mine = (*host, *_host_state(state))  # a Fingerprint's fields (built as one only to explain)
        _, _, c1, c2, _ = self._config  # type: ignore[misc]  # the config's shares, made by _next
        f = float(found_inf) != 0  # non-zero (NaN too) as read_flag; 0-d on the host: no sync
        if extra is None and red.size <= fp.LANE_RANKS:
            return self._one_value(mine, f, self._lane_share(mine), like)
        d1, d2 = fp.shares(mine[1:], first=1)
        four_d = 4.0 * ((d1 + c1) % fp.P1 * 2**25 + (d2 + c2) % fp.P2)  # exact: below 2**52
        size = fp.HEAD + extras * red.size
        message = self._messages.get(size)
        if message is None:
            message = self._messages[size] = np.zeros(size)
        message[0] = four_d + f  # the buffer is reused: nothing keeps it past this call
        message[1] = f - four_d
        if extra is not None:
            _fill_slots(message[fp.HEAD:], np.asarray(_host(extra), np.float64).reshape(-1), red.rank)
        red.allreduce_max_(message)
        total = float(message[0]) + float(message[1])  # exact: integers below 2**53
        if not fp.verdict(total):
            self._explain(fp.Fingerprint(*mine), None)
        agreed = _new_flag(like, total / 2)
        if extra is None:
            return Agreed(agreed, None)
        return Agreed(agreed, _new_like(extra, fp.gather_extras(message[fp.HEAD:], red.size), extra))

    def _one_value(self, mine: tuple[int, ...], found: bool, share: int, like: Any) -> Agreed:
        """The message without extra values in a group of at most 1023 ranks, on the host: ONE
        int64, summed (``_fingerprint.lane``): the flags' count and a check that every rank sent
        one digest (a device computes the same value: ``_lane_on_device``)."""
        fp, red = self._fp, self.reducer
        message = self._one
        message[0] = fp.lane(share, found, red.rank, red.size, mine[3])  # key: the reducer's count
        red.allreduce_sum_(message)
        aligned, agreed = fp.lane_verdict(int(message[0]))
        if not aligned:
            self._explain(fp.Fingerprint(*mine), None)
        return Agreed(_new_flag(like, 1.0 if agreed else 0.0), None)

    def _on_device(self, found_inf: Any, extra: Any, host: list[int], state: Any, like: Any) -> Agreed:
        """The message built, reduced and judged on the device: no host read (GPU arrays)."""
        fp, red = self._fp, self.reducer
        xp = array_api_compat.array_namespace(like)
        device = array_api_compat.device(like)
        found = bool(found_inf) if found_inf is None or isinstance(found_inf, bool) else found_inf
        if extra is None and red.size <= fp.LANE_RANKS:  # the host path's message, built here
            return self._lane_on_device(xp, device, found, host, state)
        f64 = xp.float64
        digest = self._device(xp, device, "digest")
        if isinstance(state, HostState):
            shares, arrays = fp.shares([*host, *_host_state(state)]), (None, None, None)
        else:
            shares, arrays = fp.shares(host), tuple(state)
        parts = [digest(shares, found, *arrays)]
        if extra is not None:
            k = _size(extra)
            mine = xp.reshape(xp.astype(extra, f64), (-1,))
            mine = xp.where(xp.isnan(mine), xp.full_like(mine, math.inf), mine)  # inf survives a MAX
            before, after = red.rank * k, (red.size - red.rank - 1) * k
            parts = [parts[0], xp.full((before,), -math.inf, dtype=f64, device=device), mine,
                     xp.full((after,), -math.inf, dtype=f64, device=device)]
        message = xp.concat(parts)
        red.allreduce_max_(message)
        total = message[0] + message[1]
        self._sent.append(_Sent(total, host, state, "head"))
        agreed = xp.astype(total > 0, xp.float32)  # 0 or 2: aligned; 4 and more: not, and all skip
        if extra is None:
            return Agreed(agreed, None)
        slots = xp.reshape(message[fp.HEAD:], (red.size, -1))
        summed = slots[0, ...]
        for r in range(1, red.size):  # rank order, the same on every rank
            summed = summed + slots[r, ...]
        return Agreed(agreed, xp.reshape(xp.astype(summed, extra.dtype), extra.shape))

    def _lane_share(self, fields: Any) -> int:
        """The one-value digest's share of ``fields`` (the host fields, or all of them), the config's
        share (made by ``_next``) added: the fields after the config are weighed here."""
        return (self._config[4] + self._fp.lane_share(fields[1:], first=1)) % self._fp.Q  # type: ignore[index]

    def _lane_on_device(self, xp: Any, device: Any, found: Any, host: list[int], state: Any) -> Agreed:
        """The one-value message (as on the host) computed, reduced and judged on the device: the
        agreed flag is 1 also where the ranks differ (every rank skips; :meth:`verify` names it)."""
        fp, red = self._fp, self.reducer
        lane = self._device(xp, device, "lane")
        c = fp.coefficient(red.rank, red.size, host[3])
        if isinstance(state, HostState):
            message = lane(fp.lane_share([*host, *_host_state(state)]), found, c)
        else:
            message = lane(self._lane_share(host), found, c, *state)
        red.allreduce_sum_(message)
        total = message[0]
        self._sent.append(_Sent(total, host, state, "lane"))
        differ = (total % fp.B) % fp.Q != 0
        return Agreed(xp.astype((total >= fp.B) | differ, xp.float32), None)

    def sum_payload_(self, storage: Any, payload: int, config: LossScaleConfig, state: Any, *,
                     whose: int = 0) -> Any:
        """Sum ``storage`` in place: its first ``payload`` values and, after them, the fingerprint.

        For data-parallel gradients (the trainer's flat buffer with ``BITS`` spare values at
        its end): one SUM collective. Returns None when the check ran on the host (it raised if
        the ranks differ), else a 0-d float32 device flag, 1 when they differ (add it to the step's
        overflow check; :meth:`verify` names the difference after a skip).
        """
        fp = self._fp
        host = self._next(config, payload, 0, whose)
        view = _host_view(storage)
        if view is not None and _on_host(None, None, state):
            mine = fp.Fingerprint(*host, *_host_state(state))
            view[payload:] = fp.encode(mine, fp.BITS)
            self.reducer.allreduce_sum_(storage)
            self._check_bits(view[payload:], mine)
            return None
        xp = array_api_compat.array_namespace(storage)
        encoder = self._device(xp, array_api_compat.device(storage), fp.BITS)
        storage[payload:] = xp.astype(self._encode(encoder, host, state), storage.dtype)
        self.reducer.allreduce_sum_(storage)
        sums = storage[payload:]
        self._sent.append(_Sent(sums, host, state, "bits"))
        return xp.astype(encoder.misaligned(sums, self.reducer.size), xp.float32)

    def _device(self, xp: Any, device: Any, kind: Any) -> Any:
        """The device digest ("digest"), one-value message ("lane") or encoder (an ``Encoding``) on
        ``device``, made once."""
        key = (device, kind)
        made = self._devices.get(key)
        if made is None:
            fp = self._fp
            if kind == "digest":
                made = fp.DeviceDigest(xp, device)
            elif kind == "lane":
                made = fp.DeviceLane(xp, device)
            else:
                made = fp.DeviceEncoder(xp, device, kind)
            self._devices[key] = made
        return made

    @staticmethod
    def _encode(encoder: Any, host: list[int], state: Any) -> Any:
        """The fingerprint encoded on the encoder's device (float64), computed there: no host read."""
        if isinstance(state, HostState):
            return encoder([*host, *_host_state(state)])
        return encoder(host, *state)

    # -- checking -------------------------------------------------------------------
    def verify(self) -> None:
        """After a skip decision said skip: RankMismatchError if this iteration's messages show
        ranks that differ (reads them: a host sync, only on skipped steps; where a digest
        differs, the second collective that names the difference, on every rank)."""
        fp, to_host = self._fp, self._to_host
        for sent in self._sent:
            if sent.kind == "lane" and fp.lane_verdict(int(to_host(sent.reduced)))[0]:
                continue
            if sent.kind == "head" and fp.verdict(float(to_host(sent.reduced))):
                continue
            mine = fp.Fingerprint(*sent.host, *_host_state(sent.state))
            if sent.kind != "bits":
                self._explain(mine, sent)
            self._check_bits(to_host(sent.reduced), mine)

    def _explain(self, mine: Any, sent: _Sent | None) -> NoReturn:
        """The second collective, run by every rank once the digests differ: the fingerprint's
        bytes and their squares summed, which name what differs; then RankMismatchError."""
        fp, red = self._fp, self.reducer
        if sent is None or isinstance(sent.state, HostState):
            message = fp.encode(mine, fp.BYTES)
            if sent is not None:  # a device message: the explanation lives there too (NCCL)
                message = self._on_device_of(message, sent.reduced)
        else:
            xp = array_api_compat.array_namespace(sent.reduced)
            encoder = self._device(xp, array_api_compat.device(sent.reduced), fp.BYTES)
            message = encoder(sent.host, *sent.state)
        red.allreduce_sum_(message)
        self._raise(fp.describe(self._to_host(message), red.size, mine))

    def _check_bits(self, sums: Any, mine: Any) -> None:
        fp = self._fp
        if fp.misaligned(sums, self.reducer.size, fp.BITS):
            self._raise(fp.describe(sums, self.reducer.size, mine, fp.BITS))

    def _raise(self, what: str) -> NoReturn:
        red = self.reducer
        red.retire(f"an agreement found the ranks misaligned ({what})")
        raise self._mismatch(
            f"{red.describe()}: the ranks are not aligned, so no rank applies this step: {what}. "
            f"{_fix(what)} The reducer is now retired: restart the ranks (e.g. from the last "
            "checkpoint, loaded on every rank)."
        )

    def _next(self, config: LossScaleConfig, payload: int, extras: int, whose: int) -> list[int]:
        """The host fields of the next agreement: config, iteration, collective, sequence, payload,
        extras, and whose flag (this agreement's place among the process's, with the caller's ``whose``)."""
        known = self._config
        if known is None or known[0] is not config:
            crc = self._crc(config)
            known = self._config = (config, crc, *self._fp.shares([crc]), self._fp.lane_share([crc]))
        self.collective += 1
        owner = self.owner if not whose else zlib.crc32(whose.to_bytes(8, "little"), self.owner)
        return [known[1], self.iteration, self.collective, self.reducer.collectives, payload, extras, owner]


def check_extra(extra: Any, most: int = USER_EXTRA) -> None:
    """Refuse ``extra`` with more than ``most`` values (ConfigError; nothing is sent)."""
    extras = 0 if extra is None else _size(extra)
    if extras > most:
        raise ConfigError(
            f"agree_(extra=...) carries at most {most} values in the step's collective, got "
            f"{extras} (shape {tuple(extra.shape)}). Fix: send e.g. a sum of squares pair."
        )


def _fill_slots(slots: np.ndarray, mine: np.ndarray, rank: int) -> None:
    """This rank's values into its own slots, -inf in the others' (a MAX keeps each rank's own);
    NaN sent as +inf, which a MAX keeps (it may drop a NaN)."""
    k = mine.shape[0]
    slots.fill(-math.inf)
    slots[rank * k:(rank + 1) * k] = np.where(np.isnan(mine), math.inf, mine)


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
                "StepGuard alike and give a loss on every rank or on none, give every rank the same "
                "StepGuard history (load the same checkpoint on every rank: a guard's histories of applied "
                "steps and its streak are part of the flag's identity), build its scalers in "
                "the same order, and give a data-parallel trainer the same max_grad_norm (two optimizers "
                "with the same number of parameters per group and the same dtypes cannot be told apart: "
                "keep their order the same on every rank).")
    if "extra values agreed" in what:
        return ("Fix: clip (global_norm / clip_grad_norm_ with scaler=) on every rank alike, or on none.")
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


def _host_state(state: Any) -> tuple[int, int, int]:
    """(scale bits, growth tracker, backoff tracker) as host integers (a sync on a GPU)."""
    if isinstance(state, HostState):
        return _scale_bits(state.scale), int(state.growth_tracker), int(state.backoff_tracker)
    to_host = backend_of(state[0]).to_host  # a plain read of CPU scalars, one sync each on a GPU
    scale, growth, backoff = (to_host(a) for a in state)
    return _scale_bits(float(scale)), int(growth), int(backoff)


def _scale_bits(scale: float) -> int:
    """The float32 bit pattern of ``scale`` (as ``polyamp.distributed._fingerprint.scale_bits``)."""
    return _U32.unpack(_F32.pack(scale))[0]


_F32, _U32 = struct.Struct("<f"), struct.Struct("<I")


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
    """Host values of a host array: a view where one is free, else its backend's ``to_numpy``
    (a bfloat16 or requires-grad CPU tensor has no NumPy view)."""
    if isinstance(array, bool):
        return float(array)
    view = _host_view(array)
    return view if view is not None else backend_of(array).to_numpy(array)


def _new_flag(like: Any, value: float) -> Any:
    """A new 0-d float32 array holding ``value``, in ``like``'s library, in host memory (its
    backend's ``full``: the cheapest new scalar each library has)."""
    if isinstance(like, (np.ndarray, np.generic, bool)):
        return np.asarray(value, np.float32)
    return backend_of(like).full(value, "float32", like)


def _new_like(like: Any, values: Any, shape_of: Any) -> Any:
    """A new array in ``like``'s library and device holding host ``values``: 0-d float32 for a
    flag (``shape_of`` None), else with ``shape_of``'s shape and dtype (its backend's ``from_host``)."""
    if shape_of is None:
        return backend_of(like).from_host(np.asarray(values, np.float32), like, None)
    host = np.asarray(values).reshape(tuple(shape_of.shape))
    return backend_of(like).from_host(host, like, shape_of.dtype)
