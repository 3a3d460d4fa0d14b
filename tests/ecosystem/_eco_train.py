"""The ecosystem zoo's two comparisons with eager.

* :func:`run_verify`: ``fakegrad_patch.verify`` on the case (the first micro-batch, two steps,
  ``zero_grad="zeros"``: the second step accumulates into the kept ``.grad`` objects).
* :func:`independent_comparison`: our own loop, no ``verify`` code: two optimizer steps of two
  micro-batches each (gradient accumulation), eager on one deep copy, inside a propagating
  ``FakeTensorMode(allow_non_fake_inputs=True)`` on another (one mode per optimizer step, the
  optimizer stepping outside it), and after every backward and every step each parameter's
  ``.grad`` (real or fake, None or not, object kept or replaced, dtype, device, strides, values)
  and value compared with eager's. The first difference raises :class:`Mismatch` at once.
"""

from __future__ import annotations

import copy
import time
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch._functorch.config as functorch_config
from _eco_zoo import Built
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

import fakegrad_patch

STEPS = 2


class Mismatch(AssertionError):
    """The fake-mode run differs from eager (the message names the parameter and the point)."""


def run_verify(built: Built, **kwargs: Any) -> Any:
    loss = built.loss_fn
    return fakegrad_patch.verify(
        built.model,
        built.batches[0],
        lambda out: loss(out, 0),
        steps=STEPS,
        optimizer=built.optimizer,
        zero_grad="zeros",
        **kwargs,
    )


@dataclass
class Timing:
    eager_s: float
    fake_s: float
    compared: int  # parameter comparisons made


def _call(model: torch.nn.Module, batch: Any) -> Any:
    return model(**batch) if isinstance(batch, dict) else model(*batch)


class _FakeMode:
    """One FakeTensorMode, entered again for each micro-batch, propagation on while inside."""

    def __init__(self) -> None:
        with functorch_config.patch(fake_tensor_propagate_real_tensors=True):
            self.mode = FakeTensorMode(allow_non_fake_inputs=True)
        self.stack = ExitStack()

    def __enter__(self) -> None:
        self.stack.enter_context(functorch_config.patch(fake_tensor_propagate_real_tensors=True))
        self.stack.enter_context(self.mode)

    def __exit__(self, *exc: object) -> None:
        self.stack.close()


def _fake_mode() -> _FakeMode:
    return _FakeMode()


def _snapshot(model: torch.nn.Module) -> dict[str, tuple[Any, Any]]:
    """name -> (the .grad object, a copy of its values now: eager accumulates in place)."""
    out: dict[str, tuple[Any, Any]] = {}
    for name, p in model.named_parameters():
        g = p.grad
        out[name] = (g, None if g is None or isinstance(g, FakeTensor) else g.detach().clone())
    return out


def _train(built: Built, model: torch.nn.Module, fake: bool, check: Any = None) -> float:
    """Two optimizer steps of accumulated micro-batches; returns the seconds spent. Records
    ("grad", step, micro, {name: (grad, values)}, loss) after each backward and ("param", step,
    None, {name: (param, values)}, None) after each step, and passes each to ``check`` as it is
    made (fail fast). ``fake``: one propagating fake mode per optimizer step, entered for each
    micro-batch's forward and backward; the inputs are real tensors."""
    opt = built.optimizer(model.parameters())
    start = time.perf_counter()
    for step in range(STEPS):
        mode = _fake_mode() if fake else nullcontext()
        for micro, batch in enumerate(built.batches):
            inputs = copy.deepcopy(batch)
            with mode:
                loss = built.loss_fn(_call(model, inputs), micro)
                loss.backward()
            check(("grad", step, micro, _snapshot(model), loss))
        opt.step()
        opt.zero_grad()  # set_to_none: the next step starts without gradients
        values = {n: (p, p.detach().clone()) for n, p in model.named_parameters()}
        check(("param", step, None, values, None))
    return time.perf_counter() - start


def _grad_error(
    name: str,
    got_entry: tuple[Any, Any],
    want_entry: tuple[Any, Any],
    got_prev: Any,
    want_prev: Any,
) -> str | None:
    (got, got_values), (want, want_values) = got_entry, want_entry
    if want is None or got is None:
        if (want is None) != (got is None):
            has = "None" if want is None else "a tensor"
            return f"{name}: .grad is {type(got).__name__} where eager has {has}"
        return None
    if isinstance(got, FakeTensor) or type(got) is not type(want):
        return f"{name}: .grad is a {type(got).__name__} (eager: {type(want).__name__})"
    if (got is got_prev) != (want is want_prev):
        kept = "kept" if want is want_prev else "replaced"
        return f"{name}: eager {kept} the .grad object across accumulation, the fake run did not"
    for what in ("dtype", "device", "shape", "layout"):
        if getattr(got, what) != getattr(want, what):
            return f"{name}: grad {what} {getattr(got, what)} (eager {getattr(want, what)})"
    if got.stride() != want.stride():
        return f"{name}: grad strides {got.stride()} (eager {want.stride()})"
    return _value_error(name, "grad", got_values, want_values)


def _value_error(name: str, what: str, got: torch.Tensor, want: torch.Tensor) -> str | None:
    try:
        torch.testing.assert_close(got, want, rtol=1.3e-6, atol=1e-5, check_stride=False)
    except AssertionError as exc:
        first = str(exc).strip().splitlines()
        return f"{name}: {what} values differ from eager: {' '.join(first[:3])}"
    return None


class _Checker:
    def __init__(self, eager: list[Any]) -> None:
        self.eager = eager
        self.index = 0
        self.compared = 0
        self.prev_got: dict[str, Any] = {}
        self.prev_want: dict[str, Any] = {}

    def __call__(self, entry: Any) -> None:
        kind, step, micro, got_map, loss = entry
        _, _, _, want_map, want_loss = self.eager[self.index]
        self.index += 1
        where = f"step {step + 1}" + (f", micro-batch {micro + 1}" if micro is not None else "")
        if kind == "grad":
            real_loss = fakegrad_patch.materialize(loss).detach()
            error = _value_error("loss", "loss", real_loss, want_loss.detach())
            if error:
                raise Mismatch(f"{where}: {error}")
        for name, want in want_map.items():
            got = got_map[name]
            if kind == "grad":
                error = _grad_error(
                    name, got, want, self.prev_got.get(name), self.prev_want.get(name)
                )
            elif isinstance(got[0], FakeTensor):
                error = f"{name}: the parameter is a FakeTensor after the optimizer step"
            else:
                error = _value_error(name, "parameter", got[1], want[1])
            self.compared += 1
            if error:
                raise Mismatch(f"{where}: {error}")
        if kind == "grad":
            self.prev_got = {n: g for n, (g, _) in got_map.items()}
            self.prev_want = {n: g for n, (g, _) in want_map.items()}
        else:
            self.prev_got, self.prev_want = {}, {}


def independent_comparison(built: Built) -> Timing:
    """Train eager and fake copies; raise :class:`Mismatch` at the first difference."""
    eager_model = copy.deepcopy(built.model)
    fake_model = copy.deepcopy(built.model)
    eager: list[Any] = []
    with torch.random.fork_rng():
        torch.manual_seed(1)
        eager_s = _train(built, eager_model, False, eager.append)
    checker = _Checker(eager)
    with torch.random.fork_rng():
        torch.manual_seed(1)
        fake_s = _train(built, fake_model, True, checker)
    if checker.index != len(eager):
        raise Mismatch(f"the fake run made {checker.index} records, eager {len(eager)}")
    return Timing(eager_s, fake_s, checker.compared)
