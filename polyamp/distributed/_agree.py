"""Checks that every rank runs the same loss-scale config: one MAX all-reduce (a standalone check;
scalers carry the config fingerprint in every step's agreement instead)."""

from __future__ import annotations

import json
import zlib
from typing import Any

import numpy as np

from .._errors import ConfigError
from .._registry import backend_of
from ..config import LossScaleConfig
from ._reducer import Reducer


def config_fingerprint(config: LossScaleConfig) -> int:
    """A 32-bit checksum of every config field (the same on every rank for equal configs)."""
    return zlib.crc32(json.dumps(config.to_dict(), sort_keys=True).encode())


def check_same_config(reducer: Reducer, config: LossScaleConfig, like: Any = None) -> None:
    """Raise ConfigError on every rank unless all ranks hold an equal ``config``.

    One MAX all-reduce of ``[f, -f]`` (f the fingerprint): the ranks agree exactly when
    max(f) == -max(-f). The buffer lives where ``like`` lives (e.g. a CUDA tensor for NCCL);
    reading the result back is one host sync, done once per scaler.
    """
    mine = config_fingerprint(config)
    host = np.array([mine, -mine], dtype=np.float64)  # exact: |f| < 2**32
    buffer = _on_device_of(host, like)
    reducer.allreduce_max_(buffer)
    high, neg_low = (float(v) for v in to_host_array(buffer))
    if high != -neg_low:
        raise ConfigError(
            f"{reducer.describe()}: the ranks' loss-scale configs differ (fingerprints from "
            f"{int(-neg_low)} to {int(high)}; this rank's is {mine}: {config!r}). Every rank must "
            "build its scaler with the same config; fix the ranks whose settings differ."
        )


def _on_device_of(host: np.ndarray, like: Any) -> Any:
    """``host`` copied to ``like``'s library and device (its backend's ``from_host``)."""
    if like is None or isinstance(like, np.ndarray):
        return host
    return backend_of(like).from_host(host, like, None)


def to_host_array(buffer: Any) -> np.ndarray:
    """A small array's values in host memory (its backend's ``to_numpy``: a sync on a device)."""
    if isinstance(buffer, np.ndarray):
        return buffer
    return backend_of(buffer).to_numpy(buffer)
