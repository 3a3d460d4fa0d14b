"""The programs of the PT2 coexistence suite (tests/test_pt2_coexistence.py, issue 17).

Each program is something a PyTorch user (or PyTorch itself) does with fake tensors while
fakegrad_patch is switched on for the whole process: torch.compile on each backend, compiled
autograd, torch.export, make_fx, FlopCounterMode and MemTracker over fake inputs, meta init. None of
them uses real-value propagation, so the patch must leave every one of them exactly as upstream
runs it. A program records what it observed (outputs, gradients with their types, parameters after
an optimizer step, buffers, exceptions, captured graph code, dynamo counters) through a
:class:`Recorder`; ``runner.py`` runs programs in a fresh interpreter, with or without
``import fakegrad_patch`` first, and writes the records as JSON for the test to compare.

This module imports torch: import it only after deciding whether fakegrad_patch comes first.
Capability checks (``need``) skip a program where the build lacks an API; they never look at
version strings.
"""

from __future__ import annotations

import contextlib
import hashlib
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

#: name -> (group, function). A group's programs share one interpreter (start-up costs ~2 s).
PROGRAMS: dict[str, tuple[str, Callable[[Recorder], None]]] = {}


class Skip(Exception):
    """The build lacks what the program needs (the reason says what)."""


def need(condition: object, reason: str) -> None:
    if not condition:
        raise Skip(reason)


def program(group: str) -> Callable[[Callable[[Recorder], None]], Callable[[Recorder], None]]:
    def register(fn: Callable[[Recorder], None]) -> Callable[[Recorder], None]:
        assert fn.__name__ not in PROGRAMS, fn.__name__
        PROGRAMS[fn.__name__] = (group, fn)
        return fn

    return register


# ---------------------------------------------------------------------------------------------
# Recording


def _bits(t: torch.Tensor) -> tuple[str, list[Any]]:
    """A digest of the exact bits of a real tensor's values, and its first values (for humans).
    Read with every dispatch mode (a fake mode the program is inside) set aside."""
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        return _real_bits(t)


def _real_bits(t: torch.Tensor) -> tuple[str, list[Any]]:
    flat = t.detach().to("cpu").reshape(-1)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    if flat.dtype.is_floating_point:
        as_int = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
        ints = flat.contiguous().view(as_int[flat.element_size()]).tolist()
    else:
        ints = flat.tolist()
    digest = hashlib.sha256(repr(ints).encode()).hexdigest()[:24]
    return digest, flat[:6].tolist()


