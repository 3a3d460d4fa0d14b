"""A differential fuzzer of random programs: eager vs one patched propagating pass.

Each program is built from a seed only (``random.Random(seed)``; shapes are learned by running
the program eagerly while it is built, and a step that raises eagerly is dropped), 10-25 steps
over a table of ops (views of views, in-place ops directly and through views, ``out=`` ops,
multi-output ops, reductions, matmul/linear/conv, pointwise ops, double backward,
``autograd.grad``, forward AD, ``torch.func``, checkpointing, hooks, custom autograd Functions,
RNG ops, complex leaves, 0-dim and empty tensors, int/bool tensors, tensors made inside the
mode, ``.item()``/``bool()`` reads, ``.data`` assignment, optimizer-like updates of leaves under
``no_grad`` and metadata reads), then a backward from a loss over the outputs.

It runs twice from the same RNG state: eagerly, and inside
``FakeTensorMode(allow_non_fake_inputs=True)`` with real-value propagation and the patch, once
per setting (``fast``, ``repair``, and their ``buffers="write_back"`` twins ``fast-wb``,
``repair-wb``). Leaves are real tensors made outside the mode. Compared after every step: every
variable's metadata a program can read (shape, stride, storage offset, dtype, conj and neg bits,
requires_grad, is_leaf), its values (``.real_tensor`` on the fake side; none is a finding),
which variables share a storage, Python scalars read, and the global RNG state; after the
program, every variable again, every leaf's ``.grad`` (real on a real leaf, values, dtype, shape,
strides) and the RNG state. A program's outcome per setting:

* ``exact``: no difference, nothing said;
* ``reported``: the patch warned (``FakeGradPatchWarning``, or a warning-level trace event);
* ``error``: the patched pass raised where eager raised too;
* ``loud``: the patched pass raised where eager did not (``names_op``: the message names an op);
* ``silent``: a difference, and nothing said;
* ``crash``: the child interpreter died (a signal, or hung).

Programs run in child interpreters, each a shard of the seeds; a shard whose interpreter dies
goes on in a new one after the program that was running, and that program is run alone again
in a fresh interpreter to confirm it (``alone`` in its row).

    python tests/fuzz_programs.py --budget-s 60 --setting fast,repair --json out.json
        [--seed-start N] [--count N] [--workers 2] [--no-confirm]
    python tests/fuzz_programs.py --seed N --setting fast --show   # the program as Python
    python tests/fuzz_programs.py --seed N --setting fast,repair   # run one, print the outcome
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import faulthandler
import hashlib
import itertools
import json
import math
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch._functorch.config as functorch_config
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily

import fakegrad_patch
from fakegrad_patch import FakeGradPatchWarning, trace
from fakegrad_patch._core import state as _state

OUTCOMES = ("exact", "reported", "error", "loud", "silent", "crash")
#: setting name -> (propagation, buffers)
SETTINGS: dict[str, tuple[str, str]] = {
    "fast": ("fast", "upstream"),
    "repair": ("repair", "upstream"),
    "fast-wb": ("fast", "write_back"),
    "repair-wb": ("repair", "write_back"),
}
#: float tolerances: both passes run the same kernels; a decomposition may reorder a sum
RTOL, ATOL = 1e-4, 1e-5
#: a program that runs longer than this in a child is killed and counted as a crash (hung)
PROGRAM_TIMEOUT_S = 60.0
MAX_DIFFS = 12

# ---------------------------------------------------------------------------------------------
# Programs


@dataclasses.dataclass
class Step:
    """One step: Python source run in the program's namespace, and a label naming its op."""

    op: str
    code: str
    #: run after the ``with mode:`` block (a backward or an update after leaving the mode)
    outside: bool = False


@dataclasses.dataclass
class Program:
    seed: int
    leaves: list[Step]
    body: list[Step]
    #: the step eager raised at, kept on purpose as the last one (None: eager runs to the end)
    eager_raises: bool = False

    def source(self, setting: str = "fast") -> str:
        """The program as a standalone script: eager, then patched, printing both."""
        propagation, buffers = SETTINGS[setting]
        lines = [
            f"# fuzz program, seed {self.seed} ({torch.__version__}); "
            f"python tests/fuzz_programs.py --seed {self.seed} --setting {setting} --show",
            "import contextlib",
            "import torch",
            "import torch.nn.functional as F",
            "import torch.autograd.forward_ad as fwAD",
            "import torch._functorch.config as cfg",
            "from torch._subclasses.fake_tensor import FakeTensorMode",
            "import fakegrad_patch",
            "",
            *_classes_used(self.body),
            "",
            "def run(fake):",
            f"    torch.manual_seed({self.seed})",
        ]
        lines += [_indent(s.code, 4) for s in self.leaves]
        leaf_names = [s.code.split(" = ", 1)[0] for s in self.leaves]
        lines.append(
            "    mode = FakeTensorMode(allow_non_fake_inputs=True) if fake "
            "else contextlib.nullcontext()"
        )
        lines.append("    with mode:")
        inside = [s for s in self.body if not s.outside]
        outside = [s for s in self.body if s.outside]
        for i, s in enumerate(inside):
            lines.append(f"        # step {i}: {s.op}")
            lines.append(_indent(s.code, 8))
        if not inside:
            lines.append("        pass")
        for s in outside:
            lines.append(f"    # step {self.body.index(s)} (outside the mode): {s.op}")
            lines.append(_indent(s.code, 4))
        lines.append(f"    return {{n: t for n, t in locals().items() if n in {leaf_names!r}}}")
        lines += [
            "",
            "",
            "def values(t):",
            "    if t is None or not isinstance(t, torch.Tensor):",
            "        return t",
            "    r = getattr(t, 'real_tensor', t) if type(t).__name__ == 'FakeTensor' else t",
            "    return (type(t).__name__, None if r is None else r.detach().resolve_conj())",
            "",
            "",
            "eager = run(False)",
            "cfg.fake_tensor_propagate_real_tensors = True",
            f"fakegrad_patch.configure(propagation={propagation!r}, buffers={buffers!r})",
            "patched = run(True)",
            "for name in eager:",
            "    print(name, 'grad eager  ', values(eager[name].grad))",
            "    print(name, 'grad patched', values(patched[name].grad))",
            "    print(name, 'value equal',"
            " torch.equal(eager[name].detach(), patched[name].detach()))",
            "",
        ]
        return "\n".join(lines)


def _classes_used(body: list[Step]) -> list[str]:
    out = []
    for chunk in CLASSES_CODE.strip().split("\n\n\n"):
        name = chunk.split("(", 1)[0].removeprefix("class ").strip()
        if any(f"{name}.apply" in s.code for s in body):
            out += [chunk, "", ""]
    return out


def _indent(code: str, n: int) -> str:
    return "\n".join(" " * n + line for line in code.splitlines())


CLASSES_CODE = """
class Cube(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x * x

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 3 * x * x * g


class SaveOut(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        y = x.exp()
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return g * y


class TwoOut(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * 2, x.sin()

    @staticmethod
    def backward(ctx, g1, g2):
        (x,) = ctx.saved_tensors
        return g1 * 2 + g2 * x.cos()


class Dirty(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        x.mul_(2)
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx, g):
        return g * 2


class NonDiff(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        idx = x.argmax()
        ctx.mark_non_differentiable(idx)
        ctx.save_for_backward(x)
        return x.tanh(), idx

    @staticmethod
    def backward(ctx, g, _gi):
        (x,) = ctx.saved_tensors
        return g * (1 - x.tanh() ** 2)
"""

#: leaves made outside the mode (name, code); "a" is always there
GRAD_LEAVES: list[tuple[str, str]] = [
    ("a", "torch.randn(3, 4, requires_grad=True)"),
    ("b", "torch.randn(4, 3, requires_grad=True)"),
    ("c", "torch.randn(4, requires_grad=True)"),
    ("d", "torch.randn(2, 3, 4, requires_grad=True)"),
    ("s", "torch.tensor(0.7, requires_grad=True)"),
    ("nt", "torch.randn(4, 3).t().detach().requires_grad_()"),
    ("u", "torch.randn(3, 1, 2, requires_grad=True)"),
    ("p", "torch.nn.Parameter(torch.randn(3, 4))"),
    ("z", "torch.randn(3, 2, dtype=torch.complex64, requires_grad=True)"),
    ("e", "torch.randn(0, 3, requires_grad=True)"),
]
PLAIN_LEAVES: list[tuple[str, str]] = [
    ("buf", "torch.zeros(3, 4)"),
    ("ix", "torch.tensor([0, 2, 1])"),
    ("mk", "torch.randn(3, 4) > 0"),
    ("ints", "torch.arange(12).view(3, 4)"),
]


def base_namespace() -> dict[str, Any]:
    ns: dict[str, Any] = {
        "torch": torch,
        "F": F,
        "fwAD": torch.autograd.forward_ad,
        "__name__": "fuzz_program",
    }
    exec(compile(CLASSES_CODE, "<fuzz classes>", "exec"), ns)
    return ns


BASE_NAMES = frozenset(base_namespace()) | {"__builtins__"}


def user_names(ns: dict[str, Any]) -> list[str]:
    """The program's variables, in the order they were made (dicts keep insertion order)."""
    return [k for k in ns if k not in BASE_NAMES and not k.startswith("_")]


# ---------------------------------------------------------------------------------------------
# The generator


def _tup(shape: Any) -> str:
    s = tuple(int(x) for x in shape)
    return "(" + ", ".join(map(str, s)) + ("," if len(s) == 1 else "") + ")"


def _is_t(v: Any) -> bool:
    return isinstance(v, torch.Tensor)


def _fl(v: Any) -> bool:
    return _is_t(v) and v.dtype in (torch.float32, torch.float64)


def _cx(v: Any) -> bool:
    return _is_t(v) and v.dtype.is_complex


def _int(v: Any) -> bool:
    return _is_t(v) and v.dtype in (torch.int64, torch.int32)


def _bool(v: Any) -> bool:
    return _is_t(v) and v.dtype == torch.bool


def _diff(v: Any) -> bool:
    return (_fl(v) or _cx(v)) and v.requires_grad


def _nonleaf(v: Any) -> bool:
    return _diff(v) and v.grad_fn is not None


def _holds(pred: Callable[[Any], bool], value: Any) -> bool:
    # a view whose base was changed in place raises on reading its grad_fn: not a candidate
    try:
        return bool(pred(value))
    except RuntimeError:
        return False


class Gen:
    """Picks variables and writes steps; ``ns`` is the eager namespace of the program so far."""

    def __init__(self, rng: random.Random, ns: dict[str, Any], counter: int) -> None:
        self.rng = rng
        self.ns = ns
        self.counter = counter
        self.leaf_names: set[str] = set()

    def fresh(self) -> str:
        self.counter += 1
        return f"v{self.counter}"

    def names(self, pred: Callable[[Any], bool]) -> list[str]:
        return [n for n in user_names(self.ns) if _holds(pred, self.ns[n])]

    def pick(self, pred: Callable[[Any], bool], recent: float = 0.6) -> str | None:
        cands = self.names(pred)
        if not cands:
            return None
        if len(cands) > 4 and self.rng.random() < recent:
            return self.rng.choice(cands[-4:])
        return self.rng.choice(cands)

    def t(self, name: str) -> torch.Tensor:
        value = self.ns[name]
        assert isinstance(value, torch.Tensor)
        return value

    def choice(self, items: list[Any]) -> Any:
        return self.rng.choice(items)

    def partner(self, x: str, same_dtype: bool = True) -> str:
        """An expression of ``x``'s shape (or broadcastable to it) for a binary op."""
        tx = self.t(x)
        same = [
            n
            for n in self.names(lambda v: _is_t(v) and v.shape == tx.shape)
            if n != x and (not same_dtype or self.t(n).dtype == tx.dtype)
        ]
        r = self.rng.random()
        if same and r < 0.5:
            return self.choice(same)
        if r < 0.65 and "s" in self.ns and tx.dtype == torch.float32:
            return "s"
        if r < 0.8:
            return f"torch.randn({_tup(tx.shape)}, dtype={tx.dtype})"
        if r < 0.9:
            return f"torch.full({_tup(tx.shape)}, 0.25, dtype={tx.dtype})"
        return self.choice(["0.5", "1.5", "-2.0"])

    def index_for(self, size: int, n: int | None = None) -> str:
        n = n or self.rng.randint(1, 3)
        idx = [self.rng.randrange(size) for _ in range(n)]
        return f"torch.tensor({idx})"


