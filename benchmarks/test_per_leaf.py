"""Per-leaf costs (issue 17): P11, arming cost per real leaf per fake backward; P12, the set
path's time in the hook per leaf, 1 KiB and 16 MiB gradients.

* **P11.** Propagated fake forward+backward of :class:`_support.ManyLeaves` (``N`` real leaves of
  4 elements, one ``stack`` over all of them: per-leaf work is as large a share as it can be),
  N = 100 and 1000, patched vs unpatched; ``ratios.py`` reports ``(patched - unpatched) / N`` in
  microseconds per leaf (goal <= 3 us). That difference is *everything* the patch adds per leaf
  (arming, the hook that writes the real gradient) minus what it saves (upstream's fake
  AccumulateGrad, which it replaces), so the note also gives the hook's own median time per leaf
  (``duration_us`` of the ``fake_grad_set`` events of an untimed traced run). A second row times
  the fake *forward* alone: where the 0.2 core arms (at conversion, in dispatch), so its
  ``(patched - unpatched) / N`` is today's arming cost; a core that arms in the backward
  shows ~0 there and its arming in the first row.
* **P12.** Propagated fake forward+backward of K leaves, each ``(leaf * 2).sum()`` (a fresh,
  exclusive gradient per leaf: the zero-copy set path), 64 leaves of 1 KiB and 4 of 16 MiB; the
  note and ``met?`` use the hook's median ``duration_us`` over the leaves of untimed traced runs
  (goal <= 10 us, independent of size); the timed ratio is the whole step.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import fakegrad_patch
from benchmarks import _support

#: issue 17's goals, microseconds per leaf
ARMING_GOAL_US = 3.0
HOOK_GOAL_US = 10.0


def _hook_info(run: Any, model: torch.nn.Module, repeats: int) -> dict[str, Any]:
    """Untimed traced runs (patched): the hook's median time per leaf and the set events."""
    durations: list[float] = []
    events: list[dict[str, Any]] = []
    for _ in range(repeats):
        model.zero_grad(set_to_none=True)
        got = _support.grad_events(run)
        events += [e for e in got if str(e.get("event", "")).startswith("fake_grad_")]
        durations += _support.hook_durations_us(got, "set")
    model.zero_grad(set_to_none=True)
    return {
        "hook_us_median": _support.median(durations),
        "hook_samples": len(durations),
        "set_events": sum(1 for e in events if e.get("event") == "fake_grad_set"),
        "zero_copy_events": sum(1 for e in events if e.get("zero_copy")),
        "bytes_copied": sum(int(e.get("bytes", 0) or 0) for e in events),
    }


@pytest.mark.paired("unpatched", "patched", max_blocks={1000: 6})
@pytest.mark.sizes([100, 1000], [100])
@pytest.mark.parametrize("phase", ["fwd+bwd", "fwd"])
def test_p11_arming_per_leaf(
    benchmark, device: str, size: int, phase: str, slot: _support.Slot
) -> None:
    model = _support.cached(("P11", size, device), lambda: _support.ManyLeaves(size, 4, device))
    patched = slot.variant == "patched"
    _support.use_patch(patched)
    step = _support.fake_step(model)

    def forward() -> None:
        with _support.fake_mode(propagate=True):
            model().sum()

    extra: dict[str, Any] = {"leaves": size, "goal_us_per_leaf": ARMING_GOAL_US}
    if patched and phase == "fwd+bwd":
        extra.update(_hook_info(step, model, repeats=1))
    _support.record(
        benchmark,
        slot,
        case="P11",
        device=device,
        detail=f"{phase} {size} leaves propagate, per leaf",
        goal=f"≤ {ARMING_GOAL_US:g} µs/leaf",
        target=step if phase == "fwd+bwd" else forward,
        setup=lambda: model.zero_grad(set_to_none=True),
        rounds=3 if size <= 100 else 1,
        extra=extra,
    )
    if phase == "fwd+bwd":
        ok = _support.grads_are_real if patched else _support.grads_are_fake
        assert ok(model)
    assert fakegrad_patch.is_installed() is patched


class _Separate(torch.nn.Module):
    """K leaves of ``numel`` float32 elements, each used once as ``(leaf * 2).sum()``."""

    def __init__(self, k: int, numel: int, device: str) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(6)
        self.leaves = torch.nn.ParameterList(
            torch.nn.Parameter(torch.randn(numel, generator=gen).to(device)) for _ in range(k)
        )

    def forward(self) -> torch.Tensor:
        return torch.stack([(p * 2.0).sum() for p in self.leaves]).sum()


#: label -> (leaves, elements per leaf): 1 KiB and 16 MiB float32 gradients
HOOK_SIZES = {"1KiB": (64, 256), "16MiB": (4, 4 * 2**20)}


@pytest.mark.paired("unpatched", "patched", max_blocks=6)
@pytest.mark.parametrize("grad_size", list(HOOK_SIZES))
def test_p12_set_path_hook_time(
    benchmark, device: str, grad_size: str, slot: _support.Slot
) -> None:
    k, numel = HOOK_SIZES[grad_size]
    model = _support.cached(("P12", grad_size, device), lambda: _Separate(k, numel, device))
    patched = slot.variant == "patched"
    _support.use_patch(patched)
    step = _support.fake_step(model)
    extra: dict[str, Any] = {"leaves": k, "grad_bytes": numel * 4, "goal_us": HOOK_GOAL_US}
    if patched:
        extra.update(_hook_info(step, model, repeats=1 if _support.SMOKE else 3))
        if extra["hook_samples"] == 0:
            extra["hook_note"] = "no fake_grad_set event with duration_us in the trace"
    _support.record(
        benchmark,
        slot,
        case="P12",
        device=device,
        detail=f"set path, {k} leaves x {grad_size} grads propagate",
        goal=f"≤ {HOOK_GOAL_US:g} µs/leaf in the hook",
        target=step,
        setup=lambda: model.zero_grad(set_to_none=True),
        rounds=2,
        extra=extra,
    )
    ok = _support.grads_are_real if patched else _support.grads_are_fake
    assert ok(model)
