"""Shared pieces of the benchmark suite: models, fake modes, switching the patch, recording.

How a ratio is measured (docs/performance.md, "Method"): every case is a *paired* benchmark.
``conftest.py`` parametrizes each case with ``slot`` = (block, variant) and orders the items so
that one case's blocks run back to back, the variants alternating inside each block and the
order reversed on every other block (A B, B A, A B, ...). Each item is one pytest-benchmark
benchmark (its own rounds, timed by pytest-benchmark); :func:`record` files it under one group
per case and writes the case, variant and block into ``extra_info``. ``benchmarks/ratios.py``
pools the rounds of each variant over the blocks of one run and divides the medians. So both
sides of a ratio come from the same process, measured minutes (usually seconds) apart, and slow
drift of a noisy machine hits both sides alike.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch._functorch.config as functorch_config
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

import fakegrad_patch


@dataclass(frozen=True)
class Slot:
    """One item of a paired case: block ``block``, measuring ``variant``.

    ``variants[0]`` of the case is its baseline (the denominator of the ratio).
    """

    block: int
    variant: str
    variants: tuple[str, ...]
    order: int  # position of this slot in the case's run order

    @property
    def baseline(self) -> str:
        return self.variants[0]

    @property
    def id(self) -> str:
        return f"b{self.block}-{self.variant}"


def slots(variants: tuple[str, ...], blocks: int) -> list[Slot]:
    """The slots of one case in run order: variants alternate, reversed on odd blocks."""
    out: list[Slot] = []
    for block in range(blocks):
        order = variants if block % 2 == 0 else tuple(reversed(variants))
        out.extend(Slot(block, v, variants, len(out) + i) for i, v in enumerate(order))
    return out


# -- switching the patch ------------------------------------------------------------------------


def use_patch(on: bool) -> None:
    """Install or uninstall the patch (both idempotent) and check that it took effect, so a
    benchmark can never silently time the wrong variant.

    A fresh installation probes torch for known defects on first use; that one-off cost of
    ``install()`` is paid here, outside the timed rounds.
    """
    if on:
        fakegrad_patch.install()
        applied = fakegrad_patch._patch.current()
        probes = getattr(applied, "probes", None)
        if probes is not None and hasattr(probes, "detected"):
            probes.detected()
    else:
        fakegrad_patch.uninstall()
    assert fakegrad_patch.is_installed() is on, fakegrad_patch.status()


_cache: dict[tuple[Any, ...], Any] = {}


def cached(key: tuple[Any, ...], build: Callable[[], Any]) -> Any:
    """One object per ``key`` for the whole module: both variants of a case use the same
    model and tensors (same memory, warm caches), built once."""
    if key not in _cache:
        _cache[key] = build()
    return _cache[key]


def clear_cache() -> None:
    _cache.clear()


# -- devices and fake modes ---------------------------------------------------------------------


def synced(target: Callable[[], Any], device: str) -> Callable[[], Any]:
    """``target`` followed by a device synchronisation on CUDA (kernels are asynchronous)."""
    if device != "cuda":
        return target

    def run() -> None:
        target()
        torch.cuda.synchronize()

    return run


def fake_mode(*, propagate: bool) -> FakeTensorMode:
    """``FakeTensorMode(allow_non_fake_inputs=True)``, with real-value propagation when asked.

    The flag is read when the mode is built (and per thread on 2.13), so it is patched around
    the constructor only, and the mode itself is checked.
    """
    with functorch_config.patch(fake_tensor_propagate_real_tensors=propagate):
        mode = FakeTensorMode(allow_non_fake_inputs=True)
    assert mode.propagate_real_tensors is propagate
    return mode


def grads_are_real(model: torch.nn.Module) -> bool:
    """True when every parameter holds a real (non-fake) ``.grad``."""
    return all(
        p.grad is not None and not isinstance(p.grad, FakeTensor) for p in model.parameters()
    )


def grads_are_fake(model: torch.nn.Module) -> bool:
    """True when every parameter holds a FakeTensor ``.grad`` (the unpatched outcome)."""
    return all(isinstance(p.grad, FakeTensor) for p in model.parameters())


# -- models -------------------------------------------------------------------------------------


def deep_mlp(device: str, *, layers: int = 25, width: int = 32) -> torch.nn.Sequential:
    """``layers`` Linear+ReLU blocks: ``2 * layers`` parameter tensors (50 by default), small
    enough that per-op dispatch cost, not arithmetic, dominates: the worst case for overhead."""
    torch.manual_seed(0)
    mods: list[torch.nn.Module] = []
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*mods).to(device)


def train_mlp(device: str) -> torch.nn.Sequential:
    """A small MLP classifier for the real training step."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(256, 512),
        torch.nn.ReLU(),
        torch.nn.Linear(512, 512),
        torch.nn.ReLU(),
        torch.nn.Linear(512, 10),
    ).to(device)