Template = Callable[[Gen], tuple[str, str] | None]

UNARY = [
    "{x}.sin()",
    "{x}.cos()",
    "{x}.tanh()",
    "{x}.sigmoid()",
    "{x}.relu()",
    "F.gelu({x})",
    "F.silu({x})",
    "{x}.abs()",
    "-{x}",
    "{x}.exp()",
    "{x}.square()",
    "({x}.abs() + 0.1).sqrt()",
    "({x}.abs() + 0.1).log()",
    "({x}.abs() + 0.5).reciprocal()",
    "{x}.clamp(-0.5, 0.5)",
    "F.elu({x})",
    "F.leaky_relu({x}, 0.1)",
    "torch.erf({x})",
    "torch.atan({x})",
    "F.softplus({x})",
    "{x} * 2",
    "{x} + 1",
    "{x}.clone()",
    "{x}.contiguous()",
    "{x}.to(torch.float64)",
    "{x}.to(torch.bfloat16).float()",
]
BINARY = [
    "{x} + {y}",
    "{x} - {y}",
    "{x} * {y}",
    "{x} / ({y}.abs() + 0.5)",
    "torch.maximum({x}, {y})",
    "torch.minimum({x}, {y})",
    "torch.atan2({x}, {y})",
    "torch.pow({x}.abs() + 0.5, {y})",
    "torch.xlogy({x}, {y}.abs() + 0.1)",
    "torch.xlogy({x}, {y})",
    "torch.lerp({x}, {y}, 0.3)",
    "torch.hypot({x}, {y})",
    "torch.where({x} > 0, {x}, {y})",
    "torch.addcmul({x}, {x}, {y}, value=0.5)",
]
REDUCE = [
    "{x}.sum()",
    "{x}.sum({d})",
    "{x}.mean({d}, keepdim=True)",
    "{x}.prod({d})",
    "{x}.amax({d})",
    "{x}.amin()",
    "{x}.norm()",
    "torch.logsumexp({x}, {d})",
    "{x}.var({d})",
    "{x}.std()",
    "{x}.cumsum({d})",
    "{x}.cumprod({d})",
    "{x}.max()",
    "{x}.softmax({d})",
    "{x}.log_softmax({d})",
]


def t_unary(g: Gen) -> tuple[str, str] | None:
    x = g.pick(lambda v: _fl(v))
    if x is None:
        return None
    expr = g.choice(UNARY)
    o = g.fresh()
    return "pointwise:" + expr.split("(")[0].replace("{x}", "x"), f"{o} = {expr.format(x=x)}"


def t_binary(g: Gen) -> tuple[str, str] | None:
    x = g.pick(_fl)
    if x is None:
        return None
    y = g.partner(x)
    expr = g.choice(BINARY)
    if not y.isidentifier() and "{y}." in expr:
        y = f"({y})"
    scalar = y[0].isdigit() or y[0] == "-"
    if scalar and ("{y}." in expr or any(k in expr for k in ("where", "atan2", "hypot"))):
        y = f"torch.tensor({y})"
    o = g.fresh()
    label = expr.replace("{x}", "x").replace("{y}", "y").split("(")[0] or expr
    return "binary:" + label[:20], f"{o} = {expr.format(x=x, y=y)}"


def t_reduce(g: Gen) -> tuple[str, str] | None:
    x = g.pick(lambda v: _fl(v) and v.dim() >= 1)
    if x is None:
        return None
    d = g.rng.randrange(g.t(x).dim())
    expr = g.choice(REDUCE)
    o = g.fresh()
    return "reduce:" + expr.split("(")[0].replace("{x}.", ""), f"{o} = {expr.format(x=x, d=d)}"


def t_view(g: Gen) -> tuple[str, str] | None:
    x = g.pick(lambda v: _is_t(v) and v.numel() > 0, recent=0.8)
    if x is None:
        return None
    tx = g.t(x)
    o = g.fresh()
    n, shape, dim = tx.numel(), tuple(tx.shape), tx.dim()
    kinds = ["view", "reshape", "unsqueeze", "flatten", "slice", "detach", "expand"]
    if dim >= 1:
        kinds += ["narrow", "select", "unfold", "as_strided", "as_strided_overlap"]
    if dim == 2:
        kinds += ["t", "t", "mT"]
    if dim >= 2:
        kinds += ["transpose", "diagonal", "permute", "squeeze"]
    kind = g.choice(kinds)
    if kind == "view":
        divs = [k for k in range(1, n + 1) if n % k == 0]
        k = g.choice(divs)
        target = g.choice([(-1,), (k, -1), (-1, k), (1, n)])
        return "view:view", f"{o} = {x}.view({_tup(target)})"
    if kind == "reshape":
        divs = [k for k in range(1, n + 1) if n % k == 0]
        k = g.choice(divs)
        return "view:reshape", f"{o} = {x}.reshape({k}, -1)"
    if kind == "unsqueeze":
        return "view:unsqueeze", f"{o} = {x}.unsqueeze({g.rng.randint(-1, dim)})"
    if kind == "flatten":
        return "view:flatten", f"{o} = {x}.flatten()"
    if kind == "detach":
        return "view:detach", f"{o} = {x}.detach()"
    if kind == "slice":
        if dim == 0:
            return "view:view", f"{o} = {x}.view(1)"
        d = g.rng.randrange(dim)
        sl = g.choice(["1:", "::2", ":-1", "0:0"])
        return f"view:slice[{sl}]", f"{o} = {x}[{':, ' * d}{sl}]"
    if kind == "expand":
        ones = [i for i, s in enumerate(shape) if s == 1]
        if ones:
            new = list(shape)
            new[g.choice(ones)] = 3
            return "view:expand", f"{o} = {x}.expand({_tup(new)})"
        return "view:expand", f"{o} = {x}.unsqueeze(0).expand({_tup((2, *shape))})"
    if kind == "narrow":
        d = g.rng.randrange(dim)
        size = shape[d]
        if size == 0:
            return None
        start = g.rng.randrange(size)
        length = g.rng.randint(0 if g.rng.random() < 0.1 else 1, size - start)
        return "view:narrow", f"{o} = {x}.narrow({d}, {start}, {length})"
    if kind == "select":
        d = g.rng.randrange(dim)
        if shape[d] == 0:
            return None
        i = g.rng.randrange(shape[d])
        if d == 0 and g.rng.random() < 0.5:
            return "view:getitem", f"{o} = {x}[{i}]"
        return "view:select", f"{o} = {x}.select({d}, {i})"
    if kind == "unfold":
        d = g.rng.randrange(dim)
        if shape[d] < 2:
            return None
        return "view:unfold", f"{o} = {x}.unfold({d}, 2, 1)"
    if kind in ("as_strided", "as_strided_overlap"):
        total = tx.untyped_storage().nbytes() // max(tx.element_size(), 1)
        root = tx._base if tx._base is not None else tx
        if total != root.numel() or root.storage_offset() != 0 or not root.is_contiguous():
            # a storage larger than what its tensor wrote (a kernel's bigger buffer): as_strided
            # over it reads uninitialised memory in eager too, whatever it holds
            return None
        off = tx.storage_offset()
        if kind == "as_strided_overlap":
            size, stride = g.choice([((2, 2), (1, 1)), ((3, 2), (1, 1)), ((2, 3), (1, 0))])
        else:
            size, stride = g.choice(
                [((2, 2), (2, 1)), ((2,), (2,)), ((3,), (1,)), ((2, 2), (1, 2))]
            )
        span = sum((s - 1) * st for s, st in zip(size, stride, strict=True)) + 1
        if off + span > total:
            off = 0
        if span > total:
            return None
        return (
            f"view:{kind}",
            f"{o} = {x}.as_strided({_tup(size)}, {_tup(stride)}, {off})",
        )
    if kind in ("t", "mT"):
        return f"view:{kind}", f"{o} = {x}.{kind}" + ("()" if kind == "t" else "")
    if kind == "transpose":
        return "view:transpose", f"{o} = {x}.transpose(0, -1)"
    if kind == "diagonal":
        off = g.choice([0, 0, 1, -1])
        return "view:diagonal", f"{o} = {x}.diagonal({off}, 0, 1)"
    if kind == "permute":
        perm = list(range(dim))
        g.rng.shuffle(perm)
        return "view:permute", f"{o} = {x}.permute({_tup(perm)})"
    if kind == "squeeze":
        return "view:squeeze", f"{o} = {x}.squeeze()"
    return None


def t_multi_view(g: Gen) -> tuple[str, str] | None:
    x = g.pick(lambda v: _is_t(v) and v.dim() >= 1 and v.numel() > 0)
    if x is None:
        return None
    tx = g.t(x)
    d = g.rng.randrange(tx.dim())
    size = tx.shape[d]
    o = g.fresh()
    kind = g.choice(["split", "split_sizes", "chunk", "unbind"])
    if kind == "unbind" and size <= 4:
        names = [f"{o}_{i}" for i in range(size)]
        return "multi:unbind", f"{', '.join(names)}{',' if size == 1 else ''} = {x}.unbind({d})"
    if kind == "split_sizes" and size >= 2:
        first = g.rng.randint(1, size - 1)
        return "multi:split", f"{o}_0, {o}_1 = {x}.split([{first}, {size - first}], {d})"
    if kind == "chunk":
        k = g.rng.randint(1, 3)
        count = len(tx.chunk(k, d))
        names = [f"{o}_{i}" for i in range(count)]
        return "multi:chunk", f"{', '.join(names)}{',' if count == 1 else ''} = {x}.chunk({k}, {d})"
    k = g.rng.randint(1, 2)
    count = len(tx.split(k, d))
    if count > 4:
        return None
    names = [f"{o}_{i}" for i in range(count)]
    return "multi:split", f"{', '.join(names)}{',' if count == 1 else ''} = {x}.split({k}, {d})"


INPLACE = [
    ("add_", "{x}.add_({y})"),
    ("mul_", "{x}.mul_({y})"),
    ("sub_", "{x}.sub_({y}, alpha=0.5)"),
    ("div_", "{x}.div_(2.0)"),
    ("copy_", "{x}.copy_({y})"),
    ("clamp_", "{x}.clamp_(-0.5, 0.5)"),
    ("zero_", "{x}.zero_()"),
    ("fill_", "{x}.fill_(0.3)"),
    ("sigmoid_", "{x}.sigmoid_()"),
    ("addcmul_", "{x}.addcmul_({y}, {y}, value=0.1)"),
    ("lerp_", "{x}.lerp_({y}, 0.5)"),
    ("masked_fill_", "{x}.masked_fill_({x} > 0, 0.0)"),
    ("setitem", "{x}[0] = 1.5"),
    ("setitem_mask", "{x}[{x} < 0] = 0.0"),
    ("iadd", "{x} += {y}"),
]


def t_inplace(g: Gen) -> tuple[str, str] | None:
    x = g.pick(
        lambda v: _fl(v) and not (v.is_leaf and v.requires_grad) and v.numel() > 0, recent=0.7
    )
    if x is None:
        return None
    name, expr = g.choice(INPLACE)
    tx = g.t(x)
    if name == "setitem" and tx.dim() == 0:
        expr = "{x}.fill_(1.5)"
    if name == "masked_fill_":
        masks = [n for n in g.names(lambda v: _bool(v) and v.shape == tx.shape)]
        if masks and g.rng.random() < 0.5:
            expr = "{x}.masked_fill_(" + g.choice(masks) + ", -1.0)"
    y = g.partner(x)
    code = expr.format(x=x, y=y)
    if g.rng.random() < 0.2:
        return f"inplace-no_grad:{name}", f"with torch.no_grad():\n    {code}"
    return f"inplace:{name}", code


