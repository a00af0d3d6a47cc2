"""Checks that every rank runs the same loss-scale config: one MAX all-reduce (a standalone check;
scalers carry the config fingerprint in every step's agreement instead)."""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from .._digest import BITS, content_digest
from .._errors import ConfigError
from .._registry import backend_of
from ..config import LossScaleConfig
from ._reducer import Reducer


def config_fingerprint(config: LossScaleConfig) -> int:
    """A 128-bit digest of every config field (the same on every rank for equal configs; two
    different configs share one with probability 2**-128)."""
    return content_digest(json.dumps(config.to_dict(), sort_keys=True).encode())


def check_same_config(reducer: Reducer, config: LossScaleConfig, like: Any = None) -> None:
    """Raise ConfigError on every rank unless all ranks hold an equal ``config``.

    One MAX all-reduce of ``[w, -w]`` (w the fingerprint's 32-bit words): the ranks agree exactly
    when max(w) == -max(-w) for every word. The buffer lives where ``like`` lives (e.g. a CUDA
    tensor for NCCL); reading the result back is one host sync, done once per scaler.
    """
    mine = config_fingerprint(config)
    words = [(mine >> shift) & 0xFFFFFFFF for shift in range(0, BITS, 32)]
    buffer = np.array([*words, *(-w for w in words)], dtype=np.float64)  # exact: |w| < 2**32
    if like is not None and not isinstance(like, np.ndarray):
        buffer = backend_of(like).from_host(buffer, like, None)
    reducer.allreduce_max_(buffer)
    sums = to_host_array(buffer)
    high, neg_low = sums[:len(words)], sums[len(words):]
    if np.any(high != -neg_low):
        raise ConfigError(
            f"{reducer.describe()}: the ranks' loss-scale configs differ (this rank's fingerprint is "
            f"{mine:#x}: {config!r}). Every rank must build its scaler with the same config; fix the "
            "ranks whose settings differ."
        )


def to_host_array(buffer: Any) -> np.ndarray:
    """A small array's values in host memory (its backend's ``to_numpy``: a sync on a device)."""
    if isinstance(buffer, np.ndarray):
        return buffer
    return backend_of(buffer).to_numpy(buffer)