def small_convnet(device: str) -> torch.nn.Sequential:
    """A small conv net (two convs, pooling, a classifier) for the real training step."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.Conv2d(16, 32, 3, stride=2, padding=1),
        torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(32, 10),
    ).to(device)


#: name -> (builder, input shape, number of classes)
TRAIN_MODELS: dict[str, tuple[Callable[[str], torch.nn.Module], tuple[int, ...]]] = {
    "mlp": (train_mlp, (64, 256)),
    "convnet": (small_convnet, (16, 3, 32, 32)),
}


def batch(shape: tuple[int, ...], device: str, classes: int = 10) -> tuple[torch.Tensor, ...]:
    """A fixed random batch (inputs, integer targets)."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(shape, generator=gen).to(device)
    y = torch.randint(0, classes, (shape[0],), generator=gen).to(device)
    return x, y


# -- recording ----------------------------------------------------------------------------------

#: Multiplier for every case's rounds (``--bench-scale``; set by conftest.py).
SCALE = 1.0


def record(
    benchmark: Any,
    slot: Slot,
    *,
    case: str,
    device: str,
    detail: str,
    goal: float | str | None,
    target: Callable[[], Any],
    rounds: int,
    iterations: int = 1,
    setup: Callable[[], Any] | None = None,
    warmup_rounds: int | None = None,
    extra: dict[str, Any] | None = None,
) -> None:
    """Time ``target`` for one slot with pytest-benchmark and label it for ``ratios.py``.

    ``rounds`` is scaled by ``--bench-scale`` (at least 1). ``goal`` is the ratio the issue
    asks for (variant/baseline), a text goal, or None when there is none. Warm-up: one round in
    block 0 (first touch: lazy imports, torch's dispatch caches), none after, since the model
    and tensors are shared by every slot of the case (:func:`cached`).
    """
    if warmup_rounds is None:
        warmup_rounds = 1 if slot.block == 0 else 0
    benchmark.group = f"{case} {device} {detail}"
    benchmark.extra_info.update(
        {
            "case": case,
            "device": device,
            "detail": detail,
            "variant": slot.variant,
            "baseline": slot.baseline,
            "variants": list(slot.variants),
            "block": slot.block,
            "goal": goal,
            "torch": torch.__version__,
            **(extra or {}),
        }
    )
    benchmark.pedantic(
        synced(target, device),
        setup=setup,
        rounds=max(1, round(rounds * SCALE)),
        iterations=iterations,
        warmup_rounds=warmup_rounds,
    )


@contextlib.contextmanager
def trace_config(**kwargs: Any) -> Iterator[None]:
    """``fakegrad_patch.trace.configure_trace(**kwargs)`` for the block, restored on exit."""
    from fakegrad_patch import trace

    previous = trace.configure_trace(**kwargs)
    try:
        yield
    finally:
        trace.restore(previous)
