"""Failures that wait for a fix outside these tests (issue 38): one reason per cause, named
after the op and the run that showed it. A test marks itself ``xfail(strict=False)`` with one
of them for the devices and kernels the cause applies to (:func:`xfail`), so a fix shows as
XPASS rather than failing, and the entry can then be removed here.

Observed on one NVIDIA H200 with torch 2.11.0+cu130 (the issue's first GPU run) or on the CPU
with torch 2.13.0 and 2.14.1; "expected" marks a case that takes the same op as an observed one
and has not run yet. ``tests/cuda_check.py`` lists every XFAIL and XPASS of a GPU run with its
reason.
"""

from __future__ import annotations

import pytest

H200 = "H200, torch 2.11.0+cu130"

#: nn.GRUCell on CUDA, and nn.GRU without cuDNN (its cell is the same kernel).
GRU_FUSED_CELL = (
    "aten._thnn_fused_gru_cell (CUDA's GRU cell kernel) has no meta kernel: FakeTensorMode runs "
    "the real kernel on zero-filled inputs, so the propagated values, and so the gradients, are "
    f"silently wrong ({H200}: an nn.GRUCell loop; nn.GRU without cuDNN expected, same kernel)"
)
#: nn.LSTM / nn.GRU / nn.RNN with cuDNN.
CUDNN_RNN = (
    "aten._cudnn_rnn under real-value propagation: 'Attempted to set the storage of a tensor on "
    f'device "meta" to a storage on different device "cuda:0"\' ({H200}: nn.LSTM; nn.GRU and '
    "nn.RNN expected, same op)"
)
#: nn.LSTM on the CPU.
MKLDNN_LSTM = (
    "CPU nn.LSTM: the fake kernel of aten.mkldnn_rnn_layer.default disagrees with the real one at "
    "output[3] (the workspace: fake size 0, real size > 0), MetadataMismatchError (torch 2.13.0 "
    "and 2.14.1 CPU); being fixed in the core"
)
#: A PackedSequence into nn.LSTM / nn.GRU / nn.RNN.
PACKED_SEQUENCE = (
    "a PackedSequence input: the RNN kernel reads batch_sizes' values (aten._local_scalar_dense), "
    "which a FakeTensorMode without a ShapeEnv refuses: DataDependentOutputException (torch "
    "2.13.0 and 2.14.1 CPU, the same with the patch uninstalled; on CUDA expected as well, or "
    "aten._cudnn_rnn's failure first)"
)
#: BatchNorm whose input needs no gradient (output_mask[0] False), CPU.
BN_NO_INPUT_GRAD_CPU = (
    "aten.native_batch_norm_backward with output_mask[0] False (the BatchNorm's input needs no "
    "gradient): the fake kernel returns a grad_input tensor where the real kernel returns None, "
    "and propagation's check (fake_utils._check_fake_real_tensors) raises TypeError (torch 2.13.0 "
    "and 2.14.1 CPU, the same with the patch uninstalled)"
)
#: BatchNorm backward through CUDA's native kernel with a False in its output mask.
BN_MASK_CUDA = (
    "aten.native_batch_norm_backward with a False in output_mask (a frozen weight or bias, "
    "affine=False, an input without gradient) on CUDA: the fake kernel returns None where the "
    f"real kernel returns an empty tensor, MetadataMismatchError ({H200})"
)
#: float32 attention on CUDA (SDPA's memory-efficient kernel).
SDPA_EFFICIENT = (
    "aten._scaled_dot_product_efficient_attention (float32 attention on CUDA): its philox "
    "seed/offset outputs are on another device in the fake kernel than in the real one, "
    f"MetadataMismatchError ({H200}: a float32 TransformerEncoderLayer)"
)
#: buffers="write_back" of BatchNorm's running statistics on CUDA.
BN_WRITE_BACK_CUDA = (
    "buffers=\"write_back\" on CUDA: BatchNorm's running_mean ends about 1.5x eager's update "
    f"({H200})"
)


def xfail(request: pytest.FixtureRequest, reason: str) -> None:
    """Mark the running test ``xfail(strict=False)`` with ``reason`` (call it before the part
    that fails)."""
    request.applymarker(pytest.mark.xfail(strict=False, reason=reason))
