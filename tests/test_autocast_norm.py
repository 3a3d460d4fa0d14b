"""Issue 18.3: CPU autocast with BatchNorm/LayerNorm/GroupNorm under real-value propagation.

Upstream (2.13.0, 2.14.1, patched or not): the CPU kernel returns the norm's statistics in
float32 for a reduced-precision input with float32 parameters, the fake kernel in the input
dtype, and propagation raises ``MetadataMismatchError`` at the first norm. Issue 39: in a user's
mode (no ShapeEnv) the patch makes the op's outputs from the real kernel's (what eager runs):
the model trains like eager, with a ``propagation_rebuilt`` trace event naming the op; the fake
kernels torch.compile and export share are untouched. With ``propagation="upstream"`` the
patch says what the refusal is: a ``propagation_mismatch`` trace event naming the known defect,
a note on the exception (Python 3.11+), and a plain ``verify`` error; the documented workaround
(the norm in float32) trains like eager. On CUDA, autocast runs the norms in float32: no
mismatch.
"""

from __future__ import annotations

import copy
import functools
import gc
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch._functorch.config as functorch_config
import torch._subclasses.fake_tensor as fake_tensor_module
from _helpers import assert_real_grads_equal, fake_mode, fake_path_is_exact
from test_trace import check_schema
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

import fakegrad_patch
from fakegrad_patch import trace

pytestmark = pytest.mark.usefixtures("propagate")


@pytest.fixture(autouse=True)
def _collect() -> Iterator[None]:
    """The upstream error's traceback holds the mode in reference cycles: collect them, so that
    no later ``uninstall()`` (other test files) finds these modes' records still alive."""
    yield
    gc.collect()


#: None on builds without the class (then nothing here can be refused)
MismatchError: Any = getattr(fake_tensor_module, "MetadataMismatchError", None)


@functools.cache
def _upstream_refuses() -> bool:
    """Behaviour, not version: does this build's propagation check refuse CPU autocast norms?"""
    if MismatchError is None:
        return False
    try:
        with (
            functorch_config.patch(fake_tensor_propagate_real_tensors=True),
            fakegrad_patch.patched(propagation="upstream"),
        ):
            _run_autocast(_model("layer_norm"), _input("layer_norm"), torch.bfloat16)
    except MismatchError:
        return True
    finally:
        gc.collect()
    return False


@pytest.fixture
def refused() -> None:
    if not _upstream_refuses():
        pytest.skip("this build's propagation does not refuse CPU autocast norms")


def _model(norm: str) -> nn.Module:
    torch.manual_seed(0)
    if norm == "layer_norm":
        return nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    if norm == "group_norm":
        return nn.Sequential(nn.Conv2d(3, 4, 1), nn.GroupNorm(2, 4))
    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4))
    return model.eval() if norm == "batch_norm_eval" else model


def _input(norm: str) -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(3, 6) if norm == "layer_norm" else torch.randn(2, 3, 4, 4)


NORMS = {
    "layer_norm": "aten.native_layer_norm",
    "batch_norm": "aten.native_batch_norm",
    "batch_norm_eval": "aten.native_batch_norm",
    "group_norm": "aten.native_group_norm",
}
DTYPES = [torch.bfloat16, torch.float16]


def _run_autocast(model: nn.Module, x: torch.Tensor, dtype: torch.dtype) -> None:
    with FakeTensorMode(allow_non_fake_inputs=True), torch.autocast("cpu", dtype=dtype):
        model(x).float().pow(2).mean().backward()


@pytest.fixture
def upstream_propagation() -> None:
    """Upstream's propagation (the repairs off), whether the patch is installed or not (the
    can-fail run uninstalls it); conftest.py restores the settings after the test."""
    fakegrad_patch.configure(propagation="upstream")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("norm", NORMS)
def test_the_norms_train_like_eager_from_the_real_kernels_outputs(
    refused: None, norm: str, dtype: torch.dtype
) -> None:
    """The repairs rebuild the outputs whose fake kernel disagrees (``propagation="repair"``
    here; the fast path never runs the fake kernel: tests/test_programs.py)."""
    if fakegrad_patch.settings().propagation == "fast":
        fakegrad_patch.configure(propagation="repair")
    model, x = _model(norm), _input(norm)
    reference = copy.deepcopy(model)
    with trace.capture(trace.INFO) as events:
        _run_autocast(model, x, dtype)
    with torch.autocast("cpu", dtype=dtype):
        reference(x).float().pow(2).mean().backward()
    assert_real_grads_equal(model, reference, atol=0, rtol=0)
    rebuilt = [e for e in events if e["event"] == "propagation_rebuilt"]
    assert rebuilt and all(e["op"].startswith(NORMS[norm]) for e in rebuilt), events
    assert all(e["reason"] == "MetadataMismatchError" and e["outputs"] == "real" for e in rebuilt)
    assert not [e for e in events if e["event"] == "propagation_mismatch"], events
    for event in rebuilt:
        check_schema(event)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("norm", NORMS)
