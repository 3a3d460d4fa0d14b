"""A small zoo of models built from ``torch.nn`` only, for ``fakegrad_patch.verify``.

Each factory takes a device and returns the dict the ``verify`` command accepts (``model``,
``inputs`` and optionally ``loss_fn``, ``optimizer``, ``steps``). The families: plain MLP, conv
net with BatchNorm in channels_last, a residual net with BatchNorm everywhere, a tiny
transformer block (LayerNorm, attention, dropout, tied embeddings), an RNN cell unrolled in a
Python loop, and parametrizations (weight_norm, orthogonal, a custom one, spectral_norm), and a
sparse embedding. Also usable from the command line:
``python -m fakegrad_patch verify tests/_zoo.py:mlp``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import orthogonal, spectral_norm, weight_norm

Case = dict[str, Any]


def _sgd(lr: float = 0.1, momentum: float = 0.9) -> Callable[..., torch.optim.Optimizer]:
    return functools.partial(torch.optim.SGD, lr=lr, momentum=momentum)


def _classifier(
    model: nn.Module, x: torch.Tensor, classes: int, optimizer: Any, steps: int
) -> Case:
    """A case trained with cross-entropy against random labels (drawn after ``x``)."""
    y = torch.randint(0, classes, (x.shape[0],), device=x.device)
    return {
        "model": model,
        "inputs": (x,),
        "loss_fn": lambda out: F.cross_entropy(out, y),
        "optimizer": optimizer,
        "steps": steps,
    }


def mlp(device: str = "cpu") -> Case:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4)
    )
    model.to(device)
    x = torch.randn(8, 16, device=device)
    return _classifier(model, x, 4, functools.partial(torch.optim.AdamW, lr=1e-2), 3)


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 16, 3, stride=2, padding=1)
        self.bn2 = nn.BatchNorm2d(16)
        self.head = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.bn2(self.conv2(x)))
        return self.head(x.mean(dim=(2, 3)))


def conv_bn_channels_last(device: str = "cpu") -> Case:
    torch.manual_seed(0)
    model = ConvNet().to(device=device, memory_format=torch.channels_last)
    x = torch.randn(4, 3, 12, 12, device=device).to(memory_format=torch.channels_last)
    return _classifier(model, x, 5, _sgd(), 2)


class BatchNormResNet(nn.Module):
    """A stem and one residual block with BatchNorm2d, then a head with a BatchNorm1d without
    affine parameters: every buffer of the model is a running statistic (or its counter)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8))
        self.block = nn.Sequential(
            nn.Conv2d(8, 8, 3, padding=1, bias=False),
            nn.BatchNorm2d(8, momentum=0.2),
            nn.ReLU(),
            nn.Conv2d(8, 8, 3, padding=1, bias=False),
            nn.BatchNorm2d(8),
        )
        self.head = nn.Sequential(
            nn.Linear(8, 6), nn.BatchNorm1d(6, affine=False), nn.ReLU(), nn.Linear(6, 3)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.stem(x))
        x = F.relu(x + self.block(x))
        return self.head(x.mean(dim=(2, 3)))


def batchnorm_resnet(device: str = "cpu") -> Case:
    """BatchNorm everywhere, three SGD steps: with ``buffers="write_back"`` the running
    statistics must end equal to eager's too."""
    torch.manual_seed(0)
    model = BatchNormResNet().to(device)
    x = torch.randn(4, 3, 8, 8, device=device)
    return _classifier(model, x, 3, _sgd(), 3)


