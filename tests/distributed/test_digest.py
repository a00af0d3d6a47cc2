"""The step agreement's messages: the one-value SUM ``f * B + (c * D mod Q)`` (groups of at most
1023 ranks: exact, its flag exact, ranks that differ found) and the MAX message ``[4d + f, f - 4d,
*slots]``: each built alike on the host and on a device (the formats' one code, on NumPy and on
torch tensors standing for a GPU's, against a plain-Python reference of the documented formulas),
the verdict exact at any world size (simulated up to 2**20 ranks with np.maximum over many
messages), the extras slots, and the exact explanation."""

from __future__ import annotations

import math

import numpy as np
import pytest

from polyamp import LossScaleConfig, LossScaler
from polyamp.distributed import Reducer
from polyamp.distributed import _fingerprint as fp
from polyamp.distributed import _wire as wire
from polyamp.policy import scale_bits

SCALES = [2.0**-126, 0.3, 1.0, 65536.0, 2.0**100 * 1.75, 3.4028234663852886e38]


def _is_prime(n: int) -> bool:
    return n > 1 and all(n % k for k in range(2, math.isqrt(n) + 1))


def _reference(values, digest: fp.Hash) -> int:
    """The documented digest in plain Python: ``sum(w * h) mod p`` over the 16-bit halves of the
    fields' 32-bit words (the config and whose flag four words each)."""
    return sum(int(w) * (v >> (16 * half) & 0xFFFF)
               for v, pair in zip(fp.words(values), digest.weights)
               for half, w in enumerate(pair)) % digest.prime


def _d(values) -> int:
    """The two-value message's digest ``d = d1 * 2**25 + d2`` (reference)."""
    return _reference(values, fp.HIGH) * 2**25 + _reference(values, fp.LOW)


def _lane(values, found: bool, rank: int, ranks: int, key: int) -> int:
    """What a rank sends in the one-value SUM (reference): ``f * B + (c * D mod Q)``."""
    return int(found) * wire.B + wire.coefficient(rank, ranks, key) * _reference(values, fp.LANE) % fp.Q


def _head(values, found: bool) -> list[float]:
    return [4.0 * _d(values) + found, found - 4.0 * _d(values)]


def test_the_digest_primes_and_weights():
    assert _is_prime(fp.P1) and _is_prime(fp.P2) and fp.P1 != fp.P2 and max(fp.P1, fp.P2) < 2**25
    assert fp.P1 * fp.P2 > 2**49  # a mismatch goes unseen with a chance below 2**-49
    for digest in (fp.HIGH, fp.LOW, fp.LANE):
        weights = digest.weights.reshape(-1).tolist()
        assert len(weights) == 2 * fp.N_WORDS and all(0 < w < digest.prime for w in weights)
        assert len(set(weights)) == len(weights)


def _print(**fields) -> fp.Fingerprint:
    base = dict(config=3_000_000_000, iteration=12, collective=1, sequence=40, payload=0, extras=0, whose=0,
                scale=scale_bits(65536.0), growth_tracker=1999, backoff_tracker=0)
    base.update(fields)
    return fp.Fingerprint(**base)


def test_the_digest_fits_and_every_field_moves_it():
    base = _print()
    d = _d(base)
    assert 0 <= d < 2**50
    for name in fp.FIELDS:
        for delta in (1, 2**16, 2**31):
            other = base._replace(**{name: (getattr(base, name) + delta) % 2**32})
            assert _d(other) != d, (name, delta)


def _place(library: str):
    """A device place (the GPU path's code) on NumPy or torch CPU arrays, and how to make its arrays."""
    if library == "torch":
        torch = pytest.importorskip("torch")
        import array_api_compat

        xp = array_api_compat.array_namespace(torch.zeros(()))
        return fp.Place(xp, torch.device("cpu")), lambda v, dtype: torch.tensor(
            np.asarray(v).tolist(), dtype=getattr(torch, dtype))
    import array_api_compat.numpy as xp

    return fp.Place(xp, "cpu"), lambda v, dtype: np.asarray(v, dtype)


