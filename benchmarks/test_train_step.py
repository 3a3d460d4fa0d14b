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
