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
  several processes can share it; or stderr (``FAKEGRAD_TRACE=-``). The file is opened without
  following a symlink and without blocking, must be a regular file, and is rotated to
  ``path.1`` when it reaches ``max_bytes`` (``FAKEGRAD_TRACE_MAX_BYTES``).

Why a private pipeline: this is a library inside someone else's program. We never call
``structlog.configure`` and never touch ``logging``; ``structlog.wrap_logger`` gets every argument
explicitly because it falls back to the global configuration for anything left unset. structlog
is imported only when the first event passes the filter (``import fakegrad_patch`` stays light).

Why it is cheap (trace at ``info`` is what people turn on while debugging a real model, so its
cost per event must not change the timing they are looking at): the filtering bound logger and
its level methods are built once per configuration and cached; there are three processors
(envelope, fan-out, renderer), the timestamp is formatted once per second, the memory buffer
keeps the event dict itself (no copy; ``events()`` copies on the way out), and the renderer
returns bytes (orjson when installed: ``pip install fakegrad_patch[fast]``; the standard library
otherwise) that the file sink hands to ``os.write`` as they are.

Events never carry tensors: a JSON fallback would call ``repr()``, which is slow and can re-enter
fake dispatch. The envelope step replaces anything that is not plain data by ``"<TypeName>"``
without calling its ``repr``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import stat
import sys
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterator, MutableMapping
from typing import Any, Final

from .. import _config as _settings
from .._errors import FakeGradPatchWarning

try:  # at import, not under a sink's lock (issue 40: never an import while holding a lock)
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

SCHEMA_VERSION: Final = 1
#: level name -> number: the settings' table (they parse level names with it), not a copy
_LEVEL_NAMES: Final = _settings.TRACE_LEVELS
DEBUG, INFO, WARNING, ERROR = (_LEVEL_NAMES[n] for n in ("debug", "info", "warning", "error"))
_NAMES_BY_LEVEL: Final = {v: k for k, v in _LEVEL_NAMES.items()}

