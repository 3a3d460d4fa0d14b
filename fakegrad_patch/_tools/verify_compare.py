"""What ``verify`` compares, and how: the eager copy against the patched copy after each step
(gradients, parameter values, losses), the buffers after the last step, and what the patch's own
trace says it did to each parameter. :mod:`.verify` runs the two copies; this module judges them.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .verify_report import BufferReport, ParamReport

#: Default tolerances per gradient dtype: ``torch.testing.assert_close``'s (rtol, atol). The patch
#: runs the same kernels as eager, so differences are normally exactly 0; these only absorb
#: reduction-order noise.
DEFAULT_TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float16: (1e-3, 1e-5),
    torch.bfloat16: (1.6e-2, 1e-5),
    torch.float32: (1.3e-6, 1e-5),
    torch.float64: (1e-7, 1e-7),
    torch.complex64: (1.3e-6, 1e-5),
    torch.complex128: (1e-7, 1e-7),
}

_FALLBACK_TOLERANCE = (1.3e-6, 1e-5)

Tolerance = float | Mapping[torch.dtype, float] | None

_BUFFER_NOTE = (
    "differs from eager: updated on a fake copy inside the mode (upstream; "
    'buffers="write_back" writes it back)'
)

_BUFFER_NOTE_WRITE_BACK = "differs from eager though written back (see the trace)"

_PATCH_EVENTS = {
    "fake_grad_set": "set",
    "fake_grad_accumulate": "accumulate",
    "fake_grad_drop": "drop",
    "fake_grad_error": "error",
    "fake_grad_keep": "keep",
}

#: Outcomes that are problems even when the values happen to agree.
_BAD_OUTCOMES = ("drop", "error", "keep", "zeros")


@dataclass
class _Grad:
    kind: str  # "real" | "fake" | "none"
    tensor: torch.Tensor | None


class Comparison:
    """The eager and the patched copy of one ``verify`` run, compared: one row per parameter,
    the losses, the problems and notes that are no parameter's."""

    def __init__(
        self,
        eager: torch.nn.Module,
        patched: torch.nn.Module,
        fake_cls: type,
        atol: Tolerance,
        rtol: Tolerance,
        buffers_mode: str,
    ) -> None:
        self.eager, self.patched = eager, patched
        self.fake_cls = fake_cls
        self.atol, self.rtol = atol, rtol
        self.buffers_mode = buffers_mode
        self.e_params = dict(eager.named_parameters())
        self.p_params = dict(patched.named_parameters())
        self.rows: dict[str, ParamReport] = {
            name: ParamReport(
                name=name,
                shape=list(p.shape),
                dtype=_dt(p.dtype),
                device=str(p.device),
            )
            for name, p in self.p_params.items()
        }
        self.losses: list[dict[str, float | None]] = []
        self.general: list[str] = []
        self.notes: list[str] = []
        self.prev_e: dict[str, torch.Tensor | None] = {}
        self.prev_p: dict[str, torch.Tensor | None] = {}

    def _kind(self, g: Any) -> _Grad:
        if g is None:
            return _Grad("none", None)
        if isinstance(g, self.fake_cls):
            return _Grad("fake", None)
        return _Grad("real", g)

    def step(self, step: int, loss_e: torch.Tensor, loss_p: torch.Tensor | None) -> None:
        le = _scalar(loss_e)
        lp = None if loss_p is None else _scalar(loss_p)
        diff = None if lp is None or le is None else abs(lp - le)
        self.losses.append({"eager": le, "patched": lp, "abs_diff": diff})
        if lp is None:
            self.general.append(f"step {step}: the patched loss has no real values")
        elif le is not None and not _close_scalar(le, lp, loss_e.dtype, self.atol, self.rtol):
            why = (
                "the forward values under the fake mode are wrong, so every gradient is suspect"
                if step == 1
                else "the forward values under the fake mode are wrong, or the differences of "
                "earlier steps changed the parameters"
            )
            self.general.append(f"step {step}: loss differs from eager ({lp!r} vs {le!r}): {why}")
        for name, row in self.rows.items():
            pe, pp = self.e_params[name], self.p_params[name]
            ge, gp = self._kind(pe.grad), self._kind(pp.grad)
            if step == 1:
                row.eager_grad, row.grad = ge.kind, gp.kind
            else:
                row.eager_grad = _worse(row.eager_grad, ge.kind)
                row.grad = _worse(row.grad, gp.kind)
            if gp.kind == "fake":
                _problem(row, f"step {step}: a FakeTensor was left in .grad")
            elif gp.kind != ge.kind:
                what = (
                    "no gradient where eager has one"
                    if gp.kind == "none"
                    else "a gradient where eager has none"
                )
                _problem(row, f"step {step}: {what}")
            if ge.tensor is not None and gp.tensor is not None:
                self._grads(step, row, ge.tensor, gp.tensor)
            if step > 1:
                self._identity(step, row, name, pe.grad, pp.grad)
            self.prev_e[name], self.prev_p[name] = pe.grad, pp.grad

    def _grads(self, step: int, row: ParamReport, ge: torch.Tensor, gp: torch.Tensor) -> None:
        row.eager_grad_dtype, row.grad_dtype = _dt(ge.dtype), _dt(gp.dtype)
        row.eager_grad_device, row.grad_device = str(ge.device), str(gp.device)
        row.eager_grad_strides = _strides(ge)
        row.grad_strides = _strides(gp)
        if gp.dtype != ge.dtype:
            _problem(row, f"step {step}: grad dtype {_dt(gp.dtype)} (eager {_dt(ge.dtype)})")
        if gp.device != ge.device:
            _problem(row, f"step {step}: grad device {gp.device} (eager {ge.device})")
        if gp.layout != ge.layout:
            _problem(row, f"step {step}: grad layout {gp.layout} (eager {ge.layout})")
        elif row.grad_strides != row.eager_grad_strides:
            _problem(
                row,
                f"step {step}: grad strides {tuple(row.grad_strides or ())} "
                f"(eager {tuple(row.eager_grad_strides or ())})",
            )
        if gp.shape != ge.shape:
            _problem(row, f"step {step}: grad shape {list(gp.shape)} (eager {list(ge.shape)})")
            return
        rtol, atol = _tolerance(ge.dtype, self.atol, self.rtol)
        row.rtol, row.atol = rtol, atol
        abs_diff, rel_diff, close = _difference(gp, ge, rtol, atol)
        row.max_abs = _max(row.max_abs, abs_diff)
        row.max_rel = _max(row.max_rel, rel_diff)
        if not close:
            _problem(
                row,
                f"step {step}: gradient differs from eager: max abs {abs_diff:.3e}, max rel "
                f"{rel_diff:.3e} (atol {atol:g}, rtol {rtol:g})",
            )

    def _identity(self, step: int, row: ParamReport, name: str, ge: Any, gp: Any) -> None:
        prev_e, prev_p = self.prev_e.get(name), self.prev_p.get(name)
        kept_e = prev_e is not None and ge is prev_e
        kept_p = prev_p is not None and gp is prev_p
        # the report column: the weakest statement over the steps ("new" once replaced)
        row.eager_identity = "new" if not kept_e or row.eager_identity == "new" else "kept"
        row.identity = "new" if not kept_p or row.identity == "new" else "kept"
        if kept_e and not kept_p:
            _problem(
                row,
                f"step {step}: .grad was replaced by a new tensor; eager kept the same object "
                "(optimizers and DDP buckets holding it miss the update)",
            )
        elif kept_p and not kept_e:
            _problem(row, f"step {step}: .grad kept the same object; eager replaced it")

    def values(self) -> None:
        for name, row in self.rows.items():
            pe, pp = self.e_params[name], self.p_params[name]
            if isinstance(pp, self.fake_cls) or pe.shape != pp.shape:
                _problem(row, "parameter is no longer a real tensor of its shape after the step")
                continue
            rtol, atol = _tolerance(pe.dtype, self.atol, self.rtol)
            abs_diff, rel_diff, close = _difference(pp.detach(), pe.detach(), rtol, atol)
            row.value_max_abs = _max(row.value_max_abs, abs_diff)
            if not close and not any("value" in p for p in row.problems):
                _problem(
                    row,
                    f"parameter value after the optimizer step differs from eager: max abs "
                    f"{abs_diff:.3e}, max rel {rel_diff:.3e}",
                )

    def outcomes(self, events: list[dict[str, Any]], names: dict[int, str]) -> None:
        unknown = 0
        internal: dict[str, int] = {}
        for event in events:
            kind = event.get("event")
            if kind == "internal_error":
                text = (
                    f"internal error in fakegrad_patch ({event.get('where')}): {event.get('error')}"
                )
                internal[text] = internal.get(text, 0) + 1
                continue
            name = names.get(event.get("leaf_id", -1))
            if kind == "d2_repaired" and name is not None:
                self.rows[name].d2_repairs += 1
            action = _PATCH_EVENTS.get(str(kind))
            if action is None:
                continue
            if name is None:
                unknown += 1
                continue
            row = self.rows[name]
            key = "zeros" if event.get("source") == "zeros" else action
            row.outcomes[key] = row.outcomes.get(key, 0) + 1
            row.zero_copy += bool(event.get("zero_copy"))
            row.bytes += int(event.get("bytes") or 0)
        for row in self.rows.values():
            for key in _BAD_OUTCOMES:
                if row.outcomes.get(key):
                    _problem(row, f"patch outcome {key!r} x{row.outcomes[key]} (see the trace)")
        self.general += [f"{text} (x{n})" if n > 1 else text for text, n in internal.items()]
        repairs = sum(row.d2_repairs for row in self.rows.values())
        if repairs:
            self.notes.append(
                "this torch build has defect D2 (converted parameters get uninitialised values): "
                f"the patch repaired parameter values {repairs} time(s)"
            )
        if unknown:
            self.notes.append(
                f"{unknown} fake gradient(s) reached real leaves that are not parameters of the "
                "model (inputs requiring grad, tensors created in forward)"
            )

    def buffers(self, events: list[dict[str, Any]], strict: bool) -> list[BufferReport]:
        out = []
        e_buffers = dict(self.eager.named_buffers())
        for name, bp in self.patched.named_buffers():
            be = e_buffers.get(name)
            if be is None:
                continue
            row = BufferReport(name, list(bp.shape), _dt(bp.dtype), str(bp.device), True)
            if isinstance(bp, self.fake_cls):
                row.matches, row.note = False, "a FakeTensor replaced the buffer"
            elif bp.shape != be.shape or bp.dtype != be.dtype:
                row.matches, row.note = False, "shape or dtype differs from eager"
            else:
                rtol, atol = _tolerance(be.dtype, self.atol, self.rtol)
                abs_diff, _, close = _difference(bp, be, rtol, atol)
                row.max_abs = abs_diff
                if not close:
                    row.matches = False
                    row.note = (
                        _BUFFER_NOTE_WRITE_BACK
                        if self.buffers_mode == "write_back"
                        else _BUFFER_NOTE
                    )
            out.append(row)
        if any(not b.matches for b in out):
            if not strict:
                self.notes.append(
                    "buffers marked ~ differ from eager; this does not fail the verdict "
                    '(check_buffers="strict" makes it)'
                )
            if self.buffers_mode != "write_back":
                self.notes.append(
                    "buffers updated in place inside the mode stay stale by default (upstream "
                    'semantics): buffers="write_back" (verify(..., buffers="write_back"), '
                    "fakegrad_patch.configure(buffers=...), FAKEGRAD_BUFFERS=write_back, "
                    "verify --buffers write_back) makes them reach the real buffers as in eager"
                )
        lost = [e for e in events if e.get("event") == "update_lost"]
        if lost:
            kinds = sorted({str(e.get("kind")) for e in lost})
            self.notes.append(
                f"in-place updates of real tensors inside the mode that reached only fake "
                f"copies: {len(lost)} ({', '.join(kinds)}; update_lost events): "
                f"{lost[0].get('fix')}"
            )
        written = [e for e in events if e.get("event") == "buffer_written_back"]
        if written:
            nbytes = sum(int(e.get("bytes") or 0) for e in written)
            self.notes.append(
                f"buffers written back to the real buffers: {len(written)} time(s), {nbytes} bytes"
            )
        return out


