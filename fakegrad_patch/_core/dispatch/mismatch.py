"""Saying plainly when real-value propagation refuses a fake kernel.

A propagating mode runs every op twice, on fake (meta) tensors and on the real propagated values,
and compares the outputs' metadata; a difference raises upstream's ``MetadataMismatchError`` out
of the user's forward, with a message of tensor reprs. The best-known case is an upstream defect:
under **CPU autocast** BatchNorm/LayerNorm/GroupNorm get reduced-precision inputs with float32
parameters; the CPU kernel returns their statistics (``save_mean``/``save_invstd``,
``mean``/``rstd``) in float32, the fake kernel in the input dtype (measured on 2.13.0 and 2.14.1,
patched or not, forward and eval BatchNorm too).

The patch wraps the exception's ``__init__`` (nothing runs unless one is raised): when the outer
"Real tensor propagation found a metadata mismatch" error is made, it traces
``propagation_mismatch`` (op, output, the cause as upstream words it, which known defect) and,
in a user's mode (no ShapeEnv; Python 3.11+), adds a note to the exception that says what it is
and how to work around it. ``verify`` words its error from :func:`describe`. Nothing is repaired:
the known repair would patch fake kernels that torch.compile, export and make_fx share.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from typing import Any

from ... import trace
from ..typing import InternalErrors

#: The ops whose CPU fake kernels return their statistics in the input dtype.
NORM_OPS = (
    "aten.native_batch_norm.",
    "aten._native_batch_norm_legit",
    "aten.native_layer_norm.",
    "aten.native_group_norm.",
)
CPU_AUTOCAST_NORM = "cpu_autocast_norm"

_PREFIX = "Real tensor propagation found"
_WHERE = re.compile(r"at output(\S*), for func: (\S+)\s*$")

HINTS = {
    CPU_AUTOCAST_NORM: (
        "fakegrad_patch: this is an upstream PyTorch defect, not a gradient difference (patched "
        "or not): under CPU autocast a norm layer gets a reduced-precision input with float32 "
        "parameters; the CPU kernel returns its statistics in float32, the fake kernel in the "
        "input dtype, and real-value propagation refuses the mismatch at the first norm. "
        "Workaround: run the norm layers in float32 (with torch.autocast('cpu', enabled=False): "
        "y = norm(x.float()).to(x.dtype)) or run without autocast; see docs/troubleshooting.md "
        "('MetadataMismatchError under CPU autocast')."
    ),
    None: (
        "fakegrad_patch: real-value propagation found that this op's fake (meta) kernel "
        "disagrees with its real kernel: an upstream defect of the op's fake implementation, not "
        "a gradient difference; the model cannot run under propagation as it is (see "
        "docs/troubleshooting.md)."
    ),
}


def describe(exc: BaseException, cause: BaseException | None = None) -> dict[str, Any] | None:
    """What a propagation mismatch error says, as plain data: ``op``, ``output``, ``cause``,
    ``known`` (``"cpu_autocast_norm"`` or None) and ``hint``; None for other errors."""
    reason = str(getattr(exc, "reason", "") or exc)
    if not reason.startswith(_PREFIX):
        return None
    found = _WHERE.search(reason)
    op = found.group(2) if found else None
    output = found.group(1) if found else None
    inner = cause if cause is not None else exc.__cause__
    text = str(getattr(inner, "reason", "") or inner or "").strip().splitlines()
    cause_text = text[0][:200] if text else None
    known = None
    if (
        op is not None
        and op.startswith(NORM_OPS)
        and cause_text is not None
        and cause_text.startswith("Dtypes")
        and "float32" in cause_text
    ):
        known = CPU_AUTOCAST_NORM
    return {"op": op, "output": output, "cause": cause_text, "known": known, "hint": HINTS[known]}


class Mismatch:
    """The wrapper around ``MetadataMismatchError.__init__``."""

    def __init__(self, errors: InternalErrors, repairing: Callable[[], bool]) -> None:
        self._errors = errors
        #: whether the dispatch path rebuilds a refused op's outputs from the real kernel's
        self._repairing = repairing
        self.active = True

    def init(self, wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: Any) -> Any:
        result = wrapped(*args, **kwargs)
        if self.active:
            try:
                self._seen(instance)
            except Exception as exc:  # never make the host's error worse
                self._errors.internal_error("mismatch", exc)
        return result

    def _seen(self, exc: BaseException) -> None:
        reason = getattr(exc, "reason", None)
        if not isinstance(reason, str) or not reason.startswith(_PREFIX):
            return
        user = _in_user_mode()
        if user and self._repairing():
            # the dispatch wrapper makes the op's outputs from the real kernel's
            # (``propagation_rebuilt``) and calls :meth:`report` only when it cannot
            return
        self.report(exc, cause=sys.exc_info()[1], note=user)

    def report(
        self, exc: BaseException, cause: BaseException | None = None, *, note: bool = True
    ) -> None:
        """Trace ``propagation_mismatch`` and, in a user's mode, add the note."""
        info = describe(exc, cause=cause)  # made inside the inner error's handler
        if info is None:
            return
        if trace.enabled(trace.WARNING):
            trace.emit(
                "propagation_mismatch",
                trace.WARNING,
                op=info["op"],
                output=info["output"],
                cause=info["cause"],
                known=info["known"],
            )
        if note and hasattr(exc, "add_note"):
            exc.add_note(info["hint"])


def _in_user_mode() -> bool:
    """Is the mode that raises a user's (no ShapeEnv)? Tracers' modes get no note."""
    frame: Any = sys._getframe(3)
    for _ in range(8):
        if frame is None:
            return False
        mode = frame.f_locals.get("self")
        if mode is not None and hasattr(mode, "propagate_real_tensors"):
            return getattr(mode, "shape_env", None) is None
        frame = frame.f_back
    return False