def t_index_inplace(g: Gen) -> tuple[str, str] | None:
    x = g.pick(lambda v: _fl(v) and v.dim() >= 1 and v.numel() > 0 and not v.is_leaf)
    if x is None:
        return None
    tx = g.t(x)
    d = g.rng.randrange(tx.dim())
    if tx.shape[d] == 0:
        return None
    n = g.rng.randint(1, 3)
    idx = g.index_for(tx.shape[d], n)
    src_shape = list(tx.shape)
    src_shape[d] = n
    kind = g.choice(["index_add_", "index_fill_", "index_copy_", "scatter_add_", "index_put_"])
    src = f"torch.randn({_tup(src_shape)}, dtype={tx.dtype})"
    if kind == "index_add_":
        return "inplace:index_add_", f"{x}.index_add_({d}, {idx}, {src})"
    if kind == "index_fill_":
        return "inplace:index_fill_", f"{x}.index_fill_({d}, {idx}, -0.5)"
    if kind == "index_copy_":
        uniq = sorted(set(eval(idx[len("torch.tensor(") : -1])))
        src_shape[d] = len(uniq)
        return (
            "inplace:index_copy_",
            f"{x}.index_copy_({d}, torch.tensor({uniq}), "
            f"torch.randn({_tup(src_shape)}, dtype={tx.dtype}))",
        )
    if kind == "scatter_add_":
        return (
            "inplace:scatter_add_",
            f"{x}.scatter_add_({d}, torch.zeros_like({x}, dtype=torch.long), {x}.detach() * 0.5)",
        )
    return "inplace:index_put_", f"{x}.index_put_(({idx},), torch.tensor(2.0), accumulate=True)"


def t_strided_inplace(g: Gen) -> tuple[str, str] | None:
    """In-place writes next to as_strided/expand views whose gradients then flow back: the
    base written after an overlapping view of it was taken, or a write through a view."""
    x = g.pick(lambda v: _fl(v) and v.requires_grad and v.numel() >= 4)
    if x is None:
        return None
    o = g.fresh()
    kind = g.choice(["overlap_then_base", "write_through", "expand_then_base", "diag_write"])
    base = f"{o}_b = {x}.flatten()[:4].clone()\n"
    if kind == "overlap_then_base":
        return "strided:overlapping view, base written", (
            base + f"{o} = {o}_b.as_strided((3, 2), (1, 1), 0)\n{o}_b.mul_(2)"
        )
    if kind == "write_through":
        return "strided:write through as_strided", (
            base + f"{o}_b.as_strided((2,), (2,), 0).mul_(3)\n{o} = {o}_b * 1"
        )
    if kind == "expand_then_base":
        return "strided:expanded view, base written", (
            base + f"{o} = {o}_b[:1].expand(3, 1)\n{o}_b.add_(1)"
        )
    return "strided:write through diagonal", (
        f"{o}_b = {x}.flatten()[:4].clone().view(2, 2)\n{o}_b.diagonal().mul_(2)\n{o} = {o}_b + 0"
    )


def t_leaf_update(g: Gen) -> tuple[str, str] | None:
    """An in-place update of a leaf (or a view of one) under no_grad: the optimizer idiom."""
    x = g.pick(lambda v: _fl(v) and v.is_leaf and v.requires_grad and v.numel() > 0)
    if x is None:
        return None
    has_grad = g.t(x).grad is not None
    kinds = ["mul_", "add_", "view_add_", "copy_"]
    if has_grad:
        kinds += ["sgd", "sgd", "isub", "foreach", "optim", "grad_zero", "grad_none"]
    kind = g.choice(kinds)
    if kind == "mul_":
        return "leaf-update:mul_", f"with torch.no_grad():\n    {x}.mul_(0.9)"
    if kind == "add_":
        return "leaf-update:add_", f"with torch.no_grad():\n    {x}.add_(0.25)"
    if kind == "view_add_":
        return "leaf-update:view_add_", f"with torch.no_grad():\n    {x}.view(-1)[0:2].add_(1.0)"
    if kind == "copy_":
        return "leaf-update:copy_", f"with torch.no_grad():\n    {x}.copy_({x} * 0.5)"
    if kind == "sgd":
        return "leaf-update:sgd", f"with torch.no_grad():\n    {x}.add_({x}.grad, alpha=-0.1)"
    if kind == "isub":
        return "leaf-update:isub", f"with torch.no_grad():\n    {x} -= 0.1 * {x}.grad"
    if kind == "foreach":
        return (
            "leaf-update:foreach",
            f"with torch.no_grad():\n    torch._foreach_add_([{x}], [{x}.grad], alpha=-0.1)",
        )
    if kind == "optim":
        o = g.fresh()
        mom = g.choice(["", ", momentum=0.9"])
        return "leaf-update:optim.SGD", (f"{o} = torch.optim.SGD([{x}], lr=0.1{mom})\n{o}.step()")
    if kind == "grad_zero":
        return "leaf-update:grad.zero_", f"{x}.grad.zero_()"
    return "leaf-update:grad=None", f"{x}.grad = None"


def t_optimizer_step(g: Gen) -> tuple[str, str] | None:
    """An optimizer-like step over the leaves that have a gradient, inside the mode."""
    leaves = g.names(lambda v: _fl(v) and v.is_leaf and v.requires_grad and v.grad is not None)
    if not leaves:
        return None
    kind = g.choice(["sgd", "isub", "foreach", "optim", "optim_zero"])
    if kind == "sgd":
        code = "\n".join(f"    {x}.add_({x}.grad, alpha=-0.1)" for x in leaves)
        return "optimizer:sgd(no_grad add_)", f"with torch.no_grad():\n{code}"
    if kind == "isub":
        code = "\n".join(f"    {x} -= 0.1 * {x}.grad" for x in leaves)
        return "optimizer:isub", f"with torch.no_grad():\n{code}"
    if kind == "foreach":
        ps, gs = ", ".join(leaves), ", ".join(f"{x}.grad" for x in leaves)
        return "optimizer:_foreach_add_", (
            f"with torch.no_grad():\n    torch._foreach_add_([{ps}], [{gs}], alpha=-0.1)"
        )
    o = g.fresh()
    extra = g.choice(["", ", momentum=0.9", ", weight_decay=0.1"])
    zero = f"\n{o}.zero_grad()" if kind == "optim_zero" else ""
    return f"optimizer:optim.SGD({extra[2:]})", (
        f"{o} = torch.optim.SGD([{', '.join(leaves)}], lr=0.1{extra})\n{o}.step(){zero}"
    )


def t_data(g: Gen) -> tuple[str, str] | None:
    x = g.pick(lambda v: _fl(v) and v.numel() > 0)
    if x is None:
        return None
    kind = g.choice(["assign", "assign_new", "mul_", "read"])
    if kind == "assign":
        return ".data:assign", f"{x}.data = {x}.data * 0.5"
    if kind == "assign_new":
        return ".data:assign_new", f"{x}.data = torch.randn_like({x})"
    if kind == "mul_":
        return ".data:mul_", f"{x}.data.mul_(2)"
    return ".data:read", f"{g.fresh()} = {x}.data"


def t_out(g: Gen) -> tuple[str, str] | None:
    x = g.pick(lambda v: _fl(v) and v.dim() >= 1 and v.numel() > 0)
    if x is None:
        return None
    tx = g.t(x)
    o = g.fresh()
    src = f"{x}.detach()"
    kind = g.choice(["empty", "empty", "noncontig_out", "noncontig_in", "buffer", "multi"])
    op = g.choice(["add", "mul", "sin", "exp", "clamp", "sum"])
    call = {
        "add": "torch.add({s}, 1.0, out={o})",
        "mul": "torch.mul({s}, {s}, out={o})",
        "sin": "torch.sin({s}, out={o})",
        "exp": "torch.exp({s}, out={o})",
        "clamp": "torch.clamp({s}, -0.5, 0.5, out={o})",
        "sum": "torch.sum({s}, 0, out={o})",
    }[op]
    if kind == "empty":
        return f"out=:{op}(empty)", f"{o} = torch.empty(0)\n" + call.format(s=src, o=o)
    if kind == "noncontig_out" and tx.dim() == 2 and op != "sum":
        rev = _tup(tuple(tx.shape)[::-1])
        return (
            f"out=:{op}(non-contiguous out)",
            f"{o} = torch.zeros({rev}).t()\n" + call.format(s=src, o=o),
        )
    if kind == "noncontig_in" and tx.dim() == 2:
        return (
            f"out=:{op}(non-contiguous input)",
            f"{o} = torch.empty(0)\n" + call.format(s=f"{src}.t()", o=o),
        )
    if kind == "buffer" and "buf" in g.ns and tuple(tx.shape) == (3, 4) and op != "sum":
        return f"out=:{op}(real buffer)", call.format(s=src, o="buf")
    if kind == "multi" and tx.dim() >= 1:
        return (
            "out=:max(dim)",
            f"{o}_v, {o}_i = torch.empty(0), torch.empty(0, dtype=torch.long)\n"
            f"torch.max({src}, 0, out=({o}_v, {o}_i))",
        )
    return f"out=:{op}(empty)", f"{o} = torch.empty(0)\n" + call.format(s=src, o=o)


def t_multi_out(g: Gen) -> tuple[str, str] | None:
    x = g.pick(lambda v: _fl(v) and v.dim() >= 1 and v.numel() > 0)
    if x is None:
        return None
    tx = g.t(x)
    d = g.rng.randrange(tx.dim())
    o = g.fresh()
    kind = g.choice(["max", "min", "sort", "topk", "kthvalue", "median", "var_mean", "aminmax"])
    if kind == "topk":
        k = g.rng.randint(1, tx.shape[d])
        return "multi-out:topk", f"{o}_v, {o}_i = torch.topk({x}, {k}, dim={d})"
    if kind == "sort":
        return "multi-out:sort", f"{o}_v, {o}_i = torch.sort({x}, dim={d}, descending=True)"
    if kind == "kthvalue":
        return "multi-out:kthvalue", f"{o}_v, {o}_i = torch.kthvalue({x}, 1, {d})"
    if kind == "median":
        # torch's CPU median(dim) reads garbage from an expanded (stride-0) input (2.13,
        # 2.14.1): eager itself is wrong there, so such inputs are made contiguous first
        src = f"{x}.contiguous()" if 0 in tx.stride() else x
        return "multi-out:median", f"{o}_v, {o}_i = {src}.median({d})"
    if kind == "var_mean":
        return "multi-out:var_mean", f"{o}_v, {o}_m = torch.var_mean({x}, {d})"
    if kind == "aminmax":
        return "multi-out:aminmax", f"{o}_v, {o}_m = torch.aminmax({x}.detach(), dim={d})"
    return f"multi-out:{kind}", f"{o}_v, {o}_i = torch.{kind}({x}, dim={d})"


def t_matmul(g: Gen) -> tuple[str, str] | None:
    x = g.pick(lambda v: _fl(v) and v.dim() in (1, 2, 3) and v.numel() > 0)
    if x is None:
        return None
    tx = g.t(x)
    o = g.fresh()
    k = tx.shape[-1]
    dt = tx.dtype
    kind = g.choice(["matmul", "linear", "self", "einsum", "conv", "conv2d", "outer"])
    if kind == "self" and tx.dim() == 2:
        return "matmul:x@x.T", f"{o} = {x} @ {x}.t()"
    if kind == "outer" and tx.dim() == 1:
        return "matmul:outer", f"{o} = torch.outer({x}, {x})"
    if kind == "conv" and tx.dim() == 3 and tx.shape[-1] >= 2:
        w = f"torch.randn(2, {tx.shape[1]}, 2, dtype={dt})"
        ws = [n for n in g.names(lambda v: _fl(v) and v.dim() == 3 and v.shape[1] == tx.shape[1])]
        if ws and g.rng.random() < 0.3:
            cand = g.choice(ws)
            if g.t(cand).shape[-1] <= tx.shape[-1]:
                w = cand
        return "conv:conv1d", f"{o} = F.conv1d({x}, {w}, padding={g.choice([0, 1])})"
    if kind == "conv2d" and tx.dim() == 2 and min(tx.shape) >= 2:
        return (
            "conv:conv2d",
            f"{o} = F.conv2d({x}[None, None], torch.randn(2, 1, 2, 2, dtype={dt}), stride=1)",
        )
    partners = [n for n in g.names(lambda v: _fl(v) and v.dim() in (1, 2) and v.shape[0] == k)]
    if kind == "linear":
        ws = [n for n in g.names(lambda v: _fl(v) and v.dim() == 2 and v.shape[-1] == k)]
        w = g.choice(ws) if ws and g.rng.random() < 0.6 else f"torch.randn(2, {k}, dtype={dt})"
        b = g.choice(["", ", None"]) if not w.isidentifier() else ""
        return "linear", f"{o} = F.linear({x}, {w}{b})"
    if kind == "einsum" and tx.dim() == 2:
        return "matmul:einsum", f"{o} = torch.einsum('ij,kj->ik', {x}, {x})"
    y = (
        g.choice(partners)
        if partners and g.rng.random() < 0.7
        else f"torch.randn({k}, 2, dtype={dt})"
    )
    return "matmul:matmul", f"{o} = {x} @ {y}"


