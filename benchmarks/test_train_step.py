"""P1: a real training step, patch installed vs not (goal: ratio <= 1.01).

A real step never enters a FakeTensorMode, so the patch's wrapper is never called; what could
still cost something is what an earlier fake session left behind (hooks on AccumulateGrad nodes,
registry entries). ``after_fake`` runs, before the timed rounds, a fake session on the same
parameters (propagation on, forward + backward, graph dropped), in the slot's variant.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

import fakegrad_patch
from benchmarks import _support


def _build(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[Any, ...]:
    return model, x, y, torch.optim.SGD(model.parameters(), lr=0.01)


@pytest.mark.paired("unpatched", "patched")
@pytest.mark.parametrize("history", ["fresh", "after_fake"])
@pytest.mark.parametrize("model_name", sorted(_support.TRAIN_MODELS))
def test_p1_real_train_step(
    benchmark, device: str, model_name: str, history: str, slot: _support.Slot
) -> None:
    build, shape = _support.TRAIN_MODELS[model_name]
    model, x, y, opt = _support.cached(
        ("P1", model_name, history, device),
        lambda: _build(build(device), *_support.batch(shape, device)),
    )
    _support.use_patch(slot.variant == "patched")

    if history == "after_fake":
        opt.zero_grad(set_to_none=True)  # else unpatched torch would keep the real grads
        with _support.fake_mode(propagate=True):
            F.cross_entropy(model(x), y).backward()
        # The graph is gone; the patched run left real grads, the unpatched one fake grads.
        ok = _support.grads_are_real if slot.variant == "patched" else _support.grads_are_fake
        assert ok(model)
    # Hooks still attached to live AccumulateGrad nodes: none once the fake graph is gone.
    extra = {"armed_leaves_before_step": fakegrad_patch.status()["armed_leaves"]}

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()

    _support.record(
        benchmark,
        slot,
        case="P1",
        device=device,
        detail=f"train step {model_name} {history}",
        goal=1.01,
        target=step,
        rounds=4,
        iterations=5,
        extra=extra,
    )
    assert _support.grads_are_real(model)


#: tiny real steps per timed call (issue 28's row: the per-backward cost is all there is to see)
TINY_STEPS = 2000


@pytest.mark.paired("unpatched", "patched", "patched_mode_alive")
def test_p1_tiny_real_steps(benchmark, device: str, slot: _support.Slot) -> None:
    """P1 tiny: 2,000 real steps of a 3-element leaf (``(w * w).sum().backward()``), per timed
    call. ``patched``: installed in a process where no propagating mode lives (earlier cases'
    modes are collected first): ``torch.autograd.backward`` is torch's own function, so the goal
    is no cost at all (<= 1.01). ``patched_mode_alive``: a propagating mode lives during the
    timing, so the backward wrapper is in place: what a real backward pays while it is (no goal;
    the figure behind the choice in docs/how-it-works.md)."""
    import gc

    w = _support.cached(("P1tiny", device), lambda: torch.ones(3, device=device).requires_grad_())
    _support.use_patch(slot.variant != "unpatched")
    keep = None
    gc.collect()  # modes of earlier cases (their fakes hold cycles) die here
    if slot.variant == "patched_mode_alive":
        keep = _support.fake_mode(propagate=True)
    # None: a core without the lazy interception (0.3: always wrapped once installed)
    wrapped = fakegrad_patch.status().get("backward_wrapped")
    if wrapped is not None:
        assert wrapped is (slot.variant == "patched_mode_alive"), fakegrad_patch.status()

    def steps() -> None:
        for _ in range(TINY_STEPS):
            (w * w).sum().backward()
        w.grad = None

    _support.record(
        benchmark,
        slot,
        case="P1",
        device=device,
        detail=f"{TINY_STEPS} tiny real steps",
        goal=1.01 if slot.variant == "patched" else None,
        target=steps,
        rounds=6,
        iterations=1,
        extra={"backward_wrapped": wrapped, "steps": TINY_STEPS},
    )
    del keep