def describe(value: Any) -> Any:
    """A JSON-able, exact description: tensors by type, metadata and value bits."""
    from torch._subclasses.fake_tensor import FakeTensor

    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, torch.Tensor):
        out: dict[str, Any] = {
            "type": "FakeTensor" if isinstance(value, FakeTensor) else type(value).__name__,
            "shape": list(value.shape),
            "dtype": str(value.dtype),
            "device": str(value.device),
            "requires_grad": value.requires_grad,
        }
        if value.layout == torch.strided:
            out["stride"] = list(value.stride())
        if not isinstance(value, FakeTensor) and value.device.type != "meta":
            out["bits"], out["head"] = _bits(value)
        return out
    if isinstance(value, dict):
        return {str(k): describe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [describe(v) for v in value]
    if isinstance(value, torch.Size):
        return list(value)
    return f"<{type(value).__name__}>"


_ADDRESS = re.compile(r"0x[0-9a-fA-F]+")
#: ``id()`` in dynamo's guard text (``___check_obj_id(self, 140253102929552)``)
_OBJ_ID = re.compile(r"(___check_obj_id\([^,()]*, )\d+")


def normalize_text(text: str) -> str:
    """Object addresses differ from process to process; nothing else in a message should."""
    return _OBJ_ID.sub(r"\1?", _ADDRESS.sub("0x?", text))


def exception_record(exc: BaseException) -> dict[str, str]:
    return {"type": f"{type(exc).__module__}.{type(exc).__qualname__}", "message": str(exc)}


@dataclass
class Recorder:
    """What one program observed, in the order it observed it."""

    record: dict[str, Any] = field(default_factory=dict)
    codes: list[list[str]] = field(default_factory=list)

    def __call__(self, key: str, value: Any) -> None:
        assert key not in self.record, key
        self.record[key] = describe(value)

    def module(self, key: str, model: nn.Module) -> None:
        """Parameters, their gradients (type and values) and buffers."""
        self(
            key,
            {
                "params": dict(model.named_parameters()),
                "grads": {n: p.grad for n, p in model.named_parameters()},
                "buffers": dict(model.named_buffers()),
            },
        )

    def code(self, kind: str, gm: Any) -> None:
        self.codes.append([kind, normalize_text(str(gm.code))])

    @contextlib.contextmanager
    def raises(self, key: str) -> Iterator[None]:
        """Record the exception of the block (type and message) or that there was none."""
        try:
            yield
        except Exception as exc:
            self.record[key] = exception_record(exc)
        else:
            self.record[key] = None

    def counters(self, key: str, *, frames: bool = True) -> None:
        """torch._dynamo's counters (graph breaks, captures, compiled-autograd counts, frames).

        ``frames`` counts every Python frame dynamo's callback converts while a compiled region
        or compiled autograd runs, library frames included; under compiled autograd torch itself
        varies it from run to run (sympy frames: 690/628 and 691/630 total/ok in two unpatched
        runs of one program on 2.13 with PYTHONHASHSEED=0), and so does the count of library
        generator frames it refuses ("Attempt to trace generator": sympy/mpmath frames of the
        symbolic-shape code, 62 or 64 depending on sympy's caches, the only frames that differed
        when every converted frame was listed). Those programs pass ``frames=False``; their
        captures, graphs and every other graph break are still compared."""
        from torch._dynamo.utils import counters

        def kept(group: str, name: str) -> bool:
            return frames or not (
                group == "frames"
                or (group == "unimplemented" and "generator" in name.split("\n")[0].lower())
            )

        self.record[key] = {
            str(group): {
                normalize_text(str(k)): int(v)
                for k, v in sorted(c.items(), key=str)
                if kept(str(group), str(k))
            }
            for group, c in sorted(counters.items(), key=lambda kv: str(kv[0]))
            if c
        }

    @contextlib.contextmanager
    def dynamo_frames(self, key: str) -> Iterator[None]:
        """What dynamo did with each frame of the block, by the frame's code name: compiled
        (once per compiled version, so a recompile counts again), why it recompiled, and every
        frame it let run uncompiled for a reason of its own (no ops traced, an error suppressed,
        a graph break in a loop). The frames it skips as library code (its skip list, or no
        tensor in the frame) and sympy's and mpmath's frames (the symbolic-shape code under
        compiled autograd: torch itself varies their number from run to run, generators refused
        included, see :meth:`counters`) are left out. Read from
        dynamo's bookkeeping (``orig_code_map``, ``guard_failures``) and its debug log line
        ``skipping: NAME (reason: ..., file: ...)``: the same on 2.4.0, 2.13.0 and 2.14.1."""
        import logging

        from torch._dynamo import utils

        skipped: dict[str, int] = {}
        # its skip list (2.4.0 says "in skipfiles"), no tensor in the frame
        library = ("frame is in the Dynamo skipfiles list", "in skipfiles", "no tensor-related")
        noisy = re.compile(r"[/\\](sympy|mpmath)[/\\]")

        class Skips(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                args = record.args if isinstance(record.args, tuple) else ()
                if not str(record.msg).startswith("skipping: ") or len(args) < 3:
                    return
                name, reason, file = (str(a) for a in args[:3])
                reason = normalize_text(reason.split("\n")[0])
                if not reason.startswith(library) and not noisy.search(file):
                    skipped[f"{name}: {reason}"] = skipped.get(f"{name}: {reason}", 0) + 1

        logger = logging.getLogger("torch._dynamo.convert_frame")
        handler, level, propagate = Skips(logging.DEBUG), logger.level, logger.propagate
        logger.addHandler(handler)
        logger.setLevel(logging.DEBUG)
        logger.propagate = False  # torch's own handlers print nothing more than before
        try:
            yield
        finally:
            logger.removeHandler(handler)
            logger.setLevel(level)
            logger.propagate = propagate
        origs = getattr(getattr(utils, "orig_code_map", None), "values", None)
        failures = getattr(utils, "guard_failures", None)
        compiled: dict[str, int] = {}
        for code in origs.values() if isinstance(origs, dict) else ():
            compiled[code.co_name] = compiled.get(code.co_name, 0) + 1
        self.record[key] = {
            "compiled": dict(sorted(compiled.items())) if isinstance(origs, dict) else None,
            "recompiles": None
            if not isinstance(failures, dict)
            else {
                code.co_name: [normalize_text(str(r)) for r in reasons]
                for code, reasons in sorted(failures.items(), key=lambda kv: kv[0].co_name)
            },
            "run_uncompiled": dict(sorted(skipped.items())),
        }

    def result(self) -> dict[str, Any]:
        return {**self.record, "graph_code": self.codes}


def reset_torch_state() -> None:
    """Between programs of one interpreter: fresh dynamo caches and counters, the same seed."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    ca = _compiled_autograd_module()
    if ca is not None and hasattr(ca, "reset"):
        ca.reset()
    torch.manual_seed(0)


# ---------------------------------------------------------------------------------------------
# Building blocks


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def inputs(batch: int = 3, features: int = 4) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randn(batch, features, generator=g)


def recording_backend(rec: Recorder, name: str) -> Callable[..., Any]:
    """The named dynamo backend, recording the code of every graph handed to it."""
    from torch._dynamo.backends.registry import lookup_backend

    inner = lookup_backend(name)

    def backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        rec.code(f"dynamo->{name}", gm)
        return inner(gm, example_inputs)

    return backend


def recording_aot_backend(rec: Recorder) -> Any:
    """aot_eager that records AOTAutograd's forward and backward graphs (the joint trace with
    fakes, where the patch used to see real parameters)."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    def compiler(kind: str) -> Callable[..., Any]:
        def compile_graph(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
            rec.code(kind, gm)
            return make_boxed_func(gm.forward)

        return compile_graph

    aot = aot_autograd(fw_compiler=compiler("aot-forward"), bw_compiler=compiler("aot-backward"))

    def backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        rec.code("dynamo->aot", gm)
        return aot(gm, example_inputs)

    return backend


def train(
    rec: Recorder,
    model: nn.Module,
    forward: Callable[[torch.Tensor], torch.Tensor],
    batches: list[torch.Tensor],
    *,
    lr: float = 0.1,
) -> None:
    """SGD steps: the loss, gradients (type and values) and parameters after each step."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for i, x in enumerate(batches):
        opt.zero_grad()
        loss = forward(x).square().mean()
        loss.backward()
        rec(f"step{i}.loss", loss)
        rec(f"step{i}.grads", {n: p.grad for n, p in model.named_parameters()})
        opt.step()
        rec.module(f"step{i}.after", model)


def _compiled_autograd_module() -> Any:
    try:
        from torch._dynamo import compiled_autograd
    except ImportError:
        return None
    return compiled_autograd


def compiled_autograd_enable() -> Callable[[Any], Any]:
    """``compiled_autograd._enable`` (newer builds) or ``enable`` (older ones)."""
    ca = _compiled_autograd_module()
    need(ca is not None, "torch._dynamo.compiled_autograd is missing")
    fn = getattr(ca, "_enable", None) or getattr(ca, "enable", None)
    need(fn is not None, "torch._dynamo.compiled_autograd has neither _enable nor enable")
    return fn  # type: ignore[no-any-return]


def need_compiled_autograd_config() -> None:
    import torch._dynamo.config as dynamo_config

    need(
        hasattr(dynamo_config, "compiled_autograd"),
        "torch._dynamo.config has no compiled_autograd switch",
    )


def fake_mode() -> Any:
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


# ---------------------------------------------------------------------------------------------
# torch.compile


def _compile_train(rec: Recorder, backend: Any, **kwargs: Any) -> None:
    model = mlp()
    compiled = torch.compile(model, backend=backend, **kwargs)
    train(rec, model, compiled, [inputs(), inputs()])
    rec.counters("counters")


@program("compile")
def compile_eager(rec: Recorder) -> None:
    _compile_train(rec, recording_backend(rec, "eager"))


@program("compile")
def compile_aot_eager(rec: Recorder) -> None:
    _compile_train(rec, recording_aot_backend(rec))


@program("compile")
def compile_aot_eager_by_name(rec: Recorder) -> None:
    _compile_train(rec, "aot_eager")


@program("inductor")
def compile_inductor(rec: Recorder) -> None:
    _compile_train(rec, "inductor")


@program("compile")
def compile_dynamic(rec: Recorder) -> None:
    model = mlp()
    compiled = torch.compile(model, backend=recording_aot_backend(rec), dynamic=True)
    train(rec, model, compiled, [inputs(3), inputs(5), inputs(7)])
    rec.counters("counters")


@program("compile")
def compile_fullgraph_backward_error(rec: Recorder) -> None:
    """fullgraph=True over a training step: dynamo refuses ``backward()`` (an error the user
    sees, which must read the same with the patch)."""
    model = mlp()

    def step(x: torch.Tensor) -> torch.Tensor:
        loss = model(x).sum()
        loss.backward()
        return loss

    with rec.raises("error"):
        torch.compile(step, backend=recording_backend(rec, "eager"), fullgraph=True)(inputs())
    rec.module("model", model)
    rec.counters("counters")


@program("compile")
def compile_fullgraph_graph_break_error(rec: Recorder) -> None:
    model = mlp()

    def forward(x: torch.Tensor) -> torch.Tensor:
        y = model(x)
        torch._dynamo.graph_break()
        return y.relu()

    with rec.raises("error"):
        torch.compile(forward, backend=recording_aot_backend(rec), fullgraph=True)(inputs())
    rec.counters("counters")


@program("compile")
def compile_graph_break(rec: Recorder) -> None:
    """A graph break in the middle of a training forward: two graphs, two backward graphs."""
    model = mlp()

    def forward(x: torch.Tensor) -> torch.Tensor:
        h = model[1](model[0](x))
        torch._dynamo.graph_break()
        return model[2](h)

    train(rec, model, torch.compile(forward, backend=recording_aot_backend(rec)), [inputs()])
    rec.counters("counters")


@program("compile")
def compile_batchnorm(rec: Recorder) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 2))
    compiled = torch.compile(model, backend=recording_aot_backend(rec))
    train(rec, model, compiled, [inputs(), inputs(4)])
    model.eval()
    rec("eval_output", compiled(inputs()))
    rec.module("final", model)
    rec.counters("counters")


class _ScaleGrad(torch.autograd.Function):
    """y = 2x with a backward that scales by 3 (so a wrong path shows in the values)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * 3


@program("compile")
def compile_custom_autograd_function(rec: Recorder) -> None:
    model = mlp()

    def forward(x: torch.Tensor) -> torch.Tensor:
        return model[2](_ScaleGrad.apply(model[1](model[0](x))))

    train(rec, model, torch.compile(forward, backend=recording_aot_backend(rec)), [inputs()] * 2)
    rec.counters("counters")


@program("compile")
def compile_checkpoint(rec: Recorder) -> None:
    from torch.utils.checkpoint import checkpoint

    model = mlp()

    def forward(x: torch.Tensor) -> torch.Tensor:
        h = checkpoint(lambda t: model[1](model[0](t)), x, use_reentrant=False)
        return model[2](h)

    train(rec, model, torch.compile(forward, backend=recording_aot_backend(rec)), [inputs()] * 2)
    rec.counters("counters")


def _hooked_optimizers(model: nn.Module, make: Callable[[nn.Parameter], Any]) -> dict[Any, Any]:
    """One optimizer per parameter, stepped and zeroed by the parameter's post-accumulate-grad
    hook."""
    need(
        hasattr(torch.Tensor, "register_post_accumulate_grad_hook"),
        "Tensor.register_post_accumulate_grad_hook is missing",
    )
    optimizers = {p: make(p) for p in model.parameters()}

    def hook(p: torch.Tensor) -> None:
        optimizers[p].step()
        optimizers[p].zero_grad()

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(hook)
    return optimizers


def _optimizer_in_backward(model: nn.Module) -> None:
    """One SGD per parameter, stepped by a post-accumulate-grad hook (the torchtune pattern)."""
    _hooked_optimizers(model, lambda p: torch.optim.SGD([p], lr=0.1))


@program("compile")
def compile_optimizer_in_backward(rec: Recorder) -> None:
    model = mlp()
    _optimizer_in_backward(model)
    compiled = torch.compile(model, backend=recording_aot_backend(rec))
    for i in range(2):
        loss = compiled(inputs()).square().mean()
        loss.backward()
        rec(f"step{i}.loss", loss)
        rec.module(f"step{i}.after", model)
    rec.counters("counters")


@program("func_grad")  # alone: the patch's first-need work used to run (and fail) inside it
def compile_func_grad(rec: Recorder) -> None:
    """torch.func.grad under torch.compile (a functorch transform inside dynamo)."""
    need(hasattr(torch, "func") and hasattr(torch.func, "grad"), "torch.func.grad is missing")
    model = mlp()
    params = dict(model.named_parameters())

    def loss(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(model, p, (x,)).square().mean()

    grad_fn = torch.compile(torch.func.grad(loss), backend=recording_backend(rec, "aot_eager"))
    rec("grads", grad_fn(params, inputs()))
    rec.module("model", model)
    rec.counters("counters")


@program("compile")
def compile_meta_init_to_empty(rec: Recorder) -> None:
    """Build on the meta device, ``to_empty`` onto the CPU, initialise, compile, train."""
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    rec.module("meta", model)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    for m in model.modules():
        if isinstance(m, nn.Linear):
            m.reset_parameters()
    train(rec, model, torch.compile(model, backend=recording_aot_backend(rec)), [inputs()] * 2)
    rec.counters("counters")


@program("compile")
def meta_init_to_empty_eager(rec: Recorder) -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    out = model(torch.empty(3, 4, device="meta"))
    out.sum().backward()
    rec("meta_output", out)
    rec.module("meta_after_backward", model)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    for m in model.modules():
        if isinstance(m, nn.Linear):
            m.reset_parameters()
    model.zero_grad(set_to_none=True)
    train(rec, model, model, [inputs()])


# ---------------------------------------------------------------------------------------------
# compiled autograd


def _compiled_autograd_config_step(rec: Recorder, backend: Any) -> None:
    """``torch._dynamo.config.compiled_autograd = True`` and a compiled training step whose
    ``backward()`` compiled autograd captures."""
    need_compiled_autograd_config()
    import torch._dynamo.config as dynamo_config

    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(x: torch.Tensor) -> torch.Tensor:
        loss = model(x).square().mean()
        loss.backward()
        return loss

    with dynamo_config.patch(compiled_autograd=True):
        compiled = torch.compile(step, backend=backend)
        for i in range(2):
            opt.zero_grad()
            rec(f"step{i}.loss", compiled(inputs()))
            rec(f"step{i}.grads", {n: p.grad for n, p in model.named_parameters()})
            opt.step()
    rec.module("after", model)
    rec.counters("counters", frames=False)  # upstream varies them here (see Recorder.counters)


@program("compiled_autograd")
def compiled_autograd_config_eager(rec: Recorder) -> None:
    _compiled_autograd_config_step(rec, recording_backend(rec, "eager"))


@program("compiled_autograd")
def compiled_autograd_config_aot_eager(rec: Recorder) -> None:
    _compiled_autograd_config_step(rec, recording_backend(rec, "aot_eager"))


@program("compiled_autograd_inductor")
def compiled_autograd_config_inductor(rec: Recorder) -> None:
    """The issue-17 segfault (exit -11 with the patch on 2.13 and 2.14.1)."""
    _compiled_autograd_config_step(rec, "inductor")


def _compiled_autograd_enable_step(rec: Recorder, backend: str, *, hooks: bool = False) -> None:
    """Eager forward, ``backward()`` inside ``compiled_autograd._enable(compiler)``."""
    enable = compiled_autograd_enable()
    model = mlp()
    if hooks:
        torch.manual_seed(0)
        model = nn.Linear(4, 2)  # each parameter's hook is a graph break: keep them few
        _optimizer_in_backward(model)

    def compiler(gm: torch.fx.GraphModule) -> Any:
        rec.code("compiled-autograd", gm)
        # The optimizer step in the hooks breaks the graph (dynamo cannot trace it whole).
        return torch.compile(gm, backend=backend, fullgraph=not hooks, dynamic=True)

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for i in range(2):
        if not hooks:
            opt.zero_grad()
        loss = model(inputs()).square().mean()
        with enable(compiler):
            loss.backward()
        rec(f"step{i}.loss", loss)
        rec.module(f"step{i}", model)
        if not hooks:
            opt.step()
    rec.module("after", model)
    rec.counters("counters")


@program("compiled_autograd")
def compiled_autograd_enable_eager(rec: Recorder) -> None:
    _compiled_autograd_enable_step(rec, "eager")


@program("compiled_autograd")
def compiled_autograd_enable_aot_eager(rec: Recorder) -> None:
    _compiled_autograd_enable_step(rec, "aot_eager")


@program("compiled_autograd_inductor")
def compiled_autograd_enable_inductor(rec: Recorder) -> None:
    _compiled_autograd_enable_step(rec, "inductor")


@program("compiled_autograd")
def compiled_autograd_optimizer_in_backward(rec: Recorder) -> None:
    _compiled_autograd_enable_step(rec, "aot_eager", hooks=True)


@program("compiled_autograd")
def compiled_autograd_config_optimizer_in_backward(rec: Recorder) -> None:
    need_compiled_autograd_config()
    import torch._dynamo.config as dynamo_config

    torch.manual_seed(0)
    model = nn.Linear(4, 2)  # each parameter's hook is a graph break: keep them few
    _optimizer_in_backward(model)

    def step(x: torch.Tensor) -> torch.Tensor:
        loss = model(x).square().mean()
        loss.backward()
        return loss

    with dynamo_config.patch(compiled_autograd=True):
        compiled = torch.compile(step, backend=recording_backend(rec, "aot_eager"))
        for i in range(2):
            rec(f"step{i}.loss", compiled(inputs()))
            rec.module(f"step{i}", model)
    rec.counters("counters", frames=False)  # upstream varies them here (see Recorder.counters)


# ---------------------------------------------------------------------------------------------
# compiled autograd with per-parameter optimizers stepped in post-accumulate-grad hooks: the
# frames dynamo compiles must be the same with the patch (with buffers="write_back" its global
# optimizer step post-hook failed the resume frame of Optimizer.step's wrapper: one frame fewer)


def _compiled_autograd_hooked_step(rec: Recorder, make: Callable[[nn.Parameter], Any]) -> None:
    """A compiled training step whose ``backward()`` compiled autograd captures
    (``torch._dynamo.config.compiled_autograd``), each parameter's optimizer stepped in its
    hook; two steps (the second runs what the first compiled, or recompiles). One Linear: each
    hook is a graph break and recompiles per parameter shape, keep them few. Backend ``eager``:
    the frames are dynamo's alone."""
    need_compiled_autograd_config()
    import torch._dynamo.config as dynamo_config

    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    optimizers = _hooked_optimizers(model, make)

    def step(x: torch.Tensor) -> torch.Tensor:
        loss = model(x).square().mean()
        loss.backward()
        return loss

    with rec.dynamo_frames("dynamo_frames"), dynamo_config.patch(compiled_autograd=True):
        compiled = torch.compile(step, backend=recording_backend(rec, "eager"))
        for i in range(2):
            rec(f"step{i}.loss", compiled(inputs()))
            rec.module(f"step{i}", model)
    rec("optimizer_state", [o.state_dict()["state"] for o in optimizers.values()])
    rec.counters("counters", frames=False)  # upstream varies them here (see Recorder.counters)


@program("optimizer_hooks")
def compiled_autograd_hooks_sgd(rec: Recorder) -> None:
    _compiled_autograd_hooked_step(rec, lambda p: torch.optim.SGD([p], lr=0.1))


@program("optimizer_hooks")
def compiled_autograd_hooks_adam(rec: Recorder) -> None:
    _compiled_autograd_hooked_step(rec, lambda p: torch.optim.Adam([p], lr=0.01, foreach=False))


@program("optimizer_hooks")
def compiled_autograd_hooks_adam_foreach(rec: Recorder) -> None:
    _compiled_autograd_hooked_step(rec, lambda p: torch.optim.Adam([p], lr=0.01, foreach=True))


# ---------------------------------------------------------------------------------------------
# torch.export


def _export_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 2))


def _export(rec: Recorder, model: nn.Module) -> Any:
    need(hasattr(torch, "export") and hasattr(torch.export, "export"), "torch.export is missing")
    ep = torch.export.export(model, (inputs(),))
    rec.code("exported", ep.graph_module)
    rec("signature", normalize_text(str(ep.graph_signature)))
    rec.module("model_after_export", model)
    return ep


@program("export")
def export_train(rec: Recorder) -> None:
    _export(rec, _export_model().train())


@program("export")
def export_eval(rec: Recorder) -> None:
    ep = _export(rec, _export_model().eval())
    rec("output", ep.module()(inputs()))


@program("export")
def export_run_decompositions(rec: Recorder) -> None:
    ep = _export(rec, _export_model().train())
    decomposed = ep.run_decompositions()
    rec.code("decomposed", decomposed.graph_module)
    rec("decomposed_signature", normalize_text(str(decomposed.graph_signature)))


@program("export")
def export_module_backward(rec: Recorder) -> None:
    """Train the unlifted module of an exported program for two steps."""
    ep = _export(rec, _export_model().train())
    module = ep.module()
    try:
        train(rec, module, module, [inputs(), inputs()])
    except RuntimeError as exc:  # a capability of the build, with or without the patch
        need(
            "modified by an inplace operation" not in str(exc),
            f"ep.module() of a train-mode BatchNorm cannot run backward on this build: {exc}",
        )
        raise


@program("export")
def export_draft_export(rec: Recorder) -> None:
    need(hasattr(torch.export, "draft_export"), "torch.export.draft_export is missing")
    model = _export_model().train()
    ep = torch.export.draft_export(model, (inputs(),))
    rec.code("draft", ep.graph_module)
    report = getattr(ep, "_report", None)
    failures = getattr(report, "failures", None)
    rec("report_failures", None if failures is None else len(failures))
    rec.module("model_after_export", model)


# ---------------------------------------------------------------------------------------------
# make_fx


def _make_fx(
    rec: Recorder, tracing_mode: str, *, backward: bool, allow_non_fake_inputs: bool = True
) -> None:
    """make_fx of a function that uses a real model (and, with ``backward``, calls backward() on
    its real parameters and returns their gradients). The real parameters reach the trace's fake
    mode as op inputs only with ``_allow_non_fake_inputs=True``; without, make_fx refuses them."""
    import inspect

    from torch.fx.experimental.proxy_tensor import make_fx

    kwargs: dict[str, Any] = {}
    if allow_non_fake_inputs:
        need(
            "_allow_non_fake_inputs" in inspect.signature(make_fx).parameters,
            "make_fx has no _allow_non_fake_inputs",
        )
        kwargs["_allow_non_fake_inputs"] = True
    model = mlp()

    def fn(x: torch.Tensor) -> Any:
        out = model(x)
        if not backward:
            return out
        out.sum().backward()
        return [p.grad for p in model.parameters()]

    with rec.raises("error"):
        gm = make_fx(fn, tracing_mode=tracing_mode, **kwargs)(inputs())
        rec.code(f"make_fx-{tracing_mode}", gm)
        rec("nodes", len(gm.graph.nodes))
    rec.module("model_after_trace", model)


@program("make_fx")
def make_fx_fake_forward(rec: Recorder) -> None:
    _make_fx(rec, "fake", backward=False)


@program("make_fx")
def make_fx_fake_backward(rec: Recorder) -> None:
    _make_fx(rec, "fake", backward=True)


@program("make_fx")
def make_fx_symbolic_forward(rec: Recorder) -> None:
    _make_fx(rec, "symbolic", backward=False)


@program("make_fx")
def make_fx_symbolic_backward(rec: Recorder) -> None:
    _make_fx(rec, "symbolic", backward=True)


@program("make_fx")
def make_fx_fake_backward_real_inputs_refused(rec: Recorder) -> None:
    _make_fx(rec, "fake", backward=True, allow_non_fake_inputs=False)


# ---------------------------------------------------------------------------------------------
# Estimators: FlopCounterMode, MemTracker, a plain fake mode (no propagation)


def _estimator_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))


