"""Runtime settings: the table of every setting, its parsers, and the ``on_missing`` policy.

:data:`SETTINGS` is the one list of what a user can set: each :class:`Setting` says its
environment variable, the Python, CLI and pytest-ini entry points that take it, the module that
reads it first, the allowed values and the parser. Everything that reads a setting parses it with
:func:`parse` (or the setting's own ``parse``) and words a bad value with :func:`invalid_message` /
:func:`env_message`, so that a bad value always gives one message naming the setting, the value
given and the allowed values; :func:`check_environment` (run by ``import fakegrad_patch``, before
the patch is installed) and ``doctor`` walk the same table. tests/test_settings_validation.py is
driven by it.

Standard library only: imported by the start-up path, which must not import torch.

Why it is long: :data:`SETTINGS` is one table (a third of the file) with the parsers it names
next to it; split, a setting's row and its parser would live apart. Sections: the settings and
their values, the parsers, the table, reading the environment, the settings in force.
"""

from __future__ import annotations

import math
import os
import sys
import threading
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal, cast

from ._errors import FakeGradPatchWarning

OnMissing = Literal["drop", "zeros", "error", "keep"]

#: Valid values of ``on_missing``, in documentation order.
ON_MISSING_VALUES: tuple[str, ...] = ("drop", "zeros", "error", "keep")
DEFAULT_ON_MISSING: OnMissing = "drop"
ENV_ON_MISSING = "FAKEGRAD_ON_MISSING"

Buffers = Literal["upstream", "write_back"]
#: Valid values of ``buffers``, in documentation order.
BUFFERS_VALUES: tuple[str, ...] = ("upstream", "write_back")
DEFAULT_BUFFERS: Buffers = "upstream"
ENV_BUFFERS = "FAKEGRAD_BUFFERS"

Propagation = Literal["fast", "repair", "upstream"]
#: Valid values of ``propagation``, in documentation order.
PROPAGATION_VALUES: tuple[str, ...] = ("fast", "repair", "upstream")
DEFAULT_PROPAGATION: Propagation = "fast"
ENV_PROPAGATION = "FAKEGRAD_PROPAGATION"


@dataclass(frozen=True)
class Settings:
    """What the patch does when a fake gradient reaches a real leaf.

    on_missing: what to do when the fake gradient carries no real values (propagation off, or an
        op that could not propagate): ``drop`` (leaf keeps what it had; warned once and traced),
        ``zeros`` (accumulate real zeros), ``error`` (raise FakeGradError; the leaf keeps what it
        had), ``keep`` (upstream behaviour: the leaf receives the FakeTensor).
    on_missing_explicit: True when the user chose ``on_missing`` (``FAKEGRAD_ON_MISSING`` set to a
        valid value, or ``configure(on_missing=...)`` / ``patched(on_missing=...)``); False when
        ``on_missing`` is the default (also after an invalid ``FAKEGRAD_ON_MISSING``).
    buffers: what happens to real tensors that do not require grad (buffers such as BatchNorm's
        running statistics, spectral_norm's ``_u``/``_v``, frozen parameters, optimizer state)
        when a propagating mode updates them in place as op inputs: ``upstream`` (default: the
        update is applied to the fake's private copy only, the real tensor stays as it was) or
        ``write_back`` (the update reaches the real tensor exactly once, as in eager mode). See
        docs/configuration.md.
    propagation: what the patch does to real-value propagation itself in a propagating mode
        without a ShapeEnv (a user's): ``fast`` (default: ops that make new tensors run their
        real kernel once and their fake outputs are made from its outputs; the repairs below
        for the rest), ``repair`` (upstream's propagation, with values it gets wrong repaired
        and ops whose fake side refuses or disagrees after the real kernel ran taking the real
        kernel's outputs) or ``upstream`` (FakeTensorMode's propagation as it is).
    """

    on_missing: OnMissing = DEFAULT_ON_MISSING
    on_missing_explicit: bool = False
    buffers: Buffers = DEFAULT_BUFFERS
    propagation: Propagation = DEFAULT_PROPAGATION


