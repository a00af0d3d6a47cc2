"""One entry-point group as a pluggy plugin manager: shared by backend and reducer discovery."""

from __future__ import annotations

from collections.abc import Sequence
from importlib.metadata import entry_points
from typing import Any

import pluggy

from . import _hookspecs


class PluginSet:
    """The plugins of one entry-point group, plus those that failed to load (and why).

    A broken plugin is recorded, never raised: it must not break discovery of the others.
    """

    def __init__(
        self, specs: Any, group: str, required: Sequence[str], kind: str, broken_prefix: str = ""
    ) -> None:
        self.manager = pluggy.PluginManager(_hookspecs.PROJECT)
        self.manager.add_hookspecs(specs)
        self.required, self.kind = tuple(required), kind
        self.broken: dict[str, str] = {}
        seen: set[str] = set()
        for ep in entry_points(group=group):
            if ep.name in seen:
                continue
            seen.add(ep.name)
            try:
                self.register(ep.load(), ep.name)
            except Exception as exc:  # noqa: BLE001 - recorded and reported where it matters
                self.broken[ep.name] = f"{broken_prefix}{type(exc).__name__}: {exc}"

    def register(self, module: Any, name: str) -> None:
        """Register one plugin module after checking it implements the required hooks."""
        missing = [h for h in self.required if not callable(getattr(module, h, None))]
        if missing:
            raise TypeError(f"{self.kind} plugin {name!r} lacks required hooks {missing}")
        self.manager.register(module, name=name)
