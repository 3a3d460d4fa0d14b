"""``fakegrad_patch.verify``: prove the patch on the user's own model, against eager.

Two deep copies of the model are trained side by side from the same state and the same random
numbers: one eagerly (the reference), one with its real parameters inside
``FakeTensorMode(allow_non_fake_inputs=True)`` with real-value propagation on and the patch
installed (what the user's program does). After each step every named parameter's ``.grad`` is
compared (real or fake, values, dtype, device, strides, the tensor object kept or replaced), then,
after the optimizer step, the parameter values; buffers after the last step; the loss of each
step. What the patch did to each parameter comes from its own trace (``trace.capture``).

Nothing of the user's is changed: the model is only deep-copied, the RNG state (CPU and the CUDA
devices involved) is forked and restored, the patch state and settings (``patched()``) and the
propagation flag (``config.patch``) are restored on exit, the trace configuration is untouched.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch

from .. import _config, trace
from .._core import install as _install
from .._core.convert import leaves as _leaves
from .._core.touchpoints import targets as _targets
from .materialize import materialize
from .verify_report import BufferReport, ParamReport, VerifyReport

ZeroGrad = Literal["none", "zeros", "never"]
ZERO_GRAD_VALUES: tuple[str, ...] = ("none", "zeros", "never")

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


class VerifyError(RuntimeError):
    """``verify`` could not compare: the model cannot be copied, fails eagerly, or cannot run
    under FakeTensorMode. The message says which and why; the original error is chained."""


Tolerance = float | Mapping[torch.dtype, float] | None
OptimizerFactory = Callable[[Iterator[torch.nn.Parameter]], torch.optim.Optimizer]


def verify(
    model: torch.nn.Module,
    example_inputs: Any,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    *,
    steps: int = 1,
    optimizer: OptimizerFactory | None = None,
    zero_grad: ZeroGrad = "none",
    atol: Tolerance = None,
    rtol: Tolerance = None,
    check_buffers: bool | Literal["strict"] = True,
    buffers: str | None = None,
) -> VerifyReport:
    """Train two deep copies of ``model`` side by side, eagerly and patched under FakeTensorMode
    with real-value propagation, and report per named parameter whether they agree.

    example_inputs: a tuple is the positional arguments of ``model``; a dict its keyword
        arguments; anything else (a tensor) the single argument. The same inputs (deep-copied)
        are used for every step.
    loss_fn: ``loss_fn(output) -> scalar tensor``; default: the sum over the floating tensors in
        the output of ``mean(out ** 2)``.
    steps: training steps; ``optimizer`` (a factory called with the copy's ``parameters()``, e.g.
        ``functools.partial(torch.optim.SGD, lr=0.1)``) steps each copy after each backward,
        outside the fake mode, as a training loop does.
    zero_grad: before every step after the first: ``"none"`` (``zero_grad()``, grads set to
        None), ``"zeros"`` (``zero_grad(set_to_none=False)``: the same ``.grad`` objects must be
        kept), ``"never"`` (gradients accumulate across steps).
    atol, rtol: a float, or a dict ``{dtype: float}``; default per gradient dtype
        (:data:`DEFAULT_TOLERANCES`).
    check_buffers: compare buffers after the last step (``"strict"``: differences fail the
        verdict; by default they are reported only, see :class:`BufferReport`).
    buffers: the patched copy's ``buffers`` setting (``"upstream"`` or ``"write_back"``, see
        docs/configuration.md); default: the setting in force (``configure``,
        ``FAKEGRAD_BUFFERS``). With ``"write_back"`` in-place buffer updates inside the mode
        reach the real buffers, and buffers are expected to equal eager's.

    Raises VerifyError when the comparison cannot be made. Never changes ``model``, the RNG state,
    the patch state or settings.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"verify: model must be a torch.nn.Module, not {type(model).__name__}")
    for name, value in (
        ("steps", steps),
        ("zero_grad", zero_grad),
        ("atol", atol),
        ("rtol", rtol),
        ("check_buffers", check_buffers),
        ("buffers", buffers),
    ):
        if value is None and name == "buffers":
            continue
        try:
            if name in ("steps", "atol", "rtol") and isinstance(value, str):
                raise ValueError(_config.invalid_message(_config.setting(name), value))
            _config.parse(name, value)  # the table's parsers also take command-line strings
        except ValueError as exc:
            raise ValueError(f"verify: {exc}") from None
    for name, value in (("atol", atol), ("rtol", rtol)):
        if isinstance(value, Mapping) and not all(isinstance(k, torch.dtype) for k in value):
            raise ValueError(
                f"verify: {_config.invalid_message(_config.setting(name), value)} "
                "(the dict's keys must be torch dtypes)"
            )
    _refuse_meta(model)
    eager = _copy(model, "the model")
    patched = _copy(model, "the model")
    names = _param_names(patched)
    loss_of = loss_fn if loss_fn is not None else default_loss
    mode = _config.current().buffers if buffers is None else _config.parse("buffers", buffers)
    run = _Run(eager, patched, example_inputs, loss_of, optimizer, zero_grad, atol, rtol, mode)
    with torch.random.fork_rng(devices=_cuda_devices(model, example_inputs)), torch.enable_grad():
        run.execute(steps)
    return run.report(
        model,
        names,
        steps,
        check_buffers,
    )


