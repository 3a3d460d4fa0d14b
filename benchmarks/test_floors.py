"""P19, P20 (issue 46): a propagating step against the floors it cannot go below.

A propagating step runs exactly eager's kernels; what it costs beyond them is bookkeeping per
aten op (FakeTensorMode's and the patch's). Two floors, one process, interleaved blocks:

* **P19, against eager**, per model: ``eager`` (the baseline: forward, backward), ``patched`` (one
  propagating fake step with the patch's defaults: the shapes and eager's gradients) and
  ``two-pass`` (the seed's workaround as a user runs it: a plain fake forward for the shapes, then
  an eager step). The models: a tiny MLP (10 x Linear(64)+ReLU, batch 8: per-op cost is the
  whole step), three large ones (6 x Linear(1024)+GELU batch 256; a conv net with BatchNorm,
  64x64, batch 16; a 2-layer TransformerEncoder d=512, sequence 128, batch 8: goal
  ``patched / eager <= 1.10``) and the zoo's models (tests/_zoo.py). ``ratios.py`` adds the
  extra cost per aten op, ``(variant - eager) / ops``, and ``patched / two-pass``.
* **P20, against a pass-through mode**, on tiny kernels (the tiny MLP): ``pass-through`` (the
  baseline: a ``TorchDispatchMode`` that only calls the op, the floor of any Python-level mode),
  ``patched``, ``eager`` and ``plain fake`` (a FakeTensorMode without propagation, the patch
  installed: upstream's own cost). Goal ``patched / pass-through <= 3``; ``ratios.py`` gives
  each variant's cost per op.

The number of aten ops per step is counted once per model (a counting ``TorchDispatchMode``
around an eager step, untimed) and saved in the JSON (``aten_ops``). A new FakeTensorMode per
step, as a tool that runs one fake session per call does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks import _floor, _support

Case = tuple[nn.Module, tuple[Any, ...], Callable[[Any], torch.Tensor]]


class PassThrough(TorchDispatchMode):
    """The least a Python dispatch mode can do: call the op."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return func(*args, **(kwargs or {}))


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops += 1
        return func(*args, **(kwargs or {}))


def aten_ops(model: nn.Module, inputs: tuple[Any, ...], loss_fn: Callable[[Any], Any]) -> int:
    """The aten ops one eager step (forward, loss, backward) dispatches."""
    counter = _Count()
    with counter:
        loss_fn(model(*inputs)).backward()
    model.zero_grad(set_to_none=True)
    return counter.ops


def tiny_mlp(device: str) -> Case:
    model, x = _support.mlp(device, 10, 64, 8, nn.ReLU)
    return model, (x,), lambda out: out.square().mean()


def large_mlp(device: str) -> Case:
    model, x = _support.mlp(device, 6, 1024, 256, nn.GELU)
    return model, (x,), lambda out: out.square().mean()


def convnet_bn(device: str) -> Case:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.Conv2d(32, 64, 3, stride=2, padding=1),
        nn.BatchNorm2d(64),
        nn.ReLU(),
        nn.Conv2d(64, 64, 3, padding=1),
        nn.BatchNorm2d(64),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(64, 10),
    ).to(device)
    x, y = _support.batch((16, 3, 64, 64), device)
    return model, (x,), lambda out: F.cross_entropy(out, y)


def transformer(device: str) -> Case:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(512, 8, dim_feedforward=2048, batch_first=True)
    model = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).to(device)
    return model, (_support.seeded_input(device, 8, 128, 512),), lambda out: out.square().mean()


#: name -> (builder, goal of patched / eager)
MODELS: dict[str, tuple[Callable[[str], Case], float | None]] = {
    "tiny_mlp10x64": (tiny_mlp, None),
    "mlp6x1024_gelu": (large_mlp, 1.10),
    "convnet_bn_64x64": (convnet_bn, 1.10),
    "transformer2_d512": (transformer, 1.10),
}
#: every zoo model (tests/_zoo.py), its loss or the mean square of its output
ZOO_MODELS = [
    "mlp",
    "conv_bn_channels_last",
    "batchnorm_resnet",
    "tiny_transformer",
    "rnn_cell_loop",
    "weight_norm",
    "orthogonal",
    "custom_parametrization",
    "spectral_norm",
    "sparse_embedding",
]