def t_norm_loss(g: Gen) -> tuple[str, str] | None:
    x = g.pick(lambda v: _fl(v) and v.dim() == 2 and min(v.shape) >= 2)
    if x is None:
        return None
    tx = g.t(x)
    o = g.fresh()
    n, c = tx.shape
    kind = g.choice(
        [
            "batch_norm",
            "batch_norm_nc",
            "batch_norm_stats",
            "layer_norm",
            "mse",
            "xent",
            "rrelu",
            "bce",
            "smooth_l1",
            "group_norm",
            "embedding",
        ]
    )
    if kind == "batch_norm":
        return "norm:batch_norm", f"{o} = F.batch_norm({x}, None, None, training=True)"
    if kind == "batch_norm_nc":
        return (
            "norm:batch_norm(non-contiguous)",
            f"{o} = F.batch_norm({x}.t(), None, None, training=True)",
        )
    if kind == "batch_norm_stats":
        return "norm:batch_norm(running stats)", (
            f"{o}_rm, {o}_rv = torch.zeros({c}), torch.ones({c})\n"
            f"{o} = F.batch_norm({x}, {o}_rm, {o}_rv, training=True, momentum=0.1)"
        )
    if kind == "layer_norm":
        return "norm:layer_norm", f"{o} = F.layer_norm({x}, ({c},))"
    if kind == "group_norm":
        return "norm:group_norm", f"{o} = F.group_norm({x}.unsqueeze(-1), 1)"
    if kind == "mse":
        return "loss:mse", f"{o} = F.mse_loss({x}, torch.zeros_like({x}))"
    if kind == "xent":
        tgt = [g.rng.randrange(c) for _ in range(n)]
        return "loss:cross_entropy", f"{o} = F.cross_entropy({x}, torch.tensor({tgt}))"
    if kind == "bce":
        return (
            "loss:bce_with_logits",
            f"{o} = F.binary_cross_entropy_with_logits({x}, torch.ones_like({x}) * 0.3)",
        )
    if kind == "smooth_l1":
        return "loss:smooth_l1", f"{o} = F.smooth_l1_loss({x}, {x}.detach() * 0.5)"
    if kind == "embedding":
        idx = [g.rng.randrange(n) for _ in range(3)]
        return "embedding", f"{o} = F.embedding(torch.tensor({idx}), {x})"
    nc = g.choice(["", ".t()"])
    return f"rng:rrelu{nc and '(non-contiguous)'}", f"{o} = F.rrelu({x}{nc}, training=True)"


def t_index(g: Gen) -> tuple[str, str] | None:
    x = g.pick(lambda v: _is_t(v) and v.dim() >= 1 and v.numel() > 0 and not _cx(v))
    if x is None:
        return None
    tx = g.t(x)
    o = g.fresh()
    kind = g.choice(
        [
            "getitem_idx",
            "index_select",
            "gather",
            "mask",
            "nonzero",
            "take",
            "cat",
            "stack",
            "where",
            "unique",
        ]
    )
    if kind == "getitem_idx":
        return "index:x[idx]", f"{o} = {x}[{g.index_for(tx.shape[0])}]"
    if kind == "index_select":
        d = g.rng.randrange(tx.dim())
        if tx.shape[d] == 0:
            return None
        return "index:index_select", f"{o} = {x}.index_select({d}, {g.index_for(tx.shape[d])})"
    if kind == "gather":
        d = g.rng.randrange(tx.dim())
        if tx.shape[d] == 0:
            return None
        return "index:gather", (
            f"{o} = {x}.gather({d}, torch.randint(0, {tx.shape[d]}, {_tup(tx.shape)}))"
        )
    if kind == "mask":
        return "index:x[mask]", f"{o} = {x}[{x} > 0]" if not _bool(tx) else f"{o} = {x}[{x}]"
    if kind == "nonzero":
        return "index:nonzero", f"{o} = torch.nonzero({x})"
    if kind == "take":
        return "index:take", f"{o} = torch.take({x}, torch.tensor([0, {tx.numel() - 1}]))"
    if kind == "cat":
        y = g.partner(x)
        if not y.isidentifier():
            y = f"{x} * 2" if not _bool(tx) else x
        return "cat", f"{o} = torch.cat([{x}, {y}], {g.rng.randrange(tx.dim())})"
    if kind == "stack":
        return "stack", f"{o} = torch.stack([{x}, {x}])"
    if kind == "unique":
        return "index:unique", f"{o}_u, {o}_c = torch.unique({x}.detach(), return_counts=True)"
    if _bool(tx):
        return None
    return "where", f"{o} = torch.where({x} > 0, {x}, torch.zeros_like({x}))"


def t_intbool(g: Gen) -> tuple[str, str] | None:
    o = g.fresh()
    x = g.pick(lambda v: _int(v) or _bool(v))
    f = g.pick(_fl)
    kinds = ["cmp", "long", "argmax"] if f else []
    if x is not None:
        kinds += ["intops", "sum", "invert", "to_float", "int_inplace"]
    if not kinds:
        return None
    kind = g.choice(kinds)
    if kind == "cmp" and f:
        return "bool:cmp", f"{o} = {f} > {g.choice(['0', '0.5', f])}"
    if kind == "long" and f:
        return "int:long", f"{o} = ({f} * 10).long()"
    if kind == "argmax" and f and g.t(f).numel() > 0:
        return "int:argmax", f"{o} = {f}.argmax()"
    assert x is not None
    tx = g.t(x)
    if kind == "intops":
        if _bool(tx):
            return "bool:and", f"{o} = {x} & ~{x}.flip(0)" if tx.dim() else f"{o} = {x} & {x}"
        return "int:ops", f"{o} = ({x} * 3 + 1) % 5 // 2"
    if kind == "sum":
        return "int:sum", f"{o} = {x}.sum()"
    if kind == "invert" and _bool(tx):
        return "bool:invert", f"{o} = ~{x}"
    if kind == "int_inplace" and _int(tx):
        return "int:add_", f"{x}.add_(1)"
    return "int:to_float", f"{o} = {x}.float()"


def t_create(g: Gen) -> tuple[str, str] | None:
    o = g.fresh()
    x = g.pick(lambda v: _fl(v) and v.numel() > 0)
    kinds = [
        "tensor",
        "arange",
        "ones",
        "zeros",
        "full",
        "eye",
        "linspace",
        "leaf",
        "scalar",
        "one",
        "one",
        "empty_shape",
    ]
    if x:
        kinds += ["ones_like", "new_tensor", "zeros_like"]
    kind = g.choice(kinds)
    if kind == "tensor":
        return "create:tensor", f"{o} = torch.tensor([1.0, -2.0, 3.0, 0.5])"
    if kind == "arange":
        return "create:arange", f"{o} = torch.arange(12.0).view(3, 4)"
    if kind == "ones":
        return "create:ones", f"{o} = torch.ones(3, 4)"
    if kind == "zeros":
        return "create:zeros", f"{o} = torch.zeros(4, 3)"
    if kind == "full":
        return "create:full", f"{o} = torch.full((4,), 0.5)"
    if kind == "eye":
        return "create:eye", f"{o} = torch.eye(3)"
    if kind == "linspace":
        return "create:linspace", f"{o} = torch.linspace(-1, 1, 4)"
    if kind == "leaf":
        return "create:leaf", f"{o} = torch.ones(3, 4, requires_grad=True)"
    if kind == "scalar":
        return "create:0-dim", f"{o} = torch.tensor(2.5)"
    if kind == "one":
        # a one-element literal: FakeTensorMode tracks it as a constant
        return "create:1-element", f"{o} = torch.tensor([{g.choice(['0.0', '0.5', '-1.5'])}])"
    if kind == "empty_shape":
        return "create:empty", f"{o} = torch.zeros(0, 4)"
    assert x is not None
    if kind == "ones_like":
        return "create:ones_like", f"{o} = torch.ones_like({x})"
    if kind == "zeros_like":
        return "create:zeros_like", f"{o} = torch.zeros_like({x})"
    return "create:new_tensor", f"{o} = {x}.new_tensor([1.0, 2.0])"


def t_rng(g: Gen) -> tuple[str, str] | None:
    o = g.fresh()
    x = g.pick(lambda v: _fl(v) and v.numel() > 0)
    kinds = [
        "rand",
        "randn",
        "randint",
        "randperm",
        "empty_uniform",
        "empty_normal",
        "linear",
        "bernoulli",
        "multinomial",
    ]
    if x:
        kinds += ["dropout", "dropout", "randn_like", "dropout_module", "uniform_", "normal_"]
    kind = g.choice(kinds)
    if kind == "rand":
        return "rng:rand", f"{o} = torch.rand(3, 4)"
    if kind == "randn":
        return "rng:randn", f"{o} = torch.randn(4)"
    if kind == "randint":
        return "rng:randint", f"{o} = torch.randint(0, 5, (3,))"
    if kind == "randperm":
        return "rng:randperm", f"{o} = torch.randperm(4)"
    if kind == "empty_uniform":
        return "rng:uniform_", f"{o} = torch.empty(3, 4).uniform_(-1, 1)"
    if kind == "empty_normal":
        return "rng:normal_", f"{o} = torch.empty(4).normal_()"
    if kind == "bernoulli":
        return "rng:bernoulli", f"{o} = torch.bernoulli(torch.full((3, 4), 0.5))"
    if kind == "multinomial":
        return "rng:multinomial", f"{o} = torch.multinomial(torch.tensor([0.2, 0.3, 0.5]), 2)"
    if kind == "linear":
        cands = g.names(lambda v: _fl(v) and v.dim() >= 1 and v.shape[-1] > 0)
        if not cands:
            return "rng:nn.Linear", f"{o}_m = torch.nn.Linear(4, 3)\n{o}_w = {o}_m.weight"
        xi = g.choice(cands)
        k = g.t(xi).shape[-1]
        return "rng:nn.Linear", (
            f"{o}_m = torch.nn.Linear({k}, 3)\n"
            f"{o}_w, {o}_b = {o}_m.weight, {o}_m.bias\n"
            f"{o} = {o}_m({xi}.float())"
        )
    assert x is not None
    if kind == "dropout":
        return "rng:dropout", f"{o} = F.dropout({x}, {g.choice(['0.5', '0.2'])}, training=True)"
    if kind == "dropout_module":
        return "rng:nn.Dropout", f"{o} = torch.nn.Dropout(0.3)({x})"
    if kind == "randn_like":
        return "rng:randn_like", f"{o} = torch.randn_like({x})"
    y = g.pick(lambda v: _fl(v) and not (v.is_leaf and v.requires_grad) and v.numel() > 0)
    if y is None:
        return None
    if kind == "uniform_":
        return "rng:uniform_(in place)", f"{y}.uniform_(-0.5, 0.5)"
    return "rng:normal_(in place)", f"{y}.normal_()"


COMPLEX = [
    ("conj", "{z}.conj()"),
    ("resolve_conj", "{z}.conj().resolve_conj()"),
    ("real", "{z}.real"),
    ("imag", "{z}.imag"),
    ("conj.imag", "{z}.conj().imag"),
    ("view_as_real", "torch.view_as_real({z})"),
    ("abs", "{z}.abs()"),
    ("mul_conj", "{z} * {z}.conj()"),
    ("angle", "{z}.angle()"),
    ("exp", "{z}.exp()"),
    ("mul_1j", "{z} * 1j"),
    ("sgn", "{z}.sgn()"),
    ("matmul", "{z} @ {z}.conj().transpose(0, -1)"),
    ("sum", "{z}.sum()"),
]


