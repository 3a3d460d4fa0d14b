"""P16: what the torch.profiler ranges (issue 27.3) cost when no profiler records.

A propagated fake forward+backward of a 100-leaf model (:class:`_support.ManyLeaves`), patch
installed, with the ranges feature on (the default: one ``torch.autograd._profiler_enabled()``
check per armed backward and per fake gradient) and off
(``_core.accumulate.profiling.set_enabled(False)``: not even the check). Goal: the ratio
within noise (<= 1.01). Private API (``fakegrad_patch._core.accumulate.profiling``), like the
micro cases P5/P7.
"""

from __future__ import annotations

import pytest

from benchmarks import _support
from fakegrad_patch._core.accumulate import profiling

LEAVES = 100


@pytest.mark.paired("ranges-off", "ranges-on")
def test_p16_profiler_ranges_unprofiled(benchmark, device: str, slot: _support.Slot) -> None:
    if not profiling.available():
        pytest.skip("this torch lacks the profiler touch points (no ranges to measure)")
    model = _support.cached(("P16", device), lambda: _support.ManyLeaves(LEAVES, 4, device))
    _support.use_patch(True)
    step = _support.fake_step(model)

    def fresh() -> None:
        model.zero_grad(set_to_none=True)

    previous = profiling.set_enabled(slot.variant == "ranges-on")
    try:
        assert not profiling.recording()  # no profiler runs: the feature's idle cost only
        _support.record(
            benchmark,
            slot,
            case="P16",
            device=device,
            detail=f"profiler ranges, no profiler, fwd+bwd {LEAVES} leaves propagate",
            goal=None if slot.variant == "ranges-off" else 1.01,
            target=step,
            setup=fresh,
            rounds=1 if _support.SMOKE else 5,
        )
    finally:
        profiling.set_enabled(previous)
    assert _support.grads_are_real(model)
