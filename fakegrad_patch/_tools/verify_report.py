"""The report of :func:`fakegrad_patch.verify`: what was compared, per parameter, and the verdict.

Plain data (no tensors are kept), so a report can be printed, turned into JSON, compared in a
test or kept after the models are gone. Rendering follows the trace reader: problems first, then
one row per parameter (rows with problems first, marked ``!``), then buffers and losses.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class ParamReport:
    """Eager vs patched for one named parameter, over every step.

    grad: ``real`` (a real tensor in every step), ``fake`` (a FakeTensor was left in ``.grad`` in
    some step), ``none`` (no gradient in some step). ``eager_grad`` is the same for the eager copy.
    max_abs / max_rel: the largest difference between the two ``.grad``s over all steps (``None``
    when no step had two real gradients to compare); rel is relative to the eager magnitude, over
    elements where the eager gradient is non-zero.
    identity: whether ``.grad`` stayed the same tensor object from one step to the next, eager and
    patched (``kept`` / ``new`` / ``-`` for a single step); they must agree.
    value_max_abs: largest difference of the parameter's values after each step (optimizer).
    outcomes: what the patch did with fake gradients of this parameter (trace events: ``set``,
    ``accumulate``, ``drop``, ``error``, ``keep``, ``zeros``), ``zero_copy`` sets and ``bytes``
    copied, ``d2_repairs`` (torch builds with defect D2).
    """

    name: str
    shape: list[int]
    dtype: str
    device: str
    grad: str = "none"
    eager_grad: str = "none"
    grad_dtype: str | None = None
    eager_grad_dtype: str | None = None
    grad_device: str | None = None
    eager_grad_device: str | None = None
    grad_strides: list[int] | None = None
    eager_grad_strides: list[int] | None = None
    max_abs: float | None = None
    max_rel: float | None = None
    atol: float = 0.0
    rtol: float = 0.0
    identity: str = "-"
    eager_identity: str = "-"
    value_max_abs: float | None = None
    outcomes: dict[str, int] = field(default_factory=dict)
    zero_copy: int = 0
    bytes: int = 0
    d2_repairs: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


@dataclass
class BufferReport:
    """Eager vs patched for one named buffer after the last step.

    By default (``buffers="upstream"``) a buffer updated in place by an op that also has fake
    inputs (BatchNorm's running statistics, spectral_norm's power iteration) is updated on its
    fake copy inside FakeTensorMode: the real buffer keeps its old values, patched or not
    (upstream; in-place ops whose inputs are all real, like ``num_batches_tracked += 1``, run for
    real). Such differences are reported (``matches`` False, with a note naming
    ``buffers="write_back"``, which writes them back) without failing the verdict, unless
    ``verify(..., check_buffers="strict")``. A later step that reads such a buffer (BatchNorm in
    eval mode, spectral_norm) computes different gradients, and those do fail it.
    """

    name: str
    shape: list[int]
    dtype: str
    device: str
    matches: bool
    max_abs: float | None = None
    note: str = ""


@dataclass
class VerifyReport:
    """What :func:`fakegrad_patch.verify` found. ``ok`` is the verdict.

    ``problems`` lists every reason the verdict is negative, most serious first (each one names
    the parameter it concerns); ``mismatched`` names the parameters with problems. ``format()``
    gives the table ``python -m fakegrad_patch verify`` prints, ``to_dict()`` its ``--json``.
    """

    model: str
    torch: str
    steps: int
    optimizer: str | None
    zero_grad: str
    parameters: list[ParamReport]
    buffers: list[BufferReport]
    losses: list[dict[str, float | None]]
    strict_buffers: bool = False
    #: the patched copy's ``buffers`` setting ("upstream" or "write_back")
    buffers_mode: str = "upstream"
    #: problems not tied to one parameter (loss differs, internal errors, leaves not in the model)
    general_problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def problems(self) -> list[str]:
        out = list(self.general_problems)
        out += [f"{p.name!r}: {problem}" for p in self.parameters for problem in p.problems]
        if self.strict_buffers:
            out += [f"buffer {b.name!r}: {b.note}" for b in self.buffers if not b.matches]
        return out

    @property
    def mismatched(self) -> list[str]:
        """Names of the parameters whose patched run differs from eager in any way."""
        return [p.name for p in self.parameters if not p.ok]

    @property
    def ok(self) -> bool:
        return not self.problems

    def __bool__(self) -> bool:
        return self.ok

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["ok"] = self.ok
        data["problems"] = self.problems
        data["mismatched"] = self.mismatched
        for row, param in zip(data["parameters"], self.parameters, strict=True):
            row["ok"] = param.ok
        return _finite(data)

    def assert_ok(self) -> None:
        """Raise AssertionError with the formatted report when the verdict is negative."""
        if not self.ok:
            raise AssertionError("fakegrad_patch.verify found differences:\n" + self.format())

    def format(self) -> str:
        return "\n".join(_render(self))

    def __str__(self) -> str:
        return self.format()


def _finite(value: Any) -> Any:
    """JSON has no inf/nan: write them as strings."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.1e}"


