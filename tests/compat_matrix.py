"""The scenario table of docs/compatibility.md: one torch build per run, merged across builds.

Not collected by pytest. Each scenario runs twice in one process, with fakegrad_patch uninstalled
(upstream) and installed, propagation on unless the scenario says otherwise, and is compared with
an eager run of the same program.

One build (the interpreter's torch; the worktree first on the path)::

    PYTHONPATH=$PWD /work/venvs/c-2.4.1/bin/python tests/compat_matrix.py --json compat/2.4.1.json

prints that build's table and saves it. Then, with any of those interpreters::

    python tests/compat_matrix.py --merge compat/*.json

prints the builds x scenarios table pasted into docs/compatibility.md (cells: upstream -> patched).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import pathlib
import platform
import threading
import warnings
from collections.abc import Callable

import torch
import torch._functorch.config as functorch_config
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils.checkpoint import checkpoint
from torch.utils.flop_counter import FlopCounterMode

import fakegrad_patch

warnings.simplefilter("ignore")


def _mode() -> FakeTensorMode:
    return FakeTensorMode(allow_non_fake_inputs=True)


def _mlp(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)).to(
        dtype
    )


def _verdict(model: torch.nn.Module, ref: torch.nn.Module, priors: list | None = None) -> str:
    kinds = set()
    for i, (p, r) in enumerate(zip(model.parameters(), ref.parameters(), strict=True)):
        g = p.grad
        if r.grad is None:
            kinds.add("None" if g is None else "unexpected grad")
        elif g is None:
            kinds.add("None (lost)")
        elif isinstance(g, FakeTensor):
            kinds.add("FakeTensor")
        elif priors is not None and g is priors[i] and not torch.allclose(g, r.grad, atol=1e-4):
            kinds.add("new grad dropped")
        elif torch.allclose(g.double(), r.grad.double(), atol=1e-4, rtol=1e-3):
            kinds.add("real == eager")
        else:
            kinds.add("real != eager")
    return ", ".join(sorted(kinds))


def linear() -> str:
    model, x = _mlp(), torch.randn(4, 8)
    ref = copy.deepcopy(model)
    with _mode():
        model(x).sum().backward()
    ref(x).sum().backward()
    return _verdict(model, ref)


def prior_grad() -> str:
    model, x = _mlp(), torch.randn(4, 8)
    ref = copy.deepcopy(model)
    for m in (model, ref):
        for p in m.parameters():
            p.grad = torch.ones_like(p)
    priors = [p.grad for p in model.parameters()]
    with _mode():
        model(x).sum().backward()
    ref(x).sum().backward()
    return _verdict(model, ref, priors)


def conv_channels_last() -> str:
    def make() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU()).to(
            memory_format=torch.channels_last
        )

    model = make()
    ref = copy.deepcopy(model)
    x = torch.randn(2, 3, 8, 8).to(memory_format=torch.channels_last)
    with _mode():
        model(x).sum().backward()
    ref(x).sum().backward()
    return _verdict(model, ref)


def new_mode_per_iteration() -> str:
    model, x = _mlp(), torch.randn(4, 8)
    ref = copy.deepcopy(model)
    for _ in range(2):
        with _mode():
            model(x).sum().backward()
        ref(x).sum().backward()
    return _verdict(model, ref)


def backward_after_block() -> str:
    model, x = _mlp(), torch.randn(4, 8)
    ref = copy.deepcopy(model)
    with _mode():
        loss = model(x).sum()
    loss.backward()
    ref(x).sum().backward()
    return _verdict(model, ref)


def flop_counter() -> str:
    model, x = _mlp(), torch.randn(4, 8)
    ref = copy.deepcopy(model)
    with FlopCounterMode(display=False), _mode():
        model(x).sum().backward()
    ref(x).sum().backward()
    return _verdict(model, ref)


def sgd_step_after() -> str:
    model, x = _mlp(), torch.randn(4, 8)
    ref = copy.deepcopy(model)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))
    with _mode():
        model(x).sum().backward()
    ref(x).sum().backward()
    opt.step()
    ref_opt.step()
    same = all(
        torch.allclose(p, r) for p, r in zip(model.parameters(), ref.parameters(), strict=True)
    )
    return "params == eager" if same else "params differ from eager"


def bf16() -> str:
    model, x = _mlp(torch.bfloat16), torch.randn(4, 8, dtype=torch.bfloat16)
    ref = copy.deepcopy(model)
    with _mode():
        model(x).float().sum().backward()
    ref(x).float().sum().backward()
    return _verdict(model, ref)


def tied_weights() -> str:
    def make() -> torch.nn.Module:
        torch.manual_seed(0)
        emb, out = torch.nn.Embedding(10, 6), torch.nn.Linear(6, 10, bias=False)
        out.weight = emb.weight
        return torch.nn.Sequential(emb, out)

    model, tokens = make(), torch.tensor([[1, 2], [3, 4]])
    ref = copy.deepcopy(model)
    with _mode():
        model(tokens).logsumexp(-1).sum().backward()
    ref(tokens).logsumexp(-1).sum().backward()
    return _verdict(model, ref)


def reached_through_real_graph() -> str:
    leaf = torch.randn(4, 4, requires_grad=True)
    ref = leaf.detach().clone().requires_grad_()
    scaled = leaf * 3.0
    with _mode():
        (torch.ones(2, 4) @ scaled).sum().backward()
    (torch.ones(2, 4) @ (ref * 3.0)).sum().backward()
    if leaf.grad is None:
        return "None"
    if isinstance(leaf.grad, FakeTensor):
        return "FakeTensor"
    return "real == eager" if torch.allclose(leaf.grad, ref.grad) else "real != eager"


def autograd_grad() -> str:
    model, x = _mlp(), torch.randn(4, 8)
    with _mode():
        grads = torch.autograd.grad(model(x).sum(), list(model.parameters()))
    fake = all(isinstance(g, FakeTensor) for g in grads)
    untouched = all(p.grad is None for p in model.parameters())
    return (
        f"returns {'FakeTensors' if fake else 'real'}; .grad {'untouched' if untouched else 'set'}"
    )


def _checkpoint(reentrant: bool) -> Callable[[], str]:
    def run() -> str:
        model, x = _mlp(), torch.randn(4, 8, requires_grad=True)
        ref = copy.deepcopy(model)
        with _mode():
            checkpoint(model, x, use_reentrant=reentrant).sum().backward()
        checkpoint(ref, x.detach().requires_grad_(), use_reentrant=reentrant).sum().backward()
        return _verdict(model, ref)

    return run


def _propagation(on: bool) -> contextlib.AbstractContextManager[object]:
    """Propagation on/off for a block; a no-op on builds without the flag (nothing propagates)."""
    if not hasattr(functorch_config, "fake_tensor_propagate_real_tensors"):
        return contextlib.nullcontext()
    return functorch_config.patch(fake_tensor_propagate_real_tensors=on)


def threads() -> str:
    out: list[str] = []

    def work() -> None:
        with _propagation(True):
            out.append(linear())

    ts = [threading.Thread(target=work) for _ in range(3)]
    # on here too: where torch's config is process-wide (2.4) a thread's restore would
    # otherwise turn propagation off under the others
    with _propagation(True):
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    return ", ".join(sorted(set(out)))


def post_accumulate_hook() -> str:
    """What a ``register_post_accumulate_grad_hook`` sees (torch <= 2.6: never runs under the
    patch, because a node pre-hook returning ``(None,)`` also skips the leaf's post hooks)."""
    model, x = _mlp(), torch.randn(4, 8)
    seen: list[str] = []

    def hook(p: torch.Tensor) -> None:
        seen.append("FakeTensor" if isinstance(p.grad, FakeTensor) else "real")

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(hook)
    with _mode():
        model(x).sum().backward()
    return f"ran {len(seen)}/4, saw {', '.join(sorted(set(seen))) or '-'}"


def _policy(on_missing: str) -> Callable[[], str]:
    def run() -> str:
        previous = fakegrad_patch.settings().on_missing
        fakegrad_patch.configure(on_missing=on_missing)  # type: ignore[arg-type]
        try:
            with _propagation(False):
                model, x = _mlp(), torch.randn(4, 8)
                with _mode():
                    model(x).sum().backward()
                grads = [p.grad for p in model.parameters()]
                if any(g is None for g in grads):
                    return "None"
                if all(isinstance(g, FakeTensor) for g in grads):
                    return "FakeTensor"
                if all(not isinstance(g, FakeTensor) and not g.any() for g in grads):
                    return "real zeros"
                return "mixed"
        except fakegrad_patch.FakeGradError:
            return "raises FakeGradError"
        finally:
            fakegrad_patch.configure(on_missing=previous)

    return run


def propagation_off() -> str:
    with _propagation(False):
        return prior_grad()


def parameter_real_tensor() -> str:
    values = torch.randn(16, 16)
    fake = FakeTensorMode().from_tensor(torch.nn.Parameter(values.clone()))
    real = getattr(fake, "real_tensor", None)
    if real is None:
        return "no real_tensor"
    return "correct" if torch.equal(real, values) else "uninitialised (D2)"


SCENARIOS: list[tuple[str, Callable[[], str]]] = [
    ("Parameter `real_tensor` after conversion", parameter_real_tensor),
    ("MLP, no prior grad", linear),
    ("MLP, prior real grad", prior_grad),
    ("conv, channels_last", conv_channels_last),
    ("new mode per iteration (x2)", new_mode_per_iteration),
    ("backward after the `with` block", backward_after_block),
    ("FlopCounterMode + fake mode", flop_counter),
    ("SGD step after fake backward", sgd_step_after),
    ("bf16 parameters", bf16),
    ("tied weights", tied_weights),
    ("leaf reached through a real op (D3)", reached_through_real_graph),
    ("`torch.autograd.grad`", autograd_grad),
    ("checkpoint, non-reentrant", _checkpoint(False)),
    ("checkpoint, reentrant", _checkpoint(True)),
    ("3 threads, own modes", threads),
    ("post-accumulate grad hooks", post_accumulate_hook),
    ("propagation off, prior grad (default policy)", propagation_off),
    ('propagation off, `on_missing="zeros"`', _policy("zeros")),
    ('propagation off, `on_missing="error"`', _policy("error")),
    ('propagation off, `on_missing="keep"`', _policy("keep")),
]


def measure() -> dict[str, object]:
    """Run every scenario upstream and patched on this build."""
    rows = []
    applied: dict[str, object] = {}
    for name, run in SCENARIOS:
        cells = []
        for installed in (False, True):
            (fakegrad_patch.install if installed else fakegrad_patch.uninstall)()
            if installed and not applied:
                status = fakegrad_patch.status()
                applied = {"installed": status["installed"], "skipped": status["skipped_reason"]}
            try:
                with _propagation(True):
                    cells.append(run())
            except Exception as exc:
                cells.append(f"raises {type(exc).__name__}")
        rows.append([name, *cells])
    fakegrad_patch.uninstall()
    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "propagation_flag": hasattr(functorch_config, "fake_tensor_propagate_real_tensors"),
        "patch": applied,
        "rows": rows,
    }