def t_complex(g: Gen) -> tuple[str, str] | None:
    o = g.fresh()
    z = g.pick(_cx)
    if z is None or g.rng.random() < 0.15:
        x = g.pick(lambda v: _fl(v) and v.dtype == torch.float32 and v.numel() > 0)
        if x is None:
            return None
        tx = g.t(x)
        if tx.dim() >= 1 and tx.shape[-1] == 2 and tx.is_contiguous() and g.rng.random() < 0.5:
            return "complex:view_as_complex", f"{o} = torch.view_as_complex({x})"
        return "complex:complex", f"{o} = torch.complex({x}, {x}.flip(0))"
    name, expr = g.choice(COMPLEX)
    if name == "matmul" and g.t(z).dim() != 2:
        name, expr = "mul_conj", "{z} * {z}.conj()"
    return f"complex:{name}", f"{o} = {expr.format(z=z)}"


def t_item(g: Gen) -> tuple[str, str] | None:
    o = g.fresh()
    x = g.pick(lambda v: _is_t(v) and v.numel() > 0 and not _cx(v))
    if x is None:
        return None
    flag = g.names(lambda v: isinstance(v, bool))
    kinds = ["item", "bool", "int", "float", "tolist"]
    if flag:
        kinds += ["branch", "branch"]
    kind = g.choice(kinds)
    if kind == "item":
        return "read:item", f"{o} = {x}.sum().item()"
    if kind == "bool":
        return "read:bool", f"{o} = bool(({x} > 0).any())"
    if kind == "int":
        return "read:int", f"{o} = int({x}.argmax())"
    if kind == "float":
        return "read:float", f"{o} = float({x}.float().mean())"
    if kind == "tolist":
        return "read:tolist", f"{o} = {x}.tolist()"
    y = g.pick(_fl)
    if y is None:
        return None
    return "read:branch", f"{o} = {y} * 2 if {g.choice(flag)} else {y} - 1"


def t_meta(g: Gen) -> tuple[str, str] | None:
    x = g.pick(_is_t)
    if x is None:
        return None
    o = g.fresh()
    expr = g.choice(
        [
            "tuple({x}.shape)",
            "{x}.stride()",
            "{x}.storage_offset()",
            "{x}.is_contiguous()",
            "str({x}.dtype)",
            "{x}.is_conj()",
            "{x}.is_neg()",
            "{x}.requires_grad",
            "{x}.is_leaf",
            "{x}.grad_fn is None",
            "{x}.numel()",
            "{x}._is_view()",
            "{x}.untyped_storage().nbytes()",
            "{x}.grad is None",
        ]
    )
    return "meta:" + expr.replace("{x}", "x"), f"{o} = {expr.format(x=x)}"


NONLINEAR = [
    "{x}.sin() * {x}",
    "{x}.pow(3)",
    "torch.pow({x}.abs() + 0.5, {y})",
    "torch.xlogy({x}, {y}.abs() + 0.1)",
    "torch.xlogy({y}, {x}.abs() + 0.1)",
    "{x}.tanh() * {y}",
    "{x}.exp() * 0.1",
    "F.softplus({x}) * {x}",
    "({x} * {y}).sigmoid()",
]


def _nonlinear(g: Gen, x: str) -> tuple[str, str]:
    """A function of ``x`` with a non-zero second derivative: (its label, its code)."""
    y = g.partner(x)
    if not y.isidentifier():
        y = f"({y})"
    expr = g.choice(NONLINEAR)
    return expr.replace("{x}", "x").replace("{y}", "y"), expr.format(x=x, y=y)


def t_autograd(g: Gen) -> tuple[str, str] | None:
    o = g.fresh()
    kind = g.choice(
        [
            "backward",
            "backward_inputs",
            "grad",
            "grad_nonleaf",
            "double",
            "double_now",
            "retain_grad",
            "backward_fake_g",
        ]
    )
    if kind in ("double", "double_now"):
        x = g.pick(lambda v: _fl(v) and v.requires_grad and v.numel() > 0)
        if x is None:
            return None
        what, h = _nonlinear(g, x)
        code = f"{o}_h = {h}\n{o}, = torch.autograd.grad({o}_h.sum(), [{x}], create_graph=True)"
        label = f"autograd:double-backward({what})"
        if kind == "double_now":
            code += f"\n({o} * {o}).sum().backward(retain_graph=True)"
        return label, code
    y = g.pick(_nonleaf)
    if y is None:
        return None
    red = f"{y}.abs().sum()" if _cx(g.t(y)) else f"{y}.sum()"
    if kind == "backward":
        return "autograd:backward", f"{red}.backward(retain_graph=True)"
    if kind == "backward_fake_g":
        return "autograd:backward(gradient)", (
            f"{y}.backward(torch.ones_like({y}), retain_graph=True)"
            if not _cx(g.t(y))
            else f"{red}.backward(torch.tensor(1.0), retain_graph=True)"
        )
    if kind == "retain_grad":
        return "autograd:retain_grad", f"{y}.retain_grad()"
    leaves = g.names(lambda v: _diff(v) and v.is_leaf)
    if kind == "backward_inputs" and leaves:
        ins = sorted(set(g.rng.sample(leaves, min(len(leaves), g.rng.randint(1, 2)))))
        return "autograd:backward(inputs=)", (
            f"{red}.backward(inputs=[{', '.join(ins)}], retain_graph=True)"
        )
    if kind == "grad_nonleaf":
        mids = g.names(_nonleaf)
        xs = sorted(set(g.rng.sample(mids, min(len(mids), 2))))
        names = [f"{o}_{i}" for i in range(len(xs))]
        return "autograd:grad(non-leaf inputs)", (
            f"{', '.join(names)}, = torch.autograd.grad({red}, [{', '.join(xs)}], "
            "retain_graph=True, allow_unused=True)"
        )
    if not leaves:
        return None
    xs = sorted(set(g.rng.sample(leaves, min(len(leaves), g.rng.randint(1, 3)))))
    names = [f"{o}_{i}" for i in range(len(xs))]
    return "autograd:grad", (
        f"{', '.join(names)}, = torch.autograd.grad({red}, [{', '.join(xs)}], "
        "retain_graph=True, allow_unused=True)"
    )


FWD_OPS = [
    "{d}.sin() * {d}",
    "{d}.exp()",
    "{d} @ {d}.t()",
    "({d} * 2).tanh()",
    "{d}.sum()",
    "F.softplus({d})",
    "{d}.view(-1)[1:]",
]


def t_forward_ad(g: Gen) -> tuple[str, str] | None:
    x = g.pick(lambda v: _fl(v) and v.dtype == torch.float32 and v.numel() > 0)
    if x is None:
        return None
    o = g.fresh()
    ops = [op for op in FWD_OPS if "@" not in op or g.t(x).dim() == 2]
    op = g.choice(ops).format(d="_d")
    prim = g.choice([f"{x}.detach()", x])
    tangent = g.choice([f"torch.ones_like({x})", f"torch.randn_like({x})"])
    return "forward-ad:" + op.replace("_d", "x")[:18], (
        "with fwAD.dual_level():\n"
        f"    _d = fwAD.make_dual({prim}, {tangent})\n"
        f"    {o}, {o}_t = fwAD.unpack_dual({op})"
    )


def t_func(g: Gen) -> tuple[str, str] | None:
    x = g.pick(lambda v: _fl(v) and v.dtype == torch.float32 and v.dim() >= 1 and v.numel() > 0)
    if x is None:
        return None
    o = g.fresh()
    kind = g.choice(["grad", "vmap", "vmap_sum", "jvp", "vjp", "jacrev", "vmap_mm"])
    if kind == "grad":
        return "func:grad", f"{o} = torch.func.grad(lambda t: (t.sin() * t).sum())({x})"
    if kind == "vmap":
        return "func:vmap", f"{o} = torch.func.vmap(torch.sin)({x})"
    if kind == "vmap_sum":
        return "func:vmap(sum)", f"{o} = torch.func.vmap(lambda r: (r * r).sum())({x})"
    if kind == "vmap_mm" and g.t(x).dim() == 2:
        k = g.t(x).shape[-1]
        return "func:vmap(mv)", (f"{o} = torch.func.vmap(lambda r: torch.ones(2, {k}) @ r)({x})")
    if kind == "jvp":
        return "func:jvp", (
            f"{o}, {o}_t = torch.func.jvp(lambda t: t.exp() * t, ({x},), (torch.ones_like({x}),))"
        )
    if kind == "vjp":
        return "func:vjp", (
            f"_o, _f = torch.func.vjp(lambda t: t.sin() * 2, {x})\n{o}, = _f(torch.ones_like(_o))"
        )
    if g.t(x).numel() > 12:
        return None
    return "func:jacrev", f"{o} = torch.func.jacrev(lambda t: t.sin().sum(0))({x})"


CKPT = [
    "lambda t: t.sin() * t.cos()",
    "lambda t: F.dropout(t, 0.3, training=True) * 2",
    "lambda t: (t @ t.transpose(0, -1)).tanh()",
    "lambda t: t.exp().sum(0)",
    "lambda t: torch.rand_like(t) + t",
]


def t_checkpoint(g: Gen) -> tuple[str, str] | None:
    x = g.pick(lambda v: _fl(v) and v.requires_grad and v.dim() >= 1 and v.numel() > 0)
    if x is None:
        return None
    o = g.fresh()
    fn = g.choice(CKPT)
    reentrant = g.choice([True, False])
    return f"checkpoint(reentrant={reentrant})", (
        f"{o} = torch.utils.checkpoint.checkpoint({fn}, {x}, use_reentrant={reentrant})"
    )


def t_hook(g: Gen) -> tuple[str, str] | None:
    o = g.fresh()
    kind = g.choice(["tensor_scale", "tensor_record", "leaf_scale", "post_record", "post_sgd"])
    if kind.startswith("post"):
        x = g.pick(lambda v: _fl(v) and v.is_leaf and v.requires_grad)
        if x is None:
            return None
        if kind == "post_record":
            return "hook:post-accumulate(record)", (
                f"{o} = []\n{x}.register_post_accumulate_grad_hook("
                f"lambda q: {o}.append(q.grad.detach().clone()))"
            )
        return "hook:post-accumulate(sgd)", (
            f"def _h{o}(q):\n    with torch.no_grad():\n        q.add_(q.grad, alpha=-0.1)\n"
            f"{x}.register_post_accumulate_grad_hook(_h{o})"
        )
    if kind == "leaf_scale":
        x = g.pick(lambda v: _diff(v) and v.is_leaf)
        if x is None:
            return None
        return "hook:leaf(scale)", f"{x}.register_hook(lambda gr: gr * 0.5)"
    # torch itself (2.13, 2.14.1) can crash registering a hook on a view whose base was
    # written in place (a leaf's under no_grad: always; a clone's: sometimes), eagerly: no views
    x = g.pick(lambda v: _nonleaf(v) and not v._is_view())
    if x is None:
        return None
    if kind == "tensor_scale":
        return "hook:tensor(scale)", f"{x}.register_hook(lambda gr: gr * 2)"
    return "hook:tensor(record)", (
        f"{o} = []\n{x}.register_hook(lambda gr: {o}.append(gr.detach().clone()))"
    )


def t_custom(g: Gen) -> tuple[str, str] | None:
    x = g.pick(lambda v: _fl(v) and v.numel() > 0)
    if x is None:
        return None
    o = g.fresh()
    kind = g.choice(["Cube", "SaveOut", "TwoOut", "Dirty", "NonDiff"])
    if kind == "TwoOut":
        return "custom:TwoOut", f"{o}_a, {o}_b = TwoOut.apply({x})"
    if kind == "NonDiff":
        return "custom:NonDiff", f"{o}, {o}_i = NonDiff.apply({x})"
    if kind == "Dirty":
        return "custom:Dirty(mark_dirty)", f"{o} = Dirty.apply({x}.clone())"
    return f"custom:{kind}", f"{o} = {kind}.apply({x})"


