"""What the dispatch path did in this process: counted (``status()["propagation"]``) and traced."""

from __future__ import annotations

from typing import Any

from ... import trace


class Settings:
    """The ``propagation`` setting, as the dispatch path's parts read it."""

    __slots__ = ("fast", "repair")

    def __init__(self) -> None:
        #: the repairs are on (``propagation="fast"`` or ``"repair"``)
        self.repair = True
        #: the fast path is on (``propagation="fast"``)
        self.fast = True


class Stats:
    """Repairs and rebuilds by kind, and the ops that took the fast path (statistics: a lost
    increment under threads is harmless)."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.fast_ops = 0

    def fast(self, func: Any) -> None:
        self.fast_ops += 1
        if trace.enabled(trace.DEBUG):
            trace.emit("propagation_fast", trace.DEBUG, op=str(func))

    def report(self, kind: str, event: str, func: Any, **fields: Any) -> None:
        """A repair or rebuild done on ``func``: counted and traced at info."""
        self.counts[kind] = self.counts.get(kind, 0) + 1
        if trace.enabled(trace.INFO):
            trace.emit(event, trace.INFO, op=str(func), **fields)
