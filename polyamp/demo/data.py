"""The demo's dataset, generated in code: interleaved spirals (Lang and Witbrock's two-spirals
problem, with ``classes`` arms as in CS231n), a classic that no linear model solves.
"""

from __future__ import annotations

import numpy as np

from polyamp._errors import ConfigError

__all__ = ["spirals"]


def spirals(n: int, *, classes: int = 3, turns: float = 1.0, noise: float = 0.1,
            seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``n`` points of ``classes`` interleaved spiral arms (``turns`` windings, Gaussian angle
    noise): float32 (n, 2) inputs, int64 labels."""
    for name, value in (("n", n), ("classes", classes)):
        if isinstance(value, bool) or not isinstance(value, int) or value < (1 if name == "n" else 2):
            raise ConfigError(f"{name} must be an int >= {1 if name == 'n' else 2}, got {name}={value!r}")
    if not (turns > 0 and noise >= 0):
        raise ConfigError(f"turns must be > 0 and noise >= 0, got turns={turns!r}, noise={noise!r}")
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, classes, n)
    radius = rng.uniform(0.1, 1.0, n)
    angle = 2 * np.pi * (labels / classes + turns * radius) + noise * rng.standard_normal(n)
    points = np.stack([radius * np.sin(angle), radius * np.cos(angle)], axis=1)
    return points.astype(np.float32), labels.astype(np.int64)
