"""P7: tracing cost per interception: no sink vs the memory buffer vs a JSONL file.

One round is ``CALLS`` interceptions: the materializer's entry point called directly on a small
leaf that already has a real ``.grad`` (accumulate path, 1 KiB), so the arithmetic is negligible
and the difference between variants is the cost of building and writing one ``fake_grad_*``
event. ``ratios.py`` reports it as microseconds per interception:
``(median(variant) - median(no-sink)) / CALLS``.

* ``no-sink``: the default, level ``warning``; info events are filtered by one int comparison.
* ``memory``: level ``info``, in-memory buffer only.
* ``jsonl``: level ``info`` and a JSONL file sink (``configure_trace(path=...)``).

A second group times ``trace.emit`` alone with the keywords of a real ``fake_grad_set`` event
(the tracer's own cost, without describing the leaf). Goals (issue 13), in microseconds per
event over no-sink: memory <= 10, JSONL <= 20, measured on the issue's 2-core machine; they are
in ``extra_info["goal_us_per_event"]`` and the detail text, and the JSON serializer used
(``orjson`` with the ``fast`` extra, else ``json``) in ``extra_info["json_backend"]``.
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
#: variant -> the issue's goal, microseconds per event above no-sink
GOAL_US = {"memory": 10.0, "jsonl": 20.0}
#: The keywords of a real fake_grad_set event (the leaf of a 100-parameter model).
FIELDS: dict[str, Any] = {
    "backward_id": 3,
    "leaf_id": 139840463736416,
    "name": "layers.12.weight",
    "shape": [512, 512],
    "dtype": "float32",
    "device": "cpu",
    "source": "propagated",
    "action": "set",
    "zero_copy": True,
    "bytes": 0,
    "duration_us": 77.3,
}


def _goal(variant: str) -> str | None:
    goal = GOAL_US.get(variant)
    return None if goal is None else f"<= {goal:g} µs/event"


def _extra(variant: str) -> dict[str, Any]:
    return {
        "interceptions_per_round": CALLS,
        "goal_us_per_event": GOAL_US.get(variant),
        "json_backend": getattr(trace, "json_backend", None),
    }


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
    applied = fakegrad_patch._core.install.current()
    if applied is None or not hasattr(applied, "materializer"):
        pytest.skip("fakegrad_patch._core.install.current().materializer is not available")
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
            goal=_goal(slot.variant),
            target=intercept,
            rounds=5,
            extra=_extra(slot.variant),
        )
        recorded = [e for e in trace.events() if e.get("event") == "fake_grad_accumulate"]
    # Each variant did what it says: nothing recorded without a sink, events otherwise.
    assert bool(recorded) is (slot.variant != "no-sink")
    if slot.variant == "jsonl":
        assert (tmp_path / "trace.jsonl").stat().st_size > 0
    trace.clear()


@pytest.mark.paired("no-sink", "memory", "jsonl")
def test_p7_emit_cost(benchmark, device: str, slot: _support.Slot, tmp_path: Path) -> None:
    """``trace.emit`` alone, ``CALLS`` events per round (one per interception above)."""
    if device != "cpu":
        pytest.skip("trace.emit does not touch the device")

    def emit() -> None:
        for _ in range(CALLS):
            trace.emit("fake_grad_set", trace.INFO, **FIELDS)

    with _support.trace_config(**_trace_settings(slot.variant, tmp_path)):
        trace.clear()
        emit()  # the first event builds the logger (and picks the JSON serializer)
        trace.clear()
        _support.record(
            benchmark,
            slot,
            case="P7",
            device=device,
            detail=f"trace.emit only, {CALLS} events/round",
            goal=_goal(slot.variant),
            target=emit,
            rounds=20,
            extra=_extra(slot.variant),
        )
        recorded = [e for e in trace.events() if e.get("event") == "fake_grad_set"]
    assert bool(recorded) is (slot.variant != "no-sink")
    if slot.variant == "jsonl":
        assert (tmp_path / "trace.jsonl").stat().st_size > 0
    trace.clear()
