"""PyTorch's own operator database as a test family (issue 39): every op of ``op_db`` that
supports autograd, in float32 (and bfloat16 where the op supports it on the device), every
sample (capped for time), eager gradients vs one patched propagating fake pass. Other dtypes on
request (float64, complex64: the op must support the dtype's backward, else it is not run; a
complex sample without a complex leaf is skipped).

A sample is

* ``exact``: every leaf's gradient equals eager's (real, same dtype and shape, the dtype's
  tolerance; complex gradients also with eager's conj/neg bits), and the patch said nothing;
  where the values alone differ, a gradient whose error against the same sample computed in
  double precision is of the order of eager's own error is exact too (the row says so:
  ``arbitrated``; see ``_arbitrate``);
* ``reported``: the patch warned (``FakeGradPatchWarning``, with a warning-level trace event
  naming the op or the leaf) that a gradient is not eager's;
* ``error``: the patched pass raised (upstream's exception, or the patch's, naming the op);
* ``silent``: a gradient differs from eager's, or is fake, and nothing said so; in a complex
  dtype also a differentiable output whose fake has other conj/neg bits than eager's output, or
  whose propagated values (``real_tensor``) differ from eager's output in value or bits. The
  suite requires none;
* ``skip``: eager itself fails on the sample, or it has no leaf (no complex leaf, complex).

A plain module (imported by tests/test_opinfo_sweep.py and run as a script):

    python tests/opinfo_sweep.py --json sweep.json --workers 2 [--device cpu]
        [--plan float32:4,bfloat16:1,float64:all,complex64:all] [--ops name,...]
        [--propagation fast|repair|upstream] [--unpatched]
        [--update-expected tests/opinfo_expected.json]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import hashlib
import json
import os
import sys
import time
import warnings
from collections import Counter
from typing import Any

import torch
import torch._functorch.config as functorch_config
from torch._subclasses.fake_tensor import FakeTensorMode

import fakegrad_patch
from fakegrad_patch import FakeGradPatchWarning, _config, trace
from fakegrad_patch._config import DEFAULT_PROPAGATION, PROPAGATION_VALUES
from fakegrad_patch._core import state as _state

CATEGORIES = ("exact", "reported", "error", "silent", "skip")
#: (rtol, atol) per dtype: torch.testing's defaults, rtol ten times looser for the floating
#: ones (the same kernels run in both passes, but decompositions may reorder sums)
TOL = {
    torch.float32: (1.3e-6 * 10, 1e-5),
    torch.bfloat16: (1.6e-2, 1e-2),
    torch.float64: (1e-7 * 10, 1e-7),
    torch.complex64: (1.3e-6 * 10, 1e-5),
    torch.complex128: (1e-7 * 10, 1e-7),
}


@functools.cache
def op_db() -> list[Any]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torch.testing._internal.common_methods_invocations import op_db as db
    return list(db)


def op_id(op: Any) -> str:
    return f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name


def sweep_ops(device: str, dtype: torch.dtype) -> list[Any]:
    """The ops of ``op_db`` with autograd that support ``dtype`` on ``device``."""
    out = []
    for op in op_db():
        if not op.supports_autograd:
            continue
        try:
            dtypes = op.supported_backward_dtypes(device)
        except Exception:
            continue
        if dtype in dtypes:
            out.append(op)
    return out


def _seed(op: Any) -> int:
    return int.from_bytes(hashlib.sha256(op_id(op).encode()).digest()[:4], "little")


def samples(op: Any, device: str, dtype: torch.dtype, limit: int | None) -> list[Any]:
    """The op's samples, the same on every call (seeded by the op's name)."""
    torch.manual_seed(_seed(op))
    out = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i, sample in enumerate(op.sample_inputs(device, dtype, requires_grad=True)):
            if limit is not None and i >= limit:
                break
            out.append(sample)
    return out


def _map_tensors(fn: Any, value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, list | tuple) and not hasattr(value, "_fields"):
        return type(value)(_map_tensors(fn, v) for v in value)
    if isinstance(value, dict):
        return {k: _map_tensors(fn, v) for k, v in value.items()}
    return value


def _flat_tensors(value: Any) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []

    def note(t: torch.Tensor) -> torch.Tensor:
        out.append(t)
        return t

    _map_tensors(note, value)
    return out


def _fresh(sample: Any) -> tuple[Any, Any, Any, list[torch.Tensor]]:
    """New leaves with the sample's values (same strides), and the list of them."""
    leaves: list[torch.Tensor] = []

    def copy(t: torch.Tensor) -> torch.Tensor:
        if t.layout != torch.strided:
            c = t.detach().clone()
        else:
            c = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
            with torch.no_grad():
                c.copy_(t.detach())
        if t.requires_grad:
            c.requires_grad_(True)
            leaves.append(c)
        return c

    args = _map_tensors(copy, (sample.input, *sample.args))
    kwargs = _map_tensors(copy, dict(sample.kwargs))
    return args[0], args[1:], kwargs, leaves