def _build(name: str, device: str) -> tuple[Case, int]:
    if name in MODELS:
        case = MODELS[name][0](device)
    else:
        case = _support.zoo_case(name.removeprefix("zoo_"), device)
    return case, aten_ops(*case)


def _timed(variant: str, model: nn.Module, inputs: Any, loss_fn: Any) -> Callable[[], None]:
    def eager() -> None:
        loss_fn(model(*inputs)).backward()

    def patched() -> None:
        with _support.fake_mode(propagate=True):
            loss_fn(model(*inputs)).backward()

    def two_pass() -> None:
        with _support.fake_mode(propagate=False):
            model(*inputs)  # the shapes
        eager()

    def pass_through() -> None:
        with PassThrough():
            loss_fn(model(*inputs)).backward()

    def plain_fake() -> None:
        with _support.fake_mode(propagate=False):
            loss_fn(model(*inputs)).backward()

    def fake_floor() -> None:
        with _floor.FakeFloor():
            loss_fn(model(*inputs)).backward()

    return {
        "eager": eager,
        "patched": patched,
        "two-pass": two_pass,
        "pass-through": pass_through,
        "plain fake": plain_fake,
        "fake floor": fake_floor,
    }[variant]


def _floor_or_skip(case: str, detail: str, device: str, variant: str) -> None:
    """Skip the fake floor's slot, said in the table, where it cannot run on this build."""
    if variant == "fake floor":
        why = _floor.available(device)
        if why is not None:
            _support.skip_case(case, detail, device, f"fake floor: {why}")


@pytest.mark.paired("eager", "patched", "two-pass", "fake floor")
@pytest.mark.parametrize("name", list(MODELS))
def test_p19_step_against_eager(benchmark, device: str, name: str, slot: _support.Slot) -> None:
    _p19(benchmark, device, name, slot)


@pytest.mark.paired("eager", "patched", "two-pass")
@pytest.mark.parametrize("name", [f"zoo_{n}" for n in ZOO_MODELS])
def test_p19_zoo_step_against_eager(benchmark, device: str, name: str, slot: _support.Slot) -> None:
    """The zoo's models without the fake floor (a reference mode, not general: an RNN cell's
    loop and a parametrization's in-place updates are beyond it)."""
    _p19(benchmark, device, name, slot)


def _p19(benchmark: Any, device: str, name: str, slot: _support.Slot) -> None:
    (model, inputs, loss_fn), ops = _support.cached(
        ("P19", name, device), lambda: _build(name, device)
    )
    variant = slot.variant
    _floor_or_skip("P19", name, device, variant)
    _support.use_patch(True)
    goal = MODELS[name][1] if name in MODELS and variant == "patched" else None
    _support.record(
        benchmark,
        slot,
        case="P19",
        device=device,
        detail=name,
        goal=goal,
        target=_timed(variant, model, inputs, loss_fn),
        setup=lambda: model.zero_grad(set_to_none=True),
        rounds=3 if name in ("tiny_mlp10x64",) or name.startswith("zoo_") else 2,
        extra={"aten_ops": ops},
    )
    if variant == "fake floor":
        assert _support.grads_are_fake(model)  # it accumulates nothing: a floor, not a fix
    else:
        assert _support.grads_are_real(model)


@pytest.mark.paired("pass-through", "patched", "eager", "plain fake", "fake floor")
def test_p20_per_op_against_a_pass_through_mode(
    benchmark, device: str, slot: _support.Slot
) -> None:
    (model, inputs, loss_fn), ops = _support.cached(
        ("P20", device), lambda: _build("tiny_mlp10x64", device)
    )
    variant = slot.variant
    _floor_or_skip("P20", "tiny_mlp10x64, per aten op", device, variant)
    _support.use_patch(True)
    _support.record(
        benchmark,
        slot,
        case="P20",
        device=device,
        detail="tiny_mlp10x64, per aten op",
        goal=3.0 if variant == "patched" else None,
        target=_timed(variant, model, inputs, loss_fn),
        setup=lambda: model.zero_grad(set_to_none=True),
        rounds=20,
        extra={"aten_ops": ops},
    )
    if variant in ("plain fake", "fake floor"):
        assert _support.grads_are_fake(model)
    else:
        assert _support.grads_are_real(model)