ENV_PATH: Final = "FAKEGRAD_TRACE"
ENV_LEVEL: Final = "FAKEGRAD_TRACE_LEVEL"
ENV_MAX_BYTES: Final = "FAKEGRAD_TRACE_MAX_BYTES"
ENV_JSON: Final = "FAKEGRAD_TRACE_JSON"
DEFAULT_BUFFER_SIZE: Final = 10_000
#: A trace file is rotated to ``path.1`` when it reaches this size (0: never).
DEFAULT_MAX_BYTES: Final = 100 * 1024 * 1024
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
    max_bytes: the trace file is renamed to ``path.1`` (replacing it) and started afresh when it
        reaches this size, so at most about twice this is on disk; 0: no limit.
    """

    path: str | None = None
    level: int | None = None
    buffer_size: int = DEFAULT_BUFFER_SIZE
    max_bytes: int = DEFAULT_MAX_BYTES

    @property
    def effective_level(self) -> int:
        if self.level is not None:
            return self.level
        return INFO if self.path is not None else WARNING


def parse_level(level: int | str) -> int:
    """``"debug"``/``"info"``/``"warning"``/``"error"`` (any case) or an int >= 0 (or a string of
    one) -> an int. ValueError naming the setting, the value and the allowed values."""
    return int(_settings.parse("level", level))


def parse_max_bytes(value: int | str) -> int:
    """An int >= 0, or a string of one (``"0"`` means no limit). ValueError naming the setting,
    the value given and the allowed values."""
    return int(_settings.parse("max_bytes", value))


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


def _env(env: str) -> Any:
    """The parsed value of ``env`` (None when unset, blank or invalid; an invalid value warns once,
    never raising: ``import fakegrad_patch`` checks the environment again, raising under
    ``-W error``)."""
    value, problem = _settings.parse_env(env)
    if problem is not None:
        _settings.warn_invalid_env(env, os.environ.get(env, ""), problem, may_raise=False)
    return value


def _config_from_env() -> TraceConfig:
    path = _normalize_path(_env(ENV_PATH))
    level = _env(ENV_LEVEL)
    max_bytes = _env(ENV_MAX_BYTES)
    return TraceConfig(
        path=path, level=level, max_bytes=DEFAULT_MAX_BYTES if max_bytes is None else max_bytes
    )


# -- sinks ----------------------------------------------------------------------------------------

_O_NOFOLLOW: Final = getattr(os, "O_NOFOLLOW", 0)
_O_NONBLOCK: Final = getattr(os, "O_NONBLOCK", 0)
_OPEN_FLAGS: Final = (
    os.O_WRONLY
    | os.O_CREAT
    | os.O_APPEND
    | getattr(os, "O_CLOEXEC", 0)
    | _O_NOFOLLOW  # a link at the path (shared temp directories) is refused, never followed
    | _O_NONBLOCK  # a FIFO at the path must not hang the program in open()
)
#: How often (bytes written by this process) a file sink checks its file's size and identity.
_CHECK_EVERY_MAX: Final = 1024 * 1024


class _SinkRefused(OSError):
    """The path exists but is not something we write a trace into."""


def _kind(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return "a symbolic link (trace files are opened without following links)"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "not a regular file"


def _wide_mode_notice(path: str, mode: int) -> str:
    return (
        f"the trace file {path!r} has permissions {stat.S_IMODE(mode):04o}, wider than 0600: "
        "other users can read it (traces name your parameters; chmod 600 it)"
    )


class _FileSink:
    """Appends rendered lines (bytes) to a file: opened on the first line (mode 0600 when
    created), ``O_APPEND`` and one ``os.write`` per line, so lines from several processes never
    interleave. Rotated to ``path.1`` at ``max_bytes`` (see :meth:`_check`).

    structlog calls the method named after the level with the rendered bytes.
    """

    def __init__(self, path: str, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.failed = False
        self.failure: str | None = None
        self._fd: int | None = None
        self._ino: tuple[int, int] | None = None
        self._warned_mode = False
        self._check_every = max(1, min(max_bytes // 16, _CHECK_EVERY_MAX)) if max_bytes else 1 << 62
        self._unchecked = 0  # bytes written since the last size/identity check
        #: a notice for the user, found under the lock and given after releasing it
        self._notice: str | None = None
        # Reentrant: a weakref finalizer (leaf_released) can emit from a GC run that starts
        # inside write() on this same thread. Held for the file's own operations only: never
        # while warning, emitting or importing (issue 40).
        self._lock = threading.RLock()

    def write(self, data: bytes) -> None:
        if not data:
            return  # an event the sink does not want (the pipeline rendered nothing)
        try:
            with self._lock:
                if self.failed:
                    return
                if self._fd is None:
                    self._open()
                fd = self._fd
                assert fd is not None
                written = os.write(fd, data)
                while written < len(data):  # only on a nearly full disk: finish the line
                    written += os.write(fd, data[written:])
                self._unchecked += written
                if self._unchecked >= self._check_every:
                    self._check()
        except OSError as exc:
            self._fail(exc)
        if self._notice is not None:
            notice, self._notice = self._notice, None
            if notice is not None:
                _warn(notice)

    def _open(self) -> None:
        try:
            fd = os.open(self.path, _OPEN_FLAGS, 0o600)
        except OSError as exc:
            if exc.errno == errno.ELOOP and _O_NOFOLLOW:
                raise _SinkRefused(exc.errno, f"{self.path!r} is {_kind(stat.S_IFLNK)}") from exc
            if exc.errno == errno.ENXIO:  # O_NONBLOCK open of a FIFO nobody reads
                raise _SinkRefused(exc.errno, f"{self.path!r} is {_kind(stat.S_IFIFO)}") from exc
            raise
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise _SinkRefused(errno.EINVAL, f"{self.path!r} is {_kind(st.st_mode)}")
            if _O_NONBLOCK:
                with contextlib.suppress(OSError, AttributeError):
                    os.set_blocking(fd, True)  # a regular file: plain blocking writes
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        self._ino = (st.st_dev, st.st_ino)
        if stat.S_IMODE(st.st_mode) & 0o077 and not self._warned_mode:
            self._warned_mode = True  # warned by write(), after releasing the lock
            notice = _wide_mode_notice(self.path, st.st_mode)
            self._notice = f"fakegrad_patch: {notice}; appending to it."
        self._unchecked = 0
        if self.max_bytes and st.st_size >= self.max_bytes:
            self._check()

    def _check(self) -> None:
        """Size and identity of the file, every ``_check_every`` bytes this process wrote.

        Another process may have rotated the file (our fd then points at ``path.1``: reopen
        ``path``), or the file is full (rotate it). Rotation holds an exclusive ``flock`` on the
        full file and renames only if ``path`` still is that file, so of several processes that
        find it full at once exactly one renames it and the others just reopen.
        """
        self._unchecked = 0
        fd = self._fd
        if fd is None or not self.max_bytes:
            return
        st = os.fstat(fd)
        if self._is_current(st) and st.st_size >= self.max_bytes:
            flock = _flock(fd)
            try:
                if self._is_current(os.fstat(fd)):
                    os.replace(self.path, self.path + ".1")
            finally:
                flock.release()
        if not self._is_current(os.fstat(fd)):
            self._fd = self._ino = None
            with contextlib.suppress(OSError):
                os.close(fd)
            self._open()

    def _is_current(self, st: os.stat_result) -> bool:
        """Is ``path`` (not following links) still the file our fd writes to?"""
        try:
            now = os.lstat(self.path)
        except FileNotFoundError:
            return False
        return (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino)

    def _fail(self, exc: OSError) -> None:
        with self._lock:
            if self.failed:
                return
            self.failed = True
            self.failure = exc.strerror if isinstance(exc, _SinkRefused) else str(exc)
            fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)
        refused = isinstance(exc, _SinkRefused)
        reason = f"refused: {exc.strerror}" if refused else f"{type(exc).__name__}: {exc}"
        _warn(
            f"fakegrad_patch: cannot write the trace file {self.path!r} ({reason}); tracing to "
            "that file is disabled, the program continues (events stay in "
            "fakegrad_patch.trace.events())."
        )
        emit("trace_sink_failed", ERROR, path=self.path, error=reason)

    def close(self) -> None:
        with self._lock:
            fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)

    debug = info = warning = error = msg = write


class _Flock:
    def __init__(self, fd: int | None) -> None:
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None and fcntl is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(self._fd, fcntl.LOCK_UN)


def _flock(fd: int) -> _Flock:
    """An exclusive advisory lock on ``fd``'s file (none where ``fcntl`` does not exist)."""
    if fcntl is None:  # pragma: no cover - Windows
        return _Flock(None)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    except OSError:
        return _Flock(None)
    return _Flock(fd)


