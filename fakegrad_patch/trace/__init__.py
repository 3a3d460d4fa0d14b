"""Structured trace of every interception, through a private structlog pipeline.

Core code calls it as::

    if trace.enabled(trace.DEBUG):
        trace.emit("leaf_armed", trace.DEBUG, leaf_id=..., shape=...)

so that nothing (not even the keyword dict) is built when the level is filtered out:
``enabled`` is one integer comparison against a module global.

Where events go (docs/trace-schema.md lists every event and key):

* an in-memory bounded buffer, always (``events()``, ``clear()``);
* ``capture()`` blocks, each at its own level (the pytest fixture uses one);
* one optional sink: a JSONL file (``FAKEGRAD_TRACE=path`` or ``configure_trace(path=...)``),
  rotated to ``path.1`` at ``max_bytes`` (``FAKEGRAD_TRACE_MAX_BYTES``), or stderr
  (``FAKEGRAD_TRACE=-``).

Why it is cheap: trace at ``info`` is what people turn on while debugging a real model, so its
cost per event must not change the timing they are looking at. The structlog logger and its
level methods are built once per configuration and cached here; one processor does the rest
(``_pipeline``). Events never carry tensors: anything that is not plain data is recorded as
``"<TypeName>"``, without calling its ``repr`` (slow, and it can re-enter fake dispatch).

The parts: ``_env`` (levels, :class:`TraceConfig`, the environment), ``_sinks`` (file, stderr),
``_pipeline`` (envelope, buffer and captures, renderer, the structlog logger); this module holds
the configuration in force and the public functions.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
from collections import deque
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Final

from .. import _config as _settings
from . import _env, _pipeline, _sinks
from ._env import (
    DEBUG,
    DEFAULT_BUFFER_SIZE,
    DEFAULT_MAX_BYTES,
    ENV_JSON,
    ENV_LEVEL,
    ENV_MAX_BYTES,
    ENV_PATH,
    ENVELOPE_KEYS,
    ERROR,
    INFO,
    SCHEMA_VERSION,
    WARNING,
    TraceConfig,
    parse_level,
    parse_max_bytes,
)

__all__ = [
    "DEBUG",
    "DEFAULT_BUFFER_SIZE",
    "DEFAULT_MAX_BYTES",
    "ENVELOPE_KEYS",
    "ENV_JSON",
    "ENV_LEVEL",
    "ENV_MAX_BYTES",
    "ENV_PATH",
    "ERROR",
    "INFO",
    "SCHEMA_VERSION",
    "WARNING",
    "TraceConfig",
    "capture",
    "clear",
    "configure_trace",
    "current_config",
    "emit",
    "emit_fields",
    "enabled",
    "events",
    "json_backend",
    "parse_level",
    "parse_max_bytes",
    "restore",
    "set_level",
    "sink_problem",
]

_KEEP: Final[Any] = object()  # "argument not given" for configure_trace(path=...)


def _sink_failed(path: str, reason: str) -> None:
    """A file sink gave up (it warned already): trace it, for the buffer and captures."""
    emit("trace_sink_failed", ERROR, path=path, error=reason)


# -- the configuration in force -------------------------------------------------------------------
# ``_threshold`` and ``_methods`` are read without the lock by the per-op calls below; they are
# replaced (never changed in place) under ``_lock``, with the pipeline's targets.

_lock = threading.RLock()
_config: TraceConfig = _env.config_from_env()
_pipeline.buffer = deque(maxlen=_config.buffer_size)
# nothing is opened before the first event
_pipeline.sink = _sinks.make_sink(_config, _sink_failed, _pipeline.render_line)
#: the lowest level anything wants: the buffer, the sink or a capture block
_threshold: int = _config.effective_level
_pipeline.buffer_level = _config.effective_level
#: level -> the cached structlog bound logger's method for it (-1: the logger); emptied on
#: every configuration change and rebuilt on the next event that passes the filter
_methods: dict[int, Callable[..., Any]] = {}


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.RLock()  # the parent's may be held by a thread the child does not have


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _recompute_threshold() -> None:
    """Lowest level anything wants; called with ``_lock`` held."""
    global _threshold
    _pipeline.buffer_level = _config.effective_level
    _threshold = min([_config.effective_level, *(level for level, _ in _pipeline.captures)])


def _method_for(level: int) -> Callable[..., Any]:
    """The cached bound logger's method for ``level`` (built on first use per configuration)."""
    # structlog is imported before the lock is taken: an import while holding a lock can deadlock
    import structlog  # noqa: F401

    with _lock:
        method = _methods.get(level)
        if method is None:
            logger = _methods.get(-1)
            if logger is None:
                logger = _pipeline.build_logger(_threshold)
            name = _env.NAMES_BY_LEVEL.get(_pipeline.floor_level(level) or DEBUG, "debug")
            method = getattr(logger, name)
            _methods.update({-1: logger, level: method})
    return method


