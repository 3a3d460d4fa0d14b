"""BatchNorm's backward with each output mask, attention on each ``scaled_dot_product_attention``
backend, and a float32 ``nn.TransformerEncoderLayer`` (issue 38): ops whose fake and real kernels
differ by device and kernel, on the CPU and on CUDA (BatchNorm: with cuDNN and with CUDA's native
kernel, ``torch.backends.cudnn.flags(enabled=False)``).

Each case trains a model eagerly and under the patch with ``fakegrad_patch.verify`` (two
SGD-with-momentum steps, the second backward accumulating into the first's gradients; every
parameter's gradient real and equal to eager's, on its device, with eager's strides; the
parameters after each step). The disagreements the first GPU run found (the backward's output
mask, efficient attention's philox outputs) take the real kernel's outputs since issue 39; on
the CPU, BatchNorm without an input gradient was refused by propagation's own check the same
way (a real None where the fake kernel gives a tensor).
"""

from __future__ import annotations

import warnings
from contextlib import AbstractContextManager
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from _helpers import DEVICES_CUDNN, assert_verified, kernels, verify_two_steps
from torch import nn

SET_THEN_ACCUMULATE = {"set": 1, "accumulate": 1}

# -- BatchNorm: each output mask of its backward ---------------------------------------------------


class NormNet(nn.Module):
    """``[Conv2d] -> BatchNorm2d -> ReLU -> spatial mean -> Linear``. Without the convolution the
    BatchNorm reads the raw input, which needs no gradient."""

    def __init__(self, conv: bool = True, affine: bool = True) -> None:
        super().__init__()
        channels = 4 if conv else 3
        self.conv = nn.Conv2d(3, channels, 3, padding=1) if conv else nn.Identity()
        self.bn = nn.BatchNorm2d(channels, affine=affine)
        self.head = nn.Linear(channels, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.relu(self.bn(self.conv(x))).mean(dim=(2, 3)))


def _norm_net(mask: str) -> nn.Module:
    """The model whose BatchNorm backward has this output mask (grad_input, grad_weight,
    grad_bias), or runs on the running statistics (``eval``)."""
    model = NormNet(conv=mask != "no_input_grad", affine=mask != "affine_false")
    bn = model.bn
    if mask == "input_only":
        bn.requires_grad_(False)
    elif mask == "weight_frozen":
        bn.weight.requires_grad_(False)
    elif mask == "bias_frozen":
        bn.bias.requires_grad_(False)
    elif mask == "eval":
        bn.eval()
    return model


#: mask -> the backward's output_mask (or the mode), as the model above makes it
MASKS = {
    "all": "(T, T, T)",
    "input_only": "(T, F, F): weight and bias frozen",
    "no_input_grad": "(F, T, T): the raw input",
    "weight_frozen": "(T, F, T)",
    "bias_frozen": "(T, T, F)",
    "affine_false": "(T, F, F): no weight, no bias",
    "eval": "running statistics",
}


@pytest.mark.filterwarnings("ignore::fakegrad_patch.FakeGradPatchWarning")
@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize(("device", "cudnn"), DEVICES_CUDNN)
def test_batch_norm_backward_with_each_output_mask_trains_like_eager(
    device: str, cudnn: bool | None, mask: str
) -> None:
    torch.manual_seed(0)
    model = _norm_net(mask).to(device)
    x = torch.randn(4, 3, 6, 6, device=device)
    with kernels(cudnn):
        report = verify_two_steps(model, (x,))
    assert_verified(report, device, SET_THEN_ACCUMULATE)
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert {p.name for p in report.parameters if p.grad == "none"} == frozen


# -- attention on each SDPA backend ----------------------------------------------------------------


class CausalSelfAttention(nn.Module):
    """Projections around ``F.scaled_dot_product_attention(q, k, v, is_causal=True)``."""

    def __init__(self, dim: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        qkv = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


#: (backend, dtype): float32 on every backend that takes it; flash attention takes half
#: precision only; cuDNN attention in float32 and bfloat16 (a backend the device, dtype or build
#: lacks is skipped, found at run time)
BACKENDS = [
    ("MATH", torch.float32),
    ("EFFICIENT_ATTENTION", torch.float32),
    ("FLASH_ATTENTION", torch.float16),
    ("FLASH_ATTENTION", torch.bfloat16),
    ("CUDNN_ATTENTION", torch.float32),
    ("CUDNN_ATTENTION", torch.bfloat16),
]


def _sdpa_kernel(name: str) -> AbstractContextManager[Any]:
    attention = pytest.importorskip("torch.nn.attention")  # 2.3+
    backend = getattr(attention.SDPBackend, name, None)
    if backend is None:
        pytest.skip(f"this torch has no SDPBackend.{name}")
    return attention.sdpa_kernel([backend])


def _unavailable(name: str, dtype: torch.dtype, device: str) -> str | None:
    """Why ``name`` cannot run causal attention forward and backward here (eagerly, on a tensor
    of the test's shape), or None."""
    q = torch.randn(2, 2, 8, 8, device=device, dtype=dtype, requires_grad=True)
    try:
        with warnings.catch_warnings(), _sdpa_kernel(name):
            warnings.simplefilter("ignore")  # the backends say why they decline, as warnings
            F.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()
    except RuntimeError as exc:
        return str(exc).strip().splitlines()[0]
    return None


@pytest.mark.filterwarnings("ignore::fakegrad_patch.FakeGradPatchWarning")
@pytest.mark.parametrize(
    ("backend", "dtype"), BACKENDS, ids=[f"{b.lower()}-{str(d)[6:]}" for b, d in BACKENDS]
)
def test_attention_on_each_sdpa_backend_trains_like_eager(
    device: torch.device, backend: str, dtype: torch.dtype
) -> None:
    why = _unavailable(backend, dtype, device.type)
    if why is not None:
        pytest.skip(f"SDPBackend.{backend} cannot run {dtype} attention on {device} here: {why}")
    torch.manual_seed(0)
    model = CausalSelfAttention().to(device=device, dtype=dtype)
    x = torch.randn(2, 8, 16, device=device, dtype=dtype)
    with _sdpa_kernel(backend):
        report = verify_two_steps(model, (x,))
    assert_verified(report, device, SET_THEN_ACCUMULATE)


@pytest.mark.filterwarnings("ignore::fakegrad_patch.FakeGradPatchWarning")
def test_float32_transformer_encoder_layer_trains_like_eager(device: torch.device) -> None:
    """nn's defaults (dropout 0.1, post-norm, torch's own choice of attention kernel), in
    training mode."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, dim_feedforward=64, batch_first=True).to(device)
    x = torch.randn(3, 10, 32, device=device)
    assert_verified(verify_two_steps(layer, (x,)), device, SET_THEN_ACCUMULATE)
