"""The step agreement's messages: the one-value SUM ``f * B + (c * D mod Q)`` (host arrays, groups
of at most 1023 ranks: exact, its flag exact, ranks that differ found) and the MAX message ``[4d + f,
f - 4d, *slots]``: the digest computed alike on the host and on a device, the verdict exact at any
world size (simulated up to 2**20 ranks with np.maximum over many encoded messages), the extras
slots, and the exact explanation."""

from __future__ import annotations

import math

import numpy as np
import pytest

from polyamp import LossScaleConfig, LossScaler
from polyamp.distributed import Reducer
from polyamp.distributed import _fingerprint as fp

SCALES = [2.0**-126, 0.3, 1.0, 65536.0, 2.0**100 * 1.75, 3.4028234663852886e38]


def _is_prime(n: int) -> bool:
    return n > 1 and all(n % k for k in range(2, math.isqrt(n) + 1))


def test_the_digest_primes_and_weights():
    assert _is_prime(fp.P1) and _is_prime(fp.P2) and fp.P1 != fp.P2 and max(fp.P1, fp.P2) < 2**25
    assert fp.P1 * fp.P2 > 2**49  # a mismatch goes unseen with a chance below 2**-49
    for table, prime in ((fp.W1, fp.P1), (fp.W2, fp.P2)):
        weights = [w for pair in table for w in pair]
        assert len(weights) == 2 * len(fp.FIELDS) and all(0 < w < prime for w in weights)
        assert len(set(weights)) == len(weights)


def _print(**fields) -> fp.Fingerprint:
    base = dict(config=3_000_000_000, iteration=12, collective=1, sequence=40, payload=0, extras=0, whose=0,
                scale=fp.scale_bits(65536.0), growth_tracker=1999, backoff_tracker=0)
    base.update(fields)
    return fp.Fingerprint(**base)


def test_the_digest_fits_and_every_field_moves_it():
    base = _print()
    d = fp.digest(base)
    assert 0 <= d < 2**50 and fp.digest(list(base)) == d
    for name in fp.FIELDS:
        for delta in (1, 2**16, 2**31):
            other = base._replace(**{name: (getattr(base, name) + delta) % 2**32})
            assert fp.digest(other) != d, (name, delta)


def _device_head(xp, device, mine: fp.Fingerprint, found, to_array):
    digest = fp.DeviceDigest(xp, device)
    state = (to_array(np.float32(fp._from_bits(mine.scale)), "float32"),
             to_array(np.int32(mine.growth_tracker), "int32"),
             to_array(np.int32(mine.backoff_tracker), "int32"))
    return digest(fp.shares(mine[:fp.HOST_FIELDS]), found, *state)


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("found", [False, True, "array0", "array3"])
def test_the_device_digest_equals_the_host_digest_numpy(scale, found):
    mine = _print(scale=fp.scale_bits(np.float32(scale)), growth_tracker=2**31 - 1, backoff_tracker=65537)
    flag = np.array(float(found[-1]), np.float32) if isinstance(found, str) else found
    got = _device_head(np, "cpu", mine, flag, lambda v, dtype: np.asarray(v, dtype))
    f = bool(float(flag))
    assert got.dtype == np.float64 and got.tolist() == list(fp.head(fp.digest(mine), f))


@pytest.mark.parametrize("scale", SCALES)
def test_the_device_digest_equals_the_host_digest_torch(scale):
    torch = pytest.importorskip("torch")
    import array_api_compat

    xp = array_api_compat.array_namespace(torch.zeros(()))
    mine = _print(scale=fp.scale_bits(np.float32(scale)), iteration=2**32 - 1, growth_tracker=77)
    got = _device_head(xp, torch.device("cpu"), mine, torch.tensor(1.0),
                       lambda v, dtype: torch.tensor(v.item(), dtype=getattr(torch, dtype)))
    assert isinstance(got, torch.Tensor) and got.dtype == torch.float64
    assert got.tolist() == list(fp.head(fp.digest(mine), True))


def _reduced(digests: np.ndarray, found: np.ndarray) -> float:
    """``a + b`` after a MAX over every rank's ``[4d + f, f - 4d]`` (as gloo/MPI compute it)."""
    d = digests.astype(np.float64)
    heads = np.stack([4.0 * d + found, found - 4.0 * d], axis=1)
    a, b = np.maximum.reduce(heads, axis=0)
    return float(a + b)


