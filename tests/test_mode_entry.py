"""Issue 46: ``prim.device`` is answered at the entry of a propagating user mode.

Autograd and the dispatcher ask a fake's device (``prim.device``) about 1.5 times per aten op of
a propagating step; each question went through ``FakeTensorMode.__torch_dispatch__`` (behind
``torch._disable_dynamo`` and a call counter), then ``dispatch``, to upstream's own handler. The
patch's wrapper of the entry calls that handler at once, in propagating user modes only. The
family: programs whose ops ask devices (mixed real/fake arguments, a 0-d CPU tensor, ``cat``,
``to``, ``new_*``, indexing, backward) give what they gave, against eager; a tracer's mode (a
ShapeEnv), a plain mode and a fake of another mode keep upstream's way; the counter upstream
keeps says how many questions no longer enter.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from _helpers import fake_mode
from torch.utils import _stats

from fakegrad_patch._core import state

pytestmark = pytest.mark.usefixtures("propagate", "quiet")

LABEL = "FakeTensorMode.__torch_dispatch__"


def _entries() -> int:
    return _stats.simple_call_counter.get(LABEL, 0)


class _EntryAnswers:
    """``with _EntryAnswers(False):`` the patch's answer at the entry turned off (upstream's
    way, the wrapper still in place)."""

    def __init__(self, on: bool) -> None:
        self._on = on

    def __enter__(self) -> None:
        dispatcher = state.current().dispatch
        self._saved = dispatcher._device
        if not self._on:
            dispatcher._device = None

    def __exit__(self, *exc: object) -> None:
        state.current().dispatch._device = self._saved


#: programs on (x, p): x made inside the mode (a fake), p a real parameter
PROGRAMS: dict[str, Callable[[Any, Any], Any]] = {
    "linear + backward": lambda x, p: (x @ p).relu().sum(),
    "a 0-d CPU tensor": lambda x, p: (x * torch.tensor(2.0) + p.sum()).sum(),
    "cat and to": lambda x, p: torch.cat([x, p.t()]).to("cpu", torch.float64).sum(),
    "new_zeros and where": lambda x, p: torch.where(x > 0, x, x.new_zeros(())).sum() + p.sum(),
    "index with a tensor": lambda x, p: (p[torch.tensor([0, 2])] * x[:2, :2].sum()).sum(),
}


def _run(program: Callable[[Any, Any], Any], fake: bool) -> tuple[Any, Any, Any, int]:
    """(loss, p's gradient, x's gradient, entries of the mode) of ``program`` on a real
    parameter and an input that requires grad (autograd asks devices of what it saves and
    receives)."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(3, 3))
    if not fake:
        x = torch.randn(3, 3, generator=torch.Generator().manual_seed(1), requires_grad=True)
        loss = program(x, p)
        loss.backward()
        return loss.detach(), p.grad, x.grad, 0
    mode = fake_mode()
    before = _entries()
    with mode:
        x = torch.randn(3, 3, generator=torch.Generator().manual_seed(1), requires_grad=True)
        loss = program(x, p)
        loss.backward()
    return loss.real_tensor, p.grad, x.grad.real_tensor, _entries() - before


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_device_questions_no_longer_enter_and_answers_are_the_same(name: str) -> None:
    program = PROGRAMS[name]
    expected = _run(program, fake=False)[:3]
    _run(program, fake=True)  # first-call effects out of the count
    with _EntryAnswers(False):
        *upstream, entries_u = _run(program, fake=True)
    *patched, entries = _run(program, fake=True)
    for got in (patched, upstream):
        for value, want in zip(got, expected, strict=True):
            torch.testing.assert_close(value, want)
    assert type(patched[1]) is torch.Tensor
    assert entries < entries_u  # the device questions answered before the entry


def _tracer_entries(make_mode: Callable[[], Any], on: bool) -> tuple[int, Any]:
    user = fake_mode()  # a propagating user mode lives: the wrappers are in place
    with user:
        torch.nn.Parameter(torch.ones(2)) * 2
    with _EntryAnswers(on):
        mode = make_mode()
        before = _entries()
        with mode:
            x = torch.randn(4, 3)
            y = (x @ torch.randn(3, 2)).relu().sum()
        return _entries() - before, y.device


@pytest.mark.parametrize("kind", ["tracer (ShapeEnv)", "plain"])
def test_other_modes_keep_upstreams_entry(kind: str) -> None:
    """A tracer's mode (a ShapeEnv) and a mode without real values enter for every question,
    with or without the patch's answer on."""
    from torch._functorch import config
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    def make() -> Any:
        if kind == "plain":
            with config.patch(fake_tensor_propagate_real_tensors=False):
                return FakeTensorMode(allow_non_fake_inputs=True)
        return FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=True)

    _tracer_entries(make, True)  # first-call effects (caches) out of the count
    on, device_on = _tracer_entries(make, True)
    off, device_off = _tracer_entries(make, False)
    assert on == off
    assert device_on == device_off == torch.device("cpu")


def test_a_fake_of_another_mode_is_answered_by_its_own_mode() -> None:
    """Upstream's handler reads the fake's own mode (inside that mode's kernel invocation a fake
    is on ``meta``); the patch calls the same handler, so a fake of another mode is answered as
    upstream answers it."""
    other = fake_mode()
    with other:
        a = torch.randn(2)
    mode = fake_mode()
    with mode:
        b = torch.randn(2)
        assert torch.ops.prim.device.default(a) == torch.device("cpu")
        assert torch.ops.prim.device.default(b) == torch.device("cpu")