def _on(place, to_array, mine: fp.Fingerprint, state: bool = True) -> fp.Fields:
    """``mine`` where ``place`` builds messages: the state as arrays there, or every field a host int."""
    if not state:
        return place.fields(list(mine))
    arrays = (to_array(np.float32(fp._from_bits(mine.scale)), "float32"),
              to_array(mine.growth_tracker, "int32"), to_array(mine.backoff_tracker, "int32"))
    return place.fields(list(mine[:fp.HOST_FIELDS]), arrays)


@pytest.mark.parametrize("library", ["numpy", "torch"])
@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("found", [False, True, "array0", "array3"])
def test_the_two_value_message_is_the_same_on_host_and_device(library, scale, found):
    place, to_array = _place(library)
    mine = _print(scale=scale_bits(np.float32(scale)), iteration=2**32 - 1, growth_tracker=2**31 - 1,
                  backoff_tracker=65537)
    flag = found if isinstance(found, bool) else to_array(float(found[-1]), "float32")
    f = found not in (False, "array0")
    want = _head(mine, f)
    host = wire.TwoValueMax(fp.HOST, 0, 2, 0).send(fp.HOST.fields(list(mine)), f, None)
    assert host.dtype == np.float64 and host.tolist() == want
    for state in (True, False):  # the state's arrays, or a host state (every field a host int)
        got = wire.TwoValueMax(place, 0, 2, 0).send(_on(place, to_array, mine, state), flag, None)
        assert str(got.dtype).endswith("float64") and np.asarray(got).tolist() == want


def _reduced(digests: np.ndarray, found: np.ndarray) -> np.ndarray:
    """The two-value message after a MAX over every rank's ``[4d + f, f - 4d]`` (as gloo/MPI compute it)."""
    d = digests.astype(np.float64)
    return np.maximum.reduce(np.stack([4.0 * d + found, found - 4.0 * d], axis=1), axis=0)


@pytest.mark.parametrize("ranks", [1, 2, 3, 1000, 2**20])
def test_the_verdict_is_exact_at_any_world_size(ranks):
    rng = np.random.default_rng(ranks)
    read = wire.TwoValueMax(fp.HOST, 0, ranks, 0).read
    d = _d(_print())
    same = np.full(ranks, d, np.int64)
    for found in (np.zeros(ranks), np.eye(1, ranks, ranks - 1)[0], rng.integers(0, 2, ranks).astype(float)):
        got = read(_reduced(same, found))
        assert got.aligned and got.flag == found.any() and got.extra is None
    for other in (d + 1, d - 1, 0, 2**50 - 1, _d(_print(scale=scale_bits(32768.0)))):
        if other == d or ranks == 1:
            continue
        for where in (0, ranks - 1):
            digests = same.copy()
            digests[where] = other
            for found in (np.zeros(ranks), np.ones(ranks)):
                message = _reduced(digests, found)
                assert not read(message).aligned
                assert message.sum() == 4 * abs(other - d) + 2 * found.max()  # exact: no rounding anywhere


def test_the_one_value_constants():
    assert _is_prime(fp.Q) and 2**42 < fp.Q < 2**43  # a mismatch goes unseen with a chance below 2**-41
    assert wire.LANE_RANKS * (fp.Q - 1) < wire.B and wire.LANE_RANKS * wire.B + wire.B <= 2**63  # exact
    base = _print()
    halves, weights = np.array([(w & 0xFFFF, w >> 16) for w in fp.words(base)]), fp.LANE.weights
    parts = [fp.share(np, halves[:k], weights[:k], fp.Q) for k in (1, 7)]
    rests = [fp.share(np, halves[k:], weights[k:], fp.Q, part) for k, part in zip((1, 7), parts)]
    assert rests == [_reference(base, fp.LANE)] * 2  # shares of disjoint fields add up
    for name in fp.FIELDS:  # every field moves the digest (a difference below 2**16 per half, never 0 mod Q)
        for delta in (1, 2**16, 2**31):
            other = base._replace(**{name: (getattr(base, name) + delta) % 2**32})
            assert _reference(other, fp.LANE) != _reference(base, fp.LANE), (name, delta)


