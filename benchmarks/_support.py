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
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
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

    Whatever the patch does on first need (probing torch for known defects, calibrating) is paid
    here, outside the timed rounds: after ``install()``, one tiny propagated fake forward and
    backward on a throwaway leaf. Public API only (``install``/``uninstall``/``is_installed``),
    so it keeps working while the core is rewritten.
    """
    if on:
        fakegrad_patch.install()
        first_need()
    else:
        fakegrad_patch.uninstall()
    assert fakegrad_patch.is_installed() is on, fakegrad_patch.status()


def first_need() -> None:
    """One propagated fake forward+backward on a throwaway real leaf (untimed)."""
    leaf = torch.nn.Parameter(torch.ones(2))
    with fake_mode(propagate=True):
        (leaf * 2.0).sum().backward()


def applied() -> Any:
    """The patch's current application object, or None (private, for the micro cases P5/P7
    only; every other case uses the public API). None too when the core no longer has it."""
    module = getattr(getattr(fakegrad_patch, "_core", None), "install", None)
    current = getattr(module, "current", None)
    try:
        return current() if callable(current) else None
    except Exception:
        return None


def defects() -> Any:
    """What the patch detected about this torch (``status()["defects"]``), for the JSON."""
    try:
        return fakegrad_patch.status().get("defects")
    except Exception as exc:  # a rewritten core may report differently
        return f"unavailable ({type(exc).__name__})"


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


def seeded_input(device: str, *shape: int) -> torch.Tensor:
    """A random input of ``shape``, the same in every process (its own generator, seed 1)."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(1)).to(device)


def mlp(
    device: str, depth: int, width: int, batch: int, activation: type[torch.nn.Module]
) -> tuple[torch.nn.Sequential, torch.Tensor]:
    """``depth`` Linear(width)/``activation`` pairs and an input of ``batch`` rows, the same in
    every process (seeded)."""
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), activation()]
    return torch.nn.Sequential(*layers).to(device), seeded_input(device, batch, width)


def zoo_case(name: str, device: str) -> tuple[torch.nn.Module, tuple[Any, ...], Callable[..., Any]]:
    """tests/_zoo.py's model ``name``: (model, inputs, loss), the loss the mean square of the
    output where the zoo names none."""
    tests = str(Path(__file__).resolve().parent.parent / "tests")
    if tests not in sys.path:
        sys.path.insert(0, tests)
    import _zoo

    case = _zoo.ZOO[name](device)
    loss_fn = case.get("loss_fn") or (lambda out: out.square().mean())
    return case["model"], tuple(case["inputs"]), loss_fn


def batch(shape: tuple[int, ...], device: str, classes: int = 10) -> tuple[torch.Tensor, ...]:
    """A fixed random batch (inputs, integer targets)."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(shape, generator=gen).to(device)
    y = torch.randint(0, classes, (shape[0],), generator=gen).to(device)
    return x, y


# -- recording ----------------------------------------------------------------------------------

#: Multiplier for every case's rounds (``--bench-scale``; set by conftest.py).
SCALE = 1.0
#: ``--bench-smoke`` (set by conftest.py): the CI smoke run.
SMOKE = False
#: ``--bench-round-budget`` seconds (set by conftest.py).
ROUND_BUDGET_S = 150.0


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
    and tensors are shared by every slot of the case (:func:`cached`). Under ``--bench-smoke``:
    one round, no warm-up.
    """
    if warmup_rounds is None:
        warmup_rounds = 1 if slot.block == 0 else 0
    if SMOKE:  # one round, no warm-up: the smoke run checks that the case runs, not its speed
        rounds, warmup_rounds = 1, 0
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
        rounds=rounds if SMOKE else max(1, round(rounds * SCALE)),
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


# -- many small leaves --------------------------------------------------------------------------


class ManyLeaves(torch.nn.Module):
    """``n`` real leaf Parameters of ``numel`` elements each, all fed to one ``torch.stack``.

    The cheapest graph that reaches ``n`` leaves: one forward op over all of them (plus the
    reduction), one backward node that sends each leaf its own gradient (``unbind``), then ``n``
    AccumulateGrad nodes. So per-leaf costs (conversion, arming, the write of each gradient)
    are as large a share of the step as they can be, which is what the per-leaf cases measure.
    """

    def __init__(self, n: int, numel: int = 4, device: str = "cpu") -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(4)
        self.leaves = torch.nn.ParameterList(
            torch.nn.Parameter(torch.randn(numel, generator=gen).to(device)) for _ in range(n)
        )

    def forward(self) -> torch.Tensor:
        return torch.stack(list(self.leaves)).square().sum()


def fake_step(model: torch.nn.Module, *args: Any, propagate: bool = True) -> Callable[[], None]:
    """A fresh fake mode per call, forward and ``.sum().backward()`` inside it (the tool
    pattern every fake case uses)."""

    def run() -> None:
        with fake_mode(propagate=propagate):
            model(*args).sum().backward()

    return run


def grad_events(run: Callable[[], Any], level: str = "info") -> list[dict[str, Any]]:
    """The trace events of one call of ``run`` (``trace.capture(level)``: the buffer, the sink
    and their levels are left as they are). Empty when the trace module has no ``capture``."""
    from fakegrad_patch import trace

    capture = getattr(trace, "capture", None)
    if capture is None:
        run()
        return []
    with capture(level) as events:
        run()
    return list(events)


def hook_durations_us(events: list[dict[str, Any]], action: str = "set") -> list[float]:
    """``duration_us`` of the ``fake_grad_<action>`` events: the time spent in the hook that
    wrote the leaf's gradient, as the materializer measures it (empty if it does not)."""
    return [
        float(e["duration_us"])
        for e in events
        if e.get("event") == f"fake_grad_{action}" and isinstance(e.get("duration_us"), int | float)
    ]


def median(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


# -- skipped cases, kept for the ratio table ----------------------------------------------------

#: Cases skipped for a reason the table should show (over the time budget, ...): appended by the
#: cases, written to the JSON by conftest.py (``fakegrad_patch.skipped``), printed by ratios.py.
SKIPPED: list[dict[str, Any]] = []


def skip_case(case: str, detail: str, device: str, reason: str) -> None:
    """Skip this slot and remember why (once per case) for the ratio table."""
    entry = {"case": case, "device": device, "detail": detail, "reason": reason}
    if entry not in SKIPPED:
        SKIPPED.append(entry)
    import pytest

    pytest.skip(reason)