def default_loss(output: Any) -> torch.Tensor:
    """Sum over the floating (and complex) tensors of ``output`` of ``mean(|out| ** 2)``: every
    element gets a non-trivial gradient (unlike ``sum()``, whose gradient through LayerNorm is
    zero)."""
    terms = [
        (t.abs() if t.is_complex() else t).pow(2).mean()
        for t in _tensors(output)
        if t.is_floating_point() or t.is_complex()
    ]
    if not terms:
        raise VerifyError(
            "verify: the model's output has no floating tensor to build a loss from; pass "
            "loss_fn=..."
        )
    total = terms[0]
    for term in terms[1:]:
        total = total + term
    return total


# -- the two runs ---------------------------------------------------------------------------------


@dataclass
class _Grad:
    kind: str  # "real" | "fake" | "none"
    tensor: torch.Tensor | None


class _Run:
    def __init__(
        self,
        eager: torch.nn.Module,
        patched: torch.nn.Module,
        inputs: Any,
        loss_fn: Callable[[Any], torch.Tensor],
        optimizer: OptimizerFactory | None,
        zero_grad: ZeroGrad,
        atol: Tolerance,
        rtol: Tolerance,
        buffers: str,
    ) -> None:
        self.eager, self.patched = eager, patched
        self.buffers = buffers
        self.inputs, self.loss_fn = inputs, loss_fn
        self.zero_grad = zero_grad
        self.atol, self.rtol = atol, rtol
        self.fake_cls = _targets.resolve(_targets.FAKE_TENSOR)
        self.mode_cls = _targets.resolve(_targets.FAKE_TENSOR_MODE)
        self.config = importlib.import_module(_targets.PROPAGATE_CONFIG.module)
        self.opt_factory = optimizer
        self.opt_eager = self._optimizer(eager, "eager")
        self.opt_patched = self._optimizer(patched, "patched")
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
        self.events: list[dict[str, Any]] = []
        self.prev_e: dict[str, torch.Tensor | None] = {}
        self.prev_p: dict[str, torch.Tensor | None] = {}

    def _optimizer(self, module: torch.nn.Module, which: str) -> torch.optim.Optimizer | None:
        if self.opt_factory is None:
            return None
        try:
            return self.opt_factory(module.parameters())
        except Exception as exc:
            raise VerifyError(
                f"verify: the optimizer factory failed for the {which} copy: "
                f"{type(exc).__name__}: {exc}"
            ) from exc

    def execute(self, steps: int) -> None:
        for step in range(1, steps + 1):
            if step > 1:
                self._zero(self.eager, self.opt_eager)
                self._zero(self.patched, self.opt_patched)
            cpu, cuda = _rng_state(self.eager, self.inputs)
            loss_e = self._eager_step(step)
            _set_rng_state(cpu, cuda)
            with (
                _install.patched(buffers=self.buffers),
                trace.capture(trace.INFO) as events,
                self.config.patch(fake_tensor_propagate_real_tensors=True),
            ):
                loss_p = self._patched_step(step)
            self.events += events
            self._compare_step(step, loss_e, loss_p)
            if self.opt_eager is not None and self.opt_patched is not None:
                self.opt_eager.step()
                self.opt_patched.step()
                self._compare_values()

    def _zero(self, module: torch.nn.Module, opt: torch.optim.Optimizer | None) -> None:
        if self.zero_grad == "never":
            return
        target: Any = opt if opt is not None else module
        target.zero_grad(set_to_none=self.zero_grad == "none")

    def _eager_step(self, step: int) -> torch.Tensor:
        args, kwargs = _split_inputs(copy.deepcopy(self.inputs))
        try:
            loss = self.loss_fn(self.eager(*args, **kwargs))
            _check_loss(loss)
            loss.backward()
        except VerifyError:
            raise
        except Exception as exc:
            raise VerifyError(
                f"verify: the model failed eagerly at step {step} (before anything fake ran): "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        return loss.detach()

    def _patched_step(self, step: int) -> torch.Tensor | None:
        _leaves.name_parameters(self.patched)
        args, kwargs = _split_inputs(copy.deepcopy(self.inputs))
        try:
            with self.mode_cls(allow_non_fake_inputs=True):
                loss = self.loss_fn(self.patched(*args, **kwargs))
                loss.backward()
                real = materialize(loss.detach(), on_missing="drop")
        except Exception as exc:
            from .._core.dispatch.mismatch import describe

            info = describe(exc)
            if info is not None:
                raise VerifyError(
                    f"verify: the model ran eagerly but failed under FakeTensorMode("
                    f"allow_non_fake_inputs=True) with real-value propagation at step {step}: "
                    f"the fake kernel of {info['op']} disagrees with the real kernel at output"
                    f"{info['output'] or ''} ({info['cause']}). "
                    + _sentence(info["hint"].removeprefix("fakegrad_patch: "))
                ) from exc
            raise VerifyError(
                f"verify: the model ran eagerly but failed under FakeTensorMode("
                f"allow_non_fake_inputs=True) with real-value propagation at step {step}: "
                f"{type(exc).__name__}: {exc}. This is the fake path itself, not a gradient "
                "difference: the model cannot be traced this way (data-dependent Python control "
                "flow on tensor values, .item()/.tolist(), ops without a fake implementation)."
            ) from exc
        return real if isinstance(real, torch.Tensor) else None

    # -- comparison -----------------------------------------------------------------------------

    def _kind(self, g: Any) -> _Grad:
        if g is None:
            return _Grad("none", None)
        if isinstance(g, self.fake_cls):
            return _Grad("fake", None)
        return _Grad("real", g)

    def _compare_step(self, step: int, loss_e: torch.Tensor, loss_p: torch.Tensor | None) -> None:
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
                self._compare_grads(step, row, ge.tensor, gp.tensor)
            if step > 1:
                self._identity(step, row, name, pe.grad, pp.grad)
            self.prev_e[name], self.prev_p[name] = pe.grad, pp.grad

    def _compare_grads(
        self, step: int, row: ParamReport, ge: torch.Tensor, gp: torch.Tensor
    ) -> None:
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

    def _compare_values(self) -> None:
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

    # -- the report -----------------------------------------------------------------------------

    def _outcomes(self, names: dict[int, str]) -> None:
        unknown = 0
        internal: dict[str, int] = {}
        for event in self.events:
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

    def _buffers(self, strict: bool) -> list[BufferReport]:
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
                        _BUFFER_NOTE_WRITE_BACK if self.buffers == "write_back" else _BUFFER_NOTE
                    )
            out.append(row)
        if any(not b.matches for b in out):
            if not strict:
                self.notes.append(
                    "buffers marked ~ differ from eager; this does not fail the verdict "
                    '(check_buffers="strict" makes it)'
                )
            if self.buffers != "write_back":
                self.notes.append(
                    "buffers updated in place inside the mode stay stale by default (upstream "
                    'semantics): buffers="write_back" (verify(..., buffers="write_back"), '
                    "fakegrad_patch.configure(buffers=...), FAKEGRAD_BUFFERS=write_back, "
                    "verify --buffers write_back) makes them reach the real buffers as in eager"
                )
        lost = [e for e in self.events if e.get("event") == "update_lost"]
        if lost:
            kinds = sorted({str(e.get("kind")) for e in lost})
            self.notes.append(
                f"in-place updates of real tensors inside the mode that reached only fake "
                f"copies: {len(lost)} ({', '.join(kinds)}; update_lost events): "
                f"{lost[0].get('fix')}"
            )
        written = [e for e in self.events if e.get("event") == "buffer_written_back"]
        if written:
            nbytes = sum(int(e.get("bytes") or 0) for e in written)
            self.notes.append(
                f"buffers written back to the real buffers: {len(written)} time(s), {nbytes} bytes"
            )
        return out

    def report(
        self,
        model: torch.nn.Module,
        names: dict[int, str],
        steps: int,
        check_buffers: bool | Literal["strict"],
    ) -> VerifyReport:
        self._outcomes(names)
        strict = check_buffers == "strict"
        buffers = self._buffers(strict) if check_buffers else []
        return VerifyReport(
            model=type(model).__name__,
            torch=torch.__version__,
            steps=steps,
            optimizer=None if self.opt_eager is None else type(self.opt_eager).__name__,
            zero_grad=self.zero_grad,
            parameters=list(self.rows.values()),
            buffers=buffers,
            losses=self.losses,
            strict_buffers=strict,
            buffers_mode=self.buffers,
            general_problems=self.general,
            notes=self.notes,
        )


