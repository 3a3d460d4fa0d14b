"""The trace's configuration: levels, :class:`TraceConfig`, parsing, the environment variables.

Standard library only. The level names come from the settings table (``_config.TRACE_LEVELS``),
which parses ``FAKEGRAD_TRACE_LEVEL`` before this package is imported.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import warnings
from typing import Any, Final

from .. import _config as _settings
from .._errors import FakeGradPatchWarning

SCHEMA_VERSION: Final = 1

#: level name -> number (10, 20, 30, 40 as in ``logging``): the one table, kept with the settings
#: that parse level names; structlog's method names are its keys
LEVELS: Final = _settings.TRACE_LEVELS
DEBUG: Final = LEVELS["debug"]
INFO: Final = LEVELS["info"]
WARNING: Final = LEVELS["warning"]
ERROR: Final = LEVELS["error"]
NAMES_BY_LEVEL: Final = {number: name for name, number in LEVELS.items()}

ENV_PATH: Final = "FAKEGRAD_TRACE"
ENV_LEVEL: Final = "FAKEGRAD_TRACE_LEVEL"
ENV_MAX_BYTES: Final = "FAKEGRAD_TRACE_MAX_BYTES"
ENV_JSON: Final = "FAKEGRAD_TRACE_JSON"
DEFAULT_BUFFER_SIZE: Final = 10_000
#: A trace file is rotated to ``path.1`` when it reaches this size (0: never).
DEFAULT_MAX_BYTES: Final = 100 * 1024 * 1024
#: Keys every event carries, in the order they are written.
ENVELOPE_KEYS: Final = ("event", "level", "timestamp", "schema", "pid", "tid")


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


def normalize_path(path: str | os.PathLike[str] | None) -> str | None:
    """``None``/empty: no sink; ``"-"``: stderr; otherwise the absolute path."""
    if path is None:
        return None
    text = os.fspath(path)
    if not text:
        return None
    if text == "-":
        return "-"
    return os.path.abspath(os.path.expanduser(text))


def warn(message: str) -> None:
    """Warn without ever raising into the host: warnings-as-errors must not break tracing's
    callers, which run inside backward."""
    with contextlib.suppress(Exception):
        warnings.warn(message, FakeGradPatchWarning, stacklevel=3)


def env_value(env: str) -> Any:
    """The parsed value of ``env``: None when unset, blank or invalid. An invalid value warns
    once and never raises (``import fakegrad_patch`` checks the environment again, raising under
    ``-W error``)."""
    value, problem = _settings.parse_env(env)
    if problem is not None:
        _settings.warn_invalid_env(env, os.environ.get(env, ""), problem, may_raise=False)
    return value


def config_from_env() -> TraceConfig:
    """The configuration ``FAKEGRAD_TRACE``, ``FAKEGRAD_TRACE_LEVEL`` and
    ``FAKEGRAD_TRACE_MAX_BYTES`` ask for (the defaults where unset or invalid)."""
    path = normalize_path(env_value(ENV_PATH))
    level = env_value(ENV_LEVEL)
    max_bytes = env_value(ENV_MAX_BYTES)
    return TraceConfig(
        path=path, level=level, max_bytes=DEFAULT_MAX_BYTES if max_bytes is None else max_bytes
    )
