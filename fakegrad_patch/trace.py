"""Structured trace of every interception, through a private structlog pipeline.

Core code calls it as::

    if trace.enabled(trace.DEBUG):
        trace.emit("leaf_armed", trace.DEBUG, leaf_id=..., shape=...)

so that nothing (not even the keyword dict) is built when the level is filtered out:
``enabled`` is one integer comparison against a module global.

Where events go (see docs/trace-schema.md for every event and key):

* an in-memory bounded buffer, always (``events()``, ``clear()``);
* ``capture()`` blocks, each at its own level (the pytest fixture uses one);
* one optional sink: a JSONL file (``FAKEGRAD_TRACE=path`` or ``configure_trace(path=...)``),
  created lazily with mode 0600 and appended with one ``os.write`` per line (``O_APPEND``), so
  several processes can share it; or stderr (``FAKEGRAD_TRACE=-``).

Why a private pipeline: this is a library inside someone else's program. We never call
``structlog.configure`` and never touch ``logging``; ``structlog.wrap_logger`` gets every argument
explicitly because it falls back to the global configuration for anything left unset. structlog
is imported only when the first event passes the filter (``import fakegrad_patch`` stays light).

Events never carry tensors: ``JSONRenderer`` falls back to ``repr()``, which is slow and can
re-enter fake dispatch. A scrub step replaces anything that is not plain data by ``"<TypeName>"``
without calling its ``repr``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import threading
import warnings
from collections import deque
from collections.abc import Iterator, MutableMapping
from typing import Any, Final

from ._errors import FakeGradPatchWarning

SCHEMA_VERSION: Final = 1
DEBUG, INFO, WARNING, ERROR = 10, 20, 30, 40
_LEVEL_NAMES: Final = {"debug": DEBUG, "info": INFO, "warning": WARNING, "error": ERROR}
_NAMES_BY_LEVEL: Final = {v: k for k, v in _LEVEL_NAMES.items()}

ENV_PATH: Final = "FAKEGRAD_TRACE"
ENV_LEVEL: Final = "FAKEGRAD_TRACE_LEVEL"
DEFAULT_BUFFER_SIZE: Final = 10_000
#: Keys every event carries, in the order they are written.
ENVELOPE_KEYS: Final = ("event", "level", "timestamp", "schema", "pid", "tid")

_KEEP: Final[Any] = object()  # "argument not given" for configure_trace(path=...)


@dataclasses.dataclass(frozen=True)
class TraceConfig:
    """Where events go. Returned by :func:`configure_trace` so callers can :func:`restore` it.

    path: ``None`` (memory only), ``"-"`` (stderr) or an absolute file path.
    level: the explicit level, or ``None`` for the default (``info`` when a sink is configured,
        ``warning`` otherwise, so problems are always in the memory buffer and per-interception
        ``info`` events cost nothing unless asked for).
    buffer_size: how many events the memory buffer keeps (oldest dropped first).
    """

    path: str | None = None
    level: int | None = None
    buffer_size: int = DEFAULT_BUFFER_SIZE

    @property
    def effective_level(self) -> int:
        if self.level is not None:
            return self.level
        return INFO if self.path is not None else WARNING


def parse_level(level: int | str) -> int:
    """``"debug"``/``"info"``/``"warning"``/``"error"`` (any case) or an int -> an int."""
    if isinstance(level, bool):
        raise ValueError(f"invalid trace level {level!r}")
    if isinstance(level, int) and level >= 0:
        return level
    if isinstance(level, str) and level.strip().lower() in _LEVEL_NAMES:
        return _LEVEL_NAMES[level.strip().lower()]
    raise ValueError(
        f"invalid trace level {level!r}: expected one of {', '.join(_LEVEL_NAMES)} or an int"
    )


def _warn(message: str) -> None:
    """Warn without ever raising into the host (warnings-as-errors must not break tracing's
    callers, which run inside backward)."""
    with contextlib.suppress(Exception):
        warnings.warn(message, FakeGradPatchWarning, stacklevel=3)


def _normalize_path(path: str | os.PathLike[str] | None) -> str | None:
    if path is None:
        return None
    text = os.fspath(path)
    if not text:
        return None
    if text == "-":
        return "-"
    return os.path.abspath(os.path.expanduser(text))


def _config_from_env() -> TraceConfig:
    path = _normalize_path(os.environ.get(ENV_PATH, "").strip() or None)
    level: int | None = None
    raw = os.environ.get(ENV_LEVEL, "").strip()
    if raw:
        try:
            level = parse_level(raw)
        except ValueError as exc:
            _warn(f"fakegrad_patch: {ENV_LEVEL}: {exc}; using the default")
    return TraceConfig(path=path, level=level)


# -- sinks ----------------------------------------------------------------------------------------


class _FileSink:
    """Appends rendered lines to a file: opened on the first line (mode 0600 when created),
    ``O_APPEND`` and one ``os.write`` per line, so lines from several processes never interleave.

    structlog calls the method named after the level with the rendered string.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self.failed = False
        self._fd: int | None = None
        # Reentrant: a weakref finalizer (leaf_released) can emit from a GC run that starts
        # inside write() on this same thread.
        self._lock = threading.RLock()

    def write(self, line: str) -> None:
        data = (line + "\n").encode("utf-8")
        try:
            with self._lock:
                if self.failed:
                    return
                if self._fd is None:
                    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | getattr(os, "O_CLOEXEC", 0)
                    self._fd = os.open(self.path, flags, 0o600)
                written = os.write(self._fd, data)
                while written < len(data):  # only on a nearly full disk: finish the line
                    written += os.write(self._fd, data[written:])
        except OSError as exc:
            self._fail(exc)

    def _fail(self, exc: OSError) -> None:
        with self._lock:
            self.failed = True
            fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)
        _warn(
            f"fakegrad_patch: cannot write the trace file {self.path!r} ({exc}); tracing to that "
            "file is disabled, the program continues (events stay in "
            "fakegrad_patch.trace.events())."
        )
        emit("trace_sink_failed", ERROR, path=self.path, error=f"{type(exc).__name__}: {exc}")

    def close(self) -> None:
        with self._lock:
            fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)

    debug = info = warning = error = msg = write


