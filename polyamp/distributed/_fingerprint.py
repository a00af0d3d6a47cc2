"""What every rank must hold equal (the :class:`Fingerprint`), digested and encoded where a message lives.

The digests are universal hashes (:class:`Hash`): ``sum(w * h) mod p`` over the fields' 16-bit halves
``h``, weights fixed by :data:`SEED`. The encodings (:class:`Encoding`) carry the fields digit by digit
in a SUM: a digit summed over ``n`` ranks has ``sum**2 == n * sum_of_squares`` exactly when every rank
sent the same digit. :class:`Place` computes both for host and device, with no host read on a device.
"""

from __future__ import annotations

import hashlib
from operator import itemgetter
from typing import Any, NamedTuple

import array_api_compat.numpy as np_xp
import numpy as np

from .._skip_log import scale_text


class Fingerprint(NamedTuple):
    """One rank's fingerprint as host integers (the scale as its float32 bit pattern), in message order.

    ``extras``: how many extra values the agreement carries (a clip's sum of squares pair). ``whose``:
    whose flag this is: the scaler (its place among the agreements this process made) and what the
    caller names (the sharded facade: the optimizer's shape), so that swapped optimizers are found.
    """

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


FIELDS = Fingerprint._fields
#: Fields known on the host; the last three come from the scaler's state arrays.
HOST_FIELDS = 7
WIDTH = 32
_MASK = 2**WIDTH - 1
#: 32-bit words per field: the content digests (config; whose flag, with a guard's settings and
#: histories folded in) whole, so that every bit of them is weighed as the scale's bits are.
WORDS = tuple(4 if name in ("config", "whose") else 1 for name in FIELDS)
#: Words in a whole fingerprint, and in its host fields.
N_WORDS, HOST_WORDS = sum(WORDS), sum(WORDS[:HOST_FIELDS])
#: The index of each field's first word among a fingerprint's words.
_OFFSETS = tuple(sum(WORDS[:i]) for i in range(len(WORDS)))


def words(values: Any) -> list[int]:
    """Field values (the first ``len(values)`` fields, in order) as their 32-bit words, lowest first."""
    return [(v >> (WIDTH * k)) & _MASK for v, n in zip(values, WORDS) for k in range(n)]


def _joined(field_words: Any) -> list[Any]:
    """Per-word values back into field values (None where a word is None)."""
    parts = [list(field_words[i:i + n]) for i, n in zip(_OFFSETS, WORDS)]
    return [None if None in p else sum(int(w) << (WIDTH * k) for k, w in enumerate(p)) for p in parts]


#: The fields that stay the same from one step to the next (their share is kept per value; ``whose``
#: moves only with a guard's history), and the others, one word each: of the host fields, then of a
#: whole fingerprint (indexed by "whole").
_STATIC = tuple(FIELDS.index(name) for name in ("config", "payload", "extras", "whose"))
_DYNAMIC = tuple(i for i in range(len(FIELDS)) if i not in _STATIC)
_DYNAMIC_SETS = (tuple(i for i in _DYNAMIC if i < HOST_FIELDS), _DYNAMIC)
_STATIC_OF = itemgetter(*_STATIC)
_DYNAMIC_OF = tuple(itemgetter(*fields) for fields in _DYNAMIC_SETS)
#: How many static shares a place keeps (a few scalers and optimizers; cleared when full).
_SHARES_KEPT = 256
assert all(WORDS[i] == 1 for i in _DYNAMIC)

#: The two-value digest's primes (the largest two below 2**25), the one-value digest's (the largest
#: below 2**43), and the label their weights are drawn from.
P1, P2, Q = 2**25 - 39, 2**25 - 49, 2**43 - 57
SEED = "polyamp fingerprint digest v1"