# -- helpers --------------------------------------------------------------------------------------


def _sentence(text: str) -> str:
    return text[:1].upper() + text[1:]


def _refuse_meta(model: torch.nn.Module) -> None:
    meta = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    if meta:
        raise VerifyError(
            f"verify: {len(meta)} parameter(s) are on the meta device ({', '.join(meta[:5])}"
            f"{', ...' if len(meta) > 5 else ''}): they have no values, so there is nothing to "
            "compare. Build the model on cpu or cuda (meta models get meta gradients by design)."
        )


def _copy(obj: Any, what: str) -> Any:
    try:
        return copy.deepcopy(obj)
    except Exception as exc:
        raise VerifyError(
            f"verify: {what} cannot be deep-copied ({type(exc).__name__}: {exc}); verify works on "
            "copies so that your model is never changed. Make it copyable (define __deepcopy__, "
            "drop unpicklable attributes such as open files, locks or generators) or verify a "
            "freshly built instance."
        ) from exc


def _param_names(module: torch.nn.Module) -> dict[int, str]:
    return {id(p): name for name, p in module.named_parameters()}


def _cuda_devices(model: torch.nn.Module, inputs: Any) -> list[int]:
    devices = {t.device.index or 0 for t in _tensors(inputs) if t.device.type == "cuda"}
    devices |= {
        p.device.index or 0
        for p in (*model.parameters(), *model.buffers())
        if p.device.type == "cuda"
    }
    return sorted(devices)


