"""Recurrent layers (issue 38): cells unrolled in a Python loop (``nn.GRUCell``,
``nn.LSTMCell``, ``nn.RNNCell``) and ``nn.GRU`` / ``nn.LSTM`` / ``nn.RNN`` (one layer; two
layers, bidirectional; a ``PackedSequence`` input), on the CPU and on CUDA with cuDNN and
without (``torch.backends.cudnn.flags(enabled=False)``: CUDA's native kernels).

Each case trains a model eagerly and under the patch with ``fakegrad_patch.verify`` (the zoo's
comparison, tests/test_verify.py): two SGD-with-momentum steps, the second backward accumulating
into the first's gradients; every parameter's gradient must be real and equal to eager's, on its
device, with eager's strides, and so must the parameters after each step. Since issue 39 nothing
is pending: CPU's ``mkldnn_rnn_layer`` (a fake kernel that disagrees), packed sequences
(``batch_sizes`` read with ``_local_scalar_dense``), CUDA's ``_thnn_fused_gru_cell`` (no meta
kernel: the fallback's values) and ``_cudnn_rnn`` (a fake kernel that raises) take the real
kernel's outputs or values; the CUDA cases await a GPU to confirm it.
"""

from __future__ import annotations

from typing import Any

import _zoo
import pytest
import torch
from _helpers import DEVICES_CUDNN, assert_verified, kernels, verify_two_steps
from torch import nn

#: Two steps, the second accumulating: what ``verify_two_steps`` makes the patch do per leaf.
SET_THEN_ACCUMULATE = {"set": 1, "accumulate": 1}

#: (time steps, batch, features): small, since every op of a fake step runs twice (fake, real)
T, B, F = 3, 3, 6


@pytest.mark.filterwarnings("ignore::fakegrad_patch.FakeGradPatchWarning")
@pytest.mark.parametrize("kind", ["GRUCell", "LSTMCell", "RNNCell"])
def test_cell_unrolled_in_a_loop_trains_like_eager(kind: str, device: torch.device) -> None:
    torch.manual_seed(0)
    model = _zoo.CellLoop(kind).to(device)
    x = torch.randn(T, B, F, device=device)
    assert_verified(verify_two_steps(model, (x,)), device, SET_THEN_ACCUMULATE)


class Recurrent(nn.Module):
    """``nn.GRU`` / ``nn.LSTM`` / ``nn.RNN`` and a linear readout of every step. The output is
    the readout and the final hidden state (and cell state), so the loss reaches both."""

    def __init__(self, kind: str, layers: int, bidirectional: bool) -> None:
        super().__init__()
        self.rnn = getattr(nn, kind)(F, 8, num_layers=layers, bidirectional=bidirectional)
        self.head = nn.Linear(16 if bidirectional else 8, 3)

    def forward(self, x: Any) -> tuple[torch.Tensor, Any]:
        out, hidden = self.rnn(x)
        if isinstance(out, nn.utils.rnn.PackedSequence):
            out = out.data  # every valid step, packed: no data-dependent unpacking
        return self.head(out), hidden


@pytest.mark.filterwarnings("ignore::fakegrad_patch.FakeGradPatchWarning")
@pytest.mark.parametrize(
    ("layers", "bidirectional"), [(1, False), (2, True)], ids=["1layer", "2layers-bidirectional"]
)
@pytest.mark.parametrize("kind", ["GRU", "LSTM", "RNN"])
@pytest.mark.parametrize(("device", "cudnn"), DEVICES_CUDNN)
def test_recurrent_module_trains_like_eager(
    device: str,
    cudnn: bool | None,
    kind: str,
    layers: int,
    bidirectional: bool,
) -> None:
    torch.manual_seed(0)
    model = Recurrent(kind, layers, bidirectional).to(device)
    x = torch.randn(T, B, F, device=device)
    with kernels(cudnn):
        report = verify_two_steps(model, (x,))
    assert_verified(report, device, SET_THEN_ACCUMULATE)


@pytest.mark.filterwarnings("ignore::fakegrad_patch.FakeGradPatchWarning")
@pytest.mark.parametrize("kind", ["GRU", "LSTM", "RNN"])
@pytest.mark.parametrize(("device", "cudnn"), DEVICES_CUDNN)
def test_packed_sequence_trains_like_eager(device: str, cudnn: bool | None, kind: str) -> None:
    """Sequences of different lengths, packed before the step (as a data loader's collate does),
    into a two-layer bidirectional layer."""
    torch.manual_seed(0)
    model = Recurrent(kind, 2, True).to(device)
    x = torch.randn(T, B, F, device=device)
    packed = nn.utils.rnn.pack_padded_sequence(x, torch.tensor([T, 1, 2]), enforce_sorted=False)
    with kernels(cudnn):
        report = verify_two_steps(model, (packed,))
    assert_verified(report, device, SET_THEN_ACCUMULATE)
