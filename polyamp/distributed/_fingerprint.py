"""What every rank must hold equal: a digest in the step's one all-reduce, bytes to explain a mismatch.

No extra values, at most 1023 ranks (:data:`LANE_RANKS`): each rank sends ONE int64 (computed on
the host, or on the device from the state arrays: :class:`DeviceLane`),
``f * B + (c * D mod Q)``, reduced with SUM (:func:`lane`). ``f`` is 1 when this rank found an
inf/nan, ``D`` the :func:`lane_share` digest of its :class:`Fingerprint` mod the prime ``Q``
(below 2**43), and ``c = g(rank) - g(rank + 1)`` with the ranks in a circle and ``g`` drawn anew
for each collective: the ``c`` sum to 0, so ranks with one ``D`` send values whose ``v`` parts
sum to 0 mod Q. The sum is exact (below 1023 * (B + Q) < 2**63) and splits into the flags' count
(``total // B``, exact) and the ``v`` (``total % B``); :func:`lane_verdict` says aligned when
those are 0 mod Q. Ranks that differ, in any pattern, sum to 0 with probability 1/Q for one
collective (``g`` of a rank beside a difference is uniform), and their digests collide with
probability at most 1/(Q - 1): below 2**-41 in all.

With extra values and in larger groups, the message is ``[4*d + f, f - 4*d,
*slots]`` (float64), reduced with MAX: ``d < 2**50`` the :func:`digest`, and ``slots`` carry
extra values (each rank its own ``k`` slots, -inf in the others', see :func:`gather_extras`).
After the MAX, ``a + b == 2 * OR(f)`` when every rank sent the same ``d``, and ``a + b >= 4``
otherwise (``4 * (max d - min d)``), so the verdict (:func:`verdict`) is a property of the
reduced message that every rank evaluates alike, exact for any number of ranks (a MAX never
rounds; ``4d + 1 < 2**53``).

The digest is a universal hash: each 32-bit field split into 16-bit halves ``h``, ``d1 = sum(w1 *
h) mod P1``, ``d2 = sum(w2 * h) mod P2`` (primes below 2**25, weights in ``[1, P)`` fixed by
:data:`SEED`), ``d = d1 * 2**25 + d2``. Two fingerprints that differ collide for at most one value
of a differing half's weight in each: a chance of at most ``1 / ((P1 - 1) * (P2 - 1)) < 2**-49``
that a mismatch is not found. A device computes it from the state arrays without a host read
(:class:`DeviceDigest`).

Only once a mismatch is found, every rank sums the fingerprint's bytes and their squares in a
second collective (``encode(.., BYTES)``): ``sum**2 == n * sum_of_squares`` holds for a byte exactly
when every rank sent the same byte (checked in int64: exact up to 2**20 ranks), which names the
field that differs (:func:`describe`). The data-parallel trainer's float32 gradient buffer carries
the fields as bits after the gradients in its SUM (a bit's sum is 0 or n; exact below 2**24 ranks).
"""

from __future__ import annotations

import hashlib
import struct
from typing import Any, NamedTuple

import numpy as np

from .._skip_log import scale_text

#: The fields of a fingerprint, in message order (32 bits each). ``extras``: how many extra
#: values the agreement carries (a clip's sum of squares pair), so that ranks must agree on it too.
#: ``whose``: whose flag this is: the scaler (its place among the agreements this process made) and
#: what the caller names (the sharded facade: the optimizer's shape), so that swapped optimizers or
#: scalers are found.
FIELDS = ("config", "iteration", "collective", "sequence", "payload", "extras", "whose", "scale",
          "growth_tracker", "backoff_tracker")
#: Fields known on the host; the last three come from the scaler's state arrays.
HOST_FIELDS = 7
WIDTH = 32
_MASK = 2**WIDTH - 1
_F32, _U32 = struct.Struct("<f"), struct.Struct("<I")

#: The digest's primes (the largest two below 2**25) and the label its weights are drawn from.
P1, P2 = 2**25 - 39, 2**25 - 49
SEED = "polyamp fingerprint digest v1"
#: Values in a step agreement before its extra slots.
HEAD = 2
#: The one-value message (groups of at most LANE_RANKS ranks): each rank sends ``f * B + v``, ``v``
#: below the prime Q (the largest below 2**43). Summed over n <= 1023 ranks, the ``v`` stay below
#: 1023 * Q < B and the flags' count below 2**10, so the int64 sum is exact (below 2**63) and splits
#: into both.
Q, B, LANE_RANKS = 2**43 - 57, 2**53, 2**10 - 1
_M64 = 2**64 - 1


