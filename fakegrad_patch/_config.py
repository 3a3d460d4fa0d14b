"""Runtime settings: the ``on_missing`` policy and its environment variable.

Standard library only: imported by the start-up path, which must not import torch.
"""

from __future__ import annotations

import os
import threading
import warnings
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


def validate_on_missing(value: object) -> OnMissing:
    """Return ``value`` as a policy or raise ValueError naming the valid ones."""
    if not isinstance(value, str) or value.strip().lower() not in ON_MISSING_VALUES:
        raise ValueError(
            f"invalid on_missing policy {value!r}: expected one of "
            + ", ".join(repr(v) for v in ON_MISSING_VALUES)
        )
    return cast(OnMissing, value.strip().lower())


def settings_from_env(environ: dict[str, str] | None = None) -> Settings:
    """Settings from the environment. An invalid value warns (never raises: this runs at start-up)
    and falls back to the default."""
    env = os.environ if environ is None else environ
    raw = env.get(ENV_ON_MISSING, "").strip()
    if not raw:
        return Settings()
    try:
        return Settings(on_missing=validate_on_missing(raw))
    except ValueError as exc:
        warnings.warn(
            f"fakegrad_patch: {ENV_ON_MISSING}: {exc}; using {DEFAULT_ON_MISSING!r}",
            FakeGradPatchWarning,
            stacklevel=2,
        )
        return Settings()


_lock = threading.Lock()
_current: Settings | None = None


def current() -> Settings:
    """The settings in force (read from the environment on first use)."""
    global _current
    settings = _current
    if settings is None:
        with _lock:
            if _current is None:
                _current = settings_from_env()
            settings = _current
    return settings


def update(*, on_missing: object = None) -> Settings:
    """Change settings; return the previous ones. Arguments left as ``None`` are unchanged."""
    global _current
    with _lock:
        previous = _current if _current is not None else settings_from_env()
        new = previous
        if on_missing is not None:
            new = replace(new, on_missing=validate_on_missing(on_missing))
        _current = new
    return previous


def restore(settings: Settings) -> None:
    """Put back settings returned by :func:`update`."""
    global _current
    with _lock:
        _current = settings
