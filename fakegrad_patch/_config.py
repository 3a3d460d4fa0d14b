"""Runtime settings: the ``on_missing`` policy and its environment variable.

Standard library only: imported by the start-up path, which must not import torch.
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Literal, cast

from ._errors import FakeGradPatchWarning

OnMissing = Literal["drop", "zeros", "error", "keep"]

#: Valid values of ``on_missing``, in documentation order.
ON_MISSING_VALUES: tuple[str, ...] = ("drop", "zeros", "error", "keep")
DEFAULT_ON_MISSING: OnMissing = "drop"
ENV_ON_MISSING = "FAKEGRAD_ON_MISSING"


@dataclass(frozen=True)
class Settings:
    """What the patch does when a fake gradient reaches a real leaf.

    on_missing: what to do when the fake gradient carries no real values (propagation off, or an
        op that could not propagate): ``drop`` (leaf keeps what it had; warned once and traced),
        ``zeros`` (accumulate real zeros), ``error`` (raise FakeGradError; the leaf keeps what it
        had), ``keep`` (upstream behaviour: the leaf receives the FakeTensor).
    """

    on_missing: OnMissing = DEFAULT_ON_MISSING
    #: True when the user chose ``on_missing`` (environment or configure()/patched()): only then
    #: does the policy apply in modes that do not propagate real values.
    on_missing_explicit: bool = False


#: How many characters of a bad value a message echoes (environment values can be huge).
ECHO_LIMIT = 60


def _shown(value: object) -> str:
    """``value`` for a message: escaped (``ascii``), cut to :data:`ECHO_LIMIT` characters."""
    if isinstance(value, str) and len(value) > ECHO_LIMIT:
        return f"{value[:ECHO_LIMIT]!a}... ({len(value)} characters)"
    return ascii(value)


def validate_on_missing(value: object) -> OnMissing:
    """Return ``value`` as a policy or raise ValueError naming the valid ones."""
    if not isinstance(value, str) or value.strip().lower() not in ON_MISSING_VALUES:
        raise ValueError(
            f"invalid on_missing policy {_shown(value)}: expected one of "
            + ", ".join(repr(v) for v in ON_MISSING_VALUES)
        )
    return cast(OnMissing, value.strip().lower())


def _from_env(environ: Mapping[str, str] | None = None) -> tuple[Settings, str | None]:
    """Settings from the environment, and the warning to give when a value is invalid."""
    env = os.environ if environ is None else environ
    raw = env.get(ENV_ON_MISSING, "").strip()
    if not raw:
        return Settings(), None
    try:
        return Settings(on_missing=validate_on_missing(raw), on_missing_explicit=True), None
    except ValueError as exc:
        return Settings(), f"fakegrad_patch: {ENV_ON_MISSING}: {exc}; using {DEFAULT_ON_MISSING!r}"


def _warn(problem: str | None) -> None:
    if problem is not None:
        warnings.warn(problem, FakeGradPatchWarning, stacklevel=3)


def settings_from_env(environ: Mapping[str, str] | None = None) -> Settings:
    """Settings from the environment. An invalid value warns (never raises unless warnings are
    errors) and falls back to the default."""
    settings, problem = _from_env(environ)
    _warn(problem)
    return settings


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
    _warn(problem)
    return settings


def update(*, on_missing: object = None) -> Settings:
    """Change settings; return the previous ones. Arguments left as ``None`` are unchanged."""
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
            _current = new
    finally:
        _warn(problem)
    return previous


def restore(settings: Settings) -> None:
    """Put back settings returned by :func:`update`."""
    global _current
    with _lock:
        _current = settings
