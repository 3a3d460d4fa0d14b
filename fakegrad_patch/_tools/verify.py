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

import copy
import importlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Literal

import torch

from .. import _config, trace
from .._core import install as _install
from .._core.convert import leaves as _leaves
from .._core.touchpoints import targets as _targets
from .materialize import materialize
from .verify_compare import DEFAULT_TOLERANCES, Comparison, Tolerance
from .verify_report import VerifyReport

__all__ = ["DEFAULT_TOLERANCES", "VerifyError", "default_loss", "verify"]

ZeroGrad = Literal["none", "zeros", "never"]
ZERO_GRAD_VALUES: tuple[str, ...] = ("none", "zeros", "never")


class VerifyError(RuntimeError):
    """``verify`` could not compare: the model cannot be copied, fails eagerly, or cannot run
    under FakeTensorMode. The message says which and why; the original error is chained."""


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


class _Run:
    """The two copies trained side by side, step by step (:class:`Comparison` judges them)."""

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
        self.mode_cls = _targets.resolve(_targets.FAKE_TENSOR_MODE)
        self.config = importlib.import_module(_targets.PROPAGATE_CONFIG.module)
        self.opt_factory = optimizer
        self.opt_eager = self._optimizer(eager, "eager")
        self.opt_patched = self._optimizer(patched, "patched")
        self.compared = Comparison(
            eager, patched, _targets.resolve(_targets.FAKE_TENSOR), atol, rtol, buffers
        )
        self.events: list[dict[str, Any]] = []

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
            self.compared.step(step, loss_e, loss_p)
            if self.opt_eager is not None and self.opt_patched is not None:
                self.opt_eager.step()
                self.opt_patched.step()
                self.compared.values()

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

    def report(
        self,
        model: torch.nn.Module,
        names: dict[int, str],
        steps: int,
        check_buffers: bool | Literal["strict"],
    ) -> VerifyReport:
        compared = self.compared
        compared.outcomes(self.events, names)
        strict = check_buffers == "strict"
        buffers = compared.buffers(self.events, strict) if check_buffers else []
        return VerifyReport(
            model=type(model).__name__,
            torch=torch.__version__,
            steps=steps,
            optimizer=None if self.opt_eager is None else type(self.opt_eager).__name__,
            zero_grad=self.zero_grad,
            parameters=list(compared.rows.values()),
            buffers=buffers,
            losses=compared.losses,
            strict_buffers=strict,
            buffers_mode=self.buffers,
            general_problems=compared.general,
            notes=compared.notes,
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