class Encoding(NamedTuple):
    """How the fields travel in a SUM: ``digit_bits`` bits per value, and the squares after the digits."""

    digit_bits: int
    squares: bool

    @property
    def digits(self) -> int:
        """Digits per message (all fields)."""
        return N_WORDS * WIDTH // self.digit_bits

    @property
    def size(self) -> int:
        """Values per message: the digits, and their squares where they are not 0/1."""
        return self.digits * (2 if self.squares else 1)


#: The explanation after a mismatch (float64): bytes and their squares (exact up to 2**20 ranks).
BYTES = Encoding(8, True)
#: float32 gradient buffers (the data-parallel trainer): bits (exact below 2**24 ranks).
BITS = Encoding(1, False)


class Hash(NamedTuple):
    """A digest of the fields: ``sum(w * h) mod prime`` over their 16-bit halves ``h``."""

    prime: int
    weights: np.ndarray  # (words, 2): the weights of each word's low and high half
    pairs: list[int]  # the same as Python ints, word by word (low, high): the host's share needs no array
    dynamic: tuple[list[tuple[int, int]], ...]  # the (low, high) weights of _DYNAMIC_SETS' fields


def _hash(prime: int, label: str) -> Hash:
    """The digest mod ``prime`` whose weights, one in [1, prime) per 16-bit half of every word, are
    drawn from SHA-256 of ``label`` (the same everywhere), the low half's weight first."""
    def draw(i: int) -> int:
        word = hashlib.sha256(f"{SEED}/{label}/{i}".encode()).digest()
        return 1 + int.from_bytes(word[:8], "little") % (prime - 1)

    pairs = [draw(i) for i in range(2 * N_WORDS)]
    dynamic = tuple([(pairs[2 * _OFFSETS[i]], pairs[2 * _OFFSETS[i] + 1]) for i in fields]
                    for fields in _DYNAMIC_SETS)
    return Hash(prime, np.array(pairs, np.int64).reshape(N_WORDS, 2), pairs, dynamic)


#: The one-value message's digest (``D``) and the two halves of the two-value message's (``d1``, ``d2``).
LANE, HIGH, LOW = _hash(Q, "q"), _hash(P1, "p1"), _hash(P2, "p2")


def share(xp: Any, halves: Any, weights: Any, prime: int, base: Any = 0) -> Any:
    """``(base + sum(w * h)) mod prime`` over the 16-bit halves ``h`` of some fields (shares of
    disjoint fields add up); ``halves`` and ``weights``: (n, 2) int64, each product below 2**59."""
    return (xp.sum(weights * halves % prime) + base) % prime


def _halves(xp: Any, words: Any) -> Any:
    """The 16-bit halves of 1-d int64 ``words`` below 2**32: (n, 2), the low half first."""
    return xp.stack([words & 0xFFFF, words >> 16], axis=1)


class Fields(NamedTuple):
    """A fingerprint where its message is built: ``host`` the fields known on the host (all ten, or
    the first HOST_FIELDS; each digested and encoded as its words: the bits above them are not
    carried), and ``state`` the halves of the state's three (on its device) or None."""

    host: list[int]
    state: Any


def _pattern(xp: Any, powers: Any, scale: Any) -> Any:
    """The float32 bit pattern of ``scale`` (a positive normal float32), rebuilt exactly in float64
    from comparisons with the powers of two (no bit cast needed)."""
    s = xp.astype(scale, xp.float64)
    above = s >= powers
    power = xp.max(xp.where(above, powers, xp.zeros_like(powers)))
    exponent = xp.sum(xp.astype(above, xp.float64))  # the biased exponent, E + 127
    return exponent * 2.0**23 + (s / power - 1.0) * 2.0**23


