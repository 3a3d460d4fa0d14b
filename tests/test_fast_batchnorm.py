"""Issue 46: BatchNorm's forward takes the fast path: its real kernel runs once.

``native_batch_norm`` (and cuDNN's, MIOpen's) updates the running statistics without its schema
saying so. Upstream's path runs its real kernel and then its decomposition, whose kernels run
for real again (the whole normalisation twice: a conv net with BatchNorm cost 1.9x eager). The
fast path now runs the kernel once on the fakes' values and tells the write-back watch of the
statistics it writes, as of a schema's writes.

Family: BatchNorm 1d/2d/3d, channels_last, affine or not, statistics tracked or not, momentum
None (cumulative average), training and eval; ``buffers="upstream"`` (the update reaches only
the fake copy and is reported) and ``"write_back"`` (it reaches the real buffers once). Each case:
outputs, gradients and buffers as eager's, the trace's reports as before, and the op's kernel
run once (no nested op of a decomposition dispatched under the mode).
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from _helpers import fake_mode, is_real
from torch import nn

import fakegrad_patch
from fakegrad_patch import trace

pytestmark = pytest.mark.usefixtures("propagate")

MODULES: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]] = {
    "1d": (lambda: nn.BatchNorm1d(5), (6, 5)),
    "1d_seq": (lambda: nn.BatchNorm1d(5), (3, 5, 7)),
    "2d": (lambda: nn.BatchNorm2d(4), (3, 4, 5, 5)),
    "2d_channels_last": (lambda: nn.BatchNorm2d(4), (3, 4, 5, 5)),
    "3d": (lambda: nn.BatchNorm3d(3), (2, 3, 3, 4, 4)),
    "no_affine": (lambda: nn.BatchNorm2d(4, affine=False), (3, 4, 5, 5)),
    "untracked": (lambda: nn.BatchNorm2d(4, track_running_stats=False), (3, 4, 5, 5)),
    "momentum_none": (lambda: nn.BatchNorm2d(4, momentum=None), (3, 4, 5, 5)),
}


def _case(name: str, training: bool) -> tuple[nn.Module, nn.Module, torch.Tensor]:
    build, shape = MODULES[name]
    torch.manual_seed(0)
    conv_in = shape[1]
    head = nn.Linear(conv_in, conv_in) if len(shape) == 2 else nn.Identity()
    model = nn.Sequential(head, build())
    with torch.no_grad():  # statistics that are not the defaults: a lost update shows
        bn = model[1]
        if bn.running_mean is not None:
            bn.running_mean.uniform_(-1, 1)
            bn.running_var.uniform_(0.5, 2)
        if bn.weight is not None:
            bn.weight.uniform_(0.5, 1.5)
            bn.bias.uniform_(-0.5, 0.5)
    model.train(training)
    x = torch.randn(*shape, requires_grad=True)
    if name == "2d_channels_last":
        x = x.detach().to(memory_format=torch.channels_last).requires_grad_()
    return model, copy.deepcopy(model), x


def _step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = model(x)
    (out * torch.linspace(-1, 1, out.numel()).reshape(out.shape)).sum().backward()
    return out


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("buffers", ["upstream", "write_back"])
@pytest.mark.parametrize("name", list(MODULES))
def test_batch_norm_runs_its_kernel_once(name: str, buffers: str, training: bool) -> None:
    fakegrad_patch.configure(buffers=buffers)
    if buffers == "write_back" and not fakegrad_patch.status()["write_back"]:
        pytest.skip("write-back unavailable on this build")
    model, reference, x = _case(name, training)
    x_ref = x.detach().clone().requires_grad_()
    out_ref = _step(reference, x_ref)
    before = {k: v.clone() for k, v in model.state_dict().items()}

    with trace.capture("debug") as events, fake_mode():
        out = _step(model, x)
        values = out.real_tensor.clone()

    torch.testing.assert_close(values, out_ref.detach(), rtol=1e-5, atol=1e-6)
    for (pname, p), p_ref in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert is_real(p.grad), pname
        torch.testing.assert_close(p.grad, p_ref.grad, rtol=1e-5, atol=1e-6, msg=pname)
    assert is_real(x.grad)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-6)

    bn = model[1]
    tracked = bn.running_mean is not None
    updates = training and tracked
    names = [e["event"] for e in events]
    lost = [e for e in events if e["event"] == "update_lost"]
    if buffers == "write_back" or not updates:
        for key, value in reference.state_dict().items():
            torch.testing.assert_close(model.state_dict()[key], value, msg=key)
        assert not lost
    else:
        # the update reached only the fake copy (upstream's semantics): the real statistics
        # are as they were, and each lost update is reported
        for key in ("1.running_mean", "1.running_var"):
            assert torch.equal(model.state_dict()[key], before[key]), key
        assert len(lost) >= 2, names
    if updates and buffers == "write_back":
        assert names.count("buffer_written_back") >= 2, names
        assert not torch.equal(bn.running_mean, before["1.running_mean"])

    fast_ops = [e.get("op") for e in events if e["event"] == "propagation_fast"]
    if fakegrad_patch.settings().propagation == "fast":
        # the forward's kernel took the fast path, and no decomposition of it ran under the
        # mode (its kernels would have run for real a second time)
        assert "aten.native_batch_norm.default" in fast_ops, fast_ops
        assert not any(
            op in fast_ops for op in ("aten.var_mean.correction", "aten.rsqrt.default")
        ), fast_ops
