"""The step agreement's wire formats: one class each behind one interface (:class:`Wire`), and the
one place that picks one (:func:`wire_for`). Each rank's message carries its flag with a digest of
its fingerprint in ONE all-reduce, built and read through a :class:`~._fingerprint.Place` (host or
device alike); the formats and why each is exact are in docs/distributed.md ("Ranks that are not
aligned").
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import Any, ClassVar, NamedTuple

import numpy as np

from ._agree import to_host_array
from ._fingerprint import BITS, BYTES, HIGH, LANE, LOW, Fields, Fingerprint, Place, Q, describe

#: The one-value message: each rank sends ``f * B + v``, ``v`` below Q. Summed over n <= LANE_RANKS
#: ranks, the ``v`` stay below 1023 * Q < B and the flags' count below 2**10: exact in int64.
B, LANE_RANKS = 2**53, 2**10 - 1
#: Values in a two-value message before its extra slots.
HEAD = 2
_M64 = 2**64 - 1


class Read(NamedTuple):
    """What every rank reads from the reduced message (host values, or 0-d arrays on the device)."""

    flag: Any  # some rank found an inf/nan (bool), or None: the format carries no flag
    extra: Any  # the extra values summed over ranks in rank order (float64, 1-d), or None
    aligned: Any  # every rank sent the same fingerprint (bool)


class Wire(ABC):
    """One wire format, built for one collective: what this rank sends, what every rank reads back,
    how a difference is named (``key``: the reducer's count of collectives)."""

    op: ClassVar[str] = "sum"  # how the ranks' messages are reduced: "sum" or "max" (each format says)
    #: per extra value: True where the ranks' values combine by their max, else by their sum
    maxed: tuple[bool, ...] = ()

    def __init__(self, place: Place, rank: int, size: int, key: int) -> None:
        self.place, self.rank, self.size, self.key = place, rank, size, key

    @abstractmethod
    def send(self, fields: Fields, found: Any, values: Any) -> Any:
        """This rank's message from its flag, its extra values (or payload) and its fingerprint."""

    @abstractmethod
    def read(self, message: Any) -> Read:
        """The agreed flag, the extras and whether the ranks are aligned, from the reduced message."""

    def explain(self, reducer: Any, message: Any, mine: Fingerprint) -> str:
        """What differs, once :meth:`read` found the ranks differ: the second collective, run by
        every rank (the fingerprint's bytes and their squares summed, where the message lives)."""
        sums = self.place.encode(self.place.fields(list(mine)), BYTES)
        reducer.allreduce_sum_(sums)
        return describe(to_host_array(sums), self.size, mine)


def wire_for(size: int, n_extra: int, payload: bool = False) -> type[Wire]:
    """The wire format of an agreement among ``size`` ranks carrying ``n_extra`` extra values (or a
    ``payload``); every rank picks the same one. One int64 where it can serve (no extras, at most
    LANE_RANKS ranks), else two float64 and per-rank slots under a MAX, exact at any size."""
    if payload:
        return PayloadBits
    if n_extra == 0 and size <= LANE_RANKS:
        return OneValue
    return TwoValueMax


def _mix(x: int) -> int:
    """SplitMix64's finalizer: a bijection of 64-bit words whose outputs look uniform."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def coefficient(rank: int, ranks: int, key: int) -> int:
    """``c = g(rank) - g(rank + 1) mod Q``, the ranks in a circle and ``g(r) = _mix(key, r) mod Q``
    drawn anew for each collective ``key``: the ``c`` of all ranks sum to 0 mod Q."""
    base = (key & 0xFFFFFFFFFFF) << 20
    return (_mix(base | rank) % Q - _mix(base | (rank + 1) % ranks) % Q) % Q


def mulmod(k: int, x: Any) -> Any:
    """``k * x mod Q`` for a host integer ``k`` and int64 ``x`` in ``[0, Q)`` (a Python int or an
    array on any device), without overflow: ``k * 2**(16j) mod Q`` times the 16-bit digits of ``x``,
    each product below 2**59, three summed below 2**61."""
    k %= Q
    return (k * (x & 0xFFFF) + k * 2**16 % Q * ((x >> 16) & 0xFFFF) + k * 2**32 % Q * (x >> 32)) % Q


def lane(share: Any, found: Any, rank: int, ranks: int, key: int) -> Any:
    """What ``rank`` of ``ranks`` sends in the one-value SUM: ``f * B + (c * D mod Q)``, ``D`` the
    fingerprint's LANE digest (``share``), ``f`` 0 or 1 (Python ints or int64 arrays alike)."""
    return found * B + mulmod(coefficient(rank, ranks, key), share)


class OneValue(Wire):
    """One int64, summed (no extra values, at most LANE_RANKS ranks)."""

    def send(self, fields: Fields, found: Any, values: Any) -> Any:
        place = self.place
        if fields is None:  # a group of one: its flag alone (the digest's coefficient would be 0)
            return place.vector([place.bit(found) * B], "int64")
        value = lane(place.share(fields, LANE), place.bit(found), self.rank, self.size, self.key)
        return place.vector([value], "int64")

    def read(self, message: Any) -> Read:
        total = message[0]  # the flags' count times B, and the v parts: 0 mod Q when aligned
        if self.place.host:
            total = int(total)  # Python ints: cheaper than NumPy scalars
        return Read(total >= B, None, total % B % Q == 0)


class TwoValueMax(Wire):
    """``[4d + f, f - 4d]`` and each rank's extra values in slots of its own, float64, MAX."""

    op = "max"

    def send(self, fields: Fields, found: Any, values: Any) -> Any:
        place, f = self.place, self.place.bit(found)
        four_d = (place.share(fields, HIGH) * 2**25 + place.share(fields, LOW)) * 4  # below 2**52
        head = place.vector([four_d + f, f - four_d], "float64")
        if values is None:
            return head
        xp = place.xp
        mine = xp.reshape(xp.astype(values, xp.float64), (-1,))
        mine = xp.where(xp.isnan(mine), xp.full_like(mine, math.inf), mine)  # inf survives a MAX
        k = mine.shape[0]
        others = xp.full(((self.size - 1) * k,), -math.inf, dtype=xp.float64, device=place.device)
        return xp.concat([head, others[:self.rank * k], mine, others[self.rank * k:]])

    def read(self, message: Any) -> Read:
        total = message[0] + message[1]  # 0 or 2 when aligned, 4 and more when not: exact
        extra = None
        if message.shape[0] > HEAD:
            slots = self.place.xp.reshape(message[HEAD:], (self.size, -1))
            extra = slots[0, ...]
            for r in range(1, self.size):  # rank order, the same on every rank
                extra = extra + slots[r, ...]
            if any(self.maxed):  # the slots whose rule is the ranks' max (e.g. an amax)
                mask = self.place.constant(("maxed", self.maxed), np.asarray(self.maxed))
                extra = self.place.xp.where(mask, self.place.xp.max(slots, axis=0), extra)
        return Read(total > 0, extra, total <= 2)


class PayloadBits(Wire):
    """A payload summed with the fingerprint's bits in its last ``BITS.size`` values (no flag)."""

    def send(self, fields: Fields, found: Any, values: Any) -> Any:
        bits = self.place.encode(fields, BITS)
        values[values.shape[0] - BITS.size:] = self.place.xp.astype(bits, values.dtype)
        return values

    def read(self, message: Any) -> Read:
        xp = self.place.xp
        sums = xp.astype(message[message.shape[0] - BITS.size:], xp.float64)
        return Read(None, None, xp.all(sums * sums == float(self.size) * sums))  # every bit 0 or n

    def explain(self, reducer: Any, message: Any, mine: Fingerprint) -> str:
        """The summed bits name what differs: no second collective."""
        return describe(to_host_array(message[message.shape[0] - BITS.size:]), self.size, mine, BITS)