@pytest.mark.parametrize("ranks", [1, 2, 3, 1000, 2**20])
def test_the_verdict_is_exact_at_any_world_size(ranks):
    rng = np.random.default_rng(ranks)
    d = fp.digest(_print())
    same = np.full(ranks, d, np.int64)
    for found in (np.zeros(ranks), np.eye(1, ranks, ranks - 1)[0], rng.integers(0, 2, ranks).astype(float)):
        total = _reduced(same, found)
        assert fp.verdict(total) and total / 2 == float(found.any())
    for other in (d + 1, d - 1, 0, 2**50 - 1, fp.digest(_print(scale=fp.scale_bits(32768.0)))):
        if other == d or ranks == 1:
            continue
        for where in (0, ranks - 1):
            digests = same.copy()
            digests[where] = other
            for found in (np.zeros(ranks), np.ones(ranks)):
                total = _reduced(digests, found)
                assert not fp.verdict(total)
                assert total == 4 * abs(other - d) + 2 * found.max()  # exact: no rounding anywhere


def test_the_one_value_constants():
    assert _is_prime(fp.Q) and 2**42 < fp.Q < 2**43  # a mismatch goes unseen with a chance below 2**-41
    assert fp.LANE_RANKS * (fp.Q - 1) < fp.B and fp.LANE_RANKS * fp.B + fp.B <= 2**63  # sums split, exact
    weights = [w for pair in fp.WQ for w in pair]
    assert len(set(weights)) == len(weights) == 2 * len(fp.FIELDS) and all(0 < w < fp.Q for w in weights)
    base = _print()
    assert fp.lane_share(base) == (fp.lane_share(base[:1]) + fp.lane_share(base[1:], first=1)) % fp.Q
    for name in fp.FIELDS:  # every field moves the digest (a difference below 2**16 per half, never 0 mod Q)
        for delta in (1, 2**16, 2**31):
            other = base._replace(**{name: (getattr(base, name) + delta) % 2**32})
            assert fp.lane_share(other) != fp.lane_share(base), (name, delta)


@pytest.mark.parametrize("library", ["numpy", "torch"])
@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("found", [False, True, "array0", "array3"])
def test_the_device_lane_equals_the_host_lane(library, scale, found):
    """The one-value message computed from the state arrays (a GPU rank's, here on the CPU): equal
    to the host's, whatever the fields (up to 2**32 - 1), the scale and the flag."""
    if library == "torch":
        torch = pytest.importorskip("torch")
        import array_api_compat

        xp, device = array_api_compat.array_namespace(torch.zeros(())), torch.device("cpu")
        to_array = lambda value, dtype: torch.tensor(np.asarray(value).tolist(), dtype=getattr(torch, dtype))  # noqa: E731
    else:
        xp, device = np, "cpu"
        to_array = lambda value, dtype: np.asarray(value, dtype)  # noqa: E731
    mine = _print(config=2**32 - 1, iteration=2**31 + 5, scale=fp.scale_bits(np.float32(scale)),
                  growth_tracker=2**31 - 1, backoff_tracker=65537)
    flag = found if isinstance(found, bool) else to_array(float(found[-1]), "float32")
    lane = fp.DeviceLane(xp, device)
    for rank, ranks, key in ((0, 2, 0), (1, 2, 7), (5, 1023, 2**40 + 1)):
        c = fp.coefficient(rank, ranks, key)
        want = fp.lane(fp.lane_share(mine), found not in (False, "array0"), rank, ranks, key)
        state = (to_array(np.float32(fp._from_bits(mine.scale)), "float32"),
                 to_array(mine.growth_tracker, "int32"), to_array(mine.backoff_tracker, "int32"))
        got = lane(fp.lane_share(mine[:fp.HOST_FIELDS]), flag, c, *state)
        assert str(got.dtype).endswith("int64") and tuple(got.shape) == (1,) and int(got[0]) == want
        assert int(lane(fp.lane_share(mine), flag, c)[0]) == want  # a host state: every field's share


def test_mulmod_is_exact():
    rng = np.random.default_rng(3)
    x = np.concatenate([rng.integers(0, fp.Q, 1000), [0, 1, fp.Q - 1]]).astype(np.int64)
    for k in (0, 1, 2**16 + 3, fp.Q - 1, fp.Q + 5, int(rng.integers(0, fp.Q))):
        assert fp.mulmod(k, x).tolist() == [k * int(v) % fp.Q for v in x]


def _lane_sum(prints: list[fp.Fingerprint], found, key: int) -> tuple[int, np.int64]:
    """Every rank's one value summed: exactly (a Python int) and as an int64 all-reduce sums it."""
    values = [fp.lane(fp.lane_share(p), bool(f), r, len(prints), key)
              for r, (p, f) in enumerate(zip(prints, found))]
    assert all(0 <= v < fp.B + fp.Q for v in values)
    return sum(values), np.sum(np.array(values, np.int64))