# -- recording events -----------------------------------------------------------------------------


#: True while the sink is a JSONL file: the patch's hot paths then :func:`hold` its lines (a
#: module global, read without a lock: one attribute read where no file is traced)
file_sink_on: bool = type(_pipeline.sink) is _sinks.FileSink


def hold() -> _sinks.FileSink | None:
    """Hold this thread's lines for the file sink until :func:`release` (the patch's outermost
    op of a propagating mode and its armed backward calls): written with one ``os.write`` when
    the outermost hold ends (or every 512 lines) instead of one per line. ``None`` (nothing to
    release) where the sink is not a working file. Pass the result to :func:`release`. Never
    raises."""
    sink = _pipeline.sink
    if type(sink) is not _sinks.FileSink or sink.failed:
        return None
    try:
        sink.hold()
    except Exception as exc:
        _env.warn(f"fakegrad_patch: tracing failed ({type(exc).__name__}: {exc}); continuing")
        return None
    return sink


def release(held: _sinks.FileSink | None) -> None:
    """End a :func:`hold` (``None``: nothing to do); never raises."""
    if held is not None:
        try:
            held.release()
        except Exception as exc:
            _env.warn(f"fakegrad_patch: tracing failed ({type(exc).__name__}: {exc}); continuing")


def enabled(level: int) -> bool:
    """True when events of ``level`` are recorded somewhere. One int comparison: call it before
    building an event's keywords."""
    return level >= _threshold


def emit(event: str, level: int, **fields: Any) -> None:
    """Record one event. Never pass tensors: shapes, dtypes, devices, ids and byte counts only.

    Never raises: a tracing failure warns once and the program continues.
    """
    if level >= _threshold:
        emit_fields(event, level, fields)


def emit_fields(event: str, level: int, fields: dict[str, Any], *, owned: bool = False) -> None:
    """:func:`emit` for hot paths that already hold the fields in a dict: saves building the
    keyword dict of the call (about a microsecond for a dozen fields). ``fields`` is read, never
    kept or changed. Same rules: plain data only, never raises.

    ``owned=True`` (the patch's own hot paths: a materialized gradient, a repaired conversion):
    ``fields`` is a dict built for this one call that holds plain values only (``str``, ``int``,
    ``float``, ``bool``, ``None`` and lists of them; no tensor, no ``torch.Size``) and none of the
    envelope's keys (``event``, ``level``, ``timestamp``, ``schema``, ``pid``, ``tid``). The trace
    then takes it over as it is, unscrubbed: the caller must not use it afterwards.
    """
    if level < _threshold:
        return
    try:
        method = _methods.get(level)
        if method is None:
            method = _method_for(level)
        # the fields travel as one keyword, which the pipeline's processor spreads out
        if owned:
            method(event, _fakegrad_owned=fields)
        else:
            method(event, _fakegrad_fields=fields)
    except Exception as exc:
        _env.warn(f"fakegrad_patch: tracing failed ({type(exc).__name__}: {exc}); continuing")


def events() -> list[dict[str, Any]]:
    """A copy of the in-memory buffer, oldest first."""
    for _ in range(100):
        try:
            snapshot = list(_pipeline.buffer)
        except RuntimeError:  # appended to (a GC finalizer) while being copied: again
            continue
        expand = _pipeline.expand
        return [dict(e) if isinstance(e, dict) else expand(e) for e in snapshot]
    return []  # pragma: no cover - never seen


def clear() -> None:
    """Empty the in-memory buffer."""
    _pipeline.buffer.clear()


@contextlib.contextmanager
def capture(level: int | str = DEBUG) -> Iterator[list[dict[str, Any]]]:
    """Record every event of the block at ``level`` or above into the yielded list.

    The buffer and sink keep their own level; the previous state is restored on exit. Events
    from every thread are captured (the patch fires inside autograd's worker threads too).
    """
    global _methods
    entry: tuple[int, list[dict[str, Any]]] = (parse_level(level), [])
    with _lock:
        _pipeline.captures = (*_pipeline.captures, entry)
        _recompute_threshold()
        _methods = {}
    try:
        yield entry[1]
    finally:
        with _lock:
            _pipeline.captures = tuple(c for c in _pipeline.captures if c is not entry)
            _recompute_threshold()
            _methods = {}