def t_rare(g: Gen) -> tuple[str, str] | None:
    x = g.pick(lambda v: _fl(v) and v.numel() > 0)
    if x is None:
        return None
    o = g.fresh()
    kind = g.choice(
        [
            "set_",
            "set_storage",
            "quantize",
            "manual_seed",
            "rng_state",
            "zero_grad",
            "new_empty",
            "resize_",
        ]
    )
    if kind == "set_":
        return "rare:set_", f"{o} = torch.empty(0)\n{o}.set_({x}.detach())"
    if kind == "set_storage" and "buf" in g.ns:
        return "rare:set_(real storage)", f"{o} = torch.empty(0)\n{o}.set_(buf.untyped_storage())"
    if kind == "quantize":
        return "rare:quantize_per_tensor", (
            f"{o} = torch.quantize_per_tensor({x}.detach(), 0.1, 0, torch.qint8).dequantize()"
        )
    if kind == "manual_seed":
        return "rare:manual_seed", "torch.manual_seed(7)"
    if kind == "rng_state":
        return "rare:get/set_rng_state", (
            f"{o} = torch.get_rng_state()\n_r = torch.rand(2)\ntorch.set_rng_state({o})"
        )
    if kind == "new_empty":
        return "rare:new_zeros", f"{o} = {x}.new_zeros((2, 2))"
    if kind == "resize_":
        # only shrinking: a grown tensor's new elements are uninitialised memory
        y = g.pick(lambda v: _fl(v) and not v.requires_grad and not v._is_view() and v.numel() >= 6)
        if y is None:
            return None
        return "rare:resize_", f"{y}.resize_(2, 3)"
    return None


#: (category, weight, template)
TEMPLATES: list[tuple[str, float, Template]] = [
    ("view", 5.0, t_view),
    ("multi-view", 1.5, t_multi_view),
    ("pointwise", 3.0, t_unary),
    ("binary", 3.0, t_binary),
    ("reduce", 2.0, t_reduce),
    ("inplace", 3.0, t_inplace),
    ("index-inplace", 1.0, t_index_inplace),
    ("strided-inplace", 0.8, t_strided_inplace),
    ("leaf-update", 1.0, t_leaf_update),
    (".data", 0.5, t_data),
    ("out=", 1.5, t_out),
    ("multi-out", 1.5, t_multi_out),
    ("matmul", 2.0, t_matmul),
    ("norm/loss", 1.0, t_norm_loss),
    ("index", 1.5, t_index),
    ("int/bool", 1.0, t_intbool),
    ("create", 1.0, t_create),
    ("rng", 1.5, t_rng),
    ("complex", 1.5, t_complex),
    ("read", 1.0, t_item),
    ("meta", 1.0, t_meta),
    ("autograd", 2.0, t_autograd),
    ("forward-ad", 0.7, t_forward_ad),
    ("func", 0.7, t_func),
    ("checkpoint", 0.7, t_checkpoint),
    ("hook", 1.0, t_hook),
    ("custom", 1.0, t_custom),
    ("rare", 0.4, t_rare),
]
#: after the backward: a second step of training
POST = {
    "leaf-update",
    "view",
    "pointwise",
    "binary",
    "reduce",
    "matmul",
    "inplace",
    "read",
    "meta",
    "autograd",
    "hook",
}


def _exec(code: str, ns: dict[str, Any], where: str) -> None:
    exec(compile(code, where, "exec"), ns)


def _replay(prog: Program, body: list[Step]) -> dict[str, Any]:
    """The eager namespace after ``body`` (from the program's seed)."""
    ns = base_namespace()
    torch.manual_seed(prog.seed)
    for s in prog.leaves:
        _exec(s.code, ns, "<leaves>")
    for i, s in enumerate(body):
        _exec(s.code, ns, f"<step {i}>")
    return ns


def _try(code: str, ns: dict[str, Any]) -> BaseException | None:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _exec(code, ns, "<trial>")
    except Exception as exc:
        return exc
    return None


def _losses(g: Gen, since: int) -> list[str]:
    """Terms for a loss: differentiable non-leaf outputs made since variable number ``since``."""
    names = [n for n in g.names(_nonleaf) if _num(n) >= since]
    g.rng.shuffle(names)
    terms = []
    for n in names[:6]:
        t = g.t(n)
        if t.dtype.is_complex:
            terms.append(f"{n}.abs().sum()")
        else:
            terms.append(g.choice([f"{n}.sum()", f"{n}.pow(2).mean()", f"{n}.sin().sum()"]))
    return terms


def _num(name: str) -> int:
    digits = ""
    for ch in name[1:]:
        if not ch.isdigit():
            break
        digits += ch
    return int(digits) if name.startswith("v") and digits else -1


def generate(seed: int) -> Program:
    """The program of ``seed``: the same on every call (given the torch build)."""
    rng = random.Random(seed)
    extra = rng.sample(GRAD_LEAVES[1:-2], rng.randint(2, 4))
    # the complex leaf in half the programs, the empty one in a fifth
    extra += [
        leaf for leaf, p in zip(GRAD_LEAVES[-2:], (0.5, 0.2), strict=True) if rng.random() < p
    ]
    leaves = [GRAD_LEAVES[0], *sorted(extra, key=GRAD_LEAVES.index)]
    plain = rng.sample(PLAIN_LEAVES, rng.randint(1, 3))
    prog = Program(
        seed,
        [Step("leaf", f"{n} = {c}") for n, c in leaves + sorted(plain, key=PLAIN_LEAVES.index)],
        [],
    )
    body: list[Step] = []
    ns = _replay(prog, body)
    g = Gen(rng, ns, 0)
    weights = [w for _, w, _ in TEMPLATES]

    def grow(n_steps: int, allowed: set[str] | None) -> None:
        nonlocal ns
        made = 0
        for _ in range(n_steps * 8):
            if made >= n_steps:
                return
            cat, _, tmpl = rng.choices(TEMPLATES, weights)[0]
            if allowed is not None and cat not in allowed:
                continue
            counter = g.counter
            step = tmpl(g)
            if step is None:
                g.counter = counter
                continue
            label, code = step
            exc = _try(code, ns)
            if exc is None:
                body.append(Step(label, code))
                made += 1
                continue
            g.counter = counter
            ns = g.ns = _replay(prog, body)

    def finish(since: int, outside: bool) -> bool:
        """A loss over the outputs and its backward; False when eager cannot run it."""
        nonlocal ns
        terms = _losses(g, since)
        if not terms:
            return True
        o = g.fresh()
        # all the terms, else the first one alone that eager can differentiate
        tries = [terms] + [[t] for t in terms] if len(terms) > 1 else [terms]
        for k, chosen in enumerate(tries):
            code = f"{o} = {' + '.join(chosen)}\n{o}.backward()"
            exc = _try(code, ns)
            if exc is None:
                body.append(Step("loss.backward", code, outside=outside))
                return True
            if k == 0 and rng.random() < 0.15:
                # keep the step eager raises at, as the program's last: a patched pass
                # that does not raise there differs from eager
                body.append(Step("loss.backward(eager raises)", code, outside=outside))
                prog.eager_raises = True
                return False
            ns = g.ns = _replay(prog, body)
        return True

    grow(rng.randint(10, 22), None)
    outside = rng.random() < 0.15
    if finish(0, outside) and not outside and rng.random() < 0.4:
        # a second training step: an optimizer-like update of the leaves, then more ops
        since = g.counter + 1
        for _ in range(4):
            step = t_optimizer_step(g)
            if step is not None and _try(step[1], ns) is None:
                body.append(Step(*step))
                break
            ns = g.ns = _replay(prog, body)
        grow(rng.randint(2, 5), POST)
        finish(since, False)
    prog.body = body
    return prog


# ---------------------------------------------------------------------------------------------
# Running and recording


