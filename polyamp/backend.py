"""A backend bound for use: one plugin's kernels as plain attributes, ready for the hot path."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any, NamedTuple


class BackendInfo(NamedTuple):
    """What ``polyamp.available_backends()`` reports for one installed backend."""

    name: str
    available: bool
    reason: str
    version: str | None


@dataclass(frozen=True)
class Backend:
    """One backend's kernels, bound once so each per-step call is a plain function call."""

    name: str
    version: str | None
    plugin: ModuleType
    owns_array: Callable[[Any], bool]
    full: Callable[[Any, str, Any], Any]
    scale_array: Callable[[Any, Any], Any]
    unscale_and_check: Callable[[Sequence[Any], Any, Any], None]
    all_finite: Callable[[Sequence[Any]], Any]
    cast: Callable[[Any, str], Any]
    update_scale: Callable[[Any, Any, Any], Any]
    read_flag: Callable[[Any], bool]
    to_host: Callable[[Any], float | int]
    accepts_array: Callable[[Any], bool]
    unscale_and_check_keep: Callable[[Sequence[Any], Any, Any], None]
    # what the core needs beside the kernels (optional hooks, array-API defaults)
    is_host: Callable[[Any], bool]
    host_view: Callable[[Any], Any]
    to_numpy: Callable[[Any], Any]
    from_host: Callable[..., Any]
    finite_flags: Callable[[Sequence[Any]], list[bool]]
    overflow_counts: Callable[[Any], tuple[int, int, int, float]]
    sum_of_squares: Callable[[Sequence[Any]], Any]
    pack: Callable[[Sequence[Any], Any], Any]
    precision_counts: Callable[[Sequence[Any], Any, Sequence[Any]], tuple[Any, Any]]
    unscale_and_squares: Callable[[Sequence[Any], Any, Any], Any] | None = None  # None: not fused here
    unscale_and_count: Callable[[Sequence[Any], Any, Any, Sequence[Any]], tuple[Any, Any]] | None = None
    axis_max: Callable[[Any, Any], Any] | None = None  # None: no named mapped axes (only JAX has them)

    def __repr__(self) -> str:
        return f"<polyamp backend {self.name!r} {self.version or ''}>".replace(" >", ">")
