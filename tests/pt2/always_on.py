"""The programs of the "always on" suite (tests/test_always_on.py, issue 28).

``FAKEGRAD_PATCH=1`` is meant to be left on for a whole job, so the patch sits under programs that
use the rest of PyTorch and never enter a fake mode that propagates real values: TorchScript,
pickling and copying torch's functions, warnings and tracebacks raised through backward, the
profiler, checkpointing, anomaly mode, saved-tensor hooks, torch.func, forward-mode AD, gradcheck,
a fake mode without propagation. In such a process ``torch.autograd.backward`` must be torch's own
function object and every observation the same as without the package.

Same interface as tests/pt2/programs.py (whose recording helpers it reuses), run by the same
runner (tests/pt2/runner.py, ``COEXIST_PROGRAMS``). This module imports torch: import it only after
deciding whether fakegrad_patch comes first. Line numbers recorded here are this file's, the same
in every run; a frame of fakegrad_patch would show up as its file name.
"""

from __future__ import annotations

import copy
import hashlib
import inspect
import os
import pickle
import sys
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import torch
from programs import (  # tests/pt2 is on sys.path (runner.py)
    Recorder,
    Skip,
    exception_record,
    need,
    normalize_text,
)
from torch import nn

__all__ = ["PROGRAMS", "Recorder", "Skip", "exception_record", "normalize_text"]

#: what ``torch.autograd.backward`` was when this module was imported (after fakegrad_patch, if
#: the run imports it: the patch is applied by then)
BACKWARD_AT_IMPORT = torch.autograd.backward

#: name -> (group, function)
PROGRAMS: dict[str, tuple[str, Callable[[Recorder], None]]] = {}


def program(group: str) -> Callable[[Callable[[Recorder], None]], Callable[[Recorder], None]]:
    def register(fn: Callable[[Recorder], None]) -> Callable[[Recorder], None]:
        assert fn.__name__ not in PROGRAMS, fn.__name__
        PROGRAMS[fn.__name__] = (group, fn)
        return fn

    return register


def reset_torch_state() -> None:
    torch.manual_seed(0)


# ---------------------------------------------------------------------------------------------
# Helpers


def _where(filename: str) -> str:
    """A file as a record names it: its path under ``torch/`` or the package, else its name."""
    parts = filename.replace(os.sep, "/").split("/")
    for anchor in ("torch", "fakegrad_patch", "wrapt"):
        if anchor in parts:
            return "/".join(parts[len(parts) - parts[::-1].index(anchor) - 1 :])
    return parts[-1]


