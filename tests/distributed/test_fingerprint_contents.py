"""Every field that must be equal on every rank enters the fingerprint whole (issue 32, item 4).

Guard settings, guard histories and the config entered it as 32-bit CRCs, outside the documented
2**-41 bound: ``loss_zscore=3.976870283664759`` and ``3.522333217603794`` shared a CRC, as did
histories ending in ``1.0030881`` and ``1.0003943``, so ranks holding them agreed and one rank could
apply a step the others skipped. They enter as 128-bit content digests now, every 16-bit half
weighed as the scale's bits are. Real gloo ranks (3) and ``mpirun -n 3``.
"""

from __future__ import annotations

import json
import zlib

import numpy as np
import pytest

from polyamp import LossScaleConfig, StepGuard
from polyamp.distributed import _fingerprint as fp
from polyamp.distributed import config_fingerprint
from polyamp.guard import GuardHistory

#: The pairs the issue found (their CRC-32s are equal).
ZSCORES = (3.976870283664759, 3.522333217603794)
LAST = (1.0030881, 1.0003943)
PREFIX = [1.0, 1.01, 0.99, 1.02, 1.0]


def _history(last: float) -> GuardHistory:
    return GuardHistory(loss=(*PREFIX, last))


def test_the_pairs_share_a_crc32_but_not_a_digest():
    settings = [StepGuard(loss_zscore=z) for z in ZSCORES]
    crc = [zlib.crc32(repr((s.loss_zscore, s.grad_norm_zscore, s.max_grad_norm, s.window, s.history_needed,
                            s.max_consecutive_skips, s.on_streak)).encode()) for s in settings]
    assert crc[0] == crc[1]  # the collision the old fingerprint had
    assert settings[0].digest() != settings[1].digest()
    assert _history(LAST[0]).digest() != _history(LAST[1]).digest()
    assert max(s.digest() for s in settings) < 2**128


def test_content_fields_are_four_words_and_every_word_moves_the_digest():
    assert fp.WORDS[fp.FIELDS.index("config")] == fp.WORDS[fp.FIELDS.index("whose")] == 4
    base = fp.Fingerprint(config_fingerprint(LossScaleConfig()), 1, 1, 0, 0, 0, 2**127 + 5, 0x47800000, 0, 0)
    digest = fp.HOST.share(fp.HOST.fields(list(base)), fp.LANE)
    for name in ("config", "whose"):
        for word in range(4):  # a difference in any word (not only the low 32 bits) is seen
            other = base._replace(**{name: getattr(base, name) ^ (1 << (32 * word + 7))})
            assert fp.HOST.share(fp.HOST.fields(list(other)), fp.LANE) != digest, (name, word)


def test_a_config_digest_covers_every_field():
    a, b = LossScaleConfig(), LossScaleConfig(growth_factor=2.0000000000000004)
    assert json.dumps(a.to_dict()) != json.dumps(b.to_dict())
    assert config_fingerprint(a) != config_fingerprint(b) and config_fingerprint(a) == config_fingerprint(
        LossScaleConfig())


def colliding_run(rank: int, size: int, group: str, case: str) -> dict:
    from polyamp import LossScaleConfig, LossScaler, StepGuard
    from polyamp.distributed import reducer

    if case == "zscore":
        guard = StepGuard(loss_zscore=ZSCORES[0] if rank == 0 else ZSCORES[1], window=10, min_history=5)
    else:
        guard = StepGuard(loss_zscore=3.0, window=10, min_history=5)
    scaler = LossScaler(LossScaleConfig(init_scale=1.0, dynamic=False), reducer=reducer(group), guard=guard)
    if case == "history":  # ranks resumed from checkpoints whose histories differ in the last value
        last = LAST[0] if rank == 0 else LAST[1]
        scaler.load_state_dict({**scaler.state_dict(), "guard": _history(last).to_dict()})
    applied: list[int] = []
    for step in range(3):
        try:
            scaler.step([np.ones(2, np.float32)], lambda step=step: applied.append(step), loss=1.0)
            scaler.update()
        except Exception as exc:  # noqa: BLE001 - reported per rank
            return {"error": f"{type(exc).__name__}: {exc}", "applied": applied, "step": step}
    return {"error": None, "applied": applied, "step": 3}


def _check(results: list[dict]) -> None:
    assert len(results) == 3
    for rank, out in enumerate(results):
        assert (out["error"] or "").startswith("RankMismatchError"), (rank, out)
        assert "the flag of scaler/optimizer" in out["error"], (rank, out)
        assert out["step"] == 0 and out["applied"] == [], (rank, out)  # found before any rank applied


@pytest.mark.parametrize("case", ["zscore", "history"])
def test_colliding_guard_settings_and_histories_are_found_on_gloo(run_gloo, case):
    _check(run_gloo(colliding_run, 3, "torch", case).results())


@pytest.mark.parametrize("case", ["zscore", "history"])
def test_colliding_guard_settings_and_histories_are_found_under_mpi(run_mpi, case):
    _check(run_mpi(colliding_run, 3, "mpi", case).results())
