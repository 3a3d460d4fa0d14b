"""Issue 3, points 1-3: real grads on the leaf's device/dtype/layout, equal to eager, accumulated
exactly like AccumulateGrad."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from _helpers import assert_real_grads_equal, fake_and_eager, fake_mode, is_real
from torch._subclasses.fake_tensor import FakeTensor

pytestmark = pytest.mark.usefixtures("propagate")


def mlp(device: torch.device, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4)).to(
        device=device, dtype=dtype
    )


def test_plain_leaf_gets_real_grad_equal_to_eager(device: torch.device) -> None:
    w = torch.randn(3, 4, device=device, requires_grad=True)
    x = torch.randn(5, 3, device=device)
    with fake_mode():
        (x @ w).square().sum().backward()
    assert is_real(w.grad)
    assert w.grad.device == w.device
    w_ref = w.detach().clone().requires_grad_()
    (x @ w_ref).square().sum().backward()
    torch.testing.assert_close(w.grad, w_ref.grad)


def test_mlp_parameters_equal_eager(device: torch.device) -> None:
    x = torch.randn(6, 8, device=device)
    model, ref = fake_and_eager(lambda: mlp(device), lambda m: m(x).sum().backward())
    assert_real_grads_equal(model, ref)


def test_conv_channels_last_follows_layout_contract(device: torch.device) -> None:
    def make() -> torch.nn.Module:
        torch.manual_seed(0)
        net = torch.nn.Sequential(
            torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Conv2d(8, 4, 3)
        )
        return net.to(device=device, memory_format=torch.channels_last)

    x = torch.randn(2, 3, 10, 10, device=device).to(memory_format=torch.channels_last)
    model, ref = fake_and_eager(make, lambda m: m(x).mean().backward())
    assert_real_grads_equal(model, ref, atol=1e-5)
    weight = model[0].weight
    assert weight.grad.stride() == weight.stride()  # channels_last strides, like the weight


def test_layernorm(device: torch.device) -> None:
    def make() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8)).to(device)

    x = torch.randn(4, 8, device=device)
    model, ref = fake_and_eager(
        make, lambda m: (m(x) * torch.arange(8.0, device=device)).sum().backward()
    )
    assert_real_grads_equal(model, ref, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_parameters(device: torch.device, dtype: torch.dtype) -> None:
    if device.type == "cpu" and dtype == torch.float16:
        pytest.importorskip("torch", minversion="2.1")  # fp16 matmul on CPU exists since 2.1
    x = torch.randn(6, 8, device=device, dtype=dtype)
    model, ref = fake_and_eager(lambda: mlp(device, dtype), lambda m: m(x).float().sum().backward())
    assert_real_grads_equal(model, ref, atol=0, rtol=0)  # same kernels, same values


def test_shared_weight_used_twice(device: torch.device) -> None:
    def make() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Linear(6, 6).to(device)

    x = torch.randn(3, 6, device=device)
    model, ref = fake_and_eager(make, lambda m: m(torch.tanh(m(x))).sum().backward())
    assert_real_grads_equal(model, ref)


def test_leaf_reached_only_through_real_graph_d3(device: torch.device) -> None:
    leaf = torch.randn(4, 4, device=device, requires_grad=True)
    ref = leaf.detach().clone().requires_grad_()
    ones = torch.ones(2, 4, device=device)
    scaled = leaf * 3.0  # real op: the fake mode only ever sees `scaled`
    with fake_mode():
        (ones @ scaled).sin().sum().backward()
    (ones @ (ref * 3.0)).sin().sum().backward()
    assert is_real(leaf.grad)
    torch.testing.assert_close(leaf.grad, ref.grad)


def test_backward_called_after_the_block(device: torch.device) -> None:
    x = torch.randn(6, 8, device=device)
    model, ref = mlp(device), mlp(device)
    with fake_mode():
        loss = model(x).sum()
    loss.backward()
    ref(x).sum().backward()
    assert_real_grads_equal(model, ref)


def test_fake_tensor_meeting_real_leaf_outside_the_block(device: torch.device) -> None:
    w = torch.randn(4, 3, device=device, requires_grad=True)
    ref = w.detach().clone().requires_grad_()
    x = torch.randn(2, 4, device=device)
    with fake_mode() as mode:
        fake_x = mode.from_tensor(x)
    (fake_x @ w).sum().backward()  # the FakeTensor re-enters its mode here
    (x @ ref).sum().backward()
    assert is_real(w.grad)
    torch.testing.assert_close(w.grad, ref.grad)


def test_retain_graph_repeated_backward_accumulates(device: torch.device) -> None:
    x = torch.randn(6, 8, device=device)
    model, ref = mlp(device), mlp(device)
    with fake_mode():
        loss = model(x).sum()
        loss.backward(retain_graph=True)
        loss.backward()
    ref_loss = ref(x).sum()
    ref_loss.backward(retain_graph=True)
    ref_loss.backward()
    assert_real_grads_equal(model, ref)


def test_prior_real_grad_is_accumulated_in_place(device: torch.device) -> None:
    x = torch.randn(6, 8, device=device)
    model, ref = mlp(device), mlp(device)
    for p, r in zip(model.parameters(), ref.parameters(), strict=True):
        p.grad = torch.full_like(p, 0.5)
        r.grad = torch.full_like(r, 0.5)
    held = [p.grad for p in model.parameters()]  # what an optimizer / DDP bucket would hold
    with fake_mode():
        model(x).sum().backward()
    ref(x).sum().backward()
    assert_real_grads_equal(model, ref)
    assert all(p.grad is h for p, h in zip(model.parameters(), held, strict=True))


def test_new_mode_per_iteration_keeps_accumulating(device: torch.device) -> None:
    model, ref = mlp(device), mlp(device)
    for step in range(3):
        x = torch.randn(6, 8, device=device, generator=None)
        with fake_mode():
            model(x * (step + 1)).sum().backward()
        ref(x * (step + 1)).sum().backward()
    assert_real_grads_equal(model, ref, atol=1e-5)


def test_zero_grad_set_to_none_false_accumulates_into_zeros(device: torch.device) -> None:
    x = torch.randn(6, 8, device=device)
    model, ref = mlp(device), mlp(device)
    for m in (model, ref):
        m(x).sum().backward()
        m.zero_grad(set_to_none=False)
    held = [p.grad for p in model.parameters()]
    with fake_mode():
        model(x).sum().backward()
    ref(x).sum().backward()
    assert_real_grads_equal(model, ref)
    assert all(p.grad is h for p, h in zip(model.parameters(), held, strict=True))


def test_set_path_takes_over_propagated_buffer_without_copy() -> None:
    """P4: device, dtype and layout match -> the propagated buffer becomes .grad (zero copies)."""
    w = torch.randn(5, 3, requires_grad=True)
    x = torch.randn(4, 5)
    seen: dict[str, int] = {}

    def remember(grad: torch.Tensor) -> None:
        assert isinstance(grad, FakeTensor)
        seen["ptr"] = grad.real_tensor.data_ptr()

    w.register_hook(remember)
    with fake_mode():
        (x @ w).sin().sum().backward()
    assert is_real(w.grad)
    assert w.grad.data_ptr() == seen["ptr"]


def test_one_buffer_for_two_leaves_is_not_shared() -> None:
    """``a + b`` sends the same gradient tensor to both leaves: only one may take it over."""
    a = torch.randn(3, requires_grad=True)
    b = torch.randn(3, requires_grad=True)
    with fake_mode():
        (a + b).mul(2.0).sum().backward()
    assert is_real(a.grad) and is_real(b.grad)
    assert a.grad.data_ptr() != b.grad.data_ptr()
    a.grad.add_(1.0)  # accumulating into one must not change the other
    torch.testing.assert_close(b.grad, torch.full((3,), 2.0))


def test_real_tensor_on_another_dtype_is_cast_to_grad_dtype() -> None:
    w = torch.randn(4, 4, dtype=torch.bfloat16, requires_grad=True)
    x = torch.randn(2, 4)
    with fake_mode():
        (x @ w.float()).sum().backward()
    ref = w.detach().clone().requires_grad_()
    (x @ ref.float()).sum().backward()
    assert is_real(w.grad) and w.grad.dtype == torch.bfloat16
    torch.testing.assert_close(w.grad, ref.grad, atol=0, rtol=0)


def test_grad_dtype_is_respected_where_supported() -> None:
    w = torch.randn(4, 4, dtype=torch.bfloat16, requires_grad=True)
    if not hasattr(w, "grad_dtype"):
        pytest.skip("this torch build has no Tensor.grad_dtype")
    w.grad_dtype = torch.float32
    ref = w.detach().clone().requires_grad_()
    ref.grad_dtype = torch.float32
    x = torch.randn(2, 4, dtype=torch.bfloat16)
    with fake_mode():
        (x @ w).float().sum().backward()
    (x @ ref).float().sum().backward()
    assert is_real(w.grad) and w.grad.dtype == torch.float32
    torch.testing.assert_close(w.grad, ref.grad, atol=0, rtol=0)


@pytest.mark.parametrize("kind", ["transposed", "offset_view"])
def test_non_dense_leaves_follow_layout_contract(kind: str) -> None:
    def make() -> torch.Tensor:
        torch.manual_seed(0)
        if kind == "transposed":
            return torch.randn(6, 4).t().detach().requires_grad_()
        return torch.randn(6, 4)[1:3].detach().requires_grad_()

    leaf, eager = make(), make()
    weight = torch.randn(leaf.shape[-1], 2)
    with fake_mode():
        (leaf @ weight).sum().backward()
    (eager @ weight).sum().backward()
    assert is_real(leaf.grad)
    assert leaf.grad.stride() == eager.grad.stride()
    torch.testing.assert_close(leaf.grad, eager.grad)


def test_expanded_leaf_cannot_propagate_upstream_but_zeros_policy_obeys_contract() -> None:
    """Upstream cannot convert an expanded (stride 0) leaf with propagation on (meta_utils copies
    into an overlapping tensor and raises), on every checked build: a view of it (``t()``, whose
    base is converted) still raises. An op that only reads it reads it directly (no conversion:
    issue 46) and gets eager's gradient. Without propagation the ``zeros`` policy gives a real,
    contiguous gradient, as AccumulateGrad would."""
    leaf = torch.randn(4, 1).expand(4, 3).detach().requires_grad_()
    weight = torch.randn(3, 2)
    with pytest.raises(RuntimeError, match="more than one element"), fake_mode():
        (leaf.t().t() @ weight).sum().backward()
    with fake_mode():
        (leaf @ weight).sum().backward()
    direct, leaf.grad = leaf.grad, None
    (leaf @ weight).sum().backward()
    assert is_real(direct)
    torch.testing.assert_close(direct, leaf.grad)
    leaf.grad = None
    import torch._functorch.config as functorch_config

    import fakegrad_patch

    with (
        functorch_config.patch(fake_tensor_propagate_real_tensors=False),
        fakegrad_patch.patched(on_missing="zeros"),
        fake_mode(),
    ):
        (leaf @ weight).sum().backward()
    assert is_real(leaf.grad) and leaf.grad.is_contiguous()
    assert torch.count_nonzero(leaf.grad) == 0


def test_threads_each_with_their_own_mode() -> None:
    errors: list[BaseException] = []
    results: dict[int, tuple[torch.nn.Module, torch.nn.Module]] = {}

    def work(i: int) -> None:
        try:
            import torch._functorch.config as functorch_config

            with functorch_config.patch(fake_tensor_propagate_real_tensors=True):
                torch.manual_seed(i)
                model = torch.nn.Linear(8, 4)
                ref = copy.deepcopy(model)
                x = torch.randn(5, 8)
                for _ in range(3):
                    with fake_mode():
                        model(x).square().sum().backward()
                    ref(x).square().sum().backward()
                results[i] = (model, ref)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for model, ref in results.values():
        assert_real_grads_equal(model, ref, atol=1e-5)


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
def test_create_graph_gives_real_values_without_a_graph() -> None:
    """Documented limit: with create_graph=True the materialized gradient has eager values and
    accumulates out of place (as AccumulateGrad does in grad mode), but carries no graph."""
    w = torch.randn(3, 3, requires_grad=True)
    w.grad = torch.ones(3, 3)
    prior = w.grad
    ref = w.detach().clone().requires_grad_()
    ref.grad = torch.ones(3, 3)
    x = torch.randn(2, 3)
    with fake_mode():
        (x @ w).pow(2).sum().backward(create_graph=True)
    (x @ ref).pow(2).sum().backward(create_graph=True)
    assert is_real(w.grad) and w.grad is not prior
    assert not w.grad.requires_grad
    torch.testing.assert_close(w.grad, ref.grad.detach())