class Encoding(NamedTuple):
    """How the fields travel in a SUM: ``digit_bits`` bits per value, and the squares after the digits."""

    digit_bits: int
    squares: bool

    @property
    def digits(self) -> int:
        """Digits per message (all fields)."""
        return len(FIELDS) * WIDTH // self.digit_bits

    @property
    def size(self) -> int:
        """Values per message: the digits, and their squares where they are not 0/1."""
        return self.digits * (2 if self.squares else 1)


#: The explanation after a mismatch (float64): bytes and their squares (exact up to 2**20 ranks).
BYTES = Encoding(8, True)
#: float32 gradient buffers (the data-parallel trainer): bits (exact below 2**24 ranks).
BITS = Encoding(1, False)


class Fingerprint(NamedTuple):
    """One rank's fingerprint as host integers (the scale as its float32 bit pattern)."""

    config: int
    iteration: int
    collective: int
    sequence: int
    payload: int
    extras: int
    whose: int
    scale: int
    growth_tracker: int
    backoff_tracker: int


def _weights(prime: int, label: str) -> tuple[tuple[int, int], ...]:
    """One weight in [1, prime) per 16-bit half of every field, from SHA-256 (the same everywhere)."""
    def draw(i: int) -> int:
        word = hashlib.sha256(f"{SEED}/{label}/{i}".encode()).digest()
        return 1 + int.from_bytes(word[:8], "little") % (prime - 1)

    return tuple((draw(2 * i), draw(2 * i + 1)) for i in range(len(FIELDS)))


#: Per field: (weight of the low half, weight of the high half), for P1, P2 and Q.
W1, W2, WQ = _weights(P1, "p1"), _weights(P2, "p2"), _weights(Q, "q")
_PACKED = tuple((a1 << 64 | a2, b1 << 64 | b2) for (a1, b1), (a2, b2) in zip(W1, W2))
_LOW64 = 2**64 - 1


def scale_bits(scale: float) -> int:
    """The float32 bit pattern of ``scale`` (what a device computes from the scale array)."""
    return _U32.unpack(_F32.pack(scale))[0]


def shares(values: Any, first: int = 0) -> tuple[int, int]:
    """``(sum(w1 * h) mod P1, sum(w2 * h) mod P2)`` over the halves of ``values``, fields from ``first``.

    Both sums in one Python integer (``w1 * 2**64 + w2``: the second sum stays below 2**46).
    """
    total = 0
    for v, (low, high) in zip(values, _PACKED[first:]):
        v &= _MASK
        total += low * (v & 0xFFFF) + high * (v >> 16)
    return (total >> 64) % P1, (total & _LOW64) % P2


def digest(values: Fingerprint | list[int]) -> int:
    """The fingerprint's digest ``d = d1 * 2**25 + d2 < 2**50`` (host side)."""
    d1, d2 = shares(values)
    return d1 * 2**25 + d2


def lane_share(values: Any, first: int = 0) -> int:
    """``sum(wq * h) mod Q`` over the halves of ``values``, fields from ``first`` (the one-value
    message's digest of them; shares of disjoint fields add up mod Q)."""
    total = 0
    for v, (low, high) in zip(values, WQ[first:]):
        v &= _MASK
        total += low * (v & 0xFFFF) + high * (v >> 16)
    return total % Q


def _mix(x: int) -> int:
    """SplitMix64's finalizer: a bijection of 64-bit words whose outputs look uniform."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def _g(key: int, rank: int) -> int:
    """Rank ``rank``'s coefficient seed for the collective ``key`` (uniform-looking mod Q)."""
    return _mix(((key & 0xFFFFFFFFFFF) << 20) | rank) % Q


def coefficient(rank: int, ranks: int, key: int) -> int:
    """``c = g(rank) - g(rank + 1) mod Q``, the ranks in a circle and ``g`` drawn anew for each
    collective ``key``: the ``c`` of all ranks sum to 0 mod Q."""
    return (_g(key, rank) - _g(key, (rank + 1) % ranks)) % Q


def lane(share: int, found: bool, rank: int, ranks: int, key: int) -> int:
    """What ``rank`` of ``ranks`` sends in the one-value SUM: ``f * B + (c * D mod Q)``.

    ``D`` (``share``) the fingerprint's :func:`lane_share`, ``f`` 1 when this rank found an inf/nan,
    ``c`` its :func:`coefficient`: ranks with one ``D`` send ``v`` that sum to 0 mod Q.
    """
    return (B if found else 0) + coefficient(rank, ranks, key) * share % Q


