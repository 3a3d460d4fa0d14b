"""The narrow collaborators the core's parts hand each other (structlog's ``typing.py`` habit):
a part gets the one capability it uses, never the whole installation."""

from __future__ import annotations

from typing import Any, Protocol


class InternalErrors(Protocol):
    """Where an unexpected exception of the patch's own code goes (traced once, never raised
    into the host's program)."""

    def internal_error(self, where: str, exc: BaseException) -> None: ...


class CopyRefresher(Protocol):
    """Gives the live fakes whose values copy a real tensor its new values."""

    def refresh(self, t: Any) -> None: ...


class RetainedArmer(Protocol):
    """Arms a real non-leaf whose ``retain_grad()`` may receive a fake gradient."""

    def arm_retained(self, t: Any) -> None: ...


class MismatchReporter(Protocol):
    """Says a propagation metadata mismatch plainly."""

    def report(self, exc: BaseException) -> None: ...


class DispatchSwitch(Protocol):
    """The ``FakeTensorMode.dispatch`` wrapper's switch."""

    @property
    def observing(self) -> bool: ...

    def observe(self) -> bool: ...

    def set_policy(self, explicit: bool) -> None: ...


class ModeRegistry(Protocol):
    """Keeps the backward wrapper in place while a propagating mode lives."""

    def need_mode(self, mode: Any) -> None: ...


class FakeLeafMirror(Protocol):
    """The fake-leaf driver the converter wrapper tells of every conversion."""

    def mirroring(self) -> bool: ...

    def on_convert(self, mode: Any, t: Any, fake: Any) -> None: ...


class ModeTrust(Protocol):
    """Whether a mode's propagated values can be trusted (conversions the patch did not see)."""

    def check_mode(self, mode: Any, *, definite_only: bool = False) -> bool: ...


class BackwardScopes(Protocol):
    """DDP's scope around a backward started inside a mode in which a DDP forward ran."""

    def backward_scope(self) -> Any: ...