class Place:
    """Where messages are built and read: NumPy in host memory (:data:`HOST`), or an array library's
    device, where nothing is read to the host. Keeps the constant arrays it needs there, made once.
    """

    def __init__(self, xp: Any, device: Any, host: bool = False) -> None:
        self.xp, self.device, self.host = xp, device, host
        self._made: dict[Any, Any] = {}
        self._shares: dict[Any, int] = {}  # (prime, the static fields' values) -> their share

    def constant(self, key: Any, values: np.ndarray) -> Any:
        """``values`` as an array here (made on first use)."""
        made = self._made.get(key)
        if made is None:
            made = self._made[key] = self.xp.asarray(values, device=self.device)
        return made

    def fields(self, host: list[int], state: Any = None) -> Fields:
        """The fingerprint from host integers and, on a device, the state arrays (scale, growth, backoff)."""
        halves = None
        if state is not None:
            xp, i64 = self.xp, self.xp.int64
            powers = self.constant("powers", np.ldexp(1.0, np.arange(-126, 128)))
            scale, growth, backoff = state
            state_words = [_pattern(xp, powers, scale), growth, backoff]
            halves = _halves(xp, xp.stack([xp.reshape(xp.astype(a, i64), ()) for a in state_words]) & _MASK)
        return Fields(host, halves)

    def share(self, fields: Fields | None, digest: Hash) -> Any:
        """``digest`` of every field: the host fields' share on the host, the state's added here (a
        Python int, or a 0-d int64 array here). The host's share is :func:`share`'s in Python ints
        (the same sum mod ``prime``: no array for sixteen numbers)."""
        if fields is None:  # a group of one: the fields carry nothing
            return 0
        host, prime = fields.host, digest.prime
        total = self._static_share(digest, host)
        full = len(host) == len(FIELDS)
        for (low, high), word in zip(digest.dynamic[full], _DYNAMIC_OF[full](host)):
            total += low * (word & 0xFFFF) + high * (word >> 16 & 0xFFFF)  # Python ints: exact, reduced once
        if fields.state is None:
            return total % prime
        weights = self.constant(prime, digest.weights[HOST_WORDS:])
        return share(self.xp, fields.state, weights, prime, total % prime)

    def _static_share(self, digest: Hash, host: list[int]) -> int:
        """``sum(w * h)`` (not reduced) over the halves of the static fields' words, kept per value."""
        key = (digest.prime, *_STATIC_OF(host))
        known = self._shares.get(key)
        if known is None:
            if len(self._shares) >= _SHARES_KEPT:
                self._shares.clear()
            pairs, known = digest.pairs, 0
            for i in _STATIC:
                for k in range(WORDS[i]):
                    word, at = (host[i] >> (WIDTH * k)) & _MASK, 2 * (_OFFSETS[i] + k)
                    known += pairs[at] * (word & 0xFFFF) + pairs[at + 1] * (word >> 16)
            self._shares[key] = known
        return known

    def encode(self, fields: Fields | None, encoding: Encoding) -> Any:
        """The fields as ``encoding.size`` float64 values here (field by field, lowest digit first)."""
        xp, bits = self.xp, encoding.digit_bits
        if fields is None:  # a group of one: the fields carry nothing
            return xp.zeros(encoding.size, dtype=xp.float64, device=self.device)
        mine = words(fields.host)
        words_ = np.array(mine, np.int64) if self.host else self.vector(mine, "int64")
        halves = _halves(xp, words_)  # on the host a new array: the HOST place is shared by threads
        if fields.state is not None:
            halves = xp.concat([halves, fields.state])
        shifts = self.constant(("shifts", bits), np.arange(0, 16, bits, dtype=np.int64))
        digits = xp.reshape((halves[:, :, None] >> shifts) & (2**bits - 1), (-1,))
        digits = xp.astype(digits, xp.float64)
        return xp.concat([digits, digits * digits]) if encoding.squares else digits

    def bit(self, found: Any) -> Any:
        """1 where ``found`` (a flag here, or a bool) is non-zero (NaN too), else 0 (int64 here)."""
        if found is None or isinstance(found, bool):
            return int(bool(found))
        xp = self.xp
        return xp.reshape(xp.astype(xp.asarray(found, device=self.device) != 0, xp.int64), ())

    def vector(self, values: list[Any], dtype: str) -> Any:
        """``values`` (Python numbers, or 0-d arrays here) as one 1-d array of ``dtype`` here; in host
        memory one buffer per length, reused (a reducer may keep its view: torch's from_numpy)."""
        xp = self.xp
        if self.host:
            buffer = self._made.get((dtype, len(values)))
            if buffer is None:
                buffer = self._made[(dtype, len(values))] = np.empty(len(values), getattr(np, dtype))
            if len(values) == 1:
                buffer[0] = values[0]  # a one-value message: cheaper than a slice assignment
            else:
                buffer[:] = values
            return buffer
        kind = getattr(xp, dtype)
        return xp.stack([xp.full((), v, dtype=kind, device=self.device) if isinstance(v, (int, float))
                         else xp.astype(xp.reshape(v, ()), kind) for v in values])


