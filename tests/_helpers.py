"""Helpers shared by the tests (not fixtures)."""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode


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