def _caught(block: Callable[[], Any]) -> list[dict[str, Any]]:
    """The warnings ``block`` raises, each with the file and line it is attributed to."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        block()
    return [
        {
            "category": w.category.__name__,
            "message": normalize_text(str(w.message))[:200],
            "file": _where(w.filename),
            "line": w.lineno,
        }
        for w in caught
        if not str(w.message).startswith("fakegrad_patch")
    ]


def _frames(tb: Any) -> list[str]:
    return [f"{_where(f.filename)}:{f.name}" for f in traceback.extract_tb(tb)]


def _stack_here() -> list[str]:
    """The Python frames above the caller, innermost first (file and function)."""
    out: list[str] = []
    frame: Any = sys._getframe(2)
    while frame is not None:
        out.append(f"{_where(frame.f_code.co_filename)}:{frame.f_code.co_name}")
        frame = frame.f_back
    return out


def _leaf() -> torch.Tensor:
    return torch.tensor([1.0, 2.0, 3.0], requires_grad=True)


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:24]


# ---------------------------------------------------------------------------------------------
# The function object itself


@program("always_on")
def backward_is_torchs_own_function(rec: Recorder) -> None:
    backward = torch.autograd.backward
    rec("type", type(backward).__name__)
    rec("is_function", inspect.isfunction(backward))
    rec("same_as_at_import", backward is BACKWARD_AT_IMPORT)
    rec("module_qualname", f"{backward.__module__}.{backward.__qualname__}")
    rec("file", _where(inspect.getsourcefile(backward) or "?"))
    x = _leaf()
    (x * x).sum().backward()
    rec("grad", x.grad)
    rec("same_after_real_backward", torch.autograd.backward is backward)


@program("always_on")
def torchscript_calls_backward(rec: Recorder) -> None:
    """The issue's repro: TorchScript's builtin table is keyed by the function object."""

    def f(x: torch.Tensor) -> torch.Tensor:
        y = (x * x).sum()
        torch.autograd.backward([y])
        return y

    with rec.raises("script"):
        scripted = torch.jit.script(f)
        rec("graph", normalize_text(str(scripted.graph)))
        x = _leaf()
        rec("out", scripted(x))
        rec("grad", x.grad)


@program("always_on")
def pickle_and_copy_torch_functions(rec: Recorder) -> None:
    functions = {
        "torch.autograd.backward": torch.autograd.backward,
        "torch.autograd.grad": torch.autograd.grad,
        "torch.Tensor.backward": torch.Tensor.backward,
    }
    for name, fn in functions.items():
        for protocol in (2, 4, pickle.HIGHEST_PROTOCOL):
            with rec.raises(f"{name}.pickle{protocol}"):
                data = pickle.dumps(fn, protocol=protocol)
                rec(f"{name}.pickle{protocol}.digest", _digest(data))
                rec(f"{name}.pickle{protocol}.loads_same", pickle.loads(data) is fn)
        with rec.raises(f"{name}.copy"):
            rec(f"{name}.copy_same", copy.copy(fn) is fn)
            rec(f"{name}.deepcopy_same", copy.deepcopy(fn) is fn)
    config = {"step": torch.autograd.backward, "lr": 0.1, "nested": [torch.autograd.backward]}
    with rec.raises("config.deepcopy"):
        copied = copy.deepcopy(config)
        rec("config.deepcopy_keeps", copied["step"] is torch.autograd.backward)
    with rec.raises("config.pickle"):
        again = pickle.loads(pickle.dumps(config))
        rec("config.pickle_keeps", again["nested"][0] is torch.autograd.backward)


# ---------------------------------------------------------------------------------------------
# Warnings and tracebacks raised through backward


@program("always_on")
def warnings_from_hooks_keep_their_line(rec: Recorder) -> None:
    """A tensor hook warning with each ``stacklevel``: 1 is the hook, the higher ones walk up
    through torch's backward frames to this file's ``backward()`` line."""

    def run(level: int) -> None:
        x = _leaf()

        def hook(grad: torch.Tensor) -> None:
            warnings.warn(f"hook stacklevel={level}", UserWarning, stacklevel=level)

        x.register_hook(hook)
        (x * 2).sum().backward()

    for level in range(1, 8):
        rec(f"tensor.backward.stacklevel{level}", _caught(lambda level=level: run(level)))

    def run_autograd(level: int) -> None:
        x = _leaf()
        x.register_hook(lambda g: warnings.warn(f"level={level}", UserWarning, stacklevel=level))
        torch.autograd.backward([(x * 2).sum()])

    for level in range(1, 7):
        rec(
            f"autograd.backward.stacklevel{level}",
            _caught(lambda level=level: run_autograd(level)),
        )


@program("always_on")
def grad_variables_warns_at_the_callers_line(rec: Recorder) -> None:
    need(
        "grad_variables" in inspect.signature(torch.autograd.backward).parameters,
        "torch.autograd.backward has no grad_variables",
    )
    x = _leaf()
    y = x * 2

    def call() -> None:
        torch.autograd.backward([y], grad_variables=[torch.ones(3)])

    rec("warnings", _caught(call))
    rec("grad", x.grad)


@program("always_on")
def full_backward_hook_warning(rec: Recorder) -> None:
    """torch's own warnings raised during backward (a full backward hook on a module whose inputs
    do not require grad)."""
    torch.manual_seed(0)
    lin = nn.Linear(3, 2)
    lin.register_full_backward_hook(lambda m, gi, go: None)

    def call() -> None:
        lin(torch.ones(1, 3)).sum().backward()

    rec("warnings", _caught(call))
    rec("grad", lin.weight.grad)


@program("always_on")
def traceback_through_backward(rec: Recorder) -> None:
    x = _leaf()

    def hook(grad: torch.Tensor) -> None:
        raise ValueError("from a hook")

    x.register_hook(hook)
    try:
        (x * 2).sum().backward()
    except ValueError as exc:
        rec("exception", exception_record(exc))
        rec("frames", _frames(exc.__traceback__))
    else:
        rec("exception", None)


@program("always_on")
def python_stack_inside_backward(rec: Recorder) -> None:
    seen: list[list[str]] = []
    x = _leaf()
    x.register_hook(lambda g: seen.append(_stack_here()))
    (x * 2).sum().backward()
    torch.autograd.backward([(x * 3).sum()])
    rec("stacks", seen)


@program("always_on")
def profiler_with_stack(rec: Recorder) -> None:
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    x = torch.randn(2, 4)
    with profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:
        model(x).sum().backward()
    # Python functions are events of their own (``file.py(line): name``) with ``with_stack``
    names = [e.name for e in prof.events()]
    names += [s for e in prof.events() for s in (getattr(e, "stack", None) or [])]
    rec("functions_of_the_package", sorted({n for n in names if "fakegrad_patch" in n}))
    rec("functions_of_wrapt", sorted({n for n in names if "wrapt" in n}))
    rec("grads", [p.grad for p in model.parameters()])


# ---------------------------------------------------------------------------------------------
# The rest of autograd, real


@program("always_on")
def checkpoint_anomaly_saved_tensor_hooks(rec: Recorder) -> None:
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    lin = nn.Linear(3, 3)
    x = torch.randn(2, 3, requires_grad=True)
    for reentrant in (True, False):
        lin.zero_grad()
        x.grad = None
        out = checkpoint(lambda t: lin(t).relu(), x, use_reentrant=reentrant)
        out.sum().backward()
        rec(f"checkpoint.reentrant={reentrant}", [x.grad, lin.weight.grad])
    packed: list[str] = []
    with torch.autograd.graph.saved_tensors_hooks(
        lambda t: (packed.append("pack"), t)[1], lambda t: (packed.append("unpack"), t)[1]
    ):
        y = (x * x).sin().sum()
    with torch.autograd.detect_anomaly():
        y.backward()
    rec("saved_tensor_hooks", packed)
    rec("anomaly.grad", x.grad)


@program("always_on")
def func_forward_ad_gradcheck(rec: Recorder) -> None:
    import torch.autograd.forward_ad as fwAD
    from torch.func import grad, jvp, vmap

    x = torch.tensor([0.5, 1.0, 2.0], dtype=torch.float64, requires_grad=True)
    rec("func.grad", grad(lambda t: t.sin().sum())(x.detach()))
    rec("func.jvp", jvp(torch.sin, (x.detach(),), (torch.ones(3, dtype=torch.float64),)))
    rec("func.vmap_grad", vmap(grad(lambda t: t.sin()))(x.detach()))
    with fwAD.dual_level():
        dual = fwAD.make_dual(x.detach(), torch.ones(3, dtype=torch.float64))
        rec("forward_ad", fwAD.unpack_dual(dual.exp()).tangent)
    rec("gradcheck", torch.autograd.gradcheck(lambda t: (t * t).sum(), (x,)))
    rec("gradgradcheck", torch.autograd.gradgradcheck(lambda t: (t * t).sum(), (x,)))


@program("always_on")
def fake_mode_without_propagation_keeps_torchs_backward(rec: Recorder) -> None:
    """A fake mode that does not propagate real values (what tracers and estimators build):
    upstream's FakeTensor gradient, and torch's own backward before, during and after."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    rec("after_mode_built", torch.autograd.backward is BACKWARD_AT_IMPORT)
    torch.manual_seed(0)
    lin = nn.Linear(3, 2)
    with mode:
        out = lin(torch.ones(1, 3)).sum()
        rec("inside", torch.autograd.backward is BACKWARD_AT_IMPORT)
        out.backward()
    rec("grad", lin.weight.grad)
    rec("after", torch.autograd.backward is BACKWARD_AT_IMPORT)


@program("always_on")
def real_steps_run_the_same_python_calls(rec: Recorder) -> None:
    """The cost row's reason, counted instead of timed: the Python calls made by 100 tiny real
    steps and a Linear step (``sys.setprofile``), all of them and those in the package or wrapt.
    0.3 made 12 calls of its own per real backward."""
    import collections

    w = _leaf()
    torch.manual_seed(0)
    lin = nn.Linear(8, 2)
    x = torch.randn(4, 8)

    def steps() -> None:
        for _ in range(100):
            (w * w).sum().backward()
        lin(x).sum().backward()

    calls: collections.Counter[str] = collections.Counter()

    def profile(frame: Any, event: str, _arg: Any) -> None:
        if event in ("call", "c_call"):
            name = frame.f_code.co_filename
            calls["ours" if "fakegrad_patch" in name or "wrapt" in name else "torch"] += 1

    steps()  # warm: lazy imports, caches
    sys.setprofile(profile)
    try:
        steps()
    finally:
        sys.setprofile(None)
    rec("python_calls", dict(sorted(calls.items())))
    rec("grads", [w.grad, lin.weight.grad])