def lane_verdict(total: int) -> tuple[bool, bool]:
    """From the SUM of the ranks' :func:`lane` values: (aligned, agreed flag). Aligned when the
    ``v`` sum to 0 mod Q (every rank sent one digest, or, with probability 1/Q, digests that
    differ); the flag (1 when some rank found an inf/nan) is exact either way."""
    return total % B % Q == 0, total >= B


def head(d: int, found: bool) -> tuple[float, float]:
    """The two values a rank sends: ``(4d + f, f - 4d)``."""
    f = 1.0 if found else 0.0
    return 4.0 * d + f, f - 4.0 * d


def verdict(total: float) -> bool:
    """From ``a + b`` of the reduced head: True when the ranks are aligned (``a + b`` is 0 or 2);
    then the agreed flag is ``total / 2``."""
    return total <= 2.0


def gather_extras(slots: np.ndarray, ranks: int) -> np.ndarray:
    """The extras summed over the ranks, in rank order (the same on every rank): ``slots`` holds
    each rank's ``k`` values after the MAX, rank after rank."""
    per_rank = np.asarray(slots, np.float64).reshape(ranks, -1)
    total = per_rank[0].copy()
    for row in per_rank[1:]:
        total += row
    return total


def encode(values: Fingerprint | list[int], encoding: Encoding = BYTES) -> np.ndarray:
    """The fingerprint as ``encoding.size`` float64 values (field by field, lowest digit first)."""
    octets = np.array([v & _MASK for v in values], dtype="<u4").view(np.uint8)
    if encoding.digit_bits == 1:
        return np.unpackbits(octets, bitorder="little").astype(np.float64)
    digits = octets.astype(np.float64)
    return np.concatenate([digits, digits * digits])


def _pattern(xp: Any, powers: Any, scale: Any) -> Any:
    """The float32 bit pattern of ``scale`` (a positive normal float32), rebuilt exactly in float64
    from comparisons with the powers of two (no bit cast needed)."""
    s = xp.astype(scale, xp.float64)
    above = s >= powers
    power = xp.max(xp.where(above, powers, xp.zeros_like(powers)))
    exponent = xp.sum(xp.astype(above, xp.float64))  # the biased exponent, E + 127
    return exponent * 2.0**23 + (s / power - 1.0) * 2.0**23


def _powers(xp: Any, device: Any) -> Any:
    return xp.asarray(np.ldexp(1.0, np.arange(-126, 128)), dtype=xp.float64, device=device)


class DeviceDigest:
    """The head ``[4d + f, f - 4d]`` computed on the state's device, without a host read (GPU arrays).

    The host fields' shares enter as scalar arguments (no host-to-device copy); the state's
    halves are weighted and reduced mod P1, P2 there. Exact in float64: every product is below
    2**41, every sum below 2**46, and the remainder of such integers is exact.
    """

    def __init__(self, xp: Any, device: Any) -> None:
        self.xp, self.device = xp, device
        f64 = xp.float64
        self._powers = _powers(xp, device)
        state = range(HOST_FIELDS, len(FIELDS))
        # rows: P1, P2; columns: (lo, hi) of each state field
        weights = [[w for i in state for w in table[i]] for table in (W1, W2)]
        self._weights = xp.asarray(np.array(weights, np.float64), dtype=f64, device=device)

    def __call__(self, host: tuple[int, int], found: Any, scale: Any = None, growth: Any = None,
                 backoff: Any = None) -> Any:
        """The head, float64 of shape (2,): ``host`` the :func:`shares` of the host fields (of every
        field when ``scale`` is None), ``found`` a device flag (non-zero: inf/nan found) or a bool."""
        xp, f64 = self.xp, self.xp.float64
        if scale is None:
            four_d = xp.full((), 4.0 * (host[0] * 2**25 + host[1]), dtype=f64, device=self.device)
        else:
            four_d = self._four_d(host, scale, growth, backoff)
        if isinstance(found, bool):
            f: Any = 1.0 if found else 0.0
        else:
            f = xp.reshape(xp.astype(xp.asarray(found, device=self.device) != 0, f64), ())
        return xp.stack([four_d + f, f - four_d])

    def _four_d(self, host: tuple[int, int], scale: Any, growth: Any, backoff: Any) -> Any:
        """``4 * d`` on the device: the state's halves weighted, the host shares added, mod P1, P2."""
        xp, f64 = self.xp, self.xp.float64
        words = xp.stack([xp.reshape(_pattern(xp, self._powers, scale), ()),
                          xp.reshape(xp.astype(growth, f64), ()), xp.reshape(xp.astype(backoff, f64), ())])
        high = xp.floor(words / 65536.0)
        halves = xp.reshape(xp.stack([words - 65536.0 * high, high], axis=1), (-1,))
        sums = xp.sum(self._weights * halves[None, :], axis=1)
        d1 = (sums[0] + float(host[0])) % float(P1)  # exact: a - P*floor(a/P), a < 2**46
        d2 = (sums[1] + float(host[1])) % float(P2)
        return (d1 * 2.0**25 + d2) * 4.0