#: How many characters of a bad value a message echoes (environment values can be huge).
ECHO_LIMIT = 60


def _shown(value: object) -> str:
    """``value`` for a message: escaped (``ascii``), cut to :data:`ECHO_LIMIT` characters."""
    if isinstance(value, str) and len(value) > ECHO_LIMIT:
        return f"{value[:ECHO_LIMIT]!a}... ({len(value)} characters)"
    text = ascii(value)
    if len(text) > ECHO_LIMIT + 2:
        return f"{text[:ECHO_LIMIT]}... ({type(value).__name__})"
    return text


shown = _shown

# -- parsers: value (a string from the environment or a command line, or a Python object) ------
# -> the parsed value; ValueError (any text: messages are built by invalid_message) when invalid.


def _invalid() -> ValueError:
    return ValueError("invalid")


#: Values of ``FAKEGRAD_PATCH`` (the start-up hook, which may not import this module, has its own
#: copy; tests/test_settings_validation.py pins the two to each other).
SWITCH_ON: tuple[str, ...] = ("1", "true", "yes", "on")
SWITCH_OFF: tuple[str, ...] = ("", "0", "false", "no", "off")


def parse_switch(value: object) -> bool:
    """``FAKEGRAD_PATCH``: 1/true/yes/on -> True, empty/0/false/no/off -> False."""
    if not isinstance(value, str):
        raise _invalid()
    text = value.strip().lower()
    if text in SWITCH_ON:
        return True
    if text in SWITCH_OFF:
        return False
    raise _invalid()


def validate_on_missing(value: object) -> OnMissing:
    """Return ``value`` as a policy or raise ValueError naming the setting, the value and the
    valid ones."""
    if not isinstance(value, str) or value.strip().lower() not in ON_MISSING_VALUES:
        raise ValueError(invalid_message(setting("on_missing"), value))
    return cast(OnMissing, value.strip().lower())


def _parse_on_missing(value: object) -> OnMissing:
    return validate_on_missing(value)


def validate_buffers(value: object) -> Buffers:
    """Return ``value`` as a buffers mode or raise ValueError naming the setting, the value and
    the valid ones (``write-back`` is taken for ``write_back``)."""
    text = value.strip().lower().replace("-", "_") if isinstance(value, str) else None
    if text not in BUFFERS_VALUES:
        raise ValueError(invalid_message(setting("buffers"), value))
    return cast(Buffers, text)


def validate_propagation(value: object) -> Propagation:
    """Return ``value`` as a propagation mode or raise ValueError naming the setting, the value
    and the allowed values."""
    text = value.strip().lower() if isinstance(value, str) else None
    if text not in PROPAGATION_VALUES:
        raise ValueError(invalid_message(setting("propagation"), value))
    return cast(Propagation, text)


def _parse_path(value: object) -> str | None:
    """A trace sink path: ``None``/empty (no sink), ``"-"`` (stderr), or a path without NUL."""
    if value is None:
        return None
    if isinstance(value, bytes) or not isinstance(value, str | os.PathLike):
        raise _invalid()
    try:
        text = os.fspath(value)
    except TypeError as exc:
        raise _invalid() from exc
    if not isinstance(text, str) or "\0" in text:
        raise _invalid()
    return text.strip() or None


#: Trace level name -> number; fakegrad_patch.trace takes its levels from this table.
TRACE_LEVELS: dict[str, int] = {"debug": 10, "info": 20, "warning": 30, "error": 40}


def _non_negative_int(value: object) -> int:
    """An int >= 0, or a string of decimal digits (``_`` separators allowed) of one."""
    if isinstance(value, bool):
        raise _invalid()
    if isinstance(value, str):
        text = value.strip().replace("_", "")
        if not text.isdigit() or not text.isascii():
            raise _invalid()
        value = int(text)
    if not isinstance(value, int) or value < 0:
        raise _invalid()
    return value


def _parse_level(value: object) -> int:
    if isinstance(value, str) and value.strip().lower() in TRACE_LEVELS:
        return TRACE_LEVELS[value.strip().lower()]
    return _non_negative_int(value)