class _StderrSink:
    """Writes rendered lines to the current ``sys.stderr`` (looked up per line, so pytest's
    capture and redirections see them)."""

    path = "-"
    failed = False
    failure = None

    def write(self, data: bytes) -> None:
        if not data:
            return
        stream = sys.stderr
        if stream is None:
            return
        with contextlib.suppress(Exception):
            stream.write(data.decode("utf-8", "replace"))
            stream.flush()

    def close(self) -> None:
        pass

    debug = info = warning = error = msg = write


class _NullSink:
    """The logger's target when there is no sink: events end in the memory buffer/captures."""

    def write(self, data: bytes) -> None:
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
#: level -> the cached structlog bound logger's method for it; emptied on every configuration
#: change and rebuilt on the next event that passes the filter
_methods: dict[int, Callable[..., Any]] = {}
_threshold: int = _config.effective_level
_buffer_level: int = _config.effective_level  # the buffer's and the sink's level
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
    global _threshold, _buffer_level
    _buffer_level = _config.effective_level
    _threshold = min([_buffer_level, *(level for level, _ in _captures)])


def _make_sink(config: TraceConfig) -> _Sink | None:
    if config.path is None:
        return None
    return _StderrSink() if config.path == "-" else _FileSink(config.path, config.max_bytes)


_sink = _make_sink(_config)  # nothing is opened before the first event


def _floor_level(level: int) -> int:
    """The highest standard level <= ``level`` (structlog knows only those)."""
    return max((v for v in (0, *_NAMES_BY_LEVEL) if v <= level), default=0)


# -- the pipeline ---------------------------------------------------------------------------------

_get_ident = threading.get_ident
_PLAIN = (str, int, float, bool, type(None))
_PLAIN_TYPES = frozenset(_PLAIN)  # exact types: the fast path of _envelope