@dataclasses.dataclass
class TSnap:
    """What a program can read of a tensor, and its values."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: str
    conj: bool
    neg: bool
    requires_grad: bool
    is_leaf: bool
    fake: bool
    device: str
    storage: int | None
    values: torch.Tensor | None
    note: str = ""


Snap = Any  # TSnap | ("py", value) | ("seq", list) | ("other", type name)


def _real_of(t: torch.Tensor) -> tuple[torch.Tensor | None, str]:
    if isinstance(t, FakeTensor):
        r = getattr(t, "real_tensor", None)
        if r is None:
            return None, "no real values"
        if isinstance(r, FakeTensor):
            return None, "real values are a FakeTensor"
        if r.device != t.device:
            return None, f"real values on device {r.device}"
        return r, ""
    if t.device.type == "meta" or t.is_meta:
        return None, "a plain tensor on device meta"
    return t, ""


def snap(value: Any, depth: int = 0) -> Snap:
    if isinstance(value, torch.Tensor):
        try:
            real, note = _real_of(value)
            vals = None
            if real is not None:
                vals = real.detach()
                if vals.is_conj():
                    vals = vals.resolve_conj()
                if vals.is_neg():
                    vals = vals.resolve_neg()
                vals = vals.clone()
                if tuple(vals.shape) != tuple(value.shape):
                    note = f"real values of shape {list(vals.shape)}"
                    vals = None
            try:
                storage: int | None = value.untyped_storage()._cdata
            except Exception:
                storage = None
            return TSnap(
                tuple(value.shape),
                tuple(value.stride()),
                int(value.storage_offset()),
                str(value.dtype),
                bool(value.is_conj()),
                bool(value.is_neg()),
                bool(value.requires_grad),
                bool(value.is_leaf),
                isinstance(value, FakeTensor),
                str(value.device),
                storage,
                vals,
                note,
            )
        except Exception as exc:
            return ("other", f"unreadable tensor: {type(exc).__name__}: {exc}"[:200])
    if isinstance(value, torch.Size):
        return ("py", tuple(value))
    if isinstance(value, bool | int | float | complex | str) or value is None:
        return ("py", value)
    if isinstance(value, torch.dtype):
        return ("py", str(value))
    if isinstance(value, list | tuple) and depth < 2:
        return ("seq", [snap(v, depth + 1) for v in value])
    return ("other", type(value).__name__)


def _rng_hash() -> str:
    return hashlib.sha1(torch.get_rng_state().numpy().tobytes()).hexdigest()[:16]


@dataclasses.dataclass
class Record:
    """One run of a program: per step, every variable; at the end, grads and the RNG."""

    steps: list[dict[str, Snap]] = dataclasses.field(default_factory=list)
    rng: list[str] = dataclasses.field(default_factory=list)
    error: tuple[int, BaseException] | None = None
    final: dict[str, Snap] = dataclasses.field(default_factory=dict)
    grads: dict[str, Snap] = dataclasses.field(default_factory=dict)
    rng_final: str = ""


def _snap_all(ns: dict[str, Any]) -> dict[str, Snap]:
    return {n: snap(ns[n]) for n in user_names(ns)}


def _grads(ns: dict[str, Any]) -> dict[str, Snap]:
    out = {}
    for n in user_names(ns):
        t = ns[n]
        if isinstance(t, torch.Tensor) and _holds(
            lambda t: (t.is_leaf and t.requires_grad) or t.retains_grad, t
        ):
            try:
                out[n] = snap(t.grad)
            except Exception as exc:
                out[n] = ("other", f"unreadable .grad: {exc}"[:200])
    return out


def execute(prog: Program, fake: bool) -> Record:
    """Run the program eagerly or inside a propagating FakeTensorMode (the caller sets the
    patch's settings), recording every step."""
    rec = Record()
    ns = base_namespace()
    torch.manual_seed(prog.seed)
    for s in prog.leaves:
        _exec(s.code, ns, "<leaves>")
    mode: Any = FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext()
    inside = [(i, s) for i, s in enumerate(prog.body) if not s.outside]
    outside = [(i, s) for i, s in enumerate(prog.body) if s.outside]

    def run(i: int, s: Step) -> bool:
        try:
            _exec(s.code, ns, f"<fuzz seed {prog.seed} step {i}: {s.op}>")
        except Exception as exc:
            rec.error = (i, exc)
            return False
        with unset_fake_temporarily():
            rec.steps.append(_snap_all(ns))
            rec.rng.append(_rng_hash())
        return True

    ok = True
    with mode:
        for i, s in inside:
            if not (ok := run(i, s)):
                break
    if ok:
        for i, s in outside:
            if not run(i, s):
                break
    with unset_fake_temporarily():
        rec.final = _snap_all(ns)
        rec.grads = _grads(ns)
        rec.rng_final = _rng_hash()
    return rec


# ---------------------------------------------------------------------------------------------
# Comparing


def _close(a: torch.Tensor, b: torch.Tensor) -> str | None:
    """Why patched values ``a`` are not eager's ``b``; None when equal within tolerance."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return f"values {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"
    if a.numel() == 0 or torch.equal(a, b):
        return None
    if a.dtype in (torch.bool, torch.int64, torch.int32, torch.uint8, torch.int8, torch.qint8):
        return None if torch.equal(a, b) else "integer values differ"
    try:
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL, equal_nan=True, check_dtype=False)
    except AssertionError:
        diff = (a.to(torch.complex128) - b.to(torch.complex128)).abs()
        diff = torch.nan_to_num(diff, nan=math.inf)
        scale = float(b.abs().max()) if b.numel() else 0.0
        return f"values differ (max abs {float(diff.max()):.3g}, eager max {scale:.3g})"
    return None


def _stride_note(shape: tuple[int, ...], a: tuple[int, ...], b: tuple[int, ...]) -> str:
    only_trivial = all(x == y or s <= 1 for s, x, y in zip(shape, a, b, strict=False))
    return " (size-1 dims only)" if only_trivial else ""


def compare_snap(got: Snap, want: Snap, grad_of_real_leaf: bool = False) -> list[str]:
    """Differences of a patched snapshot from eager's (empty: equal)."""
    if isinstance(want, TSnap):
        if not isinstance(got, TSnap):
            return [f"eager has a tensor, patched {got[0]} {str(got[1])[:60]}"]
        out = []
        if grad_of_real_leaf and got.fake:
            out.append("a FakeTensor .grad on a real leaf")
        if got.shape != want.shape:
            return [*out, f"shape {list(got.shape)} vs eager {list(want.shape)}"]
        if got.dtype != want.dtype:
            out.append(f"dtype {got.dtype} vs eager {want.dtype}")
        if got.device != want.device:
            out.append(f"device {got.device} vs eager {want.device}")
        if got.stride != want.stride and want.shape and math.prod(want.shape) > 0:
            note = _stride_note(want.shape, got.stride, want.stride)
            out.append(f"stride {got.stride} vs eager {want.stride}{note}")
        if got.offset != want.offset and math.prod(want.shape) > 0:
            out.append(f"storage_offset {got.offset} vs eager {want.offset}")
        if got.conj != want.conj:
            out.append(f"is_conj {got.conj} vs eager {want.conj}")
        if got.neg != want.neg:
            out.append(f"is_neg {got.neg} vs eager {want.neg}")
        if got.requires_grad != want.requires_grad:
            out.append(f"requires_grad {got.requires_grad} vs eager {want.requires_grad}")
        if got.is_leaf != want.is_leaf:
            out.append(f"is_leaf {got.is_leaf} vs eager {want.is_leaf}")
        if got.values is None:
            out.append(got.note or "no real values")
        elif want.values is not None:
            try:
                why = _close(got.values, want.values)
            except Exception as exc:
                why = f"values unreadable ({_exc_line(exc)[:80]})"
            if why:
                out.append(why)
        return out
    if isinstance(got, TSnap):
        return [f"patched has a tensor, eager {want[0]} {str(want[1])[:60]}"]
    if got[0] != want[0]:
        return [f"{got[0]} vs eager {want[0]}"]
    if want[0] == "seq":
        if len(got[1]) != len(want[1]):
            return [f"{len(got[1])} items vs eager {len(want[1])}"]
        for i, (a, b) in enumerate(zip(got[1], want[1], strict=True)):
            if d := compare_snap(a, b):
                return [f"[{i}] {d[0]}"]
        return []
    if want[0] == "py":
        a, b = got[1], want[1]
        if isinstance(b, float) and isinstance(a, float):
            if math.isclose(a, b, rel_tol=RTOL, abs_tol=ATOL) or (math.isnan(a) and math.isnan(b)):
                return []
            return [f"{a!r} vs eager {b!r}"]
        if isinstance(b, list) and isinstance(a, list):
            try:
                ta, tb = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
                return [] if (why := _close(ta, tb)) is None else [f"list {why}"]
            except Exception:
                pass
        return [] if a == b else [f"{str(a)[:60]} vs eager {str(b)[:60]}"]
    return [] if got == want else [f"{got[1]} vs eager {want[1]}"]


def _alias_groups(snaps: dict[str, Snap], names: list[str]) -> dict[str, frozenset[str]]:
    by: dict[int, set[str]] = {}
    for n in names:
        s = snaps[n]
        if isinstance(s, TSnap) and s.storage is not None:
            by.setdefault(s.storage, set()).add(n)
    return {n: frozenset(by[s.storage]) - {n} for n in names if (s := snaps[n]).storage in by}


def compare_step(got: dict[str, Snap], want: dict[str, Snap]) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    for n, w in want.items():
        if n not in got:
            out.append((n, "variable missing"))
            continue
        out += [(n, d) for d in compare_snap(got[n], w)]
    # aliasing, among the tensors the patched pass made as fakes (a real tensor on that side
    # cannot share storage with a fake, whatever the patch does)
    fakes = [
        n
        for n, s in got.items()
        if isinstance(s, TSnap) and s.fake and isinstance(want.get(n), TSnap) and s.storage
    ]
    ga, wa = _alias_groups(got, fakes), _alias_groups(want, fakes)
    for n in fakes:
        a, b = ga.get(n, frozenset()), wa.get(n, frozenset())
        if a != b:
            out.append((n, f"shares storage with {sorted(a)} vs eager {sorted(b)}"))
    return out


@dataclasses.dataclass
class Outcome:
    outcome: str
    step: int | str | None = None
    op: str = ""
    why: str = ""
    diffs: list[str] = dataclasses.field(default_factory=list)
    warned: list[str] = dataclasses.field(default_factory=list)
    names_op: bool | None = None

    def row(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v not in (None, "", [])}


def _exc_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0][:240] if lines else ''}"


def _names_op(exc: BaseException) -> bool:
    text = "\n".join([str(exc), *(getattr(exc, "__notes__", None) or [])])
    return "aten." in text or "aten::" in text or "prims." in text


def compare(prog: Program, got: Record, want: Record) -> list[tuple[int | str, str, str]]:
    """(step, variable, what) for every difference, in program order (capped)."""
    diffs: list[tuple[int | str, str, str]] = []
    seen: set[tuple[str, str]] = set()

    def note(step: int | str, name: str, what: str) -> None:
        # one entry per variable and kind of difference: its first step
        key = (name, what.split(" ")[0])
        if key not in seen:
            seen.add(key)
            diffs.append((step, name, what))

    steps = [i for i, s in enumerate(prog.body) if not s.outside] + [
        i for i, s in enumerate(prog.body) if s.outside
    ]
    for k, (g, w) in enumerate(zip(got.steps, want.steps, strict=False)):
        i = steps[k]
        if got.rng[k] != want.rng[k]:
            note(i, "RNG", "the global RNG state differs from eager's")
        for n, d in compare_step(g, w):
            note(i, n, d)
        if len(diffs) >= MAX_DIFFS:
            return diffs
    if got.error is None and want.error is None:
        for n, d in compare_step(got.final, want.final):
            note("end", n, d)
        for n, w in want.grads.items():
            real_leaf = n in {s.code.split(" = ")[0] for s in prog.leaves}
            g2 = got.grads.get(n, ("other", "missing"))
            for d in compare_snap(g2, w, real_leaf):
                note("end", f"{n}.grad", d)
        if got.rng_final != want.rng_final:
            note("end", "RNG", "the global RNG state differs from eager's")
    return diffs[:MAX_DIFFS]


def classify(prog: Program, got: Record, want: Record, warned: list[str]) -> Outcome:
    diffs = compare(prog, got, want)
    texts = [f"step {s}: {n}: {d}" for s, n, d in diffs]
    first = diffs[0] if diffs else None

    def op_of(step: int | str | None) -> str:
        return prog.body[step].op if isinstance(step, int) else str(step or "")

    if got.error is not None:
        i, exc = got.error
        if want.error is not None and want.error[0] == i:
            return Outcome(
                "error",
                i,
                op_of(i),
                f"{_exc_line(exc)} (eager: {type(want.error[1]).__name__})",
                texts,
                warned,
                _names_op(exc),
            )
        before = f"; earlier: {texts[0]}" if texts else ""
        return Outcome("loud", i, op_of(i), _exc_line(exc) + before, texts, warned, _names_op(exc))
    if want.error is not None:
        i, exc = want.error
        texts.insert(0, f"step {i}: eager raised {_exc_line(exc)}; patched did not")
        if first is None or (isinstance(first[0], int) and first[0] > i) or first[0] == "end":
            first = (i, "-", f"eager raised {type(exc).__name__}; patched did not")
    if warned:
        why = warned[0] + (f"; first difference: {texts[0]}" if texts else "")
        return Outcome(
            "reported",
            first[0] if first else None,
            op_of(first[0] if first else None),
            why[:400],
            texts,
            warned,
        )
    if first is not None:
        return Outcome("silent", first[0], op_of(first[0]), f"{first[1]}: {first[2]}"[:400], texts)
    return Outcome("exact")


@contextlib.contextmanager
def _setting(name: str) -> Iterator[None]:
    propagation, buffers = SETTINGS[name]
    with (
        fakegrad_patch.patched(propagation=propagation, buffers=buffers),  # type: ignore[arg-type]
        functorch_config.patch(fake_tensor_propagate_real_tensors=True),
    ):
        yield


def run_one(prog: Program, want: Record, setting: str) -> Outcome:
    """One patched pass of ``prog`` under ``setting``, compared with eager's record."""
    _state.WARNED.clear()
    with (
        warnings.catch_warnings(record=True) as caught,
        trace.capture(trace.WARNING) as events,
        _setting(setting),
    ):
        warnings.simplefilter("always")
        got = execute(prog, fake=True)
    warned = [
        str(w.message).splitlines()[0][:200]
        for w in caught
        if issubclass(w.category, FakeGradPatchWarning)
    ]
    warned += sorted({f"trace event {e.get('event')}: op={e.get('op', '')}" for e in events})
    return classify(prog, got, want, warned)


def run_eager(prog: Program) -> Record:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return execute(prog, fake=False)


def self_check(seed: int) -> Outcome:
    """The program run eagerly twice, compared as a patched run is: anything but ``exact``
    is noise in the harness (a value that is not a function of the seed)."""
    prog = generate(seed)
    return classify(prog, run_eager(prog), run_eager(prog), [])


# ---------------------------------------------------------------------------------------------
# Child interpreters


def parse_seeds(spec: str) -> Iterator[int]:
    """``"1,5,9"``, or ``"start:step"`` (endless: the caller's deadline ends it)."""
    if ":" in spec:
        first, step = (int(x) for x in spec.split(":"))
        return itertools.count(first, step)
    return iter([int(x) for x in spec.split(",") if x])


