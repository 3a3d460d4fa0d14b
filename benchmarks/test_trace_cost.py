"""P7: tracing cost per interception: no sink vs the memory buffer vs a JSONL file.

One round is ``CALLS`` interceptions: the materializer's entry point called directly on a small
leaf that already has a real ``.grad`` (accumulate path, 1 KiB), so the arithmetic is negligible
and the difference between variants is the cost of building and writing one ``fake_grad_*``
event. ``ratios.py`` reports it as microseconds per interception:
``(median(variant) - median(no-sink)) / CALLS``.

* ``no-sink``: the default, level ``warning``; info events are filtered by one int comparison.
* ``memory``: level ``info``, in-memory buffer only.
* ``jsonl``: level ``info`` and a JSONL file sink (``configure_trace(path=...)``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import fakegrad_patch
from benchmarks import _support
from fakegrad_patch import trace

CALLS = 200
NUMEL = 256


def _trace_settings(variant: str, tmp_path: Path) -> dict[str, Any]:
    if variant == "no-sink":
        return {"path": None, "level": "warning"}
    if variant == "memory":
        return {"path": None, "level": "info"}
    return {"path": str(tmp_path / "trace.jsonl"), "level": "info"}


@pytest.mark.paired("no-sink", "memory", "jsonl")
def test_p7_trace_cost(benchmark, device: str, slot: _support.Slot, tmp_path: Path) -> None:
    if not hasattr(trace, "configure_trace"):
        pytest.skip("fakegrad_patch.trace.configure_trace does not exist yet")
    applied = fakegrad_patch._patch.current()
    if applied is None or not hasattr(applied, "materializer"):
        pytest.skip("fakegrad_patch._patch.current().materializer is not available")
    materializer = applied.materializer

    def build() -> tuple[torch.Tensor, Any]:
        leaf = torch.nn.Parameter(torch.zeros(NUMEL, device=device))
        leaf.grad = torch.zeros(NUMEL, device=device)
        return leaf, _support.fake_mode(propagate=True).from_tensor(
            torch.ones(NUMEL, device=device)
        )

    leaf, fake_grad = _support.cached(("P7", device), build)

    def intercept() -> None:
        with torch.no_grad():
            for _ in range(CALLS):
                materializer.on_fake_grad(leaf, fake_grad)

    with _support.trace_config(**_trace_settings(slot.variant, tmp_path)):
        trace.clear()
        _support.record(
            benchmark,
            slot,
            case="P7",
            device=device,
            detail=f"trace cost, {CALLS} interceptions/round",
            goal=None,
            target=intercept,
            rounds=5,
            extra={"interceptions_per_round": CALLS},
        )
        recorded = [e for e in trace.events() if e.get("event") == "fake_grad_accumulate"]
    # Each variant did what it says: nothing recorded without a sink, events otherwise.
    assert bool(recorded) is (slot.variant != "no-sink")
    if slot.variant == "jsonl":
        assert (tmp_path / "trace.jsonl").stat().st_size > 0
    trace.clear()
