"""LossScaler(reducer=...) in one process: the order of agree_/step/update, what is sent, copies.

The reducer here is a one-rank ``polyamp.distributed.Reducer`` (the plugin contract, summing
over a group of one) that keeps what it was sent; tests/distributed/ runs real process groups.
"""

from __future__ import annotations

import copy
import pickle
import subprocess
import sys

import numpy as np
import pytest

from polyamp import ConfigError, LossScaleConfig, LossScaler, ScalerStateError, clip_grad_norm_, global_norm
from polyamp.distributed import Reducer, config_fingerprint
from polyamp.distributed import _fingerprint as fp
from polyamp.distributed import _wire as wire
from polyamp.policy import scale_bits


class OneRank(Reducer):
    """A group of one process: a sum or max over it is the array itself. Records what it sends."""

    def __init__(self) -> None:
        super().__init__("one", 0, 1, None)
        self.sent: list[tuple[str, str, tuple, list]] = []

    def _prepare(self, array):
        return array

    def _allreduce(self, buffer, op):
        values = np.asarray(buffer).reshape(-1).tolist()
        self.sent.append((op, str(buffer.dtype), tuple(buffer.shape), values))

    def _barrier(self):
        pass


def _head(values: list[float]) -> tuple[float, int]:
    """(f, d) from a one-rank message ``[4d + f, f - 4d, ...]`` (an agreement with extra values)."""
    a, b = values[:2]
    return (a + b) / 2, int((a - b) / 8)


def _digest(config, iteration, collective, sequence, scale, growth=0, extras=0, whose=0) -> int:
    """``whose``: the agreement's place among those made on its reducer's group (0: the first)."""
    mine = fp.Fingerprint(config_fingerprint(config), iteration, collective, sequence, 0, extras, whose,
                          scale_bits(scale), growth, 0)
    return fp.HOST.share(fp.HOST.fields(list(mine)), fp.LANE)


def _grads(bad: bool = False) -> list[np.ndarray]:
    grads = [np.full(3, 8.0, np.float32), np.full(2, -4.0, np.float32)]
    if bad:
        grads[1][0] = np.inf
    return grads


def test_one_collective_per_step_also_the_first_carrying_the_fingerprint(lanes, twins):
    config = LossScaleConfig(init_scale=4.0, growth_interval=2)
    for red in (OneRank(), twins(2)):  # a group of one sends its flag alone; two ranks the digest too
        lanes.clear()
        scaler = LossScaler(config, reducer=red)
        assert scaler.reducer is red
        counts, skipped = [], []
        for bad in (False, True, False):
            before = red.collectives
            result = scaler.step(_grads(bad), lambda: None)
            scaler.update()
            counts.append(red.collectives - before)
            skipped.append(result.skipped)
        assert counts == [1, 1, 1] and skipped == [False, True, False]
        if red.size == 1:
            assert [s[:3] for s in red.sent] == [("sum", "int64", (1,))] * 3  # one SUM of 1 value
            assert [s[3] for s in red.sent] == [[0], [wire.B], [0]] and lanes == []  # no fingerprint
            continue
        assert red.sent == [("sum", (1,), "int64")] * 3
        assert [f for f, _ in lanes] == [0.0, 1.0, 0.0]
        # the state as each step unscaled with it: 4 (growth 0), 4 (growth 1), then backed off to 2
        digests = [d for _, d in lanes]
        assert digests == [_digest(config, 0, 1, 0, 4.0), _digest(config, 1, 1, 1, 4.0, growth=1),
                           _digest(config, 2, 1, 2, 2.0)]


def test_agree_carries_extra_in_the_same_collective_and_step_sends_nothing_more():
    red = OneRank()
    scaler = LossScaler(reducer=red)
    scaler.step(_grads(), lambda: None)  # the first step: config check + flag
    scaler.update()
    before = red.collectives
    grads = _grads(bad=True)
    scaler.unscale_(grads)
    agreed = scaler.agree_(np.array([2.5, 0.25]))
    assert red.sent[-1][:3] == ("max", "float64", (4,)) and red.sent[-1][3][2:] == [2.5, 0.25]
    assert _head(red.sent[-1][3])[0] == 1.0
    np.testing.assert_array_equal(agreed.extra, [2.5, 0.25])
    assert agreed.found_inf.dtype == np.float32 and float(agreed.found_inf) == 1.0
    assert scaler.step(grads, lambda: pytest.fail("an overflowing step was applied")).skipped
    scaler.update()
    assert red.collectives - before == 2  # the first message with extra values is announced first


def test_clipping_rides_in_the_scalers_collective():
    red = OneRank()
    scaler = LossScaler(LossScaleConfig(init_scale=1.0), reducer=red)
    grads = [np.array([3.0, 0.0], np.float32), np.array([4.0], np.float32)]
    scaler.unscale_(grads)
    norm = clip_grad_norm_(grads, 1.0, scaler=scaler)
    # [count, 25, ...] in the step's collective (after the announcement of its length)
    assert float(norm) == 5.0 and red.collectives == 2
    assert red.sent[-1][:3] == ("max", "float64", (4,))
    assert red.sent[-1][3][2:] == [25.0, 25.0 * 2.0**-1024]  # [sum of squares, / 2**1024] in rank 0's slots
    np.testing.assert_allclose(np.concatenate(grads), [0.6, 0.0, 0.8], rtol=1e-6)
    scaler.step(grads, lambda: None)
    scaler.update()
    assert red.collectives == 2
    # a second norm in the same iteration would be a second collective: refused
    scaler.unscale_(grads)
    global_norm(grads, scaler=scaler)
    with pytest.raises(ScalerStateError, match="agree_\\(\\) was called twice"):
        global_norm(grads, scaler=scaler)


