"""Issue 3, points 6-8: real gradients left alone, autograd features, hooks, tools stacked with the
fake mode, exceptions, no leaks, and no cost once the fake graph is gone."""

from __future__ import annotations

import contextlib
import copy
import gc
import weakref
from typing import Any

import pytest
import torch
from _helpers import assert_real_grads_equal, fake_mode, is_real
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint
from torch.utils.flop_counter import FlopCounterMode

import fakegrad_patch

pytestmark = pytest.mark.usefixtures("propagate")


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def test_real_gradients_after_the_block_are_left_to_autograd() -> None:
    """S05b: backward with real grad_tensors after the block computes real grads by itself."""
    model, ref = mlp(), mlp()
    x = torch.randn(3, 8)
    with fake_mode():
        y = model[0](x)
    seed = torch.randn(3, 16)
    torch.autograd.backward([y], [seed])
    torch.autograd.backward([ref[0](x)], [seed])
    assert is_real(model[0].weight.grad)
    torch.testing.assert_close(model[0].weight.grad, ref[0].weight.grad)


def test_backward_inputs_fills_only_the_listed_leaves() -> None:
    model, ref = mlp(), mlp()
    x = torch.randn(3, 8)
    with fake_mode():
        model(x).sum().backward(inputs=[model[0].weight])
    ref(x).sum().backward(inputs=[ref[0].weight])
    assert is_real(model[0].weight.grad)
    torch.testing.assert_close(model[0].weight.grad, ref[0].weight.grad)
    assert model[0].bias.grad is None and model[2].weight.grad is None


def test_autograd_grad_keeps_working_and_leaves_grad_untouched() -> None:
    model = mlp()
    x = torch.randn(3, 8)
    with fake_mode():
        grads = torch.autograd.grad(model(x).sum(), list(model.parameters()))
    assert all(isinstance(g, FakeTensor) for g in grads)  # functional grads stay fake
    assert all(p.grad is None for p in model.parameters())


def test_frozen_parameters_are_untouched() -> None:
    model = mlp()
    model[0].requires_grad_(False)
    with fake_mode():
        model(torch.randn(3, 8)).sum().backward()
    assert model[0].weight.grad is None and model[0].bias.grad is None
    assert is_real(model[2].weight.grad)