class TinyTransformer(nn.Module):
    """Token embedding + learned positions, one pre-norm block (multi-head attention, MLP),
    final LayerNorm, output head tied to the embedding."""

    def __init__(self, vocab: int = 50, dim: int = 32, heads: int = 4, seq: int = 12) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(seq, dim) * 0.02)
        self.ln1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, dropout=0.1, batch_first=True)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.drop = nn.Dropout(0.1)
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.embed.weight  # tied
        mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)
        self.register_buffer("causal", mask, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        x = self.embed(tokens) + self.pos[:t]
        h = self.ln1(x)
        a, _ = self.attn(h, h, h, attn_mask=self.causal[:t, :t], need_weights=False)
        x = x + self.drop(a)
        x = x + self.drop(self.mlp(self.ln2(x)))
        return self.lm_head(self.ln_f(x))


def tiny_transformer(device: str = "cpu") -> Case:
    torch.manual_seed(0)
    model = TinyTransformer().to(device)
    tokens = torch.randint(0, 50, (3, 12), device=device)

    def loss_fn(logits: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits[:, :-1].reshape(-1, 50), tokens[:, 1:].reshape(-1))

    return {
        "model": model,
        "inputs": (tokens,),
        "loss_fn": loss_fn,
        # SGD, not Adam: on older builds the fake mode's propagation picks attention kernels that
        # round differently (grads equal to ~1e-6); Adam's normalisation turns such rounding on
        # near-zero gradients into visible parameter differences.
        "optimizer": _sgd(lr=0.05),
        "steps": 2,
    }


class CellLoop(nn.Module):
    """A recurrent cell (``nn.GRUCell`` by default, ``nn.LSTMCell``, ``nn.RNNCell``) unrolled
    over time in Python, with a readout at every step."""

    def __init__(self, kind: str = "GRUCell") -> None:
        super().__init__()
        self.cell = getattr(nn, kind)(6, 10)
        self.out = nn.Linear(10, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.new_zeros(x.shape[1], 10)
        state: Any = (h, h) if isinstance(self.cell, nn.LSTMCell) else h
        outs = []
        for t in range(x.shape[0]):
            state = self.cell(x[t], state)
            h = state[0] if isinstance(state, tuple) else state
            outs.append(self.out(h))
        return torch.stack(outs)


def rnn_cell_loop(device: str = "cpu") -> Case:
    torch.manual_seed(0)
    model = CellLoop().to(device)
    return {
        "model": model,
        "inputs": (torch.randn(5, 4, 6, device=device),),
        "optimizer": _sgd(),
        "steps": 2,
    }


class Symmetric(nn.Module):
    """A custom parametrization: the weight is ``triu(X) + triu(X, 1).T``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.triu() + x.triu(1).transpose(-1, -2)


def _parametrized_mlp(device: str, wrap: Callable[[nn.Linear], nn.Module]) -> Case:
    torch.manual_seed(0)
    first = wrap(nn.Linear(8, 8))
    model = nn.Sequential(first, nn.Tanh(), nn.Linear(8, 2)).to(device)
    return {
        "model": model,
        "inputs": (torch.randn(6, 8, device=device),),
        "optimizer": _sgd(lr=0.05),
        "steps": 2,
    }


def weight_norm_model(device: str = "cpu") -> Case:
    return _parametrized_mlp(device, weight_norm)


def orthogonal_model(device: str = "cpu") -> Case:
    return _parametrized_mlp(device, orthogonal)


def custom_parametrization(device: str = "cpu") -> Case:
    def wrap(m: nn.Linear) -> nn.Module:
        parametrize.register_parametrization(m, "weight", Symmetric())
        return m

    return _parametrized_mlp(device, wrap)


def spectral_norm_model(device: str = "cpu") -> Case:
    return _parametrized_mlp(device, spectral_norm)


def sparse_embedding(device: str = "cpu") -> Case:
    """``nn.Embedding(sparse=True)``: AccumulateGrad keeps sparse gradients sparse."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(20, 6, sparse=True), nn.Flatten(), nn.Linear(18, 2))
    model.to(device)
    return {
        "model": model,
        "inputs": (torch.randint(0, 20, (4, 3), device=device),),
        "optimizer": functools.partial(torch.optim.SGD, lr=0.1),
        "steps": 2,
    }


#: name -> factory, in the order of the issue's list.
ZOO: dict[str, Callable[[str], Case]] = {
    "mlp": mlp,
    "conv_bn_channels_last": conv_bn_channels_last,
    "batchnorm_resnet": batchnorm_resnet,
    "tiny_transformer": tiny_transformer,
    "rnn_cell_loop": rnn_cell_loop,
    "weight_norm": weight_norm_model,
    "orthogonal": orthogonal_model,
    "custom_parametrization": custom_parametrization,
    "spectral_norm": spectral_norm_model,
    "sparse_embedding": sparse_embedding,
}