def worker(
    seeds: Iterator[int],
    settings: list[str],
    out: Any,
    after: tuple[int, str] | None = None,
    deadline: float | None = None,
) -> None:
    """Run ``seeds`` x ``settings`` in this interpreter, one JSON line per program, with a
    ``{"start": [seed, setting]}`` line before each (flushed). With ``after`` (the program a
    dead interpreter was running) only what comes after it (a seed whose generation died is
    skipped whole); with ``deadline`` (``time.time()``) no new seed starts after it."""
    import gc

    fakegrad_patch.install()
    faulthandler.enable()
    # what exists now (torch's modules) is never garbage: the collection after each program
    # then costs well under a millisecond instead of ~0.15 s
    gc.collect()
    gc.freeze()

    def mark(key: str, seed: int, setting: str) -> None:
        out.write(json.dumps({key: [seed, setting]}) + "\n")
        out.flush()

    for seed in seeds:
        if deadline is not None and time.time() >= deadline:
            return
        todo = ["generate", *settings]
        if after is not None:
            if seed < after[0] or (seed == after[0] and after[1] == "generate"):
                continue
            if seed == after[0] and after[1] in todo:
                todo = todo[todo.index(after[1]) + 1 :]
            after = None
        mark("start", seed, "generate")
        faulthandler.dump_traceback_later(PROGRAM_TIMEOUT_S, exit=True)
        try:
            prog = generate(seed)
            want = run_eager(prog)
        except Exception as exc:
            row = {
                "seed": seed,
                "setting": "*",
                "outcome": "skip",
                "why": f"generator: {_exc_line(exc)}",
            }
            out.write(json.dumps(row) + "\n")
            mark("done", seed, "generate")
            continue
        finally:
            faulthandler.cancel_dump_traceback_later()
        mark("done", seed, "generate")
        for setting in todo[1:] if todo[:1] == ["generate"] else todo:
            mark("start", seed, setting)
            start = time.perf_counter()
            faulthandler.dump_traceback_later(PROGRAM_TIMEOUT_S, exit=True)
            try:
                res = run_one(prog, want, setting)
            except Exception:
                res = Outcome("loud", None, "harness", traceback.format_exc(limit=3)[-300:])
            gc.collect()  # a crash at collection time belongs to this program
            faulthandler.cancel_dump_traceback_later()
            row = {
                "seed": seed,
                "setting": setting,
                **res.row(),
                "steps": len(prog.body),
                "seconds": round(time.perf_counter() - start, 3),
            }
            out.write(json.dumps(row) + "\n")
            out.flush()


def _signal_name(code: int) -> str:
    if code < 0:
        try:
            return signal.Signals(-code).name
        except ValueError:
            return f"signal {-code}"
    return f"exit {code}"


def _crash_where(err: str, seed: int) -> tuple[int | None, str, str]:
    """The step a faulthandler traceback names (its op from the program itself: the text of a
    traceback written while memory is corrupt can be garbled), and the innermost frame."""
    frames = [ln.strip() for ln in err.splitlines() if ln.strip().startswith("File ")]
    inner = frames[0][:160] if frames else ""
    for line in frames:
        m = re.search(r"<fuzz seed \d+ step (\d+)", line)
        if m:
            step = int(m.group(1))
            try:
                body = generate(seed).body
                return step, body[step].op if step < len(body) else "", inner
            except Exception:
                return step, "", inner
    return None, "", inner


def _child(
    seeds: str,
    settings: list[str],
    path: str,
    after: tuple[int, str] | None = None,
    deadline: float | None = None,
) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--jsonl", path]
    cmd += ["--seeds", seeds, "--setting", ",".join(settings)]
    if after is not None:
        cmd += ["--after", f"{after[0]}:{after[1]}"]
    if deadline is not None:
        cmd += ["--deadline", repr(deadline)]
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    with open(path + ".err", "wb") as err:
        return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=env)


def _text(path: str) -> str:
    if not os.path.exists(path):
        return ""
    with open(path, errors="replace") as f:
        return f.read()


def _read(path: str) -> tuple[list[dict[str, Any]], tuple[int, str] | None]:
    rows: list[dict[str, Any]] = []
    started: tuple[int, str] | None = None
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                if not line.endswith("\n"):
                    break
                item = json.loads(line)
                if "start" in item:
                    started = (item["start"][0], item["start"][1])
                elif "done" in item:
                    started = None
                else:
                    rows.append(item)
                    started = None
    return rows, started


def run_isolated(
    seeds: list[int] | None,
    settings: list[str],
    workers: int = 2,
    budget_s: float | None = None,
    seed_start: int = 0,
    workdir: str | None = None,
    confirm: bool = True,
) -> list[dict[str, Any]]:
    """Programs in ``workers`` child interpreters at once, each a shard of the seeds (every
    ``workers``-th): the given seeds, or, with a budget, seeds from ``seed_start`` on until the
    budget is spent (no program starts after it). An interpreter that dies is counted as a
    crash of the program it was running (run alone again in a fresh one to confirm, unless
    ``confirm`` is off), and its shard goes on after that program in a new interpreter."""
    if workdir is None:
        with tempfile.TemporaryDirectory(prefix="fuzz-") as work:
            return run_isolated(seeds, settings, workers, budget_s, seed_start, work, confirm)
    work = workdir
    deadline = time.time() + budget_s if budget_s is not None else None
    if seeds is not None:
        specs = [",".join(map(str, seeds[i::workers])) for i in range(workers)]
    else:
        specs = [f"{seed_start + i}:{workers}" for i in range(workers)]
    rows: list[dict[str, Any]] = []
    running: dict[str, tuple[subprocess.Popen[bytes], str]] = {}
    n = 0

    def start(spec: str, after: tuple[int, str] | None = None) -> None:
        nonlocal n
        n += 1
        path = os.path.join(work, f"fuzz-{os.getpid()}-{n}.jsonl")
        running[path] = (_child(spec, settings, path, after, deadline), spec)

    for spec in specs:
        if spec:
            start(spec)
    while running:
        time.sleep(0.1)
        for path, (proc, spec) in list(running.items()):
            if proc.poll() is None:
                # a child stuck where faulthandler cannot end it is killed here
                if os.path.exists(path) and time.time() - os.path.getmtime(path) > (
                    PROGRAM_TIMEOUT_S * 3
                ):
                    proc.kill()
                continue
            del running[path]
            got, started = _read(path)
            rows += got
            err = _text(path + ".err")
            for p in (path, path + ".err"):
                if os.path.exists(p):
                    os.unlink(p)
            if proc.returncode == 0:
                continue
            if started is None:
                raise RuntimeError(
                    f"fuzz child failed ({_signal_name(proc.returncode)}): {err[-2000:]}"
                )
            seed, setting = started
            hung = "Timeout" in err or proc.returncode == -signal.SIGKILL
            step, op, inner = _crash_where(err, seed)
            row: dict[str, Any] = {
                "seed": seed,
                "setting": setting if setting != "generate" else "*",
                # building the program and its eager run use no fake mode: a crash there is
                # torch's own (counted apart, never the patch's)
                "outcome": "crash" if setting != "generate" else "skip",
                "step": step,
                "op": op,
                "why": ("eager run: " if setting == "generate" else "")
                + ("hung" if hung else _signal_name(proc.returncode))
                + f" in {inner}",
            }
            start(spec, (seed, setting))
            if confirm and not hung:
                row["alone"] = _confirm_crash(seed, setting, settings, work)
            rows.append(row)
    rows.sort(key=lambda r: (r["seed"], r["setting"]))
    return rows


def _confirm_crash(seed: int, setting: str, settings: list[str], work: str) -> str:
    """Run the crashed program alone in a fresh interpreter: does it crash there too?"""
    path = os.path.join(work, f"fuzz-confirm-{os.getpid()}-{seed}.jsonl")
    one = [setting] if setting in settings else settings
    proc = _child(str(seed), one, path)
    try:
        proc.wait(timeout=PROGRAM_TIMEOUT_S * 2)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    for p in (path, path + ".err"):
        if os.path.exists(p):
            os.unlink(p)
    if proc.returncode == 0:
        return "does not crash alone (an earlier program of its interpreter is involved)"
    return f"crashes alone ({_signal_name(proc.returncode)})"


def summarize(rows: list[dict[str, Any]], settings: list[str]) -> dict[str, dict[str, int]]:
    counts: dict[str, dict[str, int]] = {s: dict.fromkeys(OUTCOMES, 0) for s in settings}
    for r in rows:
        for s in settings if r["setting"] == "*" else [r["setting"]]:
            counts.setdefault(s, dict.fromkeys(OUTCOMES, 0))
            counts[s][r["outcome"]] = counts[s].get(r["outcome"], 0) + 1
    return counts


def signature(row: dict[str, Any]) -> str:
    """A finding's class, roughly: its outcome, the op of its first differing step and what
    differed, with variable names and numbers taken out."""
    why = str(row.get("why", "")).split("; first difference: ")[-1].split("; earlier: ")[0]
    why = re.sub(r"^(step \S+: )?[a-z][\w.]*: ", "", why)
    why = re.sub(r"\(max abs [^)]*\)|\[[^\]]*\]|\([\d, ]*\)|0x[0-9a-f]+|\d+", "#", why)
    op = str(row.get("op", ""))
    if row["outcome"] == "crash":
        why = re.sub(r"line #", "", why)
    return f"{row['outcome']} | {op} | {why[:120]}"


def findings(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    keep = ("seed", "setting", "outcome", "step", "op", "why", "names_op", "alone")
    return [
        {**{k: r[k] for k in keep if k in r}, "class": signature(r)}
        for r in rows
        if r["outcome"] != "exact"
    ]


def classes(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Findings grouped by :func:`signature`: settings and seeds of each."""
    out: dict[str, dict[str, Any]] = {}
    for r in rows:
        if r["outcome"] in ("exact", "skip"):
            continue
        c = out.setdefault(signature(r), {"settings": [], "seeds": []})
        if r["setting"] not in c["settings"]:
            c["settings"].append(r["setting"])
        if r["seed"] not in c["seeds"]:
            c["seeds"].append(r["seed"])
    return dict(
        sorted(
            out.items(),
            key=lambda kv: (
                OUTCOMES.index(kv[0].split(" |")[0]) if kv[0].split(" |")[0] in OUTCOMES else 9,
                -len(kv[1]["seeds"]),
            ),
        )
    )


# ---------------------------------------------------------------------------------------------
# Command line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget-s", type=float, default=None, help="run seeds until spent")
    parser.add_argument("--setting", default="fast,repair", help=f"of {','.join(SETTINGS)}")
    parser.add_argument("--json", help="counts and every non-exact program")
    parser.add_argument("--seed-start", type=int, default=0)
    parser.add_argument("--count", type=int, default=None, help="seeds seed-start..+count")
    parser.add_argument("--seed", type=int, default=None, help="one program, in this process")
    parser.add_argument("--show", action="store_true", help="print the program as Python")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--no-confirm", action="store_true", help="do not re-run crashes alone")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--jsonl", help=argparse.SUPPRESS)
    parser.add_argument("--seeds", help=argparse.SUPPRESS)
    parser.add_argument("--after", help=argparse.SUPPRESS)
    parser.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    ns = parser.parse_args(argv)
    settings = [s.strip() for s in ns.setting.split(",") if s.strip()]
    unknown = [s for s in settings if s not in SETTINGS]
    if unknown:
        parser.error(f"--setting: unknown {unknown}; expected {list(SETTINGS)}")
    if ns.worker:
        after = None
        if ns.after:
            seed, _, setting = ns.after.partition(":")
            after = (int(seed), setting)
        with open(ns.jsonl, "w") as out:
            worker(parse_seeds(ns.seeds), settings, out, after, ns.deadline)
        return 0
    if ns.seed is not None:
        fakegrad_patch.install()
        prog = generate(ns.seed)
        if ns.show:
            print(prog.source(settings[0]))
            return 0
        want = run_eager(prog)
        for setting in settings:
            res = run_one(prog, want, setting)
            print(json.dumps({"seed": ns.seed, "setting": setting, **res.row()}, indent=1))
        return 0
    start = time.perf_counter()
    if ns.count is None and ns.budget_s is None:
        ns.budget_s = 60.0
    seeds = list(range(ns.seed_start, ns.seed_start + ns.count)) if ns.count is not None else None
    rows = run_isolated(
        seeds,
        settings,
        ns.workers,
        ns.budget_s,
        ns.seed_start,
        confirm=not ns.no_confirm,
    )
    programs = len({r["seed"] for r in rows})
    result = {
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "settings": settings,
        "seed_start": ns.seed_start,
        "programs": programs,
        "seconds": round(time.perf_counter() - start, 1),
        "counts": summarize(rows, settings),
        "classes": classes(rows),
        "findings": findings(rows),
    }
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(result, f, indent=1)
    print(json.dumps({k: result[k] for k in ("torch", "programs", "seconds", "counts")}))
    for sig, c in result["classes"].items():
        seeds = ",".join(map(str, c["seeds"][:6])) + ("..." if len(c["seeds"]) > 6 else "")
        print(f"{len(c['seeds']):4d}  {sig}  [{','.join(c['settings'])}] seeds {seeds}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
