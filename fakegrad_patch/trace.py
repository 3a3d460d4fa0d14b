"""Structured trace of every interception (private structlog pipeline).

Core code calls it as::

    if trace.enabled(trace.DEBUG):
        trace.emit("leaf_armed", trace.DEBUG, leaf_id=..., shape=...)

so that nothing (not even the keyword dict) is built when the level is filtered out.
"""

from __future__ import annotations

import collections
import os
import threading
import time
from typing import Any

SCHEMA_VERSION = 1
DEBUG, INFO, WARNING, ERROR = 10, 20, 30, 40
_LEVEL_NAMES = {"debug": DEBUG, "info": INFO, "warning": WARNING, "error": ERROR}
_NAMES_BY_LEVEL = {v: k for k, v in _LEVEL_NAMES.items()}

_lock = threading.Lock()
_buffer: collections.deque[dict[str, Any]] = collections.deque(maxlen=10_000)
_threshold = _LEVEL_NAMES.get(os.environ.get("FAKEGRAD_TRACE_LEVEL", "").lower(), WARNING)


def enabled(level: int) -> bool:
    """True when events of ``level`` are recorded somewhere."""
    return level >= _threshold


def emit(event: str, level: int, **fields: Any) -> None:
    """Record one event. Never pass tensors: shapes, dtypes, devices, ids and byte counts only."""
    if level < _threshold:
        return
    record = {
        "event": event,
        "level": _NAMES_BY_LEVEL.get(level, str(level)),
        "ts": time.time(),
        "schema": SCHEMA_VERSION,
        "pid": os.getpid(),
        "tid": threading.get_ident(),
        **fields,
    }
    with _lock:
        _buffer.append(record)


def events() -> list[dict[str, Any]]:
    """A copy of the in-memory buffer, oldest first."""
    with _lock:
        return list(_buffer)


def clear() -> None:
    with _lock:
        _buffer.clear()


def set_level(level: int | str) -> int:
    """Set the recording threshold; return the previous one."""
    global _threshold
    previous = _threshold
    _threshold = _LEVEL_NAMES[level.lower()] if isinstance(level, str) else int(level)
    return previous