# -- configuration --------------------------------------------------------------------------------


def current_config() -> TraceConfig:
    """The configuration in force."""
    return _config


def configure_trace(
    path: str | os.PathLike[str] | None = _KEEP,
    level: int | str | None = None,
    buffer_size: int | None = None,
    max_bytes: int | None = None,
) -> TraceConfig:
    """Change where events go; return the previous configuration (pass it to :func:`restore`).

    path: a file (JSONL, created on the first event with mode 0600, appended), ``"-"`` for
        stderr, ``None`` for no sink (memory buffer only); left out: unchanged.
    level: ``"debug"``/``"info"``/``"warning"``/``"error"`` or an int; ``None``: unchanged.
    buffer_size: capacity of the memory buffer (keeps the newest events); ``None``: unchanged.
    max_bytes: rotate the file to ``path.1`` when it reaches this size; 0: no limit;
        ``None``: unchanged (default ``FAKEGRAD_TRACE_MAX_BYTES``, else 100 MiB).
    """
    if path is not _KEEP:
        _settings.parse("path", path)
    new_level = None if level is None else parse_level(level)
    new_size = None if buffer_size is None else int(_settings.parse("buffer_size", buffer_size))
    new_max = None if max_bytes is None else parse_max_bytes(max_bytes)
    with _lock:
        previous = _config
        changes: dict[str, Any] = {}
        if path is not _KEEP:
            changes["path"] = _env.normalize_path(path)
        if new_level is not None:
            changes["level"] = new_level
        if new_size is not None:
            changes["buffer_size"] = new_size
        if new_max is not None:
            changes["max_bytes"] = new_max
        _apply(dataclasses.replace(previous, **changes))
    return previous


def restore(config: TraceConfig) -> None:
    """Put back a configuration returned by :func:`configure_trace`."""
    with _lock:
        _apply(config)


def _apply(config: TraceConfig) -> None:
    """Make ``config`` the one in force; called with ``_lock`` held."""
    global _config, _methods, file_sink_on
    old = _pipeline.sink
    if (
        config.path != _config.path
        or config.max_bytes != _config.max_bytes
        or (old is not None and old.failed)
    ):
        _pipeline.sink = _sinks.make_sink(config, _sink_failed, _pipeline.render_line)
        file_sink_on = type(_pipeline.sink) is _sinks.FileSink
        if old is not None:
            old.close()
    if config.buffer_size != _pipeline.buffer.maxlen:
        _pipeline.buffer = deque(_pipeline.buffer, maxlen=config.buffer_size)
    _config = config
    _recompute_threshold()
    _methods = {}  # rebuilt on the next event, for the new sink and threshold


def set_level(level: int | str) -> int:
    """Set the level of the buffer and sink; return the previous effective level."""
    previous = _config.effective_level
    configure_trace(level=level)
    return previous


def sink_problem(path: str | None = None) -> str | None:
    """Why the trace file sink cannot work (or a notice about it), without writing anything.

    ``path``: the file to check; ``None``: the configured sink (``FAKEGRAD_TRACE`` /
    :func:`configure_trace`). Returns ``None`` when there is nothing to say: no file sink, or a
    path that can be created or appended to. Otherwise one sentence: the sink already failed in
    this process, an impossible path, a missing or unwritable directory, a symlink, a FIFO or
    another file that is not a regular file, an unwritable file, or (a notice: tracing works) a
    file readable by others. Standard library only; never opens the path (a FIFO would block).
    """
    if path is None:
        target = _config.path
        if target is None or target == "-":
            return None
        sink = _pipeline.sink
        if isinstance(sink, _sinks.FileSink) and sink.path == target and sink.failed:
            return f"tracing to {target!r} failed in this process: {sink.failure}"
    else:
        target = _env.normalize_path(path)
        if target is None or target == "-":
            return None
    return _sinks.path_problem(target)


if TYPE_CHECKING:
    #: "orjson" or "json" once the first line was rendered; None before
    json_backend: str | None
else:

    def __getattr__(name: str) -> Any:
        # json_backend is set by the pipeline when it renders its first line: read it there
        if name == "json_backend":
            return _pipeline.json_backend
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