@pytest.mark.parametrize("ranks", [1, 2, 3, 64, fp.LANE_RANKS])
def test_the_one_value_sum_is_exact_and_its_flag_exact_up_to_1023_ranks(ranks):
    rng = np.random.default_rng(ranks)
    same = [_print()] * ranks
    for key in (0, 41, 2**40 + 3):
        last = np.eye(1, ranks, ranks - 1)[0]
        for found in (np.zeros(ranks), last, rng.integers(0, 2, ranks), np.ones(ranks)):
            exact, as_int64 = _lane_sum(same, found, key)
            assert exact == as_int64 < 2**63  # no int64 overflow, whatever the flags
            assert fp.lane_verdict(exact) == (True, bool(found.any()))


@pytest.mark.parametrize("ranks", [2, 3, 64, fp.LANE_RANKS])
def test_the_one_value_sum_finds_ranks_that_differ(ranks):
    """One rank off, two ranks whose differences cancel in a fixed linear sum (one an iteration
    ahead, one behind), half the ranks: for 50 collectives each, never aligned; the flag stays exact."""
    base = _print()
    ahead, behind = base._replace(iteration=13), base._replace(iteration=11)
    cases = [[base] * (ranks - 1) + [ahead], [ahead] + [base] * (ranks - 1),
             [base] * (ranks // 2) + [base._replace(scale=fp.scale_bits(32768.0))] * (ranks - ranks // 2)]
    if ranks > 2:
        cases.append([ahead, behind] + [base] * (ranks - 2))
    for prints in cases:
        for key in range(50):
            found = np.eye(1, ranks, key % ranks)[0]
            exact, as_int64 = _lane_sum(prints, found, key)
            assert exact == as_int64 and fp.lane_verdict(exact) == (False, True)


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
    scaler = LossScaler(LossScaleConfig(init_scale=4.0), reducer=Grid(fp.LANE_RANKS + 1))
    assert not scaler.step([np.ones(2, np.float32)], lambda: None).skipped
    assert scaler.reducer.sent == [("max", "float64", 2)]


@pytest.mark.parametrize("ranks", [2, 5])
def test_extras_slots_sum_every_ranks_values_in_rank_order(ranks):
    rng = np.random.default_rng(0)
    pairs = rng.random((ranks, 2)) * 10.0**rng.integers(-300, 300, (ranks, 1))
    messages = np.empty((ranks, 2 * ranks))
    for r in range(ranks):
        from polyamp._agreement import _fill_slots

        _fill_slots(messages[r], pairs[r], r)
    reduced = np.maximum.reduce(messages, axis=0)
    np.testing.assert_array_equal(reduced.reshape(ranks, 2), pairs)
    total = fp.gather_extras(reduced, ranks)
    want = pairs[0].copy()
    for row in pairs[1:]:
        want += row
    np.testing.assert_array_equal(total, want)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_non_finite_extra_keeps_the_sum_non_finite(bad):
    from polyamp._agreement import _fill_slots

    messages = np.empty((3, 6))
    for r, pair in enumerate(([1.0, 2.0], [bad, 3.0], [4.0, 5.0])):
        _fill_slots(messages[r], np.array(pair), r)
    total = fp.gather_extras(np.maximum.reduce(messages, axis=0), 3)
    assert not np.isfinite(total[0]) and total[1] == 10.0


class Ranks(Reducer):
    """Rank ``rank`` of ``size``, whose peers sent this rank's head (aligned) and ``peer_extras``."""

    def __init__(self, rank: int, size: int, peer_extras: np.ndarray) -> None:
        super().__init__("ranks", rank, size, None)
        self.peer_extras = peer_extras

    def _prepare(self, array):
        return array

    def _allreduce(self, buffer, op):
        from polyamp._agreement import _fill_slots

        assert op == "max"
        for r in range(self.size):
            if r != self.rank:  # the peer's message, built as polyamp builds it
                peer = np.array(buffer, copy=True)
                _fill_slots(peer[2:], self.peer_extras[r], r)
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


@pytest.mark.parametrize("found", [False, True, "array"])
def test_the_device_digest_of_a_host_state(found):
    """The trainer without loss scaling digests a fixed host state: every field's share on the host."""
    mine = _print(scale=fp.scale_bits(1.0), growth_tracker=0)
    flag = np.array(1.0, np.float32) if found == "array" else found
    got = fp.DeviceDigest(np, "cpu")(fp.shares(mine), flag)
    assert got.dtype == np.float64 and got.tolist() == list(fp.head(fp.digest(mine), bool(flag)))


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
            np.maximum(buffer, fp.head(fp.digest(self.other), False), out=buffer)
        elif buffer.dtype == np.int64:  # the one-value message, as rank 1 computes it from its fields
            buffer += fp.lane(fp.lane_share(self.other), False, 1, 2, self.other.sequence)
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
    other = fp.Fingerprint(config_fingerprint(config), 0, 1, 0, payload, 0, 0, fp.scale_bits(1.0), 0, 0)
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
