"""The patch's own work as named ranges in ``torch.profiler`` (and the autograd profiler).

While a profiler records, each armed backward call shows ``fakegrad_patch::arm`` (the graph walk
and the hook registration, before the engine runs) and ``fakegrad_patch::disarm`` (the hooks
removed when it returns), and each fake gradient handled by the AccumulateGrad pre-hook shows
``fakegrad_patch::materialize: <parameter name>`` (``fakegrad_patch::materialize`` for a leaf
without a name from ``fakegrad_patch.name_parameters``), nested inside the engine's
``autograd::engine::evaluate_function: torch::autograd::AccumulateGrad``. All of them appear in
``key_averages()`` and in ``export_chrome_trace`` (category ``cpu_op``, on the thread that ran
the backward).

Cost when no profiler records: one call of ``torch.autograd._profiler_enabled()`` (about 0.03 us)
per armed backward and per fake gradient; nothing else (benchmark P15). The ranges are the C++
``RecordFunction`` without the dispatcher (targets.RECORD_FUNCTION_FAST), so a FakeTensorMode
active in the thread never sees them. Where the build lacks either touch point, no range is
opened. Opening or closing a range never raises into the host.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from ..touchpoints import targets as _targets

ARM = "fakegrad_patch::arm"
DISARM = "fakegrad_patch::disarm"
MATERIALIZE = "fakegrad_patch::materialize"


def _never() -> bool:
    return False


try:
    _found = _targets.resolve_profiler()
except Exception:  # never break the import of the patch over a diagnostic
    _found = None

#: True while a profiler records. Looked up at every use, so :func:`set_enabled` takes effect at
#: once (benchmark P15 measures the patch with the feature on and off).
recording: Callable[[], bool] = _never if _found is None else _found[0]
_Range: Any = None if _found is None else _found[1]


def available() -> bool:
    """The build has both touch points."""
    return _found is not None


def set_enabled(on: bool) -> bool:
    """Turn the ranges on or off (on by default where available); returns the previous state.
    Off: not even the profiler check runs."""
    global recording
    previous = recording is not _never
    recording = _found[0] if on and _found is not None else _never
    return previous


def begin(name: str) -> Any:
    """Open a range called ``name`` when a profiler records; ``None`` otherwise (pass the result
    to :func:`end`)."""
    if not recording():
        return None
    try:
        span = _Range(name)
        span.__enter__()
    except Exception:
        return None
    return span


def end(span: Any) -> None:
    """Close a range opened by :func:`begin` (``None``: nothing to do)."""
    if span is not None:
        with contextlib.suppress(Exception):
            span.__exit__(None, None, None)


def materialize_name(name: str | None) -> str:
    """The range of one materialization: with the leaf's name when it has one."""
    return f"{MATERIALIZE}: {name}" if name else MATERIALIZE