def _scrub(value: Any, depth: int = 0) -> Any:
    """Plain data only. Anything else becomes ``"<TypeName>"``: never ``repr`` (a tensor's repr
    can re-enter fake dispatch) and never keep a reference to it (the buffer outlives it)."""
    if type(value) is list and depth < 4:  # shapes: the common case, first
        return [v if type(v) in _PLAIN_TYPES else _scrub(v, depth + 1) for v in value]
    if isinstance(value, _PLAIN):
        return value
    if depth < 4:
        if isinstance(value, list | tuple):
            return [v if type(v) in _PLAIN_TYPES else _scrub(v, depth + 1) for v in value]
        if isinstance(value, dict):
            return {str(k): _scrub(v, depth + 1) for k, v in value.items()}
    return f"<{type(value).__name__}>"


#: (second, "YYYY-MM-DDTHH:MM:SS") of the last timestamp: one tuple, swapped atomically
_second: tuple[int, str] = (-1, "")


def _timestamp() -> str:
    """ISO 8601 UTC with microseconds, ``2026-11-30T21:54:22.081334Z``; the date and time of
    day are formatted once per second (``datetime.isoformat`` per event costs more than the rest
    of the envelope)."""
    global _second
    now = time.time_ns()
    sec, ns = divmod(now, 1_000_000_000)
    cached = _second
    if cached[0] != sec:
        cached = _second = (sec, time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(sec)))
    return f"{cached[1]}.{ns // 1000:06d}Z"


#: The event's own fields travel through structlog as this one keyword (``emit`` passes the
#: dict it already has), so structlog's keyword plumbing copies one key instead of a dozen three
#: times over; the envelope spreads them out.
_FIELDS: Final = "_fakegrad_fields"
#: ``emit_fields(owned=True)``'s keyword: a dict of plain values the trace may keep as it is.
_OWNED: Final = "_fakegrad_owned"


def _envelope(
    logger: Any, method_name: str, event_dict: MutableMapping[str, Any]
) -> dict[str, Any]:
    """Stable keys first, in a fixed order (level from the method name, the timestamp); then the
    fields; every value scrubbed."""
    out: dict[str, Any] = {
        "event": event_dict.pop("event"),
        "level": method_name,
        "timestamp": _timestamp(),
        "schema": SCHEMA_VERSION,
        "pid": _pid,
        "tid": threading.get_ident(),
    }
    fields = event_dict.pop(_OWNED, None) or event_dict.pop(_FIELDS, None)
    for items in (fields or {}, event_dict):
        for key, value in items.items():
            if key not in out:
                out[key] = value if type(value) in _PLAIN_TYPES else _scrub(value)
    return out


def _envelope_fan_out_render(
    logger: Any, method_name: str, event_dict: MutableMapping[str, Any]
) -> bytes:
    """The whole pipeline as one processor (issue 27: one call instead of three, no ``DropEvent``
    raised for events the sink does not want, the buffer and the renderer sharing one dict):
    :func:`_envelope`, then the fan-out (buffer, captures), then the line as bytes, or ``b""``
    (written as nothing) when there is no sink or it does not want the event. Same keys, same
    order, same scrubbing, same bytes as :func:`_envelope` then :func:`_render`, which stay for
    the tests and for reading."""
    owned = event_dict.pop(_OWNED, None)
    fields = event_dict.pop(_FIELDS, None) if owned is None else None
    out: dict[str, Any] = {
        "event": event_dict.pop("event"),
        "level": method_name,
        "timestamp": _timestamp(),
        "schema": SCHEMA_VERSION,
        "pid": _pid,
        "tid": _get_ident(),
    }
    plain = _PLAIN_TYPES
    if owned is not None:
        # emit_fields(owned=True): plain values, no envelope key (its caller's promise): one C call
        # instead of a type test per field (issue 27: P13's cost per event)
        out.update(owned)
    elif fields:
        for key, value in fields.items():
            if key not in out:
                out[key] = value if type(value) in plain else _scrub(value)
    if event_dict:
        for key, value in event_dict.items():
            if key not in out:
                out[key] = value if type(value) in plain else _scrub(value)
    level = _LEVEL_NAMES[method_name]
    wanted = level >= _buffer_level
    if wanted:
        _buffer.append(out)  # deque.append: atomic
    if _captures:
        for capture_level, sink_list in _captures:
            if level >= capture_level:
                sink_list.append(dict(out))
    sink = _sink
    if not wanted or sink is None or sink.failed:
        return b""
    render = _render_line
    if render is None:
        render = _set_renderer()
    return render(out)


def _no_repr(obj: object) -> str:
    return f"<{type(obj).__name__}>"


