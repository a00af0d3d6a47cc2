"""A recorded flag is "non-zero means skip" across ranks too: NaN and negative flags skip every rank.

``record_found_inf`` takes any non-zero flag as a bad step (``norm * 0`` is NaN for a non-finite
norm); the local decision (``read_flag``) and the device agreement read it so, and the host
agreement must too, or the ranks apply a step a single process would skip. The host and
device paths of the same check: test_fingerprint.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from polyamp import LossScaleConfig, LossScaler

FLAGS = [float("nan"), -1.0]


def _step(scaler: LossScaler, flag: float | None, applied: list[int]) -> bool:
    if flag is not None:
        scaler.record_found_inf(np.float32(flag))
    skipped = scaler.step([np.full(3, 8.0, np.float32)], lambda: applied.append(1)).skipped
    scaler.update()
    return bool(skipped)


def flag_on_rank_0(rank: int, size: int, group: str, flag: float) -> tuple[bool, float, int]:
    scaler = LossScaler(LossScaleConfig(init_scale=4.0), reducer=group)
    applied: list[int] = []
    skipped = _step(scaler, flag if rank == 0 else None, applied)
    return skipped, scaler.get_scale(), len(applied)


@pytest.mark.parametrize("flag", FLAGS)
def test_a_non_zero_flag_on_one_rank_skips_every_rank_gloo(run_gloo, flag):
    assert run_gloo(flag_on_rank_0, 2, "torch", flag).results() == [(True, 2.0, 0)] * 2
