"""The private structlog pipeline: what happens to an event that passed the level filter.

One processor (:func:`process`) builds the envelope (stable keys first, then the fields, every
value scrubbed to plain data), puts the event in the memory buffer and in each ``capture()``
block that wants it, and returns the JSON line for the sink, or ``b""`` when the sink does not
want it. The renderer returns bytes (orjson when installed, the standard library otherwise) that
the file sink hands to ``os.write`` as they are.

This is a library inside someone else's program: we never call ``structlog.configure`` and never
touch ``logging``. ``structlog.wrap_logger`` gets every argument explicitly, because it falls back
to the global configuration for anything left unset. structlog and ``json`` are imported on the
first event that passes the filter, so ``import fakegrad_patch`` stays light.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Callable, MutableMapping
from typing import Any, Final

from ._env import DEBUG, DEFAULT_BUFFER_SIZE, ENV_JSON, LEVELS, SCHEMA_VERSION, env_value
from ._sinks import FileSink, NullSink, Sink

# -- where events go ------------------------------------------------------------------------------
# Assigned by the public API (trace/__init__.py) under its lock; read by process() without one.
# Each is replaced, never changed in place (but the buffer's contents), so a concurrent event sees
# the old or the new value, never half of a change.

#: the in-memory buffer (``events()``): the newest events, the dicts themselves
buffer: deque[dict[str, Any] | Record] = deque(maxlen=DEFAULT_BUFFER_SIZE)
#: the level of the buffer and of the sink
buffer_level: int = DEBUG
#: active ``capture()`` blocks: (level, list)
captures: tuple[tuple[int, list[dict[str, Any]]], ...] = ()
sink: Sink | None = None
pid = os.getpid()


def _after_fork_in_child() -> None:
    global pid
    pid = os.getpid()
    if isinstance(sink, FileSink):
        sink.after_fork_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


# -- the envelope ---------------------------------------------------------------------------------

_get_ident = threading.get_ident
_PLAIN = (str, int, float, bool, type(None))
_PLAIN_TYPES = frozenset(_PLAIN)  # exact types: the fast path of the envelope


def scrub(value: Any, depth: int = 0) -> Any:
    """Plain data only. Anything else becomes ``"<TypeName>"``: never ``repr`` (a tensor's repr
    can re-enter fake dispatch) and never keep a reference to it (the buffer outlives it)."""
    if type(value) is list and depth < 4:  # shapes: the common case, first
        return [v if type(v) in _PLAIN_TYPES else scrub(v, depth + 1) for v in value]
    if isinstance(value, _PLAIN):
        return value
    if depth < 4:
        if isinstance(value, list | tuple):
            return [v if type(v) in _PLAIN_TYPES else scrub(v, depth + 1) for v in value]
        if isinstance(value, dict):
            return {str(k): scrub(v, depth + 1) for k, v in value.items()}
    return f"<{type(value).__name__}>"


#: (second, "YYYY-MM-DDTHH:MM:SS") of the last timestamp: one tuple, swapped atomically
_second: tuple[int, str] = (-1, "")


def timestamp(now: int | None = None) -> str:
    """ISO 8601 UTC with microseconds, ``2026-11-30T21:54:22.081334Z``, of now or of ``now``
    (``time.time_ns()``); the date and time of day are formatted once per second
    (``datetime.isoformat`` per event costs more than the rest of the envelope)."""
    global _second
    if now is None:
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


def envelope(logger: Any, method_name: str, event_dict: MutableMapping[str, Any]) -> dict[str, Any]:
    """The envelope as a step of its own: stable keys first, in a fixed order (level from the
    method name, the timestamp), then the fields, every value scrubbed. :func:`process` does the
    same in one step with the fan-out; this form is for reading and for the tests."""
    out: dict[str, Any] = {
        "event": event_dict.pop("event"),
        "level": method_name,
        "timestamp": timestamp(),
        "schema": SCHEMA_VERSION,
        "pid": pid,
        "tid": threading.get_ident(),
    }
    fields = event_dict.pop(_OWNED, None) or event_dict.pop(_FIELDS, None)
    for items in (fields or {}, event_dict):
        for key, value in items.items():
            if key not in out:
                out[key] = value if type(value) in _PLAIN_TYPES else scrub(value)
    return out


# -- the processor --------------------------------------------------------------------------------


#: A buffered event not yet spread into its envelope: (event, level name, ``time.time_ns()``,
#: pid, tid, the owned fields). :func:`expand` makes the dict :func:`process` would have made.
Record = tuple[str, str, int, int, int, dict[str, Any]]
_time_ns = time.time_ns


def expand(record: Record) -> dict[str, Any]:
    """A fresh event dict from a :data:`Record`: the same keys, order and values as the envelope
    :func:`process` builds for the same event (the timestamp of the moment it was recorded)."""
    event, level, now, event_pid, tid, fields = record
    out: dict[str, Any] = {
        "event": event,
        "level": level,
        "timestamp": timestamp(now),
        "schema": SCHEMA_VERSION,
        "pid": event_pid,
        "tid": tid,
    }
    out.update(fields)
    return out


def process(
    logger: Any, method_name: str, event_dict: MutableMapping[str, Any]
) -> bytes | tuple[tuple[dict[str, Any]], dict[str, Any]]:
    """The whole pipeline as one structlog processor: :func:`envelope`; the event into the buffer
    (the dict itself: ``events()`` copies) and a copy into each capture block that wants its
    level; then the line as bytes, or ``b""`` (written as nothing) when there is no sink or it
    does not want the event; for the file sink, the event itself (structlog's ``(args,
    kwargs)`` form: the sink renders it, at once or with the lines its thread holds).

    One step rather than three (envelope, fan-out, renderer): one call per event, no
    ``DropEvent`` raised for events the sink does not want, one dict shared by the buffer and the
    renderer. Same keys, order, scrubbing and bytes as :func:`envelope` then :func:`render_line`.

    An owned event (``emit_fields(owned=True)``: the hot paths') that only the buffer wants (no
    line to write, no capture block) is kept as a :data:`Record`, and ``events()`` spreads it
    out: the envelope and the timestamp's text are built when someone reads the buffer, not
    for every event (P13: the trace's cost per event in memory).
    """
    owned = event_dict.pop(_OWNED, None)
    if owned is not None and not captures and len(event_dict) == 1:
        target = sink
        if target is None or target.failed:
            if LEVELS[method_name] >= buffer_level:
                buffer.append(
                    (event_dict["event"], method_name, _time_ns(), pid, _get_ident(), owned)
                )
            return b""
    fields = event_dict.pop(_FIELDS, None) if owned is None else None
    out: dict[str, Any] = {
        "event": event_dict.pop("event"),
        "level": method_name,
        "timestamp": timestamp(),
        "schema": SCHEMA_VERSION,
        "pid": pid,
        "tid": _get_ident(),
    }
    plain = _PLAIN_TYPES
    if owned is not None:
        # emit_fields(owned=True): plain values, no envelope key (its caller's promise): one C call
        # instead of a type test per field (the hot paths' cost per event)
        out.update(owned)
    elif fields:
        for key, value in fields.items():
            if key not in out:
                out[key] = value if type(value) in plain else scrub(value)
    if event_dict:
        for key, value in event_dict.items():
            if key not in out:
                out[key] = value if type(value) in plain else scrub(value)
    level = LEVELS[method_name]
    wanted = level >= buffer_level
    if wanted:
        buffer.append(out)  # deque.append: atomic
    if captures:
        for capture_level, sink_list in captures:
            if level >= capture_level:
                sink_list.append(dict(out))
    target = sink
    if not wanted or target is None or target.failed:
        return b""
    if type(target) is FileSink:
        # the file sink renders it: now, or with the lines its thread holds (FileSink.hold)
        return ((out,), {})  # structlog's (args, kwargs): logger.info(out)
    render = _render_line
    if render is None:
        render = _set_renderer()
    return render(out)


# -- the renderer ---------------------------------------------------------------------------------


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
    if env_value(ENV_JSON) == "stdlib":
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
#: "orjson" or "json" once the first line was rendered (``trace.json_backend``)
json_backend: str | None = None


def _set_renderer() -> Callable[[Any], bytes]:
    global _render_line, json_backend
    json_backend, _render_line = _make_renderer()
    return _render_line


def render_line(event_dict: Any) -> bytes:
    """One event as one JSON line (bytes, with its newline), as the sink gets it."""
    render = _render_line
    if render is None:
        render = _set_renderer()
    return render(event_dict)


# -- the logger -----------------------------------------------------------------------------------


def floor_level(level: int) -> int:
    """The highest standard level <= ``level`` (structlog knows only those)."""
    return max((v for v in (0, *LEVELS.values()) if v <= level), default=0)


def build_logger(threshold: int) -> Any:
    """The private structlog logger for the current sink, dropping events below ``threshold``
    (every argument explicit: nothing comes from structlog's global configuration)."""
    import structlog

    return structlog.wrap_logger(
        NullSink() if sink is None else sink,
        processors=[process],
        wrapper_class=structlog.make_filtering_bound_logger(floor_level(threshold)),
        context_class=dict,
        cache_logger_on_first_use=False,
        logger_factory_args=(),
    ).bind()
