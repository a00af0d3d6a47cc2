"""The paddle facade's reducer= in one process: what it sends, a rank without gradients, copies.

The reducer is a one-rank ``polyamp.distributed.Reducer`` (the plugin contract over a group of
one) that keeps what it was sent; tests/distributed/test_paddle_agreement.py runs real ranks.
"""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest
from polyamp.compat.paddle import AmpScaler, GradScaler

from polyamp import ConfigError, Parameter
from polyamp.distributed import Reducer
from polyamp.distributed import _wire as wire
from polyamp.optim import SGD


class OneRank(Reducer):
    def __init__(self) -> None:
        super().__init__("one", 0, 1, None)
        self.sent: list[tuple[str, list]] = []

    def _prepare(self, array):
        return array

    def _allreduce(self, buffer, op):
        self.sent.append((op, np.asarray(buffer).reshape(-1).tolist()))

    def _barrier(self):
        pass


def _optimizer(grad: float) -> SGD:
    param = Parameter(np.ones(3, np.float32))
    param.grad = np.full(3, grad, np.float32)
    return SGD([param], lr=0.5)


@pytest.mark.parametrize("use_minimize", [False, True])
def test_one_collective_per_step_or_minimize_with_the_fingerprint(use_minimize, lanes, twins):
    for red in (OneRank(), twins(2)):  # a group of one sends its flag alone; two ranks the digest too
        lanes.clear()
        scaler = (AmpScaler if use_minimize else GradScaler)(init_loss_scaling=2.0, reducer=red)
        counts = []
        for grad in (2.0, np.inf, 2.0):
            before = red.collectives
            optimizer = _optimizer(grad)
            if use_minimize:
                scaler.minimize(optimizer)
            else:
                scaler.step(optimizer)
                scaler.update()
            counts.append(red.collectives - before)
            assert scaler.last_step_skipped == (grad == np.inf)
        assert counts == [1, 1, 1]
        assert [op for op, *_ in red.sent] == ["sum", "sum", "sum"]
        if red.size == 1:
            assert [values for _, values in red.sent] == [[0], [wire.B], [0]] and lanes == []
        else:
            assert {shape for _, shape, _ in red.sent} == {(1,)}  # f * B + (c * D mod Q)
            assert [f for f, _ in lanes] == [0.0, 1.0, 0.0]


def test_a_rank_without_gradients_sends_zero_and_steps():
    red = OneRank()
    scaler = GradScaler(reducer=red)
    param = Parameter(np.ones(2, np.float32))  # no gradient at all
    scaler.step(SGD([param], lr=0.5))
    scaler.update()
    assert red.sent[-1] == ("sum", [0]) and scaler.last_step_skipped is False


def test_a_disabled_scaler_sends_nothing():
    red = OneRank()
    scaler = GradScaler(enable=False, reducer=red)
    scaler.step(_optimizer(np.inf))
    scaler.update()
    assert red.collectives == 0


def test_a_deep_copy_shares_the_reducer_and_pickling_refuses_it():
    red = OneRank()
    scaler = GradScaler(reducer=red)
    scaler.step(_optimizer(1.0))
    scaler.update()
    twin = copy.deepcopy(scaler)
    assert twin.engine.reducer is red
    twin.step(_optimizer(1.0))
    assert red.collectives == 2  # one per step, the copy's too
    with pytest.raises(TypeError, match="cannot be pickled.*state_dict"):
        pickle.dumps(scaler)


def test_a_reducer_that_cannot_be_built_is_refused_at_once():
    with pytest.raises(ConfigError, match="cannot build a reducer"):
        GradScaler(reducer="no-such-engine")


def test_a_copy_taken_after_unscale_still_agrees_its_flag():
    red = OneRank()
    scaler = GradScaler(reducer=red)
    optimizer = _optimizer(np.inf)
    scaler.unscale_(optimizer)
    twin = copy.deepcopy(scaler)  # keeps the pending flag as a host bool
    before = red.collectives
    twin.step(optimizer)
    assert red.collectives - before == 1 and red.sent[-1] == ("sum", [wire.B])
    assert twin.last_step_skipped is True


@pytest.mark.parametrize("guarded", [False, True], ids=["flag", "guard"])
def test_paddle_tensors_off_the_host_agree_through_host_memory(monkeypatch, twins, guarded):
    """array_api_compat knows no paddle, so paddle tensors on a GPU (stood for here by CPU tensors the
    agreement takes for device arrays) build the message in host memory from their values: the same
    messages, skips and parameters as paddle tensors in host memory (it raised TypeError before)."""
    paddle = pytest.importorskip("paddle")
    import polyamp._agreement as agreement
    from polyamp import StepGuard

    def run() -> tuple[list, list, list]:
        red = twins(2)
        scaler = GradScaler(init_loss_scaling=4.0, reducer=red, guard=StepGuard() if guarded else None)
        param = paddle.create_parameter([3], "float32")
        param.set_value(paddle.ones([3]))
        optimizer = paddle.optimizer.SGD(learning_rate=0.5, parameters=[param])
        skipped = []
        for factor in (2.0, float("inf"), 3.0):
            loss = (param * factor).sum()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.clear_grad()
            skipped.append(scaler.last_step_skipped)
        return red.sent, skipped, param.numpy().tolist()

    host = run()
    real = agreement._is_host
    monkeypatch.setattr(agreement, "_is_host", lambda a: False if "paddle" in type(a).__module__ else real(a))
    assert run() == host
    assert host[1] == [False, True, False]