class _StderrSink:
    """Writes rendered lines to the current ``sys.stderr`` (looked up per line, so pytest's
    capture and redirections see them)."""

    path = "-"
    failed = False

    def write(self, line: str) -> None:
        stream = sys.stderr
        if stream is None:
            return
        with contextlib.suppress(Exception):
            stream.write(line + "\n")
            stream.flush()

    def close(self) -> None:
        pass

    debug = info = warning = error = msg = write


_Sink = _FileSink | _StderrSink


# -- state ----------------------------------------------------------------------------------------

_lock = threading.RLock()
_config: TraceConfig = _config_from_env()
_buffer: deque[dict[str, Any]] = deque(maxlen=_config.buffer_size)
#: active capture() blocks: (level, list); replaced, never mutated, so emit reads it lock-free
_captures: tuple[tuple[int, list[dict[str, Any]]], ...] = ()
_sink: _Sink | None = None  # set below, after _make_sink is defined
_logger: Any = None  # the structlog bound logger, built on the first event that passes
_threshold: int = _config.effective_level
_pid = os.getpid()


def _after_fork_in_child() -> None:
    global _pid, _lock
    _pid = os.getpid()
    _lock = threading.RLock()
    if isinstance(_sink, _FileSink):
        _sink._lock = threading.RLock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _recompute_threshold() -> None:
    """Lowest level anything wants; called with ``_lock`` held."""
    global _threshold
    _threshold = min([_config.effective_level, *(level for level, _ in _captures)])


def _make_sink(path: str | None) -> _Sink | None:
    if path is None:
        return None
    return _StderrSink() if path == "-" else _FileSink(path)


_sink = _make_sink(_config.path)  # nothing is opened before the first event


def _floor_level(level: int) -> int:
    """The highest standard level <= ``level`` (structlog knows only those)."""
    return max((v for v in (0, *_NAMES_BY_LEVEL) if v <= level), default=0)


# -- the pipeline ---------------------------------------------------------------------------------

_PLAIN = (str, int, float, bool, type(None))
_PLAIN_TYPES = frozenset(_PLAIN)  # exact types: the fast path of _envelope


def _scrub(value: Any, depth: int = 0) -> Any:
    """Plain data only. Anything else becomes ``"<TypeName>"``: never ``repr`` (a tensor's repr
    can re-enter fake dispatch) and never keep a reference to it (the buffer outlives it)."""
    if isinstance(value, _PLAIN):
        return value
    if depth < 4:
        if isinstance(value, list | tuple):
            return [_scrub(v, depth + 1) for v in value]
        if isinstance(value, dict):
            return {str(k): _scrub(v, depth + 1) for k, v in value.items()}
    return f"<{type(value).__name__}>"


def _envelope(
    logger: Any, method_name: str, event_dict: MutableMapping[str, Any]
) -> dict[str, Any]:
    """Stable keys first, in a fixed order; every value scrubbed."""
    out: dict[str, Any] = {
        "event": event_dict.pop("event"),
        "level": event_dict.pop("level"),
        "timestamp": event_dict.pop("timestamp"),
        "schema": SCHEMA_VERSION,
        "pid": _pid,
        "tid": threading.get_ident(),
    }
    for key, value in event_dict.items():
        if key not in out:
            out[key] = value if type(value) in _PLAIN_TYPES else _scrub(value)
    return out


def _fan_out(
    logger: Any, method_name: str, event_dict: MutableMapping[str, Any]
) -> MutableMapping[str, Any]:
    """Copy the event to the memory buffer and capture blocks that want its level; hand it on to
    the renderer only when the sink wants it (``DropEvent`` otherwise: no JSON is built)."""
    level = _LEVEL_NAMES.get(event_dict["level"], ERROR)
    config_level = _config.effective_level
    if level >= config_level:
        with _lock:
            _buffer.append(dict(event_dict))
    for capture_level, sink_list in _captures:
        if level >= capture_level:
            sink_list.append(dict(event_dict))
    if _sink is None or _sink.failed or level < config_level:
        raise _DropEvent
    return event_dict


