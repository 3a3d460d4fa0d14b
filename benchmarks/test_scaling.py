"""P14: cost at any model size (issue 19, item 2): the patched / unpatched ratio of a propagated
fake training step (forward+backward) of :class:`_support.ManyLeaves` with 1 K, 10 K and 50 K
real parameter tensors of 4 elements each. Goal: flat, <= 1.05 at every size.

Every registry the patch keeps should cost O(1) amortized per operation; one that does work
proportional to its size on every conversion makes the ratio grow with N (issue 19 measured
1.0 at 5 K, 1.27 at 10 K, 1.96 at 20 K).

Bounded: the larger sizes run 2 blocks (``max_blocks``) and no warm-up round (the smallest size
warmed everything up). Before each size, its round time is estimated from the rounds of the two
next smaller sizes already measured (growth exponent from their ratio, at least linear, and
taken as quadratic once it is above 1.15); when the estimate for either variant is over
``--bench-round-budget`` seconds (default 150), the size is skipped, with the estimate, in the
pytest summary and below the ratio table. Memory: 50 K tensors
of 16 bytes plus their fakes and autograd nodes, a few hundred MiB.
"""

from __future__ import annotations

import math
import time
from typing import Any

import pytest

from benchmarks import _support

SIZES = [1000, 10000, 50000]
SMOKE_SIZES = [200]
#: variant -> {size: seconds per round measured so far}, per device
_seconds: dict[tuple[str, str], dict[int, list[float]]] = {}
_decided: dict[tuple[str, int], str | None] = {}


def estimate(times: dict[int, list[float]], size: int) -> float | None:
    """Seconds per round at ``size`` from the medians at the two largest smaller sizes."""
    known = sorted((n, _support.median(t)) for n, t in times.items() if n < size and t)
    if not known:
        return None
    n1, t1 = known[-1]
    assert t1 is not None
    exponent = 1.0
    if len(known) >= 2:
        n0, t0 = known[-2]
        if t0:
            measured = math.log(t1 / t0) / math.log(n1 / n0)
            # Superlinear growth is taken as quadratic: a registry rebuilt per call grows as
            # N^2 only past its threshold, so the measured exponent underestimates what follows.
            exponent = 2.0 if measured > 1.15 else max(1.0, measured)
    return t1 * (size / n1) ** exponent


def _over_budget(device: str, size: int, variants: tuple[str, ...]) -> str | None:
    key = (device, size)
    if key not in _decided:
        reason = None
        for variant in variants:
            guess = estimate(_seconds.get((device, variant), {}), size)
            if guess is not None and guess > _support.ROUND_BUDGET_S:
                reason = (
                    f"{size} tensors: a {variant} round is estimated at {guess:.0f} s from the "
                    f"smaller sizes, over --bench-round-budget={_support.ROUND_BUDGET_S:g} s"
                )
                break
        _decided[key] = reason
    return _decided[key]


@pytest.mark.paired("unpatched", "patched", max_blocks={10000: 2, 50000: 2})
@pytest.mark.sizes(SIZES, SMOKE_SIZES)
def test_p14_scaling(benchmark, device: str, size: int, slot: _support.Slot) -> None:
    detail = f"fake fwd+bwd propagate, {size} param tensors"
    reason = _over_budget(device, size, slot.variants)
    if reason is not None:
        _support.skip_case("P14", detail, device, reason)
    smallest = size == min(SMOKE_SIZES if _support.SMOKE else SIZES)
    model = _support.cached(("P14", size, device), lambda: _support.ManyLeaves(size, 4, device))
    patched = slot.variant == "patched"
    _support.use_patch(patched)
    step = _support.fake_step(model)
    seen = _seconds.setdefault((device, slot.variant), {}).setdefault(size, [])

    def timed() -> Any:
        start = time.perf_counter()
        step()
        seen.append(time.perf_counter() - start)

    _support.record(
        benchmark,
        slot,
        case="P14",
        device=device,
        detail=detail,
        goal=1.05,
        target=timed,
        setup=lambda: model.zero_grad(set_to_none=True),
        rounds=1,
        warmup_rounds=1 if smallest and slot.block == 0 else 0,
        extra={"param_tensors": size},
    )
    ok = _support.grads_are_real if patched else _support.grads_are_fake
    assert ok(model)