def _flops(rec: Recorder, model: nn.Module, make_input: Callable[[], torch.Tensor]) -> None:
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter:
        out = model(make_input())
        out.sum().backward()
    rec("output", out)
    rec("total_flops", counter.get_total_flops())
    rec(
        "flops",
        {
            str(mod): {str(op): int(n) for op, n in sorted(ops.items(), key=str)}
            for mod, ops in sorted(counter.get_flop_counts().items(), key=str)
        },
    )
    rec.module("model", model)


@program("estimators")
def flop_counter_real(rec: Recorder) -> None:
    _flops(rec, _estimator_model(), lambda: torch.randn(4, 16))


@program("estimators")
def flop_counter_fake_input(rec: Recorder) -> None:
    """A real model, a fake input: upstream leaves FakeTensor gradients on the real parameters."""
    model = _estimator_model()
    with fake_mode():
        _flops(rec, model, lambda: torch.randn(4, 16))


@program("estimators")
def flop_counter_fake_model(rec: Recorder) -> None:
    with fake_mode():
        model = _estimator_model()
        _flops(rec, model, lambda: torch.randn(4, 16))


def _mem_tracker(rec: Recorder, model: nn.Module, make_input: Callable[[], torch.Tensor]) -> None:
    try:
        from torch.distributed._tools.mem_tracker import MemTracker
    except ImportError as exc:
        raise Skip(f"torch.distributed._tools.mem_tracker is missing ({exc})") from None
    tracker = MemTracker()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tracker.track_external(model, opt)
    with tracker:
        out = model(make_input())
        out.sum().backward()
    for kind in ("peak", "current"):
        rec(
            f"snapshot_{kind}",
            {
                str(dev): {str(k): int(v) for k, v in sorted(d.items(), key=str)}
                for dev, d in tracker.get_tracker_snapshot(kind).items()
            },
        )
    rec("output", out)
    rec.module("model", model)


