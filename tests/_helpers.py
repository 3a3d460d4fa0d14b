"""Helpers shared by the tests (not fixtures)."""

from __future__ import annotations

import contextlib
import copy
import functools
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

import fakegrad_patch

#: The devices every device-parametrized test runs on (the ``device`` fixture of conftest.py):
#: CUDA is marked ``cuda`` and skipped cleanly without a GPU (conftest.py).
DEVICES: list[Any] = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def _devices() -> Iterator[tuple[str, Any]]:
    for param in DEVICES:
        if isinstance(param, str):
            yield param, ()
        else:
            yield param.values[0], param.marks


#: :data:`DEVICES` with CUDA run twice, cuDNN on (torch's default) and off (CUDA's native
#: kernels): ``(device, cudnn)``, ``cudnn`` None on CPU. For ops that have both kernels (RNNs,
#: BatchNorm); :func:`kernels` applies the choice.
DEVICES_CUDNN = [
    pytest.param(name, cudnn, marks=marks, id=name if cudnn is None else f"{name}-{label}")
    for name, marks in _devices()
    for cudnn, label in (((True, "cudnn"), (False, "native")) if name == "cuda" else ((None, ""),))
]


@contextlib.contextmanager
def kernels(cudnn: bool | None) -> Iterator[None]:
    """``torch.backends.cudnn.flags(enabled=cudnn)`` around the block (the other flags at
    torch's defaults); nothing for None (CPU)."""
    if cudnn is None:
        yield
        return
    with torch.backends.cudnn.flags(enabled=cudnn):
        yield


def resolved_device(device: str | torch.device) -> torch.device:
    """The device a tensor created on ``device`` lands on: ``cuda`` resolves to the current
    ``cuda:N`` (a tensor's device always has an index; ``torch.device("cuda")`` has none)."""
    return torch.empty(0, device=device).device


def fake_mode() -> FakeTensorMode:
    return FakeTensorMode(allow_non_fake_inputs=True)


def is_real(t: object) -> bool:
    return isinstance(t, torch.Tensor) and not isinstance(t, FakeTensor)


def assert_real_grads_equal(
    model: torch.nn.Module,
    reference: torch.nn.Module,
    *,
    atol: float = 1e-6,
    rtol: float = 1e-5,
) -> None:
    """Every parameter of ``model`` holds a real grad equal to ``reference``'s, same layout."""
    for (name, p), r in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert r.grad is not None, name
        assert p.grad is not None, f"{name}: no grad"
        assert is_real(p.grad), f"{name}: {type(p.grad).__name__} in .grad"
        assert p.grad.device == p.device, name
        assert p.grad.dtype == r.grad.dtype, name
        assert p.grad.stride() == r.grad.stride(), f"{name}: {p.grad.stride()} != {r.grad.stride()}"
        torch.testing.assert_close(p.grad, r.grad, atol=atol, rtol=rtol, msg=name)


def fake_and_eager(
    make: Callable[[], torch.nn.Module],
    run: Callable[[torch.nn.Module], None],
) -> tuple[torch.nn.Module, torch.nn.Module]:
    """Build a model, copy it, run ``run`` once inside a fake mode and once eagerly."""
    model = make()
    reference = copy.deepcopy(model)
    with fake_mode():
        run(model)
    run(reference)
    return model, reference


@functools.cache
def fake_path_is_exact() -> bool:
    """Behaviour, not version: do a BatchNorm model's gradients under a propagating mode (patch
    installed, default settings) equal eager's bit for bit on this build? 2.13.0 and 2.14.1:
    yes; 2.4.0: ~3e-7 apart (its fake path reduces in another order). Tests that claim
    bit-for-bit results require them where this is True, float32 tolerance elsewhere."""
    import torch._functorch.config as functorch_config

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.BatchNorm1d(4))
    reference = copy.deepcopy(model)
    x = torch.randn(6, 5)
    with functorch_config.patch(fake_tensor_propagate_real_tensors=True), fake_mode():
        model(x).pow(2).mean().backward()
    reference(x).pow(2).mean().backward()
    return all(
        is_real(p.grad) and torch.equal(p.grad, r.grad)
        for p, r in zip(model.parameters(), reference.parameters(), strict=True)
    )


def verify_two_steps(
    model: torch.nn.Module, inputs: Any, loss_fn: Any = None, **options: Any
) -> Any:
    """``fakegrad_patch.verify`` of two SGD-with-momentum steps, the second backward accumulating
    into the first's gradients (``zero_grad="never"``): the set path, then the accumulate path,
    and the parameters compared after each optimizer step."""
    sgd = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)
    options = {"steps": 2, "optimizer": sgd, "zero_grad": "never", **options}
    return fakegrad_patch.verify(model, inputs, loss_fn, **options)


def assert_verified(
    report: Any, device: str | torch.device, outcomes: dict[str, int] | None = None
) -> None:
    """A ``verify`` report says the patched copy trained exactly like eager: the verdict, every
    parameter that eager gives a gradient got a real one (compared, and its value after each
    optimizer step), only ``set``/``accumulate`` outcomes (``outcomes``: exactly these counts),
    eager's strides, on ``device`` (index resolved). A parameter eager gives no gradient (frozen)
    gets none and no outcome."""
    assert report.ok, report.format()
    where = resolved_device(device)
    compared = 0
    for p in report.parameters:
        if p.eager_grad == "none":
            assert p.grad == "none" and not p.outcomes, p
            continue
        compared += 1
        assert p.grad == p.eager_grad == "real", p
        assert p.max_abs is not None and p.value_max_abs is not None, p
        assert set(p.outcomes) <= {"set", "accumulate"} and p.outcomes, p
        if outcomes is not None:
            assert p.outcomes == outcomes, p
        assert p.grad_strides == p.eager_grad_strides, p
        assert p.grad_device is not None and torch.device(p.grad_device) == where, p
    assert compared, f"no parameter got a gradient to compare:\n{report.format()}"
    assert all(loss["abs_diff"] is not None for loss in report.losses)
