"""AccumulateGrad's layout contract, as eager applies it: a first gradient whose strides obey
the leaf's is stored as it is, any other is copied into the leaf's layout. The patch decides
the same for the gradients it writes (adopt the propagated buffer, or copy it).

Family: every permutation of every shape's dimensions for the leaf and for the gradient, shapes
with empty dimensions (an empty tensor is contiguous whatever its strides, which the contract
still compares: on 2.4 the ``svd_lowrank`` sweep found a gradient kept with other strides and
a conjugate bit eager's copy resolves), dimensions of size 1, and odd strides on dimensions of
size 0 and 1. Each case: the gradient written by a propagating fake backward has eager's strides.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
from _helpers import fake_mode, is_real

pytestmark = pytest.mark.usefixtures("propagate")

SHAPES = [(0, 3), (3, 0), (0, 10, 0), (0, 5, 10), (1, 0), (2, 1), (3, 1), (1, 1, 4), (2, 3, 4)]


def _dense_strides(shape: tuple[int, ...], order: tuple[int, ...]) -> tuple[int, ...]:
    """Dense strides with ``order[-1]`` the innermost dimension."""
    strides = [0] * len(shape)
    step = 1
    for d in reversed(order):
        strides[d] = step
        step *= max(shape[d], 1)
    return tuple(strides)


def _layouts(shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    out = {_dense_strides(shape, order) for order in itertools.permutations(range(len(shape)))}
    odd = tuple(
        7 if n < 2 else s
        for n, s in zip(shape, _dense_strides(shape, tuple(range(len(shape)))), strict=True)
    )
    out.add(odd)  # an odd stride on the dimensions of size 0 or 1
    return sorted(out)


class _GradWithStrides(torch.autograd.Function):
    """Sends back a gradient of the given strides (ones), whatever autograd hands it."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, strides: tuple[int, ...]) -> torch.Tensor:
        ctx.shape, ctx.strides = x.shape, strides
        return x.sum()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = torch.empty_strided(ctx.shape, ctx.strides, dtype=g.dtype, device=g.device)
        return grad.fill_(1.0), None


CASES = [
    (shape, leaf, grad) for shape in SHAPES for leaf in _layouts(shape) for grad in _layouts(shape)
]


@pytest.mark.parametrize(("shape", "leaf_strides", "grad_strides"), CASES)
def test_a_written_gradient_has_eagers_strides(
    shape: tuple[int, ...], leaf_strides: tuple[int, ...], grad_strides: tuple[int, ...]
) -> None:
    def leaf() -> torch.Tensor:
        return torch.empty_strided(shape, leaf_strides).zero_().requires_grad_()

    eager = leaf()
    _GradWithStrides.apply(eager, grad_strides).backward()
    patched = leaf()
    with fake_mode():
        _GradWithStrides.apply(patched, grad_strides).backward()
    assert is_real(patched.grad)
    assert patched.grad.stride() == eager.grad.stride(), (shape, leaf_strides, grad_strides)
    torch.testing.assert_close(patched.grad, eager.grad)