def _parse_json_backend(value: object) -> str:
    if not isinstance(value, str) or value.strip().lower() not in ("", "auto", "stdlib"):
        raise _invalid()
    return value.strip().lower() or "auto"


def _positive_int(value: object) -> int:
    number = _non_negative_int(value)
    if number < 1:
        raise _invalid()
    return number


def _zero_grad(value: object) -> str:
    if not isinstance(value, str) or value not in ("none", "zeros", "never"):
        raise _invalid()
    return value


def _finite_non_negative(value: object) -> float:
    if isinstance(value, bool):
        raise _invalid()
    if isinstance(value, str):
        try:
            value = float(value.strip())
        except ValueError as exc:
            raise _invalid() from exc
    if not isinstance(value, int | float):
        raise _invalid()
    number = float(value)
    if not math.isfinite(number) or number < 0:
        raise _invalid()
    return number


def _tolerance(value: object) -> object:
    """``None`` (per-dtype default), a finite number >= 0, or a mapping whose values are.
    (The keys, dtypes, are checked by ``verify``, which has torch.)"""
    if value is None:
        return None
    if isinstance(value, Mapping):
        for item in value.values():
            _finite_non_negative(item)
        return value
    return _finite_non_negative(value)


def _check_buffers(value: object) -> bool | str:
    if value is True or value is False or value == "strict":
        return cast("bool | str", value)
    raise _invalid()


PYTEST_TRUE: tuple[str, ...] = ("y", "yes", "t", "true", "on", "1")
PYTEST_FALSE: tuple[str, ...] = ("n", "no", "f", "false", "off", "0")


