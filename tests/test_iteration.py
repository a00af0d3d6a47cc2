"""The iteration written once (polyamp/_iteration.py): what every shell relies on.

Black-box where possible: the engine and both facades drive the same Iteration, so a failure of a
report or a log handler must leave each of them with a closed iteration and a scale moved once.
"""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest
import torch
from polyamp.compat.paddle import GradScaler as PaddleScaler
from polyamp.compat.torch import GradScaler as TorchScaler

import polyamp
from polyamp import LossScaler
from polyamp._iteration import Checks, Iteration


class Boom(logging.Handler):
    """A log handler that raises on every record (a broken handler in a user's logging setup)."""

    def emit(self, record: logging.LogRecord) -> None:
        raise RuntimeError("handler failed")

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 - logging's name
        raise  # noqa: PLE0704 - re-raise what emit raised, as logging.raiseExceptions would not


@pytest.fixture
def raising_handler():
    logger = logging.getLogger("polyamp")
    handler, level = Boom(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield
    logger.removeHandler(handler)
    logger.setLevel(level)


def test_a_raising_log_handler_moves_the_scale_once_and_closes_the_iteration(raising_handler):
    scaler = LossScaler(init_scale=64.0, backend="numpy")
    grads = [np.array([np.inf], np.float32)]
    assert not scaler.step(grads, lambda: None)
    with pytest.raises(RuntimeError, match="handler failed"):
        scaler.update()  # the first skip's INFO line reaches the broken handler
    assert scaler.get_scale() == 32.0 and not scaler.has_pending_check
    with pytest.raises(polyamp.ScalerStateError, match="no inf checks"):
        scaler.update()  # a retry finds the iteration closed: no second backoff
    assert scaler.get_scale() == 32.0
    assert scaler.step([np.ones(1, np.float32)], lambda: None)  # the loop goes on
    scaler.update()


@pytest.mark.parametrize("facade", ["torch", "paddle"])
def test_a_raising_log_handler_leaves_each_facade_usable(raising_handler, facade):
    param = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([param], lr=0.1)
    if facade == "torch":
        scaler = TorchScaler("cpu", init_scale=64.0)
    else:
        scaler = PaddleScaler(init_loss_scaling=64.0)
    scaler.scale(torch.ones(()))
    param.grad = torch.tensor([math.inf, 1.0])
    scaler.step(opt)
    with pytest.raises(RuntimeError, match="handler failed"):
        scaler.update()
    assert scaler.get_scale() == 32.0 if facade == "torch" else float(scaler.state_dict()["scale"][0]) == 32.0
    param.grad = torch.ones(2)
    scaler.step(opt)  # no "already stepped": the iteration ended
    scaler.update()
    assert torch.equal(param.detach(), torch.full((2,), -0.1 / 32))  # unscaled by the backed-off scale


def test_a_report_that_cannot_be_built_warns_and_never_leaves_the_iteration_open(caplog):
    """torch sparse COO gradients unscale, but the report's counts do not support them."""
    scaler = LossScaler(init_scale=8.0, backend="torch", diagnose=True)
    grad = torch.sparse_coo_tensor([[0, 2]], torch.tensor([math.inf, 1.0]), (4,), check_invariants=True)
    with caplog.at_level(logging.WARNING, logger="polyamp"):
        result = scaler.step([grad], lambda: pytest.fail("a skipped step must not apply"))
    assert result.skipped and scaler.last_overflow is None
    assert any("could not be built" in r.getMessage() for r in caplog.records)
    scaler.update()
    assert scaler.get_scale() == 4.0 and not scaler.has_pending_check
    dense = [torch.ones(3)]
    assert scaler.step(dense, lambda: None) and scaler.last_overflow is None
    scaler.update()


def test_make_scaler_takes_the_same_keywords_enabled_or_not():
    for enabled in (True, False):
        scaler = polyamp.make_scaler(enabled=enabled, diagnose=True, init_scale=8.0)
        assert scaler.last_overflow is None and scaler.enabled is enabled
    with pytest.raises(TypeError, match="diagnose must be True or False"):
        polyamp.make_scaler(enabled=False, diagnose="yes")


def test_checks_are_one_frozen_value_replaced_as_the_iteration_moves_on():
    scaler = LossScaler(init_scale=8.0, backend="numpy")
    iteration = scaler.iteration
    assert iteration.checks == Checks()
    scaler.unscale_([np.ones(2, np.float32)])
    first = iteration.checks
    assert first.unscaled and first.found is not None and first.skipped is None
    with pytest.raises(AttributeError):
        first.unscaled = False  # immutable
    scaler.step([], lambda: None)
    assert iteration.checks is not first and iteration.checks.skipped is False and first.skipped is None
    scaler.update()
    assert iteration.checks == Checks() and iteration.steps == 1


def test_every_shell_drives_the_same_iteration_type():
    torch_scaler = TorchScaler("cpu")
    paddle_scaler = PaddleScaler()
    for shell in (LossScaler(), torch_scaler.engine, paddle_scaler.engine):
        assert type(shell.iteration) is Iteration


@pytest.mark.parametrize("flag, error", [("x", TypeError), (None, TypeError), (np.ones(3), ValueError)])
def test_record_found_inf_refuses_what_is_no_flag_naming_it(flag, error):
    scaler = LossScaler(backend="numpy")
    scaler.unscale_([np.ones(2, np.float32)])
    with pytest.raises(error, match="record_found_inf\\(\\) needs flag"):
        scaler.record_found_inf(flag)
    scaler.record_found_inf(True)  # a host bool is a flag too
    assert scaler.step([], lambda: None).skipped


def test_agree_refuses_an_extra_that_is_no_array():
    scaler = LossScaler(backend="numpy")
    scaler.unscale_([np.ones(2, np.float32)])
    with pytest.raises(TypeError, match="agree_\\(\\) needs extra to be an array"):
        scaler.agree_(extra=[1.0])
    assert scaler.agree_(extra=np.zeros(2)).extra is not None  # nothing changed: the call works after