def _no_repr(obj: object) -> str:
    return f"<{type(obj).__name__}>"


def _dumps(obj: Any, **kwargs: Any) -> str:
    import json  # here, not at module top: ``import fakegrad_patch`` stays light

    kwargs["default"] = _no_repr
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False, **kwargs)


_DropEvent: type[BaseException] = Exception  # structlog.DropEvent once structlog is imported


def _build_logger() -> Any:
    """The private structlog logger for the current configuration (every argument explicit)."""
    global _DropEvent
    import structlog

    _DropEvent = structlog.DropEvent

    target = _sink if _sink is not None else _StderrSink()  # unused when no sink: events dropped
    return structlog.wrap_logger(
        target,
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True, key="timestamp"),
            _envelope,
            _fan_out,
            structlog.processors.JSONRenderer(serializer=_dumps),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_floor_level(_threshold)),
        context_class=dict,
        cache_logger_on_first_use=False,
        logger_factory_args=(),
    ).bind()


# -- public API -----------------------------------------------------------------------------------


def enabled(level: int) -> bool:
    """True when events of ``level`` are recorded somewhere. One int comparison: call it before
    building an event's keywords."""
    return level >= _threshold


def emit(event: str, level: int, **fields: Any) -> None:
    """Record one event. Never pass tensors: shapes, dtypes, devices, ids and byte counts only.

    Never raises: a tracing failure warns once and the program continues.
    """
    if level < _threshold:
        return
    global _logger
    try:
        logger = _logger
        if logger is None:
            with _lock:
                if _logger is None:
                    _logger = _build_logger()
                logger = _logger
        if level not in _NAMES_BY_LEVEL:
            level = _floor_level(level) or DEBUG
        logger.log(level, event, **fields)
    except Exception as exc:
        _warn(f"fakegrad_patch: tracing failed ({type(exc).__name__}: {exc}); continuing")


def events() -> list[dict[str, Any]]:
    """A copy of the in-memory buffer, oldest first."""
    with _lock:
        return [dict(e) for e in _buffer]


def clear() -> None:
    """Empty the in-memory buffer."""
    with _lock:
        _buffer.clear()


def current_config() -> TraceConfig:
    """The configuration in force."""
    return _config


def configure_trace(
    path: str | os.PathLike[str] | None = _KEEP,
    level: int | str | None = None,
    buffer_size: int | None = None,
) -> TraceConfig:
    """Change where events go; return the previous configuration (pass it to :func:`restore`).

    path: a file (JSONL, created on the first event with mode 0600, appended), ``"-"`` for
        stderr, ``None`` for no sink (memory buffer only); left out: unchanged.
    level: ``"debug"``/``"info"``/``"warning"``/``"error"`` or an int; ``None``: unchanged.
    buffer_size: capacity of the memory buffer (keeps the newest events); ``None``: unchanged.
    """
    new_level = None if level is None else parse_level(level)
    if buffer_size is not None and (isinstance(buffer_size, bool) or buffer_size < 0):
        raise ValueError(f"invalid buffer_size {buffer_size!r}: expected an int >= 0")
    with _lock:
        previous = _config
        changes: dict[str, Any] = {}
        if path is not _KEEP:
            changes["path"] = _normalize_path(path)
        if new_level is not None:
            changes["level"] = new_level
        if buffer_size is not None:
            changes["buffer_size"] = int(buffer_size)
        _apply(dataclasses.replace(previous, **changes))
    return previous


def restore(config: TraceConfig) -> None:
    """Put back a configuration returned by :func:`configure_trace`."""
    with _lock:
        _apply(config)


def _apply(config: TraceConfig) -> None:
    global _config, _buffer, _sink, _logger
    if config.path != _config.path or (_sink is not None and _sink.failed):
        old = _sink
        _sink = _make_sink(config.path)
        if old is not None:
            old.close()
    if config.buffer_size != _buffer.maxlen:
        _buffer = deque(_buffer, maxlen=config.buffer_size)
    _config = config
    _recompute_threshold()
    _logger = None  # rebuilt on the next event, for the new sink and threshold


def set_level(level: int | str) -> int:
    """Set the level of the buffer and sink; return the previous effective level."""
    previous = _config.effective_level
    configure_trace(level=level)
    return previous


@contextlib.contextmanager
def capture(level: int | str = DEBUG) -> Iterator[list[dict[str, Any]]]:
    """Record every event of the block at ``level`` or above into the yielded list.

    The buffer and sink keep their own level; the previous state is restored on exit. Events
    from every thread are captured (the patch fires inside autograd's worker threads too).
    """
    global _captures, _logger
    entry: tuple[int, list[dict[str, Any]]] = (parse_level(level), [])
    with _lock:
        _captures = (*_captures, entry)
        _recompute_threshold()
        _logger = None
    try:
        yield entry[1]
    finally:
        with _lock:
            _captures = tuple(c for c in _captures if c is not entry)
            _recompute_threshold()
            _logger = None


def _sink_for_tests() -> _Sink | None:
    return _sink