def _pytest_bool(value: object) -> bool:
    """pytest's ``bool`` ini type (the plugin words its own error: it may not import us)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        text = value.strip().lower()
        if text in PYTEST_TRUE:
            return True
        if text in PYTEST_FALSE:
            return False
    raise _invalid()


# -- the table -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Setting:
    """One setting and every place it can be given.

    name: the Python keyword (``configure(on_missing=...)``, ``configure_trace(max_bytes=...)``).
    env: its environment variable, or None.
    read_by: where its value is first read (module or function).
    python: the Python entry points that take it (``"fakegrad_patch.configure"``, ...).
    cli: the command-line options that take it (``"verify --atol"``).
    ini: the pytest ini options that take it.
    allowed: the allowed values, as messages say them (after ``expected``).
    parse: value -> parsed value; ValueError when invalid.
    default: what an unset (or invalid) environment value means, as messages say it.
    cli_allowed: the allowed values on a command line, when fewer than ``allowed`` (a dict
        tolerance cannot be typed there); empty: ``allowed``.
    """

    name: str
    env: str | None
    read_by: str
    python: tuple[str, ...]
    cli: tuple[str, ...]
    ini: tuple[str, ...]
    allowed: str
    parse: Callable[[Any], Any]
    default: str
    cli_allowed: str = ""


SETTINGS: tuple[Setting, ...] = (
    Setting(
        name="patch",
        env="FAKEGRAD_PATCH",
        read_by="_fakegrad_patch_startup (the .pth/.start start-up hook)",
        python=(),
        cli=(),
        ini=(),
        allowed="one of 1/true/yes/on or 0/false/no/off",
        parse=parse_switch,
        default="off (not activated)",
    ),
    Setting(
        name="on_missing",
        env=ENV_ON_MISSING,
        read_by="fakegrad_patch._config (at import fakegrad_patch)",
        python=("fakegrad_patch.configure", "fakegrad_patch.patched", "fakegrad_patch.materialize"),
        cli=(),
        ini=(),
        allowed="one of " + ", ".join(repr(v) for v in ON_MISSING_VALUES),
        parse=_parse_on_missing,
        default=repr(DEFAULT_ON_MISSING),
    ),
    Setting(
        name="buffers",
        env=ENV_BUFFERS,
        read_by="fakegrad_patch._config (at import fakegrad_patch)",
        python=("fakegrad_patch.configure", "fakegrad_patch.patched", "fakegrad_patch.verify"),
        cli=("verify --buffers",),
        ini=(),
        allowed="one of " + ", ".join(repr(v) for v in BUFFERS_VALUES),
        parse=validate_buffers,
        default=repr(DEFAULT_BUFFERS),
    ),
    Setting(
        name="propagation",
        env=ENV_PROPAGATION,
        read_by="fakegrad_patch._config (at import fakegrad_patch)",
        python=("fakegrad_patch.configure", "fakegrad_patch.patched"),
        cli=(),
        ini=(),
        allowed="one of " + ", ".join(repr(v) for v in PROPAGATION_VALUES),
        parse=validate_propagation,
        default=repr(DEFAULT_PROPAGATION),
    ),
    Setting(
        name="path",
        env="FAKEGRAD_TRACE",
        read_by="fakegrad_patch.trace (at import)",
        python=("trace.configure_trace",),
        cli=(),
        ini=(),
        allowed="a file path without NUL characters, '-' for stderr, or None/empty for no sink",
        parse=_parse_path,
        default="no sink",
    ),
    Setting(
        name="level",
        env="FAKEGRAD_TRACE_LEVEL",
        read_by="fakegrad_patch.trace (at import)",
        python=("trace.configure_trace", "trace.set_level", "trace.capture"),
        cli=(),
        ini=(),
        allowed="one of debug, info, warning, error (any case), or an integer >= 0",
        parse=_parse_level,
        default="the default ('info' with a sink, else 'warning')",
    ),
    Setting(
        name="max_bytes",
        env="FAKEGRAD_TRACE_MAX_BYTES",
        read_by="fakegrad_patch.trace (at import)",
        python=("trace.configure_trace",),
        cli=(),
        ini=(),
        allowed="an integer >= 0 (bytes; 0: no limit)",
        parse=_non_negative_int,
        default="the default 104857600",
    ),
    Setting(
        name="buffer_size",
        env=None,
        read_by="fakegrad_patch.trace.configure_trace",
        python=("trace.configure_trace",),
        cli=(),
        ini=(),
        allowed="an integer >= 0",
        parse=_non_negative_int,
        default="10000",
    ),
    Setting(
        name="json",
        env="FAKEGRAD_TRACE_JSON",
        read_by="fakegrad_patch.trace (first line written to a sink)",
        python=(),
        cli=(),
        ini=(),
        allowed="one of 'auto' (orjson when installed), 'stdlib'",
        parse=_parse_json_backend,
        default="'auto'",
    ),
    Setting(
        name="steps",
        env=None,
        read_by="fakegrad_patch.verify",
        python=("fakegrad_patch.verify",),
        cli=("verify --steps",),
        ini=(),
        allowed="an integer >= 1",
        parse=_positive_int,
        default="1",
    ),
    Setting(
        name="zero_grad",
        env=None,
        read_by="fakegrad_patch.verify",
        python=("fakegrad_patch.verify",),
        cli=("verify --zero-grad",),
        ini=(),
        allowed="one of 'none', 'zeros', 'never'",
        parse=_zero_grad,
        default="'none'",
    ),
    Setting(
        name="atol",
        env=None,
        read_by="fakegrad_patch.verify",
        python=("fakegrad_patch.verify",),
        cli=("verify --atol",),
        ini=(),
        allowed="a finite number >= 0, or a dict {dtype: finite number >= 0}",
        parse=_tolerance,
        default="per dtype",
        cli_allowed="a finite number >= 0",
    ),
    Setting(
        name="rtol",
        env=None,
        read_by="fakegrad_patch.verify",
        python=("fakegrad_patch.verify",),
        cli=("verify --rtol",),
        ini=(),
        allowed="a finite number >= 0, or a dict {dtype: finite number >= 0}",
        parse=_tolerance,
        default="per dtype",
        cli_allowed="a finite number >= 0",
    ),
    Setting(
        name="check_buffers",
        env=None,
        read_by="fakegrad_patch.verify",
        python=("fakegrad_patch.verify",),
        cli=(),
        ini=(),
        allowed="True, False or 'strict'",
        parse=_check_buffers,
        default="True",
    ),
    Setting(
        name="fakegrad_patch",
        env=None,
        read_by="fakegrad_patch_pytest (pytest_configure)",
        python=(),
        cli=(),
        ini=("fakegrad_patch",),
        allowed="a pytest boolean: " + "/".join(PYTEST_TRUE) + " or " + "/".join(PYTEST_FALSE),
        parse=_pytest_bool,
        default="false",
    ),
    Setting(
        name="fakegrad_strict",
        env=None,
        read_by="fakegrad_patch_pytest (pytest_configure)",
        python=(),
        cli=(),
        ini=("fakegrad_strict",),
        allowed="a pytest boolean: " + "/".join(PYTEST_TRUE) + " or " + "/".join(PYTEST_FALSE),
        parse=_pytest_bool,
        default="false",
    ),
)

_BY_NAME: dict[str, Setting] = {s.name: s for s in SETTINGS}
_BY_ENV: dict[str, Setting] = {s.env: s for s in SETTINGS if s.env is not None}


def setting(name: str) -> Setting:
    """The table row called ``name`` (its Python keyword)."""
    return _BY_NAME[name]


def env_setting(env: str) -> Setting:
    """The table row of environment variable ``env``."""
    return _BY_ENV[env]


def invalid_message(row: Setting, value: object) -> str:
    """The one sentence for a bad value given through Python or a command line."""
    return f"invalid {row.name} {_shown(value)}: expected {row.allowed}"


def env_problem(row: Setting, raw: str) -> str:
    """What is wrong with ``row.env=raw`` (the variable is named by the caller)."""
    return f"invalid value {_shown(raw)}: expected {row.allowed}"


def env_message(row: Setting, raw: str) -> str:
    """The one warning for a bad environment value: the variable, the value, the allowed values,
    and what is used instead."""
    return f"fakegrad_patch: {row.env}: {env_problem(row, raw)}; using {row.default}"


def parse(name: str, value: object) -> Any:
    """``value`` parsed by the row ``name``; ValueError with :func:`invalid_message`."""
    row = _BY_NAME[name]
    try:
        return row.parse(value)
    except ValueError:
        raise ValueError(invalid_message(row, value)) from None


def parse_env(env: str, environ: Mapping[str, str] | None = None) -> tuple[Any, str | None]:
    """(parsed value or None when unset/blank/invalid, the warning for an invalid value)."""
    row = _BY_ENV[env]
    raw = (os.environ if environ is None else environ).get(env)
    if raw is None or not raw.strip():
        return None, None
    try:
        return row.parse(raw), None
    except ValueError:
        return None, env_message(row, raw)


# -- reporting: one warning per invalid environment value per process ----------------------------

_reported: set[tuple[str, str]] = set()
_reported_lock = threading.Lock()


def warn_invalid_env(env: str, raw: str, message: str, *, may_raise: bool) -> None:
    """Warn ``message`` (FakeGradPatchWarning) once per process for ``env=raw``.

    ``may_raise``: the warning may become an exception (``-W error``): then it is recorded as given
    and propagates. Otherwise (a read inside the host's computation) an exception from the
    warning is swallowed and the value is left unreported, so :func:`check_environment` raises it
    at install, where the user looks.
    """
    key = (env, raw)
    with _reported_lock:
        if key in _reported:
            return
        _reported.add(key)
    try:
        warnings.warn(message, FakeGradPatchWarning, stacklevel=3)
    except Exception:
        if may_raise:
            raise
        with _reported_lock:
            _reported.discard(key)


def _hook_reported_switch() -> bool:
    """True when the start-up hook ran in this process (it reports a bad ``FAKEGRAD_PATCH``)."""
    hook = sys.modules.get("_fakegrad_patch_startup")
    state = getattr(hook, "state", None)
    return isinstance(state, dict) and bool(state.get("handled"))


def environment_problems(environ: Mapping[str, str] | None = None) -> list[tuple[Setting, str]]:
    """Every environment setting of the table whose value is invalid, with its raw value."""
    env = os.environ if environ is None else environ
    found = []
    for row in SETTINGS:
        if row.env is None:
            continue
        raw = env.get(row.env)
        if raw is None or not raw.strip():
            continue
        try:
            row.parse(raw)
        except ValueError:
            found.append((row, raw))
    return found


def check_environment() -> list[str]:
    """Validate every environment setting of the table (``import fakegrad_patch`` calls this
    before installing): one FakeGradPatchWarning per invalid value, once per process (a value the
    start-up hook already reported is not reported again); then read ``on_missing`` so that the
    policy in force is fixed now. Never raises unless warnings are errors. Returns the messages."""
    messages = []
    for row, raw in environment_problems():
        if row.env == "FAKEGRAD_PATCH":
            if _hook_reported_switch():
                continue
            message = (
                f"fakegrad_patch: {row.env}: {env_problem(row, raw)}; the start-up hook did not "
                "activate anything (import fakegrad_patch installs the patch)"
            )
        else:
            message = env_message(row, raw)
        messages.append(message)
        warn_invalid_env(row.env or "", raw, message, may_raise=True)
    current()
    return messages


# -- on_missing ----------------------------------------------------------------------------------


def _from_env(environ: Mapping[str, str] | None = None) -> tuple[Settings, str | None]:
    """Settings from the environment, and the warning to give when ``on_missing`` is invalid
    (an invalid ``FAKEGRAD_BUFFERS`` or ``FAKEGRAD_PROPAGATION`` is reported by
    :func:`check_environment`, like every other variable of the table, and means the
    default)."""
    policy, problem = parse_env(ENV_ON_MISSING, environ)
    buffers, _ = parse_env(ENV_BUFFERS, environ)
    propagation, _ = parse_env(ENV_PROPAGATION, environ)
    settings = Settings()
    if buffers is not None:
        settings = replace(settings, buffers=buffers)
    if propagation is not None:
        settings = replace(settings, propagation=propagation)
    if policy is None:
        return settings, problem
    return replace(settings, on_missing=policy, on_missing_explicit=True), None


def settings_from_env(environ: Mapping[str, str] | None = None) -> Settings:
    """Settings from the environment. An invalid value warns (never raises unless warnings are
    errors) and falls back to the default."""
    settings, problem = _from_env(environ)
    if problem is not None:
        warnings.warn(problem, FakeGradPatchWarning, stacklevel=2)
    return settings


def _warn_env(problem: str | None) -> None:
    if problem is not None:
        raw = os.environ.get(ENV_ON_MISSING, "")
        warn_invalid_env(ENV_ON_MISSING, raw, problem, may_raise=True)


_lock = threading.Lock()
_current: Settings | None = None


def current() -> Settings:
    """The settings in force (read from the environment on first use).

    The fallback is stored *before* warning about an invalid value: with warnings turned into
    errors (``-W error``) the first read raises, every later read returns the fallback instead of
    raising again (inside a backward pass, say)."""
    global _current
    settings = _current
    problem = None
    if settings is None:
        with _lock:
            if _current is None:
                _current, problem = _from_env()
            settings = _current
    _warn_env(problem)
    return settings


def update(
    *, on_missing: object = None, buffers: object = None, propagation: object = None
) -> Settings:
    """Change settings; return the previous ones. Arguments left as ``None`` are unchanged; a
    given ``on_missing`` makes it explicit (:attr:`Settings.on_missing_explicit`). Every value is
    validated before anything changes."""
    global _current
    problem = None
    try:
        with _lock:
            if _current is None:
                _current, problem = _from_env()
            previous = _current
            new = previous
            if on_missing is not None:
                new = replace(
                    new, on_missing=validate_on_missing(on_missing), on_missing_explicit=True
                )
            if buffers is not None:
                new = replace(new, buffers=validate_buffers(buffers))
            if propagation is not None:
                new = replace(new, propagation=validate_propagation(propagation))
            _current = new
    finally:
        _warn_env(problem)
    return previous


def restore(settings: Settings) -> None:
    """Put back settings returned by :func:`update` (explicit or not, exactly)."""
    global _current
    with _lock:
        _current = settings