def mulmod(k: int, x: Any) -> Any:
    """``k * x mod Q`` for a host integer ``k`` and int64 values ``x`` in ``[0, Q)`` (an array on
    any device), without overflow: ``k * 2**(16j) mod Q`` times the 16-bit digits of ``x``, each
    product below 2**59, three summed below 2**61."""
    k %= Q
    return (k * (x & 0xFFFF) + k * 2**16 % Q * ((x >> 16) & 0xFFFF) + k * 2**32 % Q * (x >> 32)) % Q


class DeviceLane:
    """The one-value message ``f * B + (c * D mod Q)`` computed on the state's device, without a
    host read (GPU arrays): equal to :func:`lane` on the host for a positive normal float32 scale
    (the only scales a config and ``set_scale`` let through).

    In int64: each product of a weight (below 2**43) and a 16-bit half is below 2**59, the state's
    six of them and the host share sum below 2**62; ``c * D mod Q`` is :func:`mulmod`.
    """

    def __init__(self, xp: Any, device: Any) -> None:
        self.xp, self.device = xp, device
        self._powers = _powers(xp, device)
        weights = [w for i in range(HOST_FIELDS, len(FIELDS)) for w in WQ[i]]  # (lo, hi) per state field
        self._weights = xp.asarray(np.array(weights, np.int64), dtype=xp.int64, device=device)

    def __call__(self, share: int, found: Any, c: int, scale: Any = None, growth: Any = None,
                 backoff: Any = None) -> Any:
        """The message, int64 of shape (1,): ``share`` the :func:`lane_share` of the host fields (of
        every field when ``scale`` is None), ``found`` a device flag (non-zero: inf/nan) or a bool,
        ``c`` this rank's :func:`coefficient`."""
        xp, i64 = self.xp, self.xp.int64
        if scale is None:
            v: Any = xp.full((), c * share % Q, dtype=i64, device=self.device)
        else:
            pattern = xp.astype(_pattern(xp, self._powers, scale), i64)
            words = xp.stack([xp.reshape(xp.astype(a, i64), ()) for a in (pattern, growth, backoff)]) & _MASK
            halves = xp.reshape(xp.stack([words & 0xFFFF, words >> 16], axis=1), (-1,))
            v = mulmod(c, (xp.sum(self._weights * halves) + share) % Q)
        if isinstance(found, bool):
            f: Any = B if found else 0
        else:
            f = xp.reshape(xp.astype(xp.asarray(found, device=self.device) != 0, i64), ()) * B
        return xp.reshape(f + v, (1,))


class DeviceEncoder:
    """Computes a SUM encoding on the state's device, without a host read (for GPU arrays).

    Host fields enter as fills (kernel arguments, no host-to-device copy); the scale's bit
    pattern is rebuilt exactly from comparisons with the powers of two (no bit cast needed).
    """

    def __init__(self, xp: Any, device: Any, encoding: Encoding = BYTES) -> None:
        self.xp, self.device, self.encoding = xp, device, encoding
        f64 = xp.float64
        per_field = WIDTH // encoding.digit_bits
        self._powers = _powers(xp, device)
        steps = -encoding.digit_bits * np.arange(per_field)
        self._shifts = xp.asarray(np.ldexp(1.0, steps), dtype=f64, device=device)
        self._base = float(2**encoding.digit_bits)

    def __call__(self, host: list[int], scale: Any = None, growth: Any = None, backoff: Any = None) -> Any:
        """The encoding of ``host`` (every field's value, or the host fields with the state arrays)."""
        xp, f64 = self.xp, self.xp.float64
        words = [xp.full((), float(v & _MASK), dtype=f64, device=self.device) for v in host]
        if scale is not None:
            words += [_pattern(xp, self._powers, scale), xp.astype(growth, f64), xp.astype(backoff, f64)]
        stacked = xp.stack([xp.reshape(w, ()) for w in words])
        high = xp.floor(stacked[:, None] * self._shifts[None, :])
        digits = xp.reshape(high - self._base * xp.floor(high / self._base), (-1,))
        return xp.concat([digits, digits * digits]) if self.encoding.squares else digits

    def misaligned(self, sums: Any, ranks: int) -> Any:
        """A 0-d bool on the device: True when some digit differed between the ranks (bits only:
        a bit's sum squared is below 2**48, exact in float64)."""
        xp = self.xp
        sums = xp.astype(sums, xp.float64)
        n = self.encoding.digits
        squares = sums[n:] if self.encoding.squares else sums
        return xp.any(sums[:n] * sums[:n] != float(ranks) * squares)