def _val(x: float | None) -> str:
    return "-" if x is None else f"{x:.6g}"


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return f"{n} B"  # pragma: no cover


def _outcome(p: ParamReport) -> str:
    if not p.outcomes:
        return "-"
    return " ".join(f"{k}:{v}" for k, v in sorted(p.outcomes.items()))


def _table(rows: Sequence[tuple[str, ...]], marks: list[str]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [
        (mark + " " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True))).rstrip()
        for mark, r in zip(marks, rows, strict=True)
    ]


def _render(r: VerifyReport) -> list[str]:
    problems = r.problems
    bad = len(r.mismatched)
    opt = f"optimizer {r.optimizer}" if r.optimizer else "no optimizer"
    lines = [
        f"fakegrad_patch verify: {r.model}, {r.steps} step(s), {opt}, zero_grad={r.zero_grad}, "
        f"torch {r.torch}",
        "eager copy vs patched copy under FakeTensorMode(allow_non_fake_inputs=True), "
        "real-value propagation on",
        (
            f"verdict: OK, {len(r.parameters)} parameter(s) match eager"
            if r.ok
            else f"verdict: MISMATCH, {bad} of {len(r.parameters)} parameter(s) differ"
            + (f", {len(problems)} problem(s)" if problems else "")
        ),
        "",
        f"PROBLEMS ({len(problems)})" if problems else "PROBLEMS: none",
    ]
    lines += [f"  ! {p}" for p in problems]
    lines += ["", f"PARAMETERS ({len(r.parameters)})"]
    header = (
        "parameter",
        "shape",
        "dtype",
        "device",
        "grad",
        "max abs",
        "max rel",
        "grad strides",
        "identity",
        "patch outcomes",
        "zero-copy",
        "copied",
    )
    ordered = sorted(r.parameters, key=lambda p: p.ok)  # stable: problems first, model order
    rows = [header] + [
        (
            p.name,
            str(p.shape),
            p.dtype,
            p.device,
            p.grad if p.grad == p.eager_grad else f"{p.grad} (eager {p.eager_grad})",
            _num(p.max_abs),
            _num(p.max_rel),
            "-" if p.grad_strides is None else str(tuple(p.grad_strides)),
            p.identity if p.identity == p.eager_identity else f"{p.identity}/{p.eager_identity}",
            _outcome(p),
            str(p.zero_copy),
            _bytes(p.bytes),
        )
        for p in ordered
    ]
    lines += _table(rows, [" "] + ["!" if not p.ok else " " for p in ordered])
    if r.buffers:
        lines += [
            "",
            f"BUFFERS ({len(r.buffers)})"
            + ("" if r.strict_buffers else " (info)")
            + f" buffers={r.buffers_mode}",
        ]
        brows = [("buffer", "shape", "dtype", "device", "max abs", "")] + [
            (b.name, str(b.shape), b.dtype, b.device, _num(b.max_abs), b.note or "== eager")
            for b in r.buffers
        ]
        lines += _table(brows, [" "] + ["~" if not b.matches else " " for b in r.buffers])
    if r.losses:
        lines += ["", "LOSS"]
        for i, loss in enumerate(r.losses, 1):
            lines.append(
                f"  step {i}: eager {_val(loss['eager'])}  patched {_val(loss['patched'])}  "
                f"|d| {_num(loss['abs_diff'])}"
            )
    if r.notes:
        lines += ["", "NOTES"] + [f"  {n}" for n in r.notes]
    return lines
