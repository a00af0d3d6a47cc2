"""check_same_config: equal configs pass, a rank with another config makes every rank raise."""

from __future__ import annotations

import pytest


def same_or_not(rank: int, size: int, odd_rank: int | None) -> dict:
    import torch

    from polyamp import ConfigError, LossScaleConfig
    from polyamp.distributed import check_same_config, reducer

    red = reducer("torch")
    config = LossScaleConfig(growth_interval=3 if rank == odd_rank else 2000)
    try:
        check_same_config(red, config, like=torch.zeros(()))
        return {"ok": True, "collectives": red.collectives}
    except ConfigError as exc:
        return {"ok": False, "message": str(exc), "collectives": red.collectives}


@pytest.mark.parametrize("odd_rank", [None, 0, 2])
def test_every_rank_sees_a_config_mismatch(run_gloo, odd_rank):
    results = run_gloo(same_or_not, 3, odd_rank).results()
    assert all(r["collectives"] == 1 for r in results)
    if odd_rank is None:
        assert all(r["ok"] for r in results)
    else:
        assert not any(r["ok"] for r in results)
        assert all("configs differ" in r["message"] for r in results)
