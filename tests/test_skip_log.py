"""Logs that scale: the first skipped steps one INFO line each, then one INFO summary per window.

Long runs (5000 steps, a skip every 250) through the engine and both facades, counting the
``polyamp`` logger's records per level; and the scale reads that logging costs.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from polyamp.compat.paddle import GradScaler as PaddleScaler
from polyamp.compat.torch import GradScaler as TorchScaler

from polyamp import LossScaler, Parameter, _skip_log
from polyamp._scaling import Scaling
from polyamp.optim import SGD

STEPS, EVERY = 5000, 250  # skips at updates 250, 500, ..., 5000: 20 of them
# The first 3 skips (2**16 -> 2**13) one line each; skip 4 (update 1000) opens a window of 1000
# updates holding 4 skips, closed at update 1999; so do 2000, 3000, 4000; 5000's is still open.
SUMMARIES = [f"4 skipped steps in the last 1000 steps, loss scale 2**{k} -> 2**{k - 4} (each step's line "
             "is at DEBUG level)" for k in (13, 9, 5, 1)]


def engine_run() -> LossScaler:
    scaler = LossScaler(init_scale=2.0**16, growth_interval=10**6, backend="numpy")
    grad = np.ones(4, np.float32)
    for i in range(1, STEPS + 1):
        grad[0] = np.inf if i % EVERY == 0 else 1.0
        scaler.step([grad], lambda: None)
        scaler.update()
    return scaler


def torch_run() -> TorchScaler:
    param = torch.nn.Parameter(torch.zeros(4))
    opt = torch.optim.SGD([param], lr=0.0)
    scaler = TorchScaler("cpu", init_scale=2.0**16, growth_interval=10**6)
    for i in range(1, STEPS + 1):
        scaler.scale(torch.ones(()))
        param.grad = torch.full((4,), torch.inf if i % EVERY == 0 else 1.0)
        scaler.step(opt)
        scaler.update()
    return scaler


def paddle_run() -> PaddleScaler:
    param = Parameter(np.zeros(4, np.float32))
    opt = SGD([param], lr=0.0)
    scaler = PaddleScaler(init_loss_scaling=2.0**16, incr_every_n_steps=10**6, decr_every_n_nan_or_inf=1)
    for i in range(1, STEPS + 1):
        scaler.scale(np.float32(1.0))
        param.grad = np.full(4, np.inf if i % EVERY == 0 else 1.0, np.float32)
        scaler.minimize(opt)
    return scaler


RUNS = {"engine": engine_run, "torch": torch_run, "paddle": paddle_run}


def records(caplog, level):
    return [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "polyamp" and r.levelno >= level]


@pytest.mark.parametrize("run", list(RUNS))
def test_a_long_run_writes_three_lines_then_a_summary_per_window(run, caplog):
    with caplog.at_level(logging.INFO, logger="polyamp"):
        RUNS[run]()
    logged = records(caplog, logging.INFO)
    assert len(logged) == 3 + 4, logged
    assert all(level == logging.INFO for level, _ in logged)
    assert [text for _, text in logged[3:]] == SUMMARIES
    first = [text for _, text in logged[:3]]
    assert "65536 -> 32768" in first[0] and "16384 -> 8192" in first[2]


@pytest.mark.parametrize("run", list(RUNS))
def test_at_debug_every_skipped_step_still_has_its_line(run, caplog):
    with caplog.at_level(logging.DEBUG, logger="polyamp"):
        RUNS[run]()
    logged = records(caplog, logging.DEBUG)
    debug = [text for level, text in logged if level == logging.DEBUG]
    assert len(debug) == STEPS // EVERY - 3  # the skips after the first three, one line each
    assert "8192 -> 4096" in debug[0] and "0.125 -> 0.0625" in debug[-1]
    assert [text for level, text in logged if level == logging.INFO][3:] == SUMMARIES


def test_logging_reads_the_scale_only_when_a_line_is_due(monkeypatch, caplog):
    """Logging off: only the floor check's read on each skipped step (20). INFO on: one more for
    each of the first 3 skips (the state before; the one after is the rule's on it, not read), one
    per window opened and one per window closed (5 + 4); none on the steps in between."""
    reads = []
    real = Scaling.host_state  # every read of the state, the engine's and the facades' alike
    monkeypatch.setattr(Scaling, "host_state", lambda self: reads.append(1) or real(self))
    with caplog.at_level(logging.WARNING, logger="polyamp"):
        engine_run()
    assert len(reads) == STEPS // EVERY
    reads.clear()
    with caplog.at_level(logging.INFO, logger="polyamp"):
        engine_run()
    assert len(reads) == STEPS // EVERY + 3 + 5 + 4


def test_the_torch_facade_logs_a_growth_at_debug(caplog):
    param = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([param], lr=0.0)
    scaler = TorchScaler("cpu", init_scale=8.0, growth_interval=2)
    with caplog.at_level(logging.DEBUG, logger="polyamp"):
        for _ in range(4):
            scaler.scale(torch.ones(()))
            param.grad = torch.ones(2)
            scaler.step(opt)
            scaler.update()
    assert records(caplog, logging.DEBUG) == [
        (logging.DEBUG, "loss scale grew 8 -> 16"), (logging.DEBUG, "loss scale grew 16 -> 32")]


def test_a_detail_is_appended_to_a_skipped_steps_line(caplog):
    log = _skip_log.SkipLog(first=1, window=2)
    with caplog.at_level(logging.INFO, logger="polyamp"):
        log.after_update(True, 4.0, lambda: 2.0, lambda s, b, a: f"skipped {b:g} -> {a:g}", " (in w1)")
        log.after_update(True, 2.0, lambda: 1.0, lambda s, b, a: f"skipped {b:g} -> {a:g}", " (in w1)")
        log.after_update(False, None, lambda: 1.0, lambda s, b, a: None)
    assert records(caplog, logging.INFO) == [
        (logging.INFO, "skipped 4 -> 2 (in w1)"),
        (logging.INFO, "1 skipped steps in the last 2 steps, loss scale 2**1 -> 2**0 (each step's line "
                       "is at DEBUG level)"),
    ]


def test_scale_text_writes_powers_of_two_as_such():
    assert [_skip_log.scale_text(s) for s in (2.0**14, 2.0**-3, 1.0, 3.0, 0.1)] == [
        "2**14", "2**-3", "2**0", "3", "0.1"]


def test_a_backoff_the_host_did_not_read_is_not_called_growth(caplog):
    """A fused optimizer decides the skip itself: the torch facade sees the scale fall, not grow."""
    param = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.Adam([param], lr=0.0, fused=True)
    scaler = TorchScaler("cpu", init_scale=8.0)
    with caplog.at_level(logging.DEBUG, logger="polyamp"):
        scaler.scale(torch.ones(()))
        param.grad = torch.full((2,), torch.inf)
        scaler.step(opt)
        scaler.update()
    assert scaler.get_scale() == 4.0
    assert records(caplog, logging.DEBUG) == [
        (logging.DEBUG, "overflow in gradients: loss scale backed off 8 -> 4")]


def test_at_debug_an_applied_step_reads_the_state_once(monkeypatch, caplog):
    """A growth line needs the state before the update; the one after is the rule's on it."""
    reads = []
    real = Scaling.host_state
    monkeypatch.setattr(Scaling, "host_state", lambda self: reads.append(1) or real(self))
    scaler = LossScaler(init_scale=8.0, growth_interval=2, backend="numpy")
    with caplog.at_level(logging.DEBUG, logger="polyamp"):
        for _ in range(4):
            scaler.step([np.ones(2, np.float32)], lambda: None)
            scaler.update()
    assert len(reads) == 4  # one per update (it was two)
    assert [r.getMessage() for r in caplog.records if r.name == "polyamp"] == [
        "loss scale grew 8 -> 16", "loss scale grew 16 -> 32"]
