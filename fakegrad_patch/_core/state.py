"""What every layer of the core may read: the one warning per process, and the installation now
in force.

This module sits below everything else in ``fakegrad_patch._core`` (it imports nothing of the
package), so that the lower layers (accumulate, write-back, DDP, fake leaves) can warn once and
find the current installation without importing :mod:`~fakegrad_patch._core.install`, which builds
them: the package's imports then run one way (activation -> install -> arming/values/accumulate ->
registries/targets; tests/test_layout.py checks it).
"""

from __future__ import annotations

import threading
import warnings
from typing import Any

from .._errors import FakeGradPatchWarning

_lock = threading.Lock()
#: keys of the warnings already shown in this process (tests discard one to see it again)
WARNED: set[str] = set()


def warn_once(key: str, message: str, *, stacklevel: int = 3) -> None:
    """One FakeGradPatchWarning per ``key`` per process."""
    with _lock:
        if key in WARNED:
            return
        WARNED.add(key)
    warnings.warn(message, FakeGradPatchWarning, stacklevel=stacklevel)


class _Current:
    #: the installation in force (an ``install.applied.Applied``), or None
    applied: Any = None


def current() -> Any:
    """The installation in force (``install.applied.Applied``), or None (not applied)."""
    return _Current.applied


def set_current(applied: Any) -> None:
    _Current.applied = applied


#: per thread: ``converting.fast`` is True while the propagation fast path converts an op's real
#: arguments (the op has not run for real: frame inspection cannot tell, no ``_dispatch_impl``)
converting = threading.local()


def op_ran_for_real(resolved: Any) -> bool | None:
    """Has the op being dispatched already run on its real arguments (see
    ``targets._make_op_ran_for_real``)? False during the fast path's conversions."""
    if getattr(converting, "fast", False):
        return False
    return resolved.op_ran_for_real()