def test_tied_weights() -> None:
    def make() -> torch.nn.Module:
        torch.manual_seed(0)
        emb = torch.nn.Embedding(10, 6)
        out = torch.nn.Linear(6, 10, bias=False)
        out.weight = emb.weight
        return torch.nn.ModuleDict({"emb": emb, "out": out})

    tokens = torch.tensor([[1, 2, 3], [4, 5, 6]])
    model, ref = make(), make()
    with fake_mode():
        model["out"](model["emb"](tokens)).logsumexp(-1).sum().backward()
    ref["out"](ref["emb"](tokens)).logsumexp(-1).sum().backward()
    assert_real_grads_equal(model, ref, atol=1e-5)


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing(reentrant: bool) -> None:
    model, ref = mlp(), mlp()
    x = torch.randn(3, 8, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    with fake_mode():
        checkpoint(model, x, use_reentrant=reentrant).sum().backward()
    checkpoint(ref, x_ref, use_reentrant=reentrant).sum().backward()
    assert_real_grads_equal(model, ref)
    assert is_real(x.grad)
    torch.testing.assert_close(x.grad, x_ref.grad)


def stacked_with_fake_mode(other: Any, outside: bool) -> contextlib.ExitStack:
    """``other`` and a fresh fake mode entered together, ``other`` outside (entered first) or
    inside."""
    stack = contextlib.ExitStack()
    for mode in (other, fake_mode()) if outside else (fake_mode(), other):
        stack.enter_context(mode)
    return stack


@pytest.mark.parametrize("order", ["flop_outside", "flop_inside"])
def test_flop_counter_stacked_with_the_fake_mode(order: str) -> None:
    model, ref = mlp(), mlp()
    x = torch.randn(3, 8)
    flops = FlopCounterMode(display=False)
    with stacked_with_fake_mode(flops, outside=order == "flop_outside"):
        model(x).sum().backward()
    eager_flops = FlopCounterMode(display=False)
    with eager_flops:
        ref(x).sum().backward()
    assert flops.get_total_flops() == eager_flops.get_total_flops()
    assert_real_grads_equal(model, ref)


_DEVICE = getattr(getattr(torch.ops.prim, "device", None), "default", None)


class _OpsInAccumulateGrad(TorchDispatchMode):
    """Records every op dispatched while an AccumulateGrad node runs (its pre-hooks included)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        node = torch._C._current_autograd_node()
        # prim.device: the engine asking a fake gradient for its device (custom device policy),
        # with or without the patch; not a computation
        if node is not None and type(node).__name__ == "AccumulateGrad" and func is not _DEVICE:
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.skipif(
    not hasattr(torch._C, "_current_autograd_node"), reason="no _current_autograd_node here"
)
@pytest.mark.parametrize("order", ["recorder_outside", "recorder_inside"])
def test_writing_the_real_grad_dispatches_no_op_to_a_stacked_mode(order: str) -> None:
    """The set path (zero-copy adoption, issue 27: outside the dispatch guard) and the accumulate
    path write real gradients without an op any mode could see: a dispatch mode stacked with the
    fake mode sees nothing while AccumulateGrad runs. Eager and upstream's fake AccumulateGrad
    dispatch there (a ``detach`` per leaf at least), which shows the recorder sees such ops."""
    model, ref = mlp(), mlp()
    x = torch.randn(3, 8)
    recorder = _OpsInAccumulateGrad()
    for _ in range(2):  # first the set path, then the accumulate path
        with stacked_with_fake_mode(recorder, outside=order == "recorder_outside"):
            model(x).sum().backward()
        ref(x).sum().backward()
        assert_real_grads_equal(model, ref)
    assert recorder.ops == []
    eager = _OpsInAccumulateGrad()
    with eager:
        ref(x).sum().backward()
    assert eager.ops, "the recorder saw no op of eager AccumulateGrad"


def test_tensor_hook_sees_the_fake_grad_and_its_result_is_materialized() -> None:
    model, ref = mlp(), mlp()
    x = torch.randn(3, 8)
    seen: list[type] = []

    def double(grad: torch.Tensor) -> torch.Tensor:
        seen.append(type(grad))
        return grad * 2

    model[0].weight.register_hook(double)
    ref[0].weight.register_hook(lambda g: g * 2)
    with fake_mode():
        model(x).sum().backward()
    ref(x).sum().backward()
    assert seen == [FakeTensor]  # documented: the hook runs inside the fake backward
    assert_real_grads_equal(model, ref)


def test_post_accumulate_hook_sees_the_real_grad() -> None:
    model = mlp()
    observed: list[tuple[bool, torch.Tensor]] = []

    def hook(param: torch.Tensor) -> None:
        observed.append((is_real(param.grad), param.grad))

    model[2].weight.register_post_accumulate_grad_hook(hook)
    with fake_mode():
        model(torch.randn(3, 8)).sum().backward()
    assert len(observed) == 1
    was_real, grad = observed[0]
    assert was_real and grad is model[2].weight.grad


def test_exception_mid_backward_leaves_real_or_previous_grads_and_no_stale_state() -> None:
    class Boom(torch.autograd.Function):
        @staticmethod
        def forward(ctx: object, t: torch.Tensor) -> torch.Tensor:
            return t.clone()

        @staticmethod
        def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("boom in backward")

    model = mlp()
    model[0].bias.grad = torch.ones(16)
    prior = model[0].bias.grad
    x = torch.randn(3, 8)
    with fake_mode():
        hidden = Boom.apply(model[0](x))  # the failure sits between the two layers
        loss = model[2](torch.tanh(hidden)).sum()
        with pytest.raises(RuntimeError, match="boom in backward"):
            loss.backward()
    for p in model.parameters():
        assert p.grad is None or is_real(p.grad)
    assert is_real(model[2].weight.grad)  # reached before the failure
    assert model[0].bias.grad is prior and torch.equal(prior, torch.ones(16))
    # the next backward works and accumulates normally
    ref = copy.deepcopy(model)
    ref.zero_grad(set_to_none=True)
    model.zero_grad(set_to_none=True)
    with fake_mode():
        model(x).sum().backward()
    ref(x).sum().backward()
    assert_real_grads_equal(model, ref)


def test_leaves_and_modes_are_not_kept_alive() -> None:
    model = mlp()
    mode = fake_mode()
    with mode:
        model(torch.randn(3, 8)).sum().backward()
    model_ref, mode_ref = weakref.ref(model), weakref.ref(mode)
    param_ref = weakref.ref(model[0].weight)
    applied = fakegrad_patch._core.install.current()
    assert applied is not None
    cached = applied.hooks._prehooks  # each armed leaf's pre-hook, reused by later backwards
    assert all(p in cached for p in model.parameters())
    cached_before, params = len(cached), len(list(model.parameters()))
    del model, mode
    gc.collect()
    assert model_ref() is None and param_ref() is None and mode_ref() is None
    assert len(cached) <= cached_before - params  # the entries went with their leaves


def test_no_hooks_remain_once_the_fake_graph_is_gone() -> None:
    """Point 8: real training after a fake session runs no Python code of the patch."""
    model = mlp()
    x = torch.randn(3, 8)
    gc.collect()
    before = fakegrad_patch.status()["armed_leaves"]  # other tests' graphs, if still alive
    with fake_mode():
        loss = model(x).sum()
        assert fakegrad_patch.status()["armed_leaves"] == before  # armed at backward, not here
        loss.backward()
    del loss
    gc.collect()
    assert fakegrad_patch.status()["armed_leaves"] == before
    applied = fakegrad_patch._core.install.current()
    assert applied is not None
    calls = 0
    original = applied.materializer.on_fake_grad

    def counting(*args: object) -> object:
        nonlocal calls
        calls += 1
        return original(*args)  # type: ignore[arg-type]

    applied.materializer.on_fake_grad = counting  # type: ignore[method-assign]
    try:
        model.zero_grad()
        model(x).sum().backward()  # real backward: AccumulateGrad nodes are fresh, hook-free
    finally:
        del applied.materializer.on_fake_grad
    assert calls == 0
    assert all(is_real(p.grad) for p in model.parameters())


def test_optimizer_step_after_patched_fake_backward_moves_parameters() -> None:
    model, ref = mlp(), mlp()
    x = torch.randn(3, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    with fake_mode():
        model(x).sum().backward()
    ref(x).sum().backward()
    opt.step()
    ref_opt.step()
    for p, r in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, r)


def test_optimizer_in_backward_hook_with_fake_mode_unset_matches_eager() -> None:
    """The documented recipe for post-accumulate hooks that must act on real tensors."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    model, ref = mlp(), mlp()
    x = torch.randn(3, 8)

    def attach(m: torch.nn.Module, unset: bool) -> None:
        for p in m.parameters():
            opt = torch.optim.SGD([p], lr=0.1)

            def step(param: torch.Tensor, opt: torch.optim.Optimizer = opt) -> None:
                if unset:
                    with unset_fake_temporarily():
                        opt.step()
                else:
                    opt.step()
                param.grad = None

            p.register_post_accumulate_grad_hook(step)

    attach(model, unset=True)
    attach(ref, unset=False)
    with fake_mode():
        model(x).sum().backward()
    ref(x).sum().backward()
    for p, r in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, r)