def _rng_state(
    model: torch.nn.Module, inputs: Any
) -> tuple[torch.Tensor, list[tuple[int, torch.Tensor]]]:
    cuda = [(d, torch.cuda.get_rng_state(d)) for d in _cuda_devices(model, inputs)]
    return torch.get_rng_state(), cuda


def _set_rng_state(cpu: torch.Tensor, cuda: list[tuple[int, torch.Tensor]]) -> None:
    torch.set_rng_state(cpu)
    for device, state in cuda:
        torch.cuda.set_rng_state(state, device)


def _tensors(tree: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        yield tree
    elif depth < 8 and isinstance(tree, list | tuple):
        for item in tree:
            yield from _tensors(item, depth + 1)
    elif depth < 8 and isinstance(tree, Mapping):
        for item in tree.values():
            yield from _tensors(item, depth + 1)


def _split_inputs(inputs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if isinstance(inputs, tuple):
        return inputs, {}
    if isinstance(inputs, dict):
        return (), inputs
    return (inputs,), {}


def _check_loss(loss: Any) -> None:
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise VerifyError(
            "verify: loss_fn must return a tensor with one element, got "
            + (
                f"shape {list(loss.shape)}"
                if isinstance(loss, torch.Tensor)
                else type(loss).__name__
            )
        )
    if not loss.requires_grad:
        raise VerifyError(
            "verify: the loss does not require grad: no parameter of the model takes part in it "
            "(all frozen, or the forward detaches its output)"
        )


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