@pytest.mark.parametrize("library", ["numpy", "torch"])
@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("found", [False, True, "array0", "array3"])
def test_the_one_value_message_is_the_same_on_host_and_device(library, scale, found):
    """The one-value message computed from the state arrays (a GPU rank's, here on the CPU): equal
    to the host's and the reference, whatever the fields (up to 2**32 - 1), the scale and the flag."""
    place, to_array = _place(library)
    mine = _print(config=2**32 - 1, iteration=2**31 + 5, scale=scale_bits(np.float32(scale)),
                  growth_tracker=2**31 - 1, backoff_tracker=65537)
    flag = found if isinstance(found, bool) else to_array(float(found[-1]), "float32")
    f = found not in (False, "array0")
    for rank, ranks, key in ((0, 2, 0), (1, 2, 7), (5, 1023, 2**40 + 1)):
        want = _lane(mine, f, rank, ranks, key)
        host = wire.OneValue(fp.HOST, rank, ranks, key).send(fp.HOST.fields(list(mine)), f, None)
        assert host.dtype == np.int64 and host.tolist() == [want]
        for state in (True, False):
            got = wire.OneValue(place, rank, ranks, key).send(_on(place, to_array, mine, state), flag, None)
            assert str(got.dtype).endswith("int64") and tuple(got.shape) == (1,) and int(got[0]) == want


@pytest.mark.parametrize("library", ["numpy", "torch"])
def test_fields_beyond_their_words_travel_as_their_words(library):
    """A count past its 32-bit word (a position after 2**32 collectives, a payload of 2**45 values,
    a 128-bit digest field given more bits) is digested and encoded as its words, on host and device,
    in every format: the message equals the one of the value cut to its words."""
    place, to_array = _place(library)
    big = _print(config=2**140 + 2**128 + 7, iteration=2**40 + 5, collective=2**32 + 1, sequence=2**33 + 2,
                 payload=2**45 + 9, extras=2**34, whose=2**131 + 3)
    cut = fp.Fingerprint(*(v % 2**(32 * n) for v, n in zip(big, fp.WORDS)))
    assert cut != big
    for rank, ranks, key in ((0, 2, 0), (1, 3, 2**40 + 1)):
        want = _lane(cut, True, rank, ranks, key)
        host = wire.OneValue(fp.HOST, rank, ranks, key).send(fp.HOST.fields(list(big)), True, None)
        assert host.tolist() == [want]
        got = wire.OneValue(place, rank, ranks, key).send(_on(place, to_array, big), True, None)
        assert int(got[0]) == want
    head = wire.TwoValueMax(fp.HOST, 0, 2, 0).send(fp.HOST.fields(list(big)), False, None)
    assert head.tolist() == _head(cut, False)
    for encoding in (fp.BYTES, fp.BITS):
        np.testing.assert_array_equal(fp.encode(big, encoding), fp.encode(cut, encoding))


def test_mulmod_is_exact():
    rng = np.random.default_rng(3)
    x = np.concatenate([rng.integers(0, fp.Q, 1000), [0, 1, fp.Q - 1]]).astype(np.int64)
    for k in (0, 1, 2**16 + 3, fp.Q - 1, fp.Q + 5, int(rng.integers(0, fp.Q))):
        assert wire.mulmod(k, x).tolist() == [k * int(v) % fp.Q for v in x]


def _lane_sum(prints: list[fp.Fingerprint], found, key: int) -> tuple[int, np.int64]:
    """Every rank's one value summed: exactly (a Python int) and as an int64 all-reduce sums it."""
    values = [_lane(p, bool(f), r, len(prints), key) for r, (p, f) in enumerate(zip(prints, found))]
    assert all(0 <= v < wire.B + fp.Q for v in values)
    return sum(values), np.sum(np.array(values, np.int64))


def _one_value_read(total: int, ranks: int) -> tuple[bool, bool]:
    read = wire.OneValue(fp.HOST, 0, ranks, 0).read(np.array([total], np.int64))
    return bool(read.aligned), bool(read.flag)


@pytest.mark.parametrize("ranks", [1, 2, 3, 64, wire.LANE_RANKS])
def test_the_one_value_sum_is_exact_and_its_flag_exact_up_to_1023_ranks(ranks):
    rng = np.random.default_rng(ranks)
    same = [_print()] * ranks
    for key in (0, 41, 2**40 + 3):
        last = np.eye(1, ranks, ranks - 1)[0]
        for found in (np.zeros(ranks), last, rng.integers(0, 2, ranks), np.ones(ranks)):
            exact, as_int64 = _lane_sum(same, found, key)
            assert exact == as_int64 < 2**63  # no int64 overflow, whatever the flags
            assert _one_value_read(exact, ranks) == (True, bool(found.any()))


