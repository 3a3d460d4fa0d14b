"""Writing the real gradient: P4 (set path, zero copies) and P5 (accumulate path, 64 MiB grads).

P4 times a propagated fake forward+backward of two 2048x2048 Linear layers (16 MiB weights) with
no prior grads, so every materialization takes the set path; before timing, one traced run
collects the ``fake_grad_set`` events and stores in ``extra_info`` how many were zero-copy and how
many bytes were copied (goal: 0 bytes when layout, device and dtype match). The assertion test
of that property lives in tests/; here it is reported next to the timing.

P5 isolates the accumulate path: the materializer's entry point, called directly on a leaf whose
``.grad`` is a real 64 MiB tensor, with a FakeTensor whose ``real_tensor`` holds the new values,
against a plain ``prior.add_(real)`` of the same bytes (goal: ratio <= 1.10). Both run under
``torch.no_grad()``, as AccumulateGrad does without ``create_graph``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import fakegrad_patch
from benchmarks import _support

P5_NUMEL = 16 * 1024 * 1024  # float32: 64 MiB per tensor, four of them alive


def _set_events(run: Any) -> list[dict[str, Any]]:
    """The ``fake_grad_*`` events of one call of ``run`` (trace at info, restored after)."""
    from fakegrad_patch import trace

    if hasattr(trace, "capture"):
        with trace.capture("info") as events:
            run()
        return [e for e in events if str(e.get("event", "")).startswith("fake_grad_")]
    previous = trace.set_level("info")
    trace.clear()
    try:
        run()
        return [e for e in trace.events() if str(e.get("event", "")).startswith("fake_grad_")]
    finally:
        trace.set_level(previous)


@pytest.mark.paired("unpatched", "patched")
def test_p4_set_path_zero_copy(benchmark, device: str, slot: _support.Slot) -> None:

    def build() -> tuple[torch.nn.Module, torch.Tensor]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(2048, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 2048)
        ).to(device)
        return model, torch.randn(32, 2048, device=device)

    model, x = _support.cached(("P4", device), build)
    patched = slot.variant == "patched"
    _support.use_patch(patched)

    def fake_step() -> None:
        with _support.fake_mode(propagate=True):
            model(x).sum().backward()

    extra: dict[str, Any] = {}
    if patched:
        model.zero_grad(set_to_none=True)
        events = _set_events(fake_step)
        assert events and all(e["event"] == "fake_grad_set" for e in events), events
        extra = {
            "set_events": len(events),
            "zero_copy_events": sum(1 for e in events if e.get("zero_copy")),
            "bytes_copied": sum(int(e.get("bytes", 0)) for e in events),
            "grad_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
            "median_duration_us": sorted(e.get("duration_us", 0.0) for e in events)[
                len(events) // 2
            ],
        }

    _support.record(
        benchmark,
        slot,
        case="P4",
        device=device,
        detail="set path 2x Linear(2048) propagate",
        goal="0 bytes copied",
        target=fake_step,
        setup=lambda: model.zero_grad(set_to_none=True),
        rounds=1,
        extra=extra,
    )
    ok = _support.grads_are_real if patched else _support.grads_are_fake
    assert ok(model)


@pytest.mark.paired("add_", "materializer")
def test_p5_accumulate_vs_add(benchmark, device: str, slot: _support.Slot) -> None:
    applied = fakegrad_patch._core.install.current()
    if applied is None or not hasattr(applied, "materializer"):
        pytest.skip("fakegrad_patch._core.install.current().materializer is not available")
    materializer = applied.materializer

    def build() -> tuple[torch.Tensor, Any]:
        gen = torch.Generator().manual_seed(3)
        leaf = torch.nn.Parameter(torch.zeros(P5_NUMEL, device=device))
        leaf.grad = torch.randn(P5_NUMEL, generator=gen).to(device)
        mode = _support.fake_mode(propagate=True)
        return leaf, mode.from_tensor(torch.randn(P5_NUMEL, generator=gen).to(device))

    leaf, fake_grad = _support.cached(("P5", device), build)
    prior = leaf.grad
    real = fake_grad.real_tensor
    assert real is not None and real.shape == prior.shape

    def plain_add() -> None:
        with torch.no_grad():
            prior.add_(real)

    def materialize() -> Any:
        with torch.no_grad():
            return materializer.on_fake_grad(leaf, fake_grad)

    assert materialize() == (None,)  # it wrote .grad itself; AccumulateGrad would do nothing

    _support.record(
        benchmark,
        slot,
        case="P5",
        device=device,
        detail="accumulate 64 MiB fp32",
        goal=1.10,
        target=materialize if slot.variant == "materializer" else plain_add,
        rounds=4,
        extra={"bytes": P5_NUMEL * 4},
    )
    # The accumulate path keeps the same tensor object in .grad (in place, like AccumulateGrad).
    assert leaf.grad is prior