def _split(sums: np.ndarray, encoding: Encoding) -> tuple[np.ndarray, np.ndarray]:
    """Digits and squares as int64 (sums of bytes below 2**28, squares below 2**36 at 2**20
    ranks: their products, below 2**57, are exact in int64, not in float64)."""
    sums = np.asarray(sums, dtype=np.float64).astype(np.int64)
    n = encoding.digits
    return (sums[:n], sums[n:]) if encoding.squares else (sums, sums)


def misaligned(sums: np.ndarray, ranks: int, encoding: Encoding = BYTES) -> bool:
    """Whether any digit was not the same on every rank (host side)."""
    digits, squares = _split(sums, encoding)
    return bool(np.any(digits * digits != ranks * squares))


def describe(sums: np.ndarray, ranks: int, mine: Fingerprint, encoding: Encoding = BYTES) -> str:
    """What differs between this rank and the others, e.g. "scale 2**10 on this rank, 2**20 on
    the other ranks"; fields are named in the order they explain a misalignment best."""
    digits, squares = _split(sums, encoding)
    own, _ = _split(encode(mine, encoding), encoding)
    per_field = WIDTH // encoding.digit_bits
    shape = (len(FIELDS), per_field)
    digits, squares, own = digits.reshape(shape), squares.reshape(shape), own.reshape(shape)
    differs = np.any(digits * digits != ranks * squares, axis=1)
    others, others_sq = digits - own, squares - own * own  # each digit summed over the other ranks
    weights = 2 ** (encoding.digit_bits * np.arange(per_field, dtype=np.int64))
    value: dict[str, int | None] = {}
    for i, name in enumerate(FIELDS):
        agree = np.all(others[i] * others[i] == (ranks - 1) * others_sq[i])
        value[name] = int(np.dot(others[i] // max(ranks - 1, 1), weights)) if agree else None
    parts = []
    if any(differs[FIELDS.index(f)] for f in ("iteration", "collective", "sequence")):
        parts.append(_position(mine, value))
    for name in ("config", "payload", "extras", "whose", "scale", "growth_tracker", "backoff_tracker"):
        if differs[FIELDS.index(name)]:
            parts.append(_field(name, getattr(mine, name), value[name]))
    return "; ".join(parts) or "the ranks' fingerprints differ"


def _position(mine: Fingerprint, other: dict[str, int | None]) -> str:
    here = f"collective {mine.collective} of iteration {mine.iteration} (the reducer's collective " \
           f"#{mine.sequence + 1}) on this rank"
    if None in (other["collective"], other["iteration"], other["sequence"]):
        return f"the ranks' collectives are not aligned: {here}, other positions on the other ranks"
    there = (f"collective {other['collective']} of iteration {other['iteration']} (#"
             f"{int(other['sequence']) + 1}) on the other ranks")  # type: ignore[arg-type]
    return f"the ranks' collectives are not aligned: {here}, {there}"


def _field(name: str, mine: int, other: int | None) -> str:
    def show(v: int) -> str:
        if name == "scale":
            return f"scale {scale_text(_from_bits(v))}"
        if name == "extras":
            return f"{v} extra values agreed (e.g. a global-norm clip's sum of squares)"
        if name == "whose":
            return f"the flag of scaler/optimizer {v:#010x}"
        label = "config fingerprint" if name == "config" else name
        return f"{v} values summed" if name == "payload" else f"{label} {v}"

    # the others disagree among themselves: at least one differs from this rank, maybe not all
    there = "another value on at least one other rank (the other ranks do not all agree)" if other is None \
        else f"{show(other)} on the other ranks"
    return f"rank states differ: {show(mine)} on this rank, {there}"


def _from_bits(pattern: int) -> float:
    return float(np.array(pattern, np.uint32).view(np.float32))