def test_the_mismatch_is_traced_and_explained_on_the_exception(
    refused: None, upstream_propagation: None, norm: str, dtype: torch.dtype
) -> None:
    with trace.capture(trace.WARNING) as events, pytest.raises(MismatchError) as info:
        _run_autocast(_model(norm), _input(norm), dtype)
    mismatches = [e for e in events if e["event"] == "propagation_mismatch"]
    assert len(mismatches) == 1, events
    event = mismatches[0]
    assert event["op"].startswith(NORMS[norm]), event
    assert event["known"] == "cpu_autocast_norm", event
    assert event["cause"].startswith("Dtypes") and "float32" in event["cause"], event
    assert "tensor(" not in str(event), "trace events never carry tensor values"
    check_schema(event)
    if sys.version_info >= (3, 11):
        notes = getattr(info.value, "__notes__", [])
        assert any("CPU autocast" in n and "float32" in n for n in notes), notes


@pytest.mark.parametrize("norm", ["layer_norm", "batch_norm"])
def test_verify_says_what_it_is_and_how_to_work_around_it(
    refused: None, upstream_propagation: None, norm: str
) -> None:
    inner = _model(norm)

    class Autocast(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return self.inner(x).float()

    with pytest.raises(fakegrad_patch.VerifyError) as info:
        fakegrad_patch.verify(Autocast(), _input(norm))
    text = str(info.value)
    assert NORMS[norm] in text and "CPU autocast" in text and "float32" in text, text
    assert "upstream PyTorch defect" in text and "docs/troubleshooting.md" in text, text


class Float32Norm(nn.Module):
    """The documented workaround: the norm outside autocast, in float32."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.norm = norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", enabled=False):
            return self.norm(x.float()).to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("norm", ["layer_norm", "batch_norm", "group_norm"])
def test_the_documented_workaround_trains_like_eager(norm: str, dtype: torch.dtype) -> None:
    model = _model(norm)
    model[1] = Float32Norm(model[1])
    reference = copy.deepcopy(model)
    x = _input(norm)
    _run_autocast(model, x, dtype)
    with torch.autocast("cpu", dtype=dtype):
        reference(x).float().pow(2).mean().backward()
    exact = fake_path_is_exact()  # bit for bit where the build's fake path is (2.13, 2.14)
    assert_real_grads_equal(model, reference, atol=0 if exact else 1e-5, rtol=0 if exact else 1e-4)


def test_without_the_patch_nothing_is_added(refused: None) -> None:
    fakegrad_patch.uninstall()
    try:
        with trace.capture(trace.DEBUG) as events, pytest.raises(MismatchError) as info:
            _run_autocast(_model("layer_norm"), _input("layer_norm"), torch.bfloat16)
        assert not [e for e in events if e["event"] == "propagation_mismatch"]
        assert not getattr(info.value, "__notes__", [])
        del info  # its traceback keeps the mode (and its records) alive
    finally:
        fakegrad_patch.install()
        fakegrad_patch.release_hooks()  # uninstall() armed lasting hooks for live records


def test_other_metadata_mismatch_errors_are_left_alone() -> None:
    """Upstream also raises the class for other checks (CrossRefFakeMode, plain values): only
    propagation's own error gets an event and a note."""
    if MismatchError is None:
        pytest.skip("no MetadataMismatchError on this build")
    with trace.capture(trace.DEBUG) as events:
        error = MismatchError("mismatch between fake value 1 and real value 2 ")
    assert not getattr(error, "__notes__", [])
    assert not [e for e in events if e["event"] == "propagation_mismatch"]


@pytest.mark.cuda
@pytest.mark.parametrize("norm", ["layer_norm", "batch_norm", "group_norm"])
def test_cuda_autocast_runs_the_norms_without_a_mismatch(norm: str) -> None:
    """CUDA autocast runs layer_norm/group_norm in float32 and batch_norm's CUDA kernel and fake
    kernel both keep float32 statistics (sources of 2.13/2.14): no mismatch, eager gradients."""
    model = _model(norm).cuda()
    reference = copy.deepcopy(model)
    x = _input(norm).cuda()
    with fake_mode(), torch.autocast("cuda", dtype=torch.bfloat16):
        model(x).float().pow(2).mean().backward()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        reference(x).float().pow(2).mean().backward()
    assert_real_grads_equal(model, reference, atol=0, rtol=0)