def test_a_rank_without_gradients_sends_zero_and_gets_the_global_norm():
    red = OneRank()
    scaler = LossScaler(reducer=red)
    scaler.unscale_([])
    norm = clip_grad_norm_([], 1.0, scaler=scaler)
    assert float(norm) == 0.0 and red.sent[-1][3][2:] == [0.0, 0.0] and _head(red.sent[-1][3])[0] == 0.0
    alone = LossScaler()
    alone.unscale_([])
    with pytest.raises(ConfigError, match="no gradients"):  # without a reducer: nothing to take part in
        clip_grad_norm_([], 1.0, scaler=alone)


@pytest.mark.parametrize("value", [3e200, 1e-300, 5.0])
def test_finite_float64_gradients_keep_a_finite_norm_across_ranks(value):
    """The squares of float64 values can overflow (3e200**2) or underflow; the pair sent keeps both."""
    grads = [np.array([3.0 * value, 4.0 * value]), np.array([0.0])]
    scaler = LossScaler(LossScaleConfig(init_scale=1.0), reducer=OneRank())
    scaler.unscale_(grads)
    norm = float(global_norm(grads, scaler=scaler))
    assert norm == pytest.approx(5.0 * value, rel=4 * 2.0**-53)  # a few float64 roundings
    scaler.step(grads, lambda: None)
    scaler.update()
    scaler.unscale_(grads)
    norm = clip_grad_norm_(grads, 1.0, scaler=scaler)
    assert np.isfinite(norm) and float(np.linalg.norm(np.concatenate(grads))) <= 1.0 + 1e-6


def test_update_without_step_agrees_the_flag():
    red = OneRank()
    scaler = LossScaler(LossScaleConfig(init_scale=8.0), reducer=red)
    scaler.unscale_(_grads(bad=True))
    scaler.update()
    assert red.collectives == 1 and scaler.get_scale() == 4.0


@pytest.mark.parametrize("when", ["before any unscale_()", "twice", "after step()"])
def test_agree_out_of_order_is_refused_and_changes_nothing(when):
    red = OneRank()
    scaler = LossScaler(reducer=red)
    if when != "before any unscale_()":
        scaler.unscale_(_grads())
    if when == "twice":
        scaler.agree_()
    if when == "after step()":
        scaler.step([], lambda: None)
    sent = red.collectives
    with pytest.raises(ScalerStateError) as info:
        scaler.agree_()
    assert f"agree_() was called {when} in this iteration" in str(info.value)
    assert red.collectives == sent


def test_flags_added_after_agree_are_refused():
    scaler = LossScaler(reducer=OneRank())
    scaler.unscale_(_grads())
    scaler.agree_()
    with pytest.raises(ScalerStateError, match="after agree_\\(\\)"):
        scaler.record_found_inf(np.float32(1.0))
    assert not scaler.step([], lambda: None).skipped  # the agreed flag stands


def test_agree_without_a_reducer_sends_nothing_and_returns_the_local_values():
    scaler = LossScaler()
    flag = scaler.unscale_(_grads(bad=True))
    extra = np.array([1.0])
    agreed = scaler.agree_(extra)
    assert agreed.found_inf is flag and agreed.extra is extra
    assert scaler.step([], lambda: None).skipped


def test_copies_share_the_reducer_and_pickling_refuses_it(lanes, twins):
    red = twins(2)  # two ranks: the messages carry the fingerprint
    scaler = LossScaler(reducer=red)
    scaler.step(_grads(), lambda: None)
    scaler.update()
    twin = copy.deepcopy(scaler)
    assert twin.reducer is red and twin.get_scale() == scaler.get_scale()
    twin.step(_grads(), lambda: None)
    assert red.collectives == 2  # one per step, the copy's first included
    config, scale = twin.config, twin.get_scale()
    # a copy counts its own iterations
    assert lanes[-1][1] == _digest(config, 0, 1, 1, scale, growth=1, whose=1)  # the 2nd on red
    with pytest.raises(TypeError, match="cannot be pickled.*state_dict"):
        pickle.dumps(scaler)
    plain = pickle.loads(pickle.dumps(LossScaler()))
    assert plain.reducer is None


def test_a_bad_reducer_is_refused_when_the_scaler_is_built():
    with pytest.raises(TypeError, match="cannot build a reducer from"):
        LossScaler(reducer=object())
    with pytest.raises(ConfigError, match="cannot build a reducer"):
        LossScaler(reducer="no-such-engine")


def test_import_polyamp_stays_free_of_distributed_torch_and_mpi4py():
    code = (
        "import sys, numpy as np, polyamp\n"
        "s = polyamp.LossScaler()\n"
        "s.step([np.ones(2, np.float32)], lambda: None); s.update()\n"
        "print(sorted({'polyamp.distributed', 'torch', 'mpi4py', 'paddle'} & set(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_agree_before_any_array_fingerprints_the_host_state():
    """A flag recorded before any gradient (a NumPy scalar: no state arrays yet) is agreed with
    the host state in the fingerprint (it used to read None's scale and raise a TypeError)."""
    scaler = LossScaler(reducer=OneRank())
    scaler.record_found_inf(np.float32(1.0))
    agreed = scaler.agree_()
    assert float(agreed.found_inf) == 1.0
    scaler.update()
    assert scaler.get_scale() == 2.0**15
