"""P15: ``buffers="write_back"`` (issue 18.2), a propagated fake training step of a BatchNorm
CNN with the option vs without (patch installed in both; the only difference is the option).

With the option ``FakeTensorMode.dispatch`` is wrapped: every op of every fake mode pays the
wrapper (the outermost op's arguments are scanned, nested ops that write get a shadow copy), and
the buffers are written back. No goal was set by the issue (it is opt-in); the ratio is reported.
Also P15-tracer: a fake forward in a mode *without* propagation (what tracers run) with the
option on vs off: the wrapper's cost where it stands aside at once.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import fakegrad_patch
from benchmarks import _support


def _bn_cnn(device: str) -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, padding=1),
        torch.nn.BatchNorm2d(16),
        torch.nn.ReLU(),
        torch.nn.Conv2d(16, 32, 3, stride=2, padding=1),
        torch.nn.BatchNorm2d(32),
        torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(32, 10),
        torch.nn.BatchNorm1d(10),
    ).to(device)


def _case(device: str) -> tuple[torch.nn.Module, torch.Tensor]:
    return _support.cached(
        ("P15", device), lambda: (_bn_cnn(device), _support.batch((16, 3, 16, 16), device)[0])
    )


@pytest.mark.paired("upstream", "write_back")
@pytest.mark.parametrize("propagate", [True, False], ids=["propagate", "plain"])
def test_p15_write_back(benchmark, device: str, propagate: bool, slot: _support.Slot) -> None:
    model, x = _case(device)
    _support.use_patch(True)
    fakegrad_patch.configure(buffers=slot.variant)

    def step() -> None:
        with _support.fake_mode(propagate=propagate):
            out = model(x).square().mean()
            if propagate:
                out.backward()

    try:
        _support.record(
            benchmark,
            slot,
            case="P15",
            device=device,
            detail="fake fwd+bwd bn-cnn propagate"
            if propagate
            else "fake fwd bn-cnn plain (tracer-like)",
            goal=None,
            target=step,
            setup=lambda: model.zero_grad(set_to_none=True),
            rounds=6,
        )
        assert fakegrad_patch.status()["write_back"] is (slot.variant == "write_back")
    finally:
        fakegrad_patch.configure(buffers="upstream")


def _mlp_and_sgd(device: str) -> tuple[torch.nn.Module, torch.Tensor, torch.optim.Optimizer]:
    def build() -> tuple[torch.nn.Module, torch.Tensor, torch.optim.Optimizer]:
        torch.manual_seed(0)
        layers: list[torch.nn.Module] = []
        for _ in range(8):
            layers += [torch.nn.Linear(64, 64), torch.nn.Tanh()]
        model = torch.nn.Sequential(*layers).to(device)
        x = _support.batch((32, 64), device)[0]
        return model, x, torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)

    return _support.cached(("P17", device), build)


@pytest.mark.paired("upstream", "write_back")
def test_p17_training_loop_inside_the_mode(benchmark, device: str, slot: _support.Slot) -> None:
    """P17 (issue 25): a whole training step inside a propagating mode (zero_grad, forward,
    backward, SGD with momentum ``step()``): upstream semantics (the step reaches only fake
    copies and each lost update is reported: the warning-level trace events are built) vs
    ``buffers="write_back"`` (the step reaches the real parameters and state)."""
    model, x, opt = _mlp_and_sgd(device)
    _support.use_patch(True)
    fakegrad_patch.configure(buffers=slot.variant)

    def step() -> None:
        with _support.fake_mode(propagate=True):
            opt.zero_grad(set_to_none=False)
            model(x).square().mean().backward()
            opt.step()

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", fakegrad_patch.FakeGradPatchWarning)
            _support.record(
                benchmark,
                slot,
                case="P17",
                device=device,
                detail="fake train step mlp8 sgd-momentum propagate",
                goal=None,
                target=step,
                setup=opt.state.clear,  # every round creates the momentum state afresh
                rounds=6,
            )
        assert fakegrad_patch.status()["write_back"] is (slot.variant == "write_back")
    finally:
        fakegrad_patch.configure(buffers="upstream")
