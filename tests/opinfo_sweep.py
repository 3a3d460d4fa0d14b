"""PyTorch's own operator database as a test family (issue 39): every op of ``op_db`` that
supports autograd, in float32 (and bfloat16 where the op supports it on the device), every
sample (capped for time), eager gradients vs one patched propagating fake pass.

A sample is

* ``exact``: every leaf's gradient equals eager's (real, same dtype and shape, float tolerance),
  and the patch said nothing;
* ``reported``: the patch warned (``FakeGradPatchWarning``, with a warning-level trace event
  naming the op or the leaf) that a gradient is not eager's;
* ``error``: the patched pass raised (upstream's exception, or the patch's, naming the op);
* ``silent``: a gradient differs from eager's, or is fake, and nothing said so. The suite
  requires none;
* ``skip``: eager itself fails on the sample, or it has no leaf.

A plain module (imported by tests/test_opinfo_sweep.py and run as a script):

    python tests/opinfo_sweep.py --json sweep.json [--device cpu] [--dtype float32]
        [--max-samples N] [--ops name,...] [--shard i/n]
"""

from __future__ import annotations

import argparse
import contextlib
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
from fakegrad_patch import FakeGradPatchWarning, trace
from fakegrad_patch._core import state as _state

CATEGORIES = ("exact", "reported", "error", "silent", "skip")
#: float tolerances (the same kernels run in both passes; decompositions may reorder sums)
TOL = {torch.float32: (1.3e-6 * 10, 1e-5), torch.bfloat16: (1.6e-2, 1e-2)}


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


def _run(op: Any, sample: Any, seed: int, fake: bool) -> list[Any]:
    """One forward and backward; the leaves' ``.grad`` (None where none)."""
    inp, args, kwargs, leaves = _fresh(sample)
    ctx: Any = FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext()
    torch.manual_seed(seed)
    with ctx:
        out = op(inp, *args, **kwargs)
        out = sample.output_process_fn_grad(out)
        outs = _differentiable(out)
        if not outs:
            return [None] * len(leaves)
        with torch._subclasses.fake_tensor.unset_fake_temporarily():
            cots = _cotangents(outs, seed)
        torch.autograd.backward(outs, cots)
    return [leaf.grad for leaf in leaves]


def _is_fake(t: Any) -> bool:
    return isinstance(t, torch._subclasses.fake_tensor.FakeTensor)


def _differs(got: Any, want: Any) -> str | None:
    """Why ``got`` (patched) is not ``want`` (eager); None when equal."""
    if want is None:
        return None if got is None else "a gradient where eager has none"
    if got is None:
        return "no gradient"
    if _is_fake(got):
        return "a FakeTensor gradient"
    if got.dtype != want.dtype or got.shape != want.shape or got.layout != want.layout:
        return f"{got.dtype}{list(got.shape)} vs {want.dtype}{list(want.shape)}"
    if want.layout != torch.strided:
        got, want = got.to_dense(), want.to_dense()
    rtol, atol = TOL.get(
        want.dtype if not want.dtype.is_complex else torch.float32, TOL[torch.float32]
    )
    try:
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol, equal_nan=True)
    except AssertionError:
        diff = (
            (got.double() - want.double()).abs()
            if not want.dtype.is_complex
            else (got - want).abs()
        )
        return f"max abs {float(torch.nan_to_num(diff, nan=float('inf')).max()):.3g}"
    return None


def run_case(op: Any, index: int, sample: Any, device: str) -> dict[str, Any]:
    """One sample, eager vs patched: its category and what was seen."""
    seed = _seed(op) + index
    row: dict[str, Any] = {"op": op_id(op), "sample": index}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            want = _run(op, sample, seed, fake=False)
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
            got = _run(op, sample, seed, fake=True)
        except Exception as exc:
            lines = str(exc).strip().splitlines()
            row.update(
                category="error", why=f"{type(exc).__name__}: {lines[0][:300] if lines else ''}"
            )
            return row
    warned = [str(w.message)[:300] for w in caught if issubclass(w.category, FakeGradPatchWarning)]
    differences = {
        i: d for i, (g, w) in enumerate(zip(got, want, strict=True)) if (d := _differs(g, w))
    }
    if warned:
        row.update(
            category="reported",
            why=warned[0],
            events=sorted({e["event"] for e in events}),
            differs=bool(differences),
        )
    elif differences:
        row.update(
            category="silent", why="; ".join(f"leaf {i}: {d}" for i, d in differences.items())
        )
    else:
        row["category"] = "exact"
    return row