#: Host memory (an Agreement holds a place of its own, whose message buffers only it reuses).
HOST = Place(np_xp, "cpu", host=True)


def encode(values: Fingerprint | list[int], encoding: Encoding = BYTES) -> np.ndarray:
    """The fingerprint as ``encoding.size`` float64 values in host memory."""
    return HOST.encode(HOST.fields(list(values)), encoding)


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
    per_word = WIDTH // encoding.digit_bits
    shape = (N_WORDS, per_word)
    digits, squares, own = digits.reshape(shape), squares.reshape(shape), own.reshape(shape)
    word_differs = np.any(digits * digits != ranks * squares, axis=1)
    others, others_sq = digits - own, squares - own * own  # each digit summed over the other ranks
    weights = 2 ** (encoding.digit_bits * np.arange(per_word, dtype=np.int64))
    agree = np.all(others * others == (ranks - 1) * others_sq, axis=1)  # per word, among the others
    value = dict(zip(FIELDS, _joined([int(np.dot(others[i] // max(ranks - 1, 1), weights)) if agree[i]
                                      else None for i in range(N_WORDS)])))
    differs = [bool(np.any(word_differs[a:a + n])) for a, n in zip(_OFFSETS, WORDS)]
    parts = []
    if any(differs[FIELDS.index(f)] for f in ("iteration", "collective", "sequence")):
        parts.append(_position(mine, value))
    for name in ("config", "payload", "extras", "whose", "scale", "growth_tracker", "backoff_tracker"):
        if differs[FIELDS.index(name)]:
            parts.append(_field(name, getattr(mine, name), value[name]))
    return "; ".join(parts) or "the ranks' fingerprints differ"


def _position(mine: Fingerprint, other: dict[str, int | None]) -> str:
    """Where this rank's collective stands (a Fingerprint's fields), and the others' (as decoded)."""
    def where(at: dict[str, Any], sequence: str) -> str:
        number = int(at["sequence"]) + 1
        return f"collective {at['collective']} of iteration {at['iteration']} ({sequence}{number})"

    here = where(mine._asdict(), "the reducer's collective #")
    known = None not in map(other.get, ("collective", "iteration", "sequence"))
    there = where(other, "#") if known else "other positions"
    return f"the ranks' collectives are not aligned: {here} on this rank, {there} on the other ranks"


#: How a field's value reads in a RankMismatchError (the scale: its value, from its bits).
_SHOWN = {"config": "config fingerprint {:#x}", "payload": "{} values summed",
          "extras": "{} extra values agreed (e.g. a global-norm clip's sum of squares, a meter's counts)",
          "whose": "the flag of scaler/optimizer {:#x}"}


def _field(name: str, mine: int, other: int | None) -> str:
    def show(v: int) -> str:
        if name == "scale":
            return f"scale {scale_text(_from_bits(v))}"
        return _SHOWN.get(name, name + " {}").format(v)

    # the others disagree among themselves: at least one differs from this rank, maybe not all
    there = "another value on at least one other rank (the other ranks do not all agree)" if other is None \
        else f"{show(other)} on the other ranks"
    return f"rank states differ: {show(mine)} on this rank, {there}"


def _from_bits(pattern: int) -> float:
    return float(np.array(pattern, np.uint32).view(np.float32))