def _stdlib_encoder(json: Any) -> Callable[[Any], str]:
    """``JSONEncoder(separators=(",", ":"), ensure_ascii=False, default=_no_repr).encode``, with
    the C encoder built once when the interpreter has it (``encode`` builds it again for every
    call: about a fifth of a line's cost). ``markers=None`` skips the cycle check: scrubbed events
    are trees. Used only where it writes exactly what ``encode`` writes."""
    encode: Callable[[Any], str] = json.JSONEncoder(
        separators=(",", ":"), ensure_ascii=False, default=_no_repr
    ).encode
    try:
        chunks = json.encoder.c_make_encoder(
            None, _no_repr, json.encoder.encode_basestring, None, ":", ",", False, False, True
        )
        sample = {"a": [1, 2.5, None, True, "\u00e9\n"], "b": {"c": object()}}
        if "".join(chunks(sample, 0)) != encode(sample):
            return encode
    except Exception:  # no C encoder here (another interpreter), or another signature
        return encode

    def fast(event_dict: Any) -> str:
        return "".join(chunks(event_dict, 0))

    fast.chunks = chunks  # type: ignore[attr-defined]  # the renderer appends the newline to them
    return fast


def _stdlib_renderer() -> Callable[[Any], bytes]:
    import json  # here, not at module top: ``import fakegrad_patch`` stays light

    fast = _stdlib_encoder(json)
    ascii_only = json.JSONEncoder(separators=(",", ":"), default=_no_repr).encode

    chunks = getattr(fast, "chunks", None)

    def render(event_dict: Any) -> bytes:
        text = fast(event_dict)
        try:
            return (text + "\n").encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate: \u escapes keep the line valid JSON
            return (ascii_only(event_dict) + "\n").encode("ascii")

    if chunks is None:
        return render

    def render_chunks(event_dict: Any) -> bytes:
        parts = chunks(event_dict, 0)  # a fresh list of str (3.10-3.12): the newline joins it
        parts.append("\n")
        try:
            return "".join(parts).encode("utf-8")
        except UnicodeEncodeError:
            return (ascii_only(event_dict) + "\n").encode("ascii")

    try:
        # Python 3.13's C encoder returns a tuple: no append there (the plain renderer then)
        if render_chunks({"a": [1, "\u00e9"]}) == render({"a": [1, "\u00e9"]}):
            return render_chunks
    except Exception:
        pass
    return render


def _make_renderer() -> tuple[str, Callable[[Any], bytes]]:
    """(backend name, event dict -> one JSON line as bytes): orjson when importable (the
    ``fast`` extra), the standard library otherwise; both write the same JSON for plain data."""
    fallback = _stdlib_renderer()
    if _env(ENV_JSON) == "stdlib":
        return "json", fallback
    try:
        import orjson
    except Exception:
        return "json", fallback
    dumps = orjson.dumps
    option = orjson.OPT_APPEND_NEWLINE

    def render(event_dict: Any) -> bytes:
        try:
            return dumps(event_dict, default=_no_repr, option=option)
        except Exception:  # ints beyond 64 bits, lone surrogates: the stdlib writes those
            return fallback(event_dict)

    return "orjson", render


_render_line: Callable[[Any], bytes] | None = None
json_backend: str | None = None  # "orjson" or "json" once the first line was rendered


def _render(logger: Any, method_name: str, event_dict: Any) -> bytes:
    render = _render_line
    if render is None:
        render = _set_renderer()
    return render(event_dict)


def _set_renderer() -> Callable[[Any], bytes]:
    global _render_line, json_backend
    json_backend, _render_line = _make_renderer()
    return _render_line


def _build_logger() -> Any:
    """The private structlog logger for the current configuration (every argument explicit)."""
    import structlog

    if _sink is None:
        target: Any = _NullSink()
    else:
        target = _sink
    # one processor (issue 27): envelope, fan-out and (when the sink wants the event) the line
    processors: list[Any] = [_envelope_fan_out_render]
    return structlog.wrap_logger(
        target,
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(_floor_level(_threshold)),
        context_class=dict,
        cache_logger_on_first_use=False,
        logger_factory_args=(),
    ).bind()