def sweep(
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    max_samples: int | None = None,
    ops: list[str] | None = None,
    shard: tuple[int, int] = (0, 1),
    patched: bool = True,
    after: str | None = None,
    out: Any = None,
) -> list[dict[str, Any]]:
    """Run the shard's ops in order (those after ``after``, when given); each row is also
    written to ``out`` (a text file) as one JSON line, flushed, with a ``{"start": op}`` line
    before each op, so a parent can tell which op crashed the interpreter."""
    if patched:
        fakegrad_patch.install()
    else:
        fakegrad_patch.uninstall()
    rows = []
    selected = [op for op in sweep_ops(device, dtype) if ops is None or op_id(op) in ops]
    mine = [op for n, op in enumerate(selected) if n % shard[1] == shard[0]]
    if after is not None:
        names = [op_id(op) for op in mine]
        mine = mine[names.index(after) + 1 :] if after in names else mine
    for op in mine:
        if out is not None:
            out.write(json.dumps({"start": op_id(op)}) + "\n")
            out.flush()
        try:
            cases = samples(op, device, dtype, max_samples)
        except Exception as exc:
            cases = []
            rows.append(
                {"op": op_id(op), "sample": -1, "category": "skip", "why": f"samples: {exc}"}
            )
        for i, sample in enumerate(cases):
            start = time.perf_counter()
            row = run_case(op, i, sample, device)
            row["seconds"] = round(time.perf_counter() - start, 4)
            rows.append(row)
        if out is not None:
            for row in rows[-max(len(cases), 1) :]:
                out.write(json.dumps(row) + "\n")
            out.flush()
    return rows


def run_isolated(
    device: str = "cpu",
    dtype: str = "float32",
    max_samples: int | None = None,
    ops: list[str] | None = None,
    workers: int = 2,
    patched: bool = True,
    workdir: str = ".",
    env: dict[str, str] | None = None,
) -> list[dict[str, Any]]:
    """The sweep in ``workers`` interpreters at once (shards of the op list); an op that kills
    its interpreter (upstream crashes on some sparse ops, patched or not) is recorded as an
    ``error`` and the shard goes on after it in a new interpreter."""
    import os
    import subprocess

    def command(i: int, after: str | None, path: str) -> list[str]:
        cmd = [
            sys.executable,
            os.path.abspath(__file__),
            "--jsonl",
            path,
            "--device",
            device,
            "--dtype",
            dtype,
            "--shard",
            f"{i}/{workers}",
        ]
        if max_samples is not None:
            cmd += ["--max-samples", str(max_samples)]
        if ops:
            cmd += ["--ops", ",".join(ops)]
        if not patched:
            cmd.append("--unpatched")
        if after is not None:
            cmd += ["--after", after]
        return cmd

    rows: list[dict[str, Any]] = []
    pending = {i: None for i in range(workers)}  # shard -> the op to go on after
    while pending:
        procs = {}
        for i, after in pending.items():
            path = os.path.join(workdir, f"sweep-{i}-{len(rows)}.jsonl")
            procs[i] = (
                subprocess.Popen(
                    command(i, after, path),
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE,
                    env=env,
                ),
                path,
            )
        pending = {}
        for i, (proc, path) in procs.items():
            _, err = proc.communicate()
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
                            done.add(item["op"])
                os.unlink(path)
            if proc.returncode == 0:
                continue
            if started is None or started in done:
                raise RuntimeError(f"sweep shard {i} failed: {err.decode()[-2000:]}")
            rows.append(
                {
                    "op": started,
                    "sample": -1,
                    "category": "error",
                    "why": f"the interpreter died (exit {proc.returncode})",
                }
            )
            pending[i] = started
    return rows


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    by_sample = Counter(r["category"] for r in rows)
    worst: dict[str, str] = {}
    order = {c: i for i, c in enumerate(("exact", "skip", "reported", "error", "silent"))}
    for r in rows:
        if order[r["category"]] >= order.get(worst.get(r["op"], "exact"), 0):
            worst[r["op"]] = r["category"]
    return {
        "samples": {c: by_sample.get(c, 0) for c in CATEGORIES},
        "ops": {c: sum(1 for v in worst.values() if v == c) for c in CATEGORIES},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="the whole run's rows and summary")
    parser.add_argument("--jsonl", help="rows as they come, one JSON line each (for a parent)")
    parser.add_argument("--after", default=None, help="go on after this op (a crash)")
    parser.add_argument("--workers", type=int, default=0, help="isolated interpreters")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-samples", type=int, default=None)
    parser.add_argument("--ops", default=None)
    parser.add_argument("--shard", default="0/1")
    parser.add_argument("--unpatched", action="store_true", help="upstream torch alone")
    ns = parser.parse_args(argv)
    i, n = (int(x) for x in ns.shard.split("/"))
    ops = ns.ops.split(",") if ns.ops else None
    start = time.perf_counter()
    if ns.jsonl:
        with open(ns.jsonl, "w") as out:
            sweep(
                ns.device,
                getattr(torch, ns.dtype),
                ns.max_samples,
                ops,
                (i, n),
                not ns.unpatched,
                ns.after,
                out,
            )
        return 0
    if ns.workers:
        rows = run_isolated(
            ns.device,
            ns.dtype,
            ns.max_samples,
            ops,
            ns.workers,
            not ns.unpatched,
            workdir=os.path.dirname(os.path.abspath(ns.json)),
        )
    else:
        rows = sweep(
            ns.device, getattr(torch, ns.dtype), ns.max_samples, ops, (i, n), not ns.unpatched
        )
    result = {
        "torch": torch.__version__,
        "device": ns.device,
        "dtype": ns.dtype,
        "patched": not ns.unpatched,
        "max_samples": ns.max_samples,
        "seconds": round(time.perf_counter() - start, 1),
        "summary": summary(rows),
        "rows": rows,
    }
    with open(ns.json, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result["summary"]))
    for r in rows:
        if r["category"] in ("silent", "error"):
            print(r["category"], r["op"], r["sample"], r.get("why", "")[:200])
    return 0


if __name__ == "__main__":
    sys.exit(main())