def _differentiable(out: Any) -> list[torch.Tensor]:
    return [
        t
        for t in _flat_tensors(out)
        if t.requires_grad and (t.dtype.is_floating_point or t.dtype.is_complex)
    ]


def _cotangents(outs: list[torch.Tensor], seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    cots = []
    for t in outs:
        c = torch.randn(t.shape, generator=gen, dtype=torch.float64)
        if t.dtype.is_complex:
            c = torch.complex(c, torch.randn(t.shape, generator=gen, dtype=torch.float64))
        cots.append(c.to(dtype=t.dtype, device=t.device))
    return cots


def _run(op: Any, sample: Any, seed: int, fake: bool) -> tuple[list[Any], list[dict[str, Any]]]:
    """One forward and backward: the leaves' ``.grad`` (None where none), and what the
    differentiable outputs were (their conj/neg bits, and their real values: for a fake, the
    values propagation gave it; None where it has none)."""
    inp, args, kwargs, leaves = _fresh(sample)
    ctx: Any = FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext()
    torch.manual_seed(seed)
    with ctx:
        out = op(inp, *args, **kwargs)
        out = sample.output_process_fn_grad(out)
        outs = _differentiable(out)
        seen = [
            {
                "conj": t.is_conj(),
                "neg": t.is_neg(),
                "values": getattr(t, "real_tensor", None) if fake else t.detach(),
            }
            for t in outs
        ]
        if not outs:
            return [None] * len(leaves), seen
        with torch._subclasses.fake_tensor.unset_fake_temporarily():
            cots = _cotangents(outs, seed)
        torch.autograd.backward(outs, cots)
    return [leaf.grad for leaf in leaves], seen


def _is_fake(t: Any) -> bool:
    return isinstance(t, torch._subclasses.fake_tensor.FakeTensor)


def _bits(got: torch.Tensor, want: torch.Tensor) -> str | None:
    """A complex tensor's conjugate/negative bits against eager's. A bit that a fake or its real
    values lost (or gained) is a metadata mismatch even where the values compare equal: real
    kernels called under a dispatch mode ignore those bits, so the next op may compute with the
    other sign."""
    wrong = [
        f"{name} bit {getattr(got, f'is_{name}')()} vs eager {getattr(want, f'is_{name}')()}"
        for name in ("conj", "neg")
        if getattr(got, f"is_{name}")() != getattr(want, f"is_{name}")()
    ]
    return ", ".join(wrong) or None


def _differs(got: Any, want: Any) -> str | None:
    """Why ``got`` (patched) is not ``want`` (eager); None when equal. Values are compared as
    eager's values (lazy conj/neg bits resolved), then, for complex tensors, the bits."""
    if want is None:
        return None if got is None else "a gradient where eager has none"
    if got is None:
        return "no gradient"
    if _is_fake(got):
        return "a FakeTensor gradient"
    if got.dtype != want.dtype or got.shape != want.shape or got.layout != want.layout:
        return f"{got.dtype}{list(got.shape)} vs {want.dtype}{list(want.shape)}"
    dense_got, dense_want = (
        (got.to_dense(), want.to_dense()) if want.layout != torch.strided else (got, want)
    )
    rtol, atol = TOL.get(want.dtype, TOL[torch.float32])
    if want.is_floating_point() or want.is_complex():
        # rounding scales with the tensor's largest magnitude, not each element's: an
        # ill-conditioned sample (linalg.householder_product's, values up to 3,653) computed in
        # another (equally exact) order differs by ~1e-5 of it where elements are small. A wrong
        # value (a lost conjugate, a double update) is of the order of the magnitude itself.
        finite = dense_want.resolve_conj().resolve_neg().abs()
        finite = finite[torch.isfinite(finite)]
        if finite.numel():
            atol = max(atol, rtol * float(finite.max()))
    try:
        torch.testing.assert_close(dense_got, dense_want, rtol=rtol, atol=atol, equal_nan=True)
    except AssertionError:
        # resolve_conj/neg: a lazy bit is part of the value (double() drops complex parts)
        g = dense_got.resolve_conj().resolve_neg()
        w = dense_want.resolve_conj().resolve_neg()
        diff = (g.double() - w.double()).abs() if not w.dtype.is_complex else (g - w).abs()
        return f"max abs {float(torch.nan_to_num(diff, nan=float('inf')).max()):.3g}"
    if want.dtype.is_complex and (bits := _bits(got, want)):
        return f"{bits} (values equal)"
    return None


def _output_differs(got: dict[str, Any], want: dict[str, Any]) -> str | None:
    """Why a patched output (its fake's conj/neg bits, its propagated values and their bits) is
    not eager's."""
    wrong = [
        f"the fake's {name} bit {got[name]} vs eager {want[name]}"
        for name in ("conj", "neg")
        if got[name] != want[name]
    ]
    # no propagated values: nothing to compare (the gradients tell whether that mattered)
    if got["values"] is not None and (d := _differs(got["values"], want["values"])):
        wrong.append(f"its real values: {d}")
    return "; ".join(wrong) or None


def _names(text: str, op: Any) -> bool:
    """Does an error's text (message and notes) name an aten/custom op (``aten.mm``, the op's own
    name)?"""
    return "aten." in text or "aten::" in text or op.name.split(".")[-1] in text


def _complex_leaf(sample: Any) -> bool:
    return any(
        t.requires_grad and t.dtype.is_complex
        for t in _flat_tensors((sample.input, sample.args, dict(sample.kwargs)))
    )


def run_case(op: Any, index: int, sample: Any, device: str, dtype: Any = None) -> dict[str, Any]:
    """One sample, eager vs patched: its category and what was seen. For a complex ``dtype``,
    the differentiable outputs are compared too (the fakes' conj/neg bits against eager's, their
    propagated values against eager's outputs): a wrong output is silent even where the
    gradients happen to agree."""
    seed = _seed(op) + index
    row: dict[str, Any] = {"op": op_id(op), "sample": index}
    complex_ = dtype is not None and dtype.is_complex
    if complex_ and not _complex_leaf(sample):
        row.update(category="skip", why="no complex leaf")
        return row
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            want, want_outs = _run(op, sample, seed, fake=False)
    except Exception as exc:
        row.update(category="skip", why=f"eager: {type(exc).__name__}")
        return row
    if not want or all(w is None for w in want):
        row.update(category="skip", why="no leaf gets a gradient")
        return row
    _state.WARNED.clear()
    with (
        warnings.catch_warnings(record=True) as caught,
        trace.capture(trace.WARNING) as events,
        functorch_config.patch(fake_tensor_propagate_real_tensors=True),
    ):
        warnings.simplefilter("always")
        try:
            got, got_outs = _run(op, sample, seed, fake=True)
        except Exception as exc:
            lines = str(exc).strip().splitlines()
            notes = getattr(exc, "__notes__", None) or []
            text = "\n".join([str(exc), *notes])
            row.update(
                category="error",
                why=f"{type(exc).__name__}: {lines[0][:300] if lines else ''}",
                names_op=_names(text, op),
            )
            return row
    warned = [str(w.message)[:300] for w in caught if issubclass(w.category, FakeGradPatchWarning)]
    differences = {
        f"leaf {i}": d
        for i, (g, w) in enumerate(zip(got, want, strict=True))
        if (d := _differs(g, w))
    }
    if complex_:
        if len(got_outs) != len(want_outs):
            differences["outputs"] = f"{len(got_outs)} differentiable vs eager {len(want_outs)}"
        else:
            differences.update(
                (f"output {i}", d)
                for i, (g, w) in enumerate(zip(got_outs, want_outs, strict=True))
                if (d := _output_differs(g, w))
            )
    if differences and not warned and all(d.startswith("max abs") for d in differences.values()):
        # values only (no bit, no fake, no missing gradient): a lower precision's rounding, or
        # a wrong value? The same sample in double precision says which is nearer the truth
        judged = _arbitrate(op, sample, seed, got, want, set(differences))
        if judged is not None:
            row["arbitrated"] = judged
            differences = {}
    if warned:
        row.update(
            category="reported",
            why=warned[0],
            events=sorted({e["event"] for e in events}),
            differs=bool(differences),
        )
    elif differences:
        row.update(category="silent", why="; ".join(f"{k}: {d}" for k, d in differences.items()))
    else:
        row["category"] = "exact"
    return row


#: the dtype a sample is recomputed in when the patched and eager gradients differ in value
WIDER = {
    torch.float32: torch.float64,
    torch.bfloat16: torch.float64,
    torch.float16: torch.float64,
    torch.complex64: torch.complex128,
}


#: how many times eager's own error (against double precision) a patched gradient may have
ARBITRATION_FACTOR = 4.0


def _arbitrate(
    op: Any, sample: Any, seed: int, got: list[Any], want: list[Any], leaves: set[str]
) -> str | None:
    """Where patched and eager gradients differ in value only: eager's gradients of the same
    sample in double precision (``WIDER``) are the reference, and the patched gradient passes
    when its error is of the order of eager's own (at most ``ARBITRATION_FACTOR`` times it, or
    the dtype's tolerance of the reference's magnitude): an ill-conditioned sample computed in
    another, equally exact order (two such orders' errors differ by small factors). A wrong
    value (a lost conjugate, an update applied twice) is of the order of the values themselves,
    far from the reference while eager is near it. None: the difference stands (or no
    reference)."""

    def widen(t: torch.Tensor) -> torch.Tensor:
        target = WIDER.get(t.dtype)
        if target is None:
            return t
        out = t.detach().to(target)
        return out.requires_grad_(t.requires_grad)

    try:
        wide = copy.copy(sample)
        wide.input = _map_tensors(widen, sample.input)
        wide.args = _map_tensors(widen, sample.args)
        wide.kwargs = _map_tensors(widen, dict(sample.kwargs))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            reference, _ = _run(op, wide, seed, fake=False)
    except Exception:
        return None
    notes = []
    for i, (g, w, r) in enumerate(zip(got, want, reference, strict=True)):
        if f"leaf {i}" not in leaves:
            continue
        if r is None or g is None or w is None or r.layout != torch.strided:
            return None
        ref = r.detach().resolve_conj().resolve_neg()
        patched_err = float((g.resolve_conj().resolve_neg().to(ref.dtype) - ref).abs().max())
        eager_err = float((w.resolve_conj().resolve_neg().to(ref.dtype) - ref).abs().max())
        rtol, _ = TOL.get(w.dtype, TOL[torch.float32])
        floor = rtol * float(ref.abs().max()) if ref.numel() else 0.0
        if not patched_err <= max(ARBITRATION_FACTOR * eager_err, floor):
            return None
        notes.append(f"leaf {i}: patched {patched_err:.3g}, eager {eager_err:.3g} from {ref.dtype}")
    return "; ".join(notes)


#: what the suite runs (tests/test_opinfo_sweep.py): (dtype, samples per op); None: every
#: sample. Capped for the CI's time (issue 39: <= 3 min per build on its two cores).
PLAN: tuple[tuple[str, int | None], ...] = (("float32", 6), ("bfloat16", 2))


def _cases(device: str, plan: Any, ops: list[str] | None) -> list[tuple[str, Any, int | None]]:
    """``(dtype, op, cap)`` for every op of every planned dtype, in a fixed order."""
    out = []
    for dtype, cap in plan:
        for op in sweep_ops(device, getattr(torch, dtype)):
            if ops is None or op_id(op) in ops:
                out.append((dtype, op, cap))
    return out


def _key(dtype: str, op: Any) -> str:
    return f"{dtype}:{op_id(op)}"


def sweep(
    device: str = "cpu",
    plan: Any = PLAN,
    ops: list[str] | None = None,
    shard: tuple[int, int] = (0, 1),
    patched: bool = True,
    after: str | None = None,
    out: Any = None,
    propagation: str = DEFAULT_PROPAGATION,
) -> list[dict[str, Any]]:
    """Run the shard's cases in order (those after the case ``after``, when given); each row is
    also written to ``out`` (a text file) as one JSON line, flushed, with a ``{"start": key}``
    line before each op, so a parent can tell which op crashed the interpreter.

    ``propagation`` is set explicitly (the library's default unless given): a
    ``FAKEGRAD_PROPAGATION`` in the environment, or a caller's settings, must not choose the
    path the sweep tests. Each row says which one ran (``unpatched`` without the patch)."""
    if patched:
        fakegrad_patch.install()
        fakegrad_patch.configure(propagation=_config.validate_propagation(propagation))
        ran = _config.current().propagation
    else:
        fakegrad_patch.uninstall()
        ran = "unpatched"
    rows: list[dict[str, Any]] = []
    mine = [c for n, c in enumerate(_cases(device, plan, ops)) if n % shard[1] == shard[0]]
    if after is not None:
        keys = [_key(d, op) for d, op, _ in mine]
        mine = mine[keys.index(after) + 1 :] if after in keys else mine
    for dtype_name, op, cap in mine:
        key = _key(dtype_name, op)
        if out is not None:
            out.write(json.dumps({"start": key}) + "\n")
            out.flush()
        dtype = getattr(torch, dtype_name)
        made: list[dict[str, Any]] = []
        try:
            cases = samples(op, device, dtype, cap)
        except Exception as exc:
            cases = []
            made.append({"op": op_id(op), "sample": -1, "category": "skip", "why": f"{exc}"})
        for i, sample in enumerate(cases):
            start = time.perf_counter()
            row = run_case(op, i, sample, device, dtype)
            row["seconds"] = round(time.perf_counter() - start, 4)
            made.append(row)
        for row in made:
            row["dtype"] = dtype_name
            row["propagation"] = ran
        rows.extend(made)
        if out is not None:
            for row in made:
                out.write(json.dumps(row) + "\n")
            out.flush()
    return rows


def run_isolated(
    device: str = "cpu",
    plan: Any = PLAN,
    ops: list[str] | None = None,
    workers: int = 2,
    patched: bool = True,
    workdir: str = ".",
    env: dict[str, str] | None = None,
    propagation: str = DEFAULT_PROPAGATION,
) -> list[dict[str, Any]]:
    """The sweep in ``workers`` interpreters at once (shards of the case list); an op that kills
    its interpreter (upstream crashes on some sparse ops, patched or not) is recorded as an
    ``error`` and the shard goes on after it in a new interpreter."""
    import subprocess

    def command(i: int, after: str | None, path: str) -> list[str]:
        cmd = [
            sys.executable,
            os.path.abspath(__file__),
            "--jsonl",
            path,
            "--device",
            device,
            "--plan",
            _plan_text(plan),
            "--shard",
            f"{i}/{workers}",
            "--propagation",
            propagation,
        ]
        if ops:
            cmd += ["--ops", ",".join(ops)]
        if not patched:
            cmd.append("--unpatched")
        if after is not None:
            cmd += ["--after", after]
        return cmd

    rows: list[dict[str, Any]] = []
    running: dict[int, tuple[Any, str]] = {}
    restarts = 0

    def start(i: int, after: str | None) -> None:
        nonlocal restarts
        path = os.path.join(workdir, f"sweep-{os.getpid()}-{i}-{restarts}.jsonl")
        restarts += 1
        proc = subprocess.Popen(
            command(i, after, path), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env
        )
        running[i] = (proc, path)

    for i in range(workers):
        start(i, None)
    while running:
        time.sleep(0.2)
        for i, (proc, path) in list(running.items()):
            if proc.poll() is None:
                continue
            err = proc.stderr.read() if proc.stderr else b""
            del running[i]
            started = None
            done: set[str] = set()
            if os.path.exists(path):
                with open(path) as f:
                    for line in f:
                        item = json.loads(line)
                        if "start" in item:
                            started = item["start"]
                        else:
                            rows.append(item)
                            done.add(f"{item['dtype']}:{item['op']}")
                os.unlink(path)
            if proc.returncode == 0:
                continue
            if started is None or started in done:
                raise RuntimeError(f"sweep shard {i} failed: {err.decode()[-2000:]}")
            dtype_name, _, op = started.partition(":")
            rows.append(
                {
                    "op": op,
                    "dtype": dtype_name,
                    "sample": -1,
                    "category": "error",
                    "why": f"the interpreter died (exit {proc.returncode})",
                    "names_op": False,
                    "propagation": propagation if patched else "unpatched",
                }
            )
            start(i, started)
    rows.sort(key=lambda r: (r["dtype"], r["op"], r["sample"]))
    return rows


def _plan_text(plan: Any) -> str:
    return ",".join(f"{d}:{'all' if c is None else c}" for d, c in plan)


def _plan_of(text: str) -> tuple[tuple[str, int | None], ...]:
    out = []
    for part in text.split(","):
        dtype, _, cap = part.partition(":")
        out.append((dtype, None if cap in ("", "all") else int(cap)))
    return tuple(out)


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per dtype: samples per category, and ops by their worst sample."""
    out: dict[str, Any] = {}
    order = {c: i for i, c in enumerate(("exact", "skip", "reported", "error", "silent"))}
    for dtype in sorted({r["dtype"] for r in rows}):
        mine = [r for r in rows if r["dtype"] == dtype]
        by_sample = Counter(r["category"] for r in mine)
        worst: dict[str, str] = {}
        for r in mine:
            if order[r["category"]] >= order.get(worst.get(r["op"], "exact"), 0):
                worst[r["op"]] = r["category"]
        out[dtype] = {
            "samples": {c: by_sample.get(c, 0) for c in CATEGORIES},
            "ops": {c: sum(1 for v in worst.values() if v == c) for c in CATEGORIES},
        }
    return out


def exact_per_op(rows: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    """dtype -> op -> how many of its samples are exact (the known-good counts)."""
    out: dict[str, dict[str, int]] = {}
    for r in rows:
        ops = out.setdefault(r["dtype"], {})
        ops[r["op"]] = ops.get(r["op"], 0) + (r["category"] == "exact")
    return out


def build_key() -> str:
    """The torch build's release (``2.13.0``: local version labels dropped)."""
    return torch.__version__.split("+")[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="the whole run's rows and summary")
    parser.add_argument("--jsonl", help="rows as they come, one JSON line each (for a parent)")
    parser.add_argument("--after", default=None, help="go on after this case (a crash)")
    parser.add_argument("--workers", type=int, default=0, help="isolated interpreters")
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--plan", default=_plan_text(PLAN), help="dtype:samples per op,... (all: every sample)"
    )
    parser.add_argument("--ops", default=None)
    parser.add_argument("--shard", default="0/1")
    parser.add_argument("--unpatched", action="store_true", help="upstream torch alone")
    parser.add_argument(
        "--propagation",
        choices=PROPAGATION_VALUES,
        default=DEFAULT_PROPAGATION,
        help=f"the patch's propagation setting (default: the library's, {DEFAULT_PROPAGATION})",
    )
    parser.add_argument(
        "--update-expected",
        metavar="FILE",
        help="write this build's exact counts per op into FILE (tests/opinfo_expected.json)",
    )
    ns = parser.parse_args(argv)
    i, n = (int(x) for x in ns.shard.split("/"))
    ops = ns.ops.split(",") if ns.ops else None
    plan = _plan_of(ns.plan)
    start = time.perf_counter()
    if ns.jsonl:
        with open(ns.jsonl, "w") as out:
            sweep(ns.device, plan, ops, (i, n), not ns.unpatched, ns.after, out, ns.propagation)
        return 0
    if ns.workers:
        workdir = os.path.dirname(os.path.abspath(ns.json or "."))
        rows = run_isolated(
            ns.device, plan, ops, ns.workers, not ns.unpatched, workdir, propagation=ns.propagation
        )
    else:
        rows = sweep(ns.device, plan, ops, (i, n), not ns.unpatched, propagation=ns.propagation)
    result = {
        "torch": torch.__version__,
        "device": ns.device,
        "plan": _plan_text(plan),
        "patched": not ns.unpatched,
        "propagation": ns.propagation if not ns.unpatched else None,
        "seconds": round(time.perf_counter() - start, 1),
        "summary": summary(rows),
        "rows": rows,
    }
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(result, f, indent=1)
    if ns.update_expected:
        expected = {}
        if os.path.exists(ns.update_expected):
            with open(ns.update_expected) as f:
                expected = json.load(f)
        expected[build_key()] = {"plan": _plan_text(plan), "exact": exact_per_op(rows)}
        with open(ns.update_expected, "w") as f:
            json.dump(expected, f, indent=1, sort_keys=True)
            f.write("\n")
    print(json.dumps(result["summary"]))
    for r in rows:
        if r["category"] in ("silent", "error"):
            print(r["category"], r["dtype"], r["op"], r["sample"], r.get("why", "")[:200])
        elif r.get("arbitrated"):
            print("arbitrated", r["dtype"], r["op"], r["sample"], r["arbitrated"][:200])
    return 0


if __name__ == "__main__":
    sys.exit(main())