def _method_for(level: int) -> Callable[..., Any]:
    """The cached bound logger's method for ``level`` (built on first use per configuration)."""
    import structlog  # noqa: F401  # import first, then lock (issue 40): the first event imports it

    with _lock:
        method = _methods.get(level)
        if method is None:
            logger = _methods.get(-1)
            if logger is None:
                logger = _build_logger()
            name = _NAMES_BY_LEVEL.get(_floor_level(level) or DEBUG, "debug")
            method = getattr(logger, name)
            _methods.update({-1: logger, level: method})
    return method


# -- public API -----------------------------------------------------------------------------------


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
        if owned:
            method(event, _fakegrad_owned=fields)
        else:
            method(event, _fakegrad_fields=fields)
    except Exception as exc:
        _warn(f"fakegrad_patch: tracing failed ({type(exc).__name__}: {exc}); continuing")


def events() -> list[dict[str, Any]]:
    """A copy of the in-memory buffer, oldest first."""
    for _ in range(100):
        try:
            snapshot = list(_buffer)
        except RuntimeError:  # appended to (a GC finalizer) while being copied: again
            continue
        return [dict(e) for e in snapshot]
    return []  # pragma: no cover - never seen


def clear() -> None:
    """Empty the in-memory buffer."""
    _buffer.clear()


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
            changes["path"] = _normalize_path(path)
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
    global _config, _buffer, _sink, _methods
    if (
        config.path != _config.path
        or config.max_bytes != _config.max_bytes
        or (_sink is not None and _sink.failed)
    ):
        old = _sink
        _sink = _make_sink(config)
        if old is not None:
            old.close()
    if config.buffer_size != _buffer.maxlen:
        _buffer = deque(_buffer, maxlen=config.buffer_size)
    _config = config
    _recompute_threshold()
    _methods = {}  # rebuilt on the next event, for the new sink and threshold


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
    global _captures, _methods
    entry: tuple[int, list[dict[str, Any]]] = (parse_level(level), [])
    with _lock:
        _captures = (*_captures, entry)
        _recompute_threshold()
        _methods = {}
    try:
        yield entry[1]
    finally:
        with _lock:
            _captures = tuple(c for c in _captures if c is not entry)
            _recompute_threshold()
            _methods = {}


def sink_problem(path: str | None = None) -> str | None:
    """Why the trace file sink cannot work (or a notice about it), without writing anything.

    ``path``: the file to check; ``None``: the configured sink (``FAKEGRAD_TRACE`` /
    :func:`configure_trace`). Returns ``None`` when there is nothing to say: no file sink, or a
    path that can be created or appended to. Otherwise one sentence: the sink already failed in
    this process, an impossible path, a missing or unwritable directory, a symlink, a FIFO or
    another file that is not a regular file, an unwritable file, or (a notice: tracing works) a
    file readable by others. Standard library only; never opens the path (a FIFO would block).
    """
    sink = _sink
    if path is None:
        target = _config.path
        if target is None or target == "-":
            return None
        if isinstance(sink, _FileSink) and sink.path == target and sink.failed:
            return f"tracing to {target!r} failed in this process: {sink.failure}"
    else:
        target = _normalize_path(path)
        if target is None or target == "-":
            return None
    try:
        st = os.lstat(target)
    except FileNotFoundError:
        return _directory_problem(target)
    except (OSError, ValueError) as exc:
        return f"impossible trace path {target!r}: {getattr(exc, 'strerror', None) or exc}"
    if not stat.S_ISREG(st.st_mode):
        return f"the trace path {target!r} is {_kind(st.st_mode)}: it will not be written"
    if not os.access(target, os.W_OK):
        return f"the trace file {target!r} is not writable"
    if stat.S_IMODE(st.st_mode) & 0o077:
        return f"notice: {_wide_mode_notice(target, st.st_mode)}"
    return None


def _directory_problem(target: str) -> str | None:
    directory = os.path.dirname(target) or "."
    try:
        st = os.stat(directory)
    except FileNotFoundError:
        return f"the directory of the trace file {target!r} does not exist"
    except (OSError, ValueError) as exc:
        return f"impossible trace path {target!r}: {getattr(exc, 'strerror', None) or exc}"
    if not stat.S_ISDIR(st.st_mode):
        return f"impossible trace path {target!r}: {directory!r} is not a directory"
    if not os.access(directory, os.W_OK | os.X_OK):
        return f"the directory {directory!r} is not writable: {target!r} cannot be created"
    return None


def _render_line_for_tests(event_dict: dict[str, Any]) -> bytes:
    return _render(None, "info", event_dict)