@program("estimators")
def mem_tracker_real(rec: Recorder) -> None:
    _mem_tracker(rec, _estimator_model(), lambda: torch.randn(4, 16))


@program("estimators")
def mem_tracker_fake_input(rec: Recorder) -> None:
    """Issue 17: with the patch MemTracker reported 0 gradient bytes (gradients dropped)."""
    model = _estimator_model()
    with fake_mode():
        _mem_tracker(rec, model, lambda: torch.randn(4, 16))


@program("estimators")
def mem_tracker_fake_model(rec: Recorder) -> None:
    with fake_mode():
        _mem_tracker(rec, _estimator_model(), lambda: torch.randn(4, 16))


@program("estimators")
def fake_mode_real_model_no_propagation(rec: Recorder) -> None:
    """The bare case: FakeTensorMode(allow_non_fake_inputs=True), real parameters, fake input,
    forward and backward, twice, no propagation: upstream's FakeTensor gradients."""
    model = mlp()
    with fake_mode():
        for i in range(2):
            out = model(torch.randn(3, 4))
            out.sum().backward()
            rec(f"pass{i}.output", out)
            rec.module(f"pass{i}", model)
    rec.module("after_mode", model)


@program("estimators")
def fake_mode_autograd_grad_no_propagation(rec: Recorder) -> None:
    model = mlp()
    with fake_mode():
        out = model(torch.randn(3, 4))
        grads = torch.autograd.grad(out.sum(), list(model.parameters()))
    rec("grads", grads)
    rec.module("model", model)