@pytest.mark.parametrize("ranks", [2, 3, 64, wire.LANE_RANKS])
def test_the_one_value_sum_finds_ranks_that_differ(ranks):
    """One rank off, two ranks whose differences cancel in a fixed linear sum (one an iteration
    ahead, one behind), half the ranks: for 50 collectives each, never aligned; the flag stays exact."""
    base = _print()
    ahead, behind = base._replace(iteration=13), base._replace(iteration=11)
    cases = [[base] * (ranks - 1) + [ahead], [ahead] + [base] * (ranks - 1),
             [base] * (ranks // 2) + [base._replace(scale=scale_bits(32768.0))] * (ranks - ranks // 2)]
    if ranks > 2:
        cases.append([ahead, behind] + [base] * (ranks - 2))
    for prints in cases:
        for key in range(50):
            found = np.eye(1, ranks, key % ranks)[0]
            exact, as_int64 = _lane_sum(prints, found, key)
            assert exact == as_int64 and _one_value_read(exact, ranks) == (False, True)


class Grid(Reducer):
    """Rank 0 of ``ranks`` whose peers hold its state: records the message kinds (MAX: unchanged)."""

    def __init__(self, ranks: int) -> None:
        super().__init__("grid", 0, ranks, None)
        self.sent: list[tuple[str, str, int]] = []

    def _prepare(self, array):
        return array

    def _allreduce(self, buffer, op):
        self.sent.append((op, str(buffer.dtype), buffer.size))
        assert op == "max"

    def _barrier(self):
        pass


def test_groups_above_1023_ranks_send_the_two_value_max():
    scaler = LossScaler(LossScaleConfig(init_scale=4.0), reducer=Grid(wire.LANE_RANKS + 1))
    assert not scaler.step([np.ones(2, np.float32)], lambda: None).skipped
    assert scaler.reducer.sent == [("max", "float64", 2)]


def _with_extras(pairs, ranks: int) -> np.ndarray:
    """Every rank's two-value message with its extra values (rank ``r`` sends ``pairs[r]``)."""
    fields = fp.HOST.fields(list(_print()))
    return np.stack([wire.TwoValueMax(fp.HOST, r, ranks, 0).send(fields, False, np.asarray(pairs[r]))
                     for r in range(ranks)])


@pytest.mark.parametrize("ranks", [2, 5])
def test_extras_slots_sum_every_ranks_values_in_rank_order(ranks):
    rng = np.random.default_rng(0)
    pairs = rng.random((ranks, 2)) * 10.0**rng.integers(-300, 300, (ranks, 1))
    reduced = np.maximum.reduce(_with_extras(pairs, ranks), axis=0)
    np.testing.assert_array_equal(reduced[wire.HEAD:].reshape(ranks, 2), pairs)
    total = wire.TwoValueMax(fp.HOST, 0, ranks, 0).read(reduced).extra
    want = pairs[0].copy()
    for row in pairs[1:]:
        want += row
    np.testing.assert_array_equal(total, want)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_non_finite_extra_keeps_the_sum_non_finite(bad):
    reduced = np.maximum.reduce(_with_extras([[1.0, 2.0], [bad, 3.0], [4.0, 5.0]], 3), axis=0)
    total = wire.TwoValueMax(fp.HOST, 0, 3, 0).read(reduced).extra
    assert not np.isfinite(total[0]) and total[1] == 10.0


class Ranks(Reducer):
    """Rank ``rank`` of ``size``, whose peers sent this rank's head (aligned) and ``peer_extras``."""

    def __init__(self, rank: int, size: int, peer_extras: np.ndarray) -> None:
        super().__init__("ranks", rank, size, None)
        self.peer_extras = peer_extras

    def _prepare(self, array):
        return array

    def _allreduce(self, buffer, op):
        if op == "sum":  # the one-value message announcing the extras' length: aligned peers, no flag
            buffer[...] = 0  # the ranks' coefficients sum to 0 mod Q, and no rank found inf
            return
        fields = fp.HOST.fields([0] * len(fp.FIELDS))
        for r in range(self.size):
            if r != self.rank:  # the peer's message, built as polyamp builds it
                peer = np.array(buffer, copy=True)
                theirs = wire.TwoValueMax(fp.HOST, r, self.size, 0).send(fields, False, self.peer_extras[r])
                peer[wire.HEAD:] = theirs[wire.HEAD:]
                np.maximum(buffer, peer, out=buffer)

    def _barrier(self):
        pass


@pytest.mark.parametrize("device_path", [False, True])
def test_agree_returns_the_extras_summed_over_ranks(monkeypatch, device_path):
    if device_path:
        import polyamp._agreement as agreement

        monkeypatch.setattr(agreement, "_on_host", lambda *args: False)
    peers = np.array([[1.0, 0.5], [0.0, 0.0], [math.nan, 4.0]])
    scaler = LossScaler(LossScaleConfig(init_scale=1.0), reducer=Ranks(1, 3, peers))
    scaler.unscale_([np.ones(2, np.float32)])
    agreed = scaler.agree_(np.array([2.0, 0.25], np.float32))
    assert agreed.extra.dtype == np.float32 and agreed.extra.shape == (2,)
    assert np.isposinf(agreed.extra[0]) and agreed.extra[1] == 4.75 and float(agreed.found_inf) == 0.0


def test_the_explanation_is_exact_at_2_20_ranks():
    """One rank of 2**20 differs by one in a byte of 255s: sums of bytes near 2**28, squares near
    2**36, their products near 2**56 (exact in int64, not in float64)."""
    ranks = 2**20
    others, mine = _print(iteration=2**32 - 1), _print(iteration=2**32 - 2)
    sums = (ranks - 1) * fp.encode(others) + fp.encode(mine)
    assert fp.misaligned(sums, ranks) and not fp.misaligned(ranks * fp.encode(others), ranks)
    text = fp.describe(sums, ranks, mine)
    assert f"collective 1 of iteration {2**32 - 2}" in text and f"iteration {2**32 - 1} (#41)" in text
    assert fp.describe(sums, ranks, others).endswith("other positions on the other ranks")


class Peer(Reducer):
    """Rank 0 of 2 whose peer holds ``other``: its head in a MAX or its one value in a SUM, its bytes
    in the explanation's SUM."""

    def __init__(self, other: fp.Fingerprint) -> None:
        super().__init__("peer", 0, 2, None)
        self.other = other

    def _prepare(self, array):
        return array

    def _allreduce(self, buffer, op):
        if op == "max":
            np.maximum(buffer, _head(self.other, False), out=buffer)
        elif buffer.dtype == np.int64:  # the one-value message, as rank 1 computes it from its fields
            buffer += _lane(self.other, False, 1, 2, self.other.sequence)
        else:  # the explanation: its bytes
            buffer += fp.encode(self.other)

    def _barrier(self):
        pass


@pytest.mark.parametrize("device_path", [False, True])
@pytest.mark.parametrize("differs", [False, True])
def test_a_host_state_is_checked_and_explained_on_either_path(monkeypatch, device_path, differs):
    """The trainer's first check (no loss scaling: a fixed host state): aligned, or a second
    collective that names the payload (the number of gradient values) that differs."""
    from polyamp._agreement import Agreement
    from polyamp.distributed import RankMismatchError, config_fingerprint
    from polyamp.policy import HostState

    if device_path:
        import polyamp._agreement as agreement

        monkeypatch.setattr(agreement, "_on_host", lambda *args: False)
    config = LossScaleConfig(init_scale=1.0, dynamic=False)
    payload = 7 if differs else 5
    other = fp.Fingerprint(config_fingerprint(config), 0, 1, 0, payload, 0, 0, scale_bits(1.0), 0, 0)
    red = Peer(other)
    agreement_ = Agreement(red)
    if not differs:
        agreed = agreement_.flag_and_extra(np.zeros((), np.float32), None, config, HostState(1.0), payload=5)
        agreement_.verify()
        assert float(agreed.found_inf) == 0.0 and red.collectives == 1
        return
    with pytest.raises(RankMismatchError, match="5 values summed on this rank, 7 values summed on the other"):
        agreed = agreement_.flag_and_extra(np.zeros((), np.float32), None, config, HostState(1.0), payload=5)
        assert float(agreed.found_inf) == 1.0 and red.collectives == 1  # the device path: skip, then verify
        agreement_.verify()
    assert red.collectives == 2



def _short_vector(a: list[int], q: int) -> list[int]:
    """A short non-zero integer ``x`` with ``sum(a * x) = 0 mod q`` (``q`` prime, ``a[0]`` not 0):
    the first vector of an LLL-reduced basis of the lattice of all such ``x``."""
    from fractions import Fraction

    n, inv = len(a), pow(a[0], -1, q)
    basis = [[q] + [0] * (n - 1)] + [[-inv * a[i] % q] + [int(j == i) for j in range(1, n)]
                                     for i in range(1, n)]

    def dot(u, v):
        return sum(x * y for x, y in zip(u, v, strict=True))

    def gram_schmidt():
        ortho, mu = [], [[Fraction(0)] * n for _ in range(n)]
        for i in range(n):
            v = [Fraction(x) for x in basis[i]]
            for j, o in enumerate(ortho):
                mu[i][j] = dot(basis[i], o) / dot(o, o)
                v = [x - mu[i][j] * y for x, y in zip(v, o, strict=True)]
            ortho.append(v)
        return ortho, mu

    k = 1
    while k < n:
        for j in range(k - 1, -1, -1):
            mu = gram_schmidt()[1]
            if abs(mu[k][j]) > Fraction(1, 2):
                basis[k] = [x - round(mu[k][j]) * y for x, y in zip(basis[k], basis[j], strict=True)]
        ortho, mu = gram_schmidt()
        if dot(ortho[k], ortho[k]) >= (Fraction(3, 4) - mu[k][k - 1] ** 2) * dot(ortho[k - 1], ortho[k - 1]):
            k += 1
        else:
            basis[k], basis[k - 1] = basis[k - 1], basis[k]
            k = max(k - 1, 1)
    return basis[0]


def _one_value_sum(prints: list[fp.Fingerprint], key: int) -> int:
    """The ranks' one-value messages, each built by the wire's own code (a buffer it reuses: copied),
    summed as int64."""
    messages = [np.array(wire.OneValue(fp.HOST, r, len(prints), key).send(fp.HOST.fields(list(p)), False,
                                                                        None)) for r, p in enumerate(prints)]
    return int(np.sum(np.concatenate(messages)))


def test_a_misalignment_that_cancels_in_one_collective_is_found_in_the_next():
    """Rank 0 ahead and rank 1 behind (in iteration and sequence) by amounts chosen so that their
    differences cancel in collective 7's linear sum (rank 2 aligned): that one collective is fooled
    (the 1/Q chance, forced), but every other collective draws fresh coefficients and finds them.
    Coefficients drawn once per rank for every collective would be fooled every time."""
    base = _print(iteration=2**15 + 2**31, sequence=2**15)
    w = fp.LANE.pairs  # per 32-bit word: the low half's weight, then the high half's

    def low(name):
        return w[2 * sum(fp.WORDS[:fp.FIELDS.index(name)])]

    it, seq = low("iteration"), low("sequence")  # the low halves' weights
    key = 7
    c0, c1 = (wire.coefficient(r, 3, key) for r in (0, 1))
    x = _short_vector([c0 * it % fp.Q, c0 * seq % fp.Q, c1 * it % fp.Q, c1 * seq % fp.Q], fp.Q)
    assert max(map(abs, x)) < 2**15 and any(x[:2]) and any(x[2:]), x
    prints = [base._replace(iteration=base.iteration + x[0], sequence=base.sequence + x[1]),
              base._replace(iteration=base.iteration + x[2], sequence=base.sequence + x[3]), base]
    assert len(set(prints)) == 3
    assert _one_value_read(_one_value_sum(prints, key), 3) == (True, False)  # fooled, by construction
    for other in [*range(key), *range(key + 1, key + 40), 2**40 + 5]:
        assert _one_value_read(_one_value_sum(prints, other), 3) == (False, False), other