# -- helpers ---------------------------------------------------------------------------------------


def _scalar(t: torch.Tensor) -> float | None:
    with contextlib.suppress(Exception):
        value = t.detach().reshape(()).to("cpu", torch.float64)
        return float(value.abs() if value.is_complex() else value)
    return None


def _close_scalar(a: float, b: float, dtype: torch.dtype, atol: Tolerance, rtol: Tolerance) -> bool:
    r, at = _tolerance(dtype, atol, rtol)
    if math.isnan(a) and math.isnan(b):
        return True
    return abs(a - b) <= at + r * abs(a)


def _tolerance(dtype: torch.dtype, atol: Tolerance, rtol: Tolerance) -> tuple[float, float]:
    default_rtol, default_atol = DEFAULT_TOLERANCES.get(dtype, _FALLBACK_TOLERANCE)
    return _pick(rtol, dtype, default_rtol), _pick(atol, dtype, default_atol)


def _pick(given: Tolerance, dtype: torch.dtype, default: float) -> float:
    if given is None:
        return default
    if isinstance(given, Mapping):
        return float(given.get(dtype, default))
    return float(given)


def _difference(
    actual: torch.Tensor, expected: torch.Tensor, rtol: float, atol: float
) -> tuple[float, float, bool]:
    """(max abs, max rel over non-zero expected, allclose with NaN == NaN)."""
    with torch.no_grad():
        a, e = _dense(actual), _dense(expected)
        wide = torch.complex128 if a.is_complex() or e.is_complex() else torch.float64
        if a.device.type == "mps":  # no float64 there
            a, e = a.cpu(), e.cpu()
        a, e = a.to(wide), e.to(wide)
        if a.numel() == 0:
            return 0.0, 0.0, True
        both_nan = torch.isnan(a) & torch.isnan(e)
        diff = (a - e).abs().masked_fill(both_nan, 0)
        diff = torch.where(torch.isnan(diff), torch.full_like(diff, math.inf), diff).real
        magnitude = e.abs().real
        nonzero = magnitude > 0
        rel = (diff[nonzero] / magnitude[nonzero]).max() if bool(nonzero.any()) else diff.max()
        close = bool((diff <= atol + rtol * magnitude.nan_to_num(0)).all())
        return float(diff.max()), float(rel), close


def _dense(t: torch.Tensor) -> torch.Tensor:
    return t.to_dense() if t.layout != torch.strided else t.detach()


def _strides(t: torch.Tensor) -> list[int] | None:
    return list(t.stride()) if t.layout == torch.strided else None


def _max(old: float | None, new: float) -> float:
    return new if old is None or new > old or math.isnan(new) else old


def _dt(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


_KIND_RANK = {"real": 0, "none": 1, "fake": 2}


def _worse(current: str, kind: str) -> str:
    """``grad``/``eager_grad`` columns: ``real`` only when every step had a real gradient."""
    return kind if _KIND_RANK[kind] > _KIND_RANK[current] else current


def _problem(row: ParamReport, text: str) -> None:
    if text not in row.problems:
        row.problems.append(text)