def _build_label(result: dict[str, object]) -> str:
    return f"{result['torch']} (py {'.'.join(str(result['python']).split('.')[:2])})"


def single_table(result: dict[str, object]) -> str:
    lines = [
        f"torch {result['torch']}, Python {result['python']}, patch {result['patch']}",
        "",
        "| scenario (propagation on unless said) | upstream | with fakegrad_patch |",
        "|---|---|---|",
    ]
    lines += ["| " + " | ".join(row) + " |" for row in result["rows"]]  # type: ignore[attr-defined]
    return "\n".join(lines)


def merged_table(results: list[dict[str, object]]) -> str:
    """Scenarios down, builds across; a cell reads ``upstream → patched``."""
    results = sorted(
        results, key=lambda r: tuple(int(p) for p in str(r["torch"]).split("+")[0].split("."))
    )
    names = [row[0] for row in results[0]["rows"]]  # type: ignore[index]
    by_build = [{row[0]: row[1:] for row in r["rows"]} for r in results]  # type: ignore[attr-defined]
    header = " | ".join(map(_build_label, results))
    lines = [
        f"| scenario (propagation on unless said) | {header} |",
        "|---|" + "---|" * len(results),
    ]
    applied, notes = [], []
    for r in results:
        patch = r["patch"]
        skipped = patch.get("skipped") if isinstance(patch, dict) else None
        applied.append("yes" if not skipped else "**no**: warns once, torch unchanged")
        if skipped:
            notes.append(f"* {_build_label(r)}: not patched: {skipped}")
    lines.append("| patch applies | " + " | ".join(applied) + " |")
    for name in names:
        cells = []
        for build in by_build:
            up, patched = build.get(name, ["not run", "not run"])
            cells.append(f"{up} → **{patched}**" if up != patched else f"{up} → same")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines + (["", *notes] if notes else []))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=pathlib.Path, help="also save this build's results here")
    parser.add_argument("--merge", nargs="+", type=pathlib.Path, help="print the merged table")
    args = parser.parse_args(argv)
    if args.merge:
        print(merged_table([json.loads(p.read_text()) for p in args.merge]))
        return
    result = measure()
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    print(single_table(result))


if __name__ == "__main__":
    main()
