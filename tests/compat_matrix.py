"""Print the compatibility table of docs/compatibility.md for the installed torch.

Run: ``python tests/compat_matrix.py`` (not collected by pytest). Each scenario runs twice in one
process, with fakegrad_patch uninstalled (upstream) and installed, propagation on unless the
scenario says otherwise, and is compared with an eager run of the same program.
"""

from __future__ import annotations

import copy
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


def threads() -> str:
    out: list[str] = []

    def work() -> None:
        with functorch_config.patch(fake_tensor_propagate_real_tensors=True):
            out.append(linear())

    ts = [threading.Thread(target=work) for _ in range(3)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return ", ".join(sorted(set(out)))


def propagation_off() -> str:
    with functorch_config.patch(fake_tensor_propagate_real_tensors=False):
        return prior_grad()


def parameter_real_tensor() -> str:
    values = torch.randn(16, 16)
    fake = FakeTensorMode().from_tensor(torch.nn.Parameter(values.clone()))
    return "correct" if torch.equal(fake.real_tensor, values) else "uninitialised (D2)"


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
    ("propagation off, prior grad (default policy)", propagation_off),
]


def main() -> None:
    rows = []
    for name, run in SCENARIOS:
        cells = []
        for installed in (False, True):
            (fakegrad_patch.install if installed else fakegrad_patch.uninstall)()
            try:
                with functorch_config.patch(fake_tensor_propagate_real_tensors=True):
                    cells.append(run())
            except Exception as exc:
                cells.append(f"raises {type(exc).__name__}")
        rows.append((name, *cells))
    print(f"torch {torch.__version__}\n")
    print("| scenario (propagation on unless said) | upstream | with fakegrad_patch |")
    print("|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
