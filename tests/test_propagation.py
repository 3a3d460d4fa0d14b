"""Issue 39: what the patch does to real-value propagation itself, one section per family. Every
test compares with eager PyTorch (same values, no fake mode). The families, found by the operator
sweep (tests/opinfo_sweep.py):

1. real gradients reaching a real leaf while a fake mode is on the stack (a real ``grad_tensors``
   passed on unchanged, a real root, ``backward()`` of a real scalar inside the block);
2. in-place ops that FakeTensorMode decomposes: the update applied once (``index_add_``, the
   backward of an overlapping ``as_strided``, ``stft``);
3. ops without a meta kernel (the unsafe fallback kernel): the real kernel's values, or none;
4. data-dependent ops in a propagating mode without a ShapeEnv: the real kernel's shapes and
   scalars (``nonzero``, ``masked_select``, mask reads, ``unique``, ``.item()``, ...);
5. fake kernels that disagree with the real kernel: the outputs made from the real kernel's
   (custom ops whose fake kernel is wrong on purpose, ``nn.LSTM`` on CPU);
6. what stays upstream's: modes with a ShapeEnv, ``propagation="upstream"``.

The ones that fail on upstream torch are listed in test_can_fail.py.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import gc
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch._subclasses.fake_tensor as fake_tensor_module
from _helpers import fake_mode, is_real
from test_trace import check_schema
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

import fakegrad_patch
from fakegrad_patch import FakeGradPatchWarning, trace

pytestmark = pytest.mark.usefixtures("propagate")


@pytest.fixture(autouse=True)
def _collect() -> Iterator[None]:
    """Refused ops' tracebacks hold their modes in reference cycles."""
    yield
    gc.collect()


def _values(t: torch.Tensor) -> torch.Tensor:
    """A real copy of what a fake tensor really holds (or of a real tensor), made with the modes
    disabled (inside the block, an op on the real values would go to the fake mode)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    real = t.real_tensor if isinstance(t, FakeTensor) else t
    assert real is not None, "no real values"
    with unset_fake_temporarily():
        return real.clone()


def _events(events: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    found = [e for e in events if e["event"] == name]
    for event in found:
        check_schema(event)
    return found


# -- 1. real gradients under a fake mode -----------------------------------------------------------

#: ops whose backward hands the incoming gradient on unchanged to the leaf
IDENTITY_BACKWARD: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "itself": lambda x: x,
    "contiguous": lambda x: x.contiguous(),
    "flatten": lambda x: x.flatten(),
    "dropout_p0": lambda x: nn.functional.dropout(x, 0.0),
    "add_real": lambda x: x + torch.ones(3),
    "positive": lambda x: +x,
}


@pytest.mark.parametrize("op", IDENTITY_BACKWARD)
@pytest.mark.parametrize("prior", [False, True], ids=["first", "accumulate"])
def test_a_real_gradient_inside_the_block_is_written_as_in_eager(op: str, prior: bool) -> None:
    """Upstream: AccumulateGrad clones (or adds into) the real gradient with the fake mode in
    thread-local state: a FakeTensor ``.grad`` (or an accumulation into a fake copy, lost)."""
    f = IDENTITY_BACKWARD[op]
    x = torch.randn(3, requires_grad=True)
    ref = x.detach().clone().requires_grad_(True)
    if prior:
        x.grad = torch.full((3,), 2.0)
        ref.grad = torch.full((3,), 2.0)
    before = x.grad
    g = torch.arange(3.0)
    with fake_mode():
        f(x).backward(g)
    f(ref).backward(g)
    assert is_real(x.grad)
    torch.testing.assert_close(x.grad, ref.grad, rtol=0, atol=0)
    if prior:
        assert x.grad is before  # accumulated in place, as AccumulateGrad does
    assert x.grad.untyped_storage().data_ptr() != g.untyped_storage().data_ptr()


def test_real_scalar_root_inside_the_block() -> None:
    """``z.backward()`` of a real scalar: torch makes the gradient (``ones_like``) under the
    fake mode: a fake one, with real values."""
    z = torch.tensor(3.0, requires_grad=True)
    with fake_mode():
        z.backward()
        (z * 2).backward()
    assert is_real(z.grad)
    assert z.grad.item() == 3.0


def test_one_real_gradient_into_two_leaves() -> None:
    x, y = (torch.randn((), requires_grad=True) for _ in range(2))
    with fake_mode():
        (x + y).backward(torch.tensor(2.0))
    assert is_real(x.grad) and is_real(y.grad)
    assert x.grad.item() == 2.0 and y.grad.item() == 2.0
    assert x.grad.untyped_storage().data_ptr() != y.grad.untyped_storage().data_ptr()


def test_a_real_backward_outside_any_mode_is_left_to_autograd() -> None:
    x = torch.randn(3, requires_grad=True)
    g = torch.ones(3)
    with trace.capture(trace.DEBUG) as events:
        x.backward(g)
    assert x.grad is not None and torch.equal(x.grad, g)
    assert not [e for e in events if e["event"].startswith(("leaf_armed", "fake_grad"))]


# -- 2. in-place ops that FakeTensorMode decomposes ------------------------------------------------

_IDX = torch.tensor([0, 1, 1, 3])

#: in-place ops with a Python decomposition that FakeTensorMode runs under the mode (its nested
#: in-place ops run for real too), and their neighbours that are right upstream
INPLACE: dict[str, Callable[[torch.Tensor, torch.Tensor], Any]] = {
    "index_add_": lambda z, s: z.index_add_(0, _IDX, s),
    "index_add_alpha": lambda z, s: z.index_add_(0, _IDX, s, alpha=-2.0),
    "index_add_2d": lambda z, s: z.view(5, 1).index_add_(0, _IDX, s.view(4, 1)),
    "index_put_accumulate": lambda z, s: z.index_put_((_IDX,), s, accumulate=True),
    "scatter_add_": lambda z, s: z.scatter_add_(0, _IDX, s),
    "index_copy_": lambda z, s: z.index_copy_(0, torch.tensor([4, 2]), s[:2]),
    "view_index_add_": lambda z, s: z[1:].index_add_(0, _IDX[:3], s[:3]),
}


@pytest.mark.parametrize("op", INPLACE)
def test_a_decomposed_in_place_op_updates_the_values_once(op: str) -> None:
    f = INPLACE[op]
    torch.manual_seed(0)
    base, src = torch.randn(5), torch.randn(4)
    want = base.clone()
    f(want, src)
    with fake_mode():
        z = base * 1  # a fake intermediate with propagated values
        f(z, src)
        got = _values(z)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize(
    "geometry",
    [((13, 16), (4, 1), 64), ((5, 5), (1, 1), 9), ((3, 4), (2, 1), 12), ((4, 4), (4, 1), 16)],
    ids=["stft_frames", "diagonal_bands", "half_overlap", "no_overlap"],
)
def test_overlapping_as_strided_backward_gives_eager_gradients(geometry: Any) -> None:
    """as_strided's backward over an overlapping geometry sums the overlaps with ``index_add_``
    (decomposed): upstream's propagated gradient was 708 off for stft's frames."""
    size, stride, n = geometry
    torch.manual_seed(0)
    x = torch.randn(n, requires_grad=True)
    w = torch.randn(size)
    ref = x.detach().clone().requires_grad_(True)
    with fake_mode():
        x.as_strided(size, stride).mul(w).sum().backward()
    ref.as_strided(size, stride).mul(w).sum().backward()
    assert is_real(x.grad)
    torch.testing.assert_close(x.grad, ref.grad)


def test_stft_gradient_is_eager() -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 64, requires_grad=True)
    ref = x.detach().clone().requires_grad_(True)
    window = torch.hann_window(16)
    with fake_mode():
        torch.stft(x, 16, 4, window=window, return_complex=True).abs().sum().backward()
    torch.stft(ref, 16, 4, window=window, return_complex=True).abs().sum().backward()
    torch.testing.assert_close(x.grad, ref.grad)


def test_the_repair_is_traced() -> None:
    """``propagation="repair"`` (upstream's path; the fast path runs an in-place op's real
    kernel once itself and no nested op writes). With the suite's repairs off
    (tests/test_can_fail.py) they stay off, and the test must fail."""
    if fakegrad_patch.settings().propagation != "upstream":
        fakegrad_patch.configure(propagation="repair")
    with trace.capture(trace.INFO) as events, fake_mode():
        z = torch.zeros(5) * 1
        z.index_add_(0, _IDX, torch.ones(4))
    repaired = _events(events, "propagation_repaired")
    assert [(e["op"], e["repair"], e["values"]) for e in repaired] == [
        ("aten.index_put_.default", "nested_write", "shadow")
    ]


# -- 3. ops without a meta kernel: the unsafe fallback ---------------------------------------------


@functools.cache
def _fallback_ops() -> dict[str, Any]:
    """Two ops in a namespace FakeTensorMode's fallback allows (``vision``, as torchvision's):
    one whose meta kernel raises NotImplementedError (upstream returns the zeros' result without
    propagating), one without any (upstream propagates)."""
    lib = torch.library.Library("vision", "FRAGMENT")
    lib.define("fakegrad_affine_nometa(Tensor x) -> Tensor")
    lib.define("fakegrad_affine_raises(Tensor x) -> Tensor")
    for name in ("fakegrad_affine_nometa", "fakegrad_affine_raises"):
        lib.impl(name, lambda x: x * 2 + 1, "CPU")

    def meta(x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("no meta kernel")

    lib.impl("fakegrad_affine_raises", meta, "Meta")
    _fallback_ops.lib = lib  # type: ignore[attr-defined]
    return {
        "meta_raises": torch.ops.vision.fakegrad_affine_raises.default,
        "no_meta": torch.ops.vision.fakegrad_affine_nometa.default,
    }


@pytest.mark.parametrize("which", ["meta_raises", "no_meta"])
def test_an_op_without_a_meta_kernel_gets_the_real_kernels_values(which: str) -> None:
    op = _fallback_ops()[which]
    x = torch.arange(4.0)
    w = torch.randn(4, requires_grad=True)
    ref = w.detach().clone().requires_grad_(True)
    with fake_mode():
        y = op(x)
        values = _values(y)
        (y * w).sum().backward()
    (op(x) * ref).sum().backward()
    torch.testing.assert_close(values, x * 2 + 1)
    torch.testing.assert_close(w.grad, ref.grad, rtol=0, atol=0)


def test_an_op_without_a_meta_kernel_and_without_values_is_reported() -> None:
    """An input with no real values (upstream runs no real kernel then): the fallback's
    zeros-values are not copied; the gradient that depends on them is reported (on_missing),
    never written from the zeros."""
    op = _fallback_ops()["meta_raises"]
    w = torch.randn(4, requires_grad=True)
    before = w.grad
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fakegrad_patch._core.state.WARNED.discard("drop")
        with fake_mode():
            x = torch.arange(4.0) * 1
            x.real_tensor = None  # values lost (as for an op whose real kernel could not run)
            y = op(x)
            assert y.real_tensor is None
            (y * w).sum().backward()
    assert w.grad is before
    assert any(issubclass(c.category, FakeGradPatchWarning) for c in caught)


@functools.cache
def _no_fake_op() -> Any:
    """An op with a CPU kernel and neither a fake nor a meta kernel, in a namespace the unsafe
    fallback does not allow (PyTorch's test_custom_op_fallback): upstream raises
    UnsupportedOperatorException."""
    lib = torch.library.Library("fakegrad_nofake", "DEF")
    lib.define("cos(Tensor x) -> Tensor")
    lib.impl("cos", lambda x: x.cos(), "CPU")
    _no_fake_op.lib = lib  # type: ignore[attr-defined]
    return torch.ops.fakegrad_nofake.cos.default


@pytest.mark.parametrize("setting", ["repair", "fast", "upstream"])
def test_an_op_without_a_fake_kernel_gets_the_real_kernels_outputs(setting: str) -> None:
    """On purpose (upstream's own test asserts the refusal): in a propagating mode the outputs
    are made from the real kernel's; ``propagation="upstream"`` keeps upstream's refusal."""
    op = _no_fake_op()
    fakegrad_patch.configure(propagation=setting)  # type: ignore[arg-type]
    x = torch.arange(4.0)
    with fake_mode() as mode:
        if setting == "upstream":
            with pytest.raises(fake_tensor_module.UnsupportedOperatorException, match="nofake"):
                op(mode.from_tensor(x))
            return
        with trace.capture(trace.INFO) as events:
            y = op(mode.from_tensor(x))
        assert isinstance(y, FakeTensor) and y.shape == (4,)
        torch.testing.assert_close(_values(y), x.cos())
    rebuilt = _events(events, "propagation_rebuilt")
    assert [(e["op"], e["reason"]) for e in rebuilt] == [
        ("fakegrad_nofake.cos.default", "UnsupportedOperatorException")
    ]


def test_the_fallback_repair_is_traced() -> None:
    op = _fallback_ops()["meta_raises"]
    with trace.capture(trace.INFO) as events, fake_mode():
        op(torch.arange(4.0))
    repaired = _events(events, "propagation_repaired")
    assert [(e["repair"], e["values"]) for e in repaired] == [("fallback_kernel", "real kernel")]
    assert repaired[0]["op"] == "vision.fakegrad_affine_raises.default"


# -- 4. data-dependent ops -------------------------------------------------------------------------

_MASK = torch.tensor([True, False, True, True, False, False])
#: made outside the mode: real tensors it converts (not constants it could read)
_SECTIONS = torch.tensor(3)
_FILL = torch.tensor([1, 1, 3])
_ROWS = torch.tensor([True, False])


def _computed(values: list[int]) -> torch.Tensor:
    """An integer tensor computed by an op (inside the mode: a fake with propagated values, not
    a constant FakeTensorMode could read)."""
    return torch.tensor(values) + torch.zeros(len(values), dtype=torch.long).abs()


#: forward -> a scalar loss, from a leaf x of shape (6,)
DATA_DEPENDENT: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "masked_select": lambda x: torch.masked_select(x * 2, _MASK).pow(2).sum(),
    "mask_read": lambda x: (x * 2)[_MASK].pow(2).sum(),
    "nonzero_read": lambda x: (x * 2)[torch.nonzero(_MASK).squeeze(1)].pow(2).sum(),
    "index_put_mask": lambda x: (x.view(2, 3) * 1).index_put((_ROWS,), x[:3] * 3).pow(2).sum(),
    "repeat_interleave": lambda x: (
        torch.repeat_interleave(x, torch.tensor([1, 2, 0, 1, 3, 1])).pow(2).sum()
    ),
    "unique_count": lambda x: x.pow(2).sum() * torch.unique(torch.tensor([1, 2, 2, 5])).numel(),
    "item": lambda x: x.pow(2).sum() * (x * 1).sum().item(),
    "bool": lambda x: x.pow(2).sum() if bool((x * 1).sum() > -100) else x.sum(),
    "equal": lambda x: x.pow(2).sum() * (2.0 if torch.equal(x * 1, x * 1) else 3.0),
    "narrow_tensor": lambda x: (x * 2).narrow(0, _computed([1]).squeeze(), 3).pow(2).sum(),
    "tensor_split": lambda x: (x * 2).tensor_split(_SECTIONS)[1].pow(2).sum(),
    "index_fill": lambda x: (x * 1).index_fill(0, _FILL, x[0] * 1).pow(2).sum(),
    "gaussian_nll_loss": lambda x: nn.functional.gaussian_nll_loss(
        x * 1, torch.zeros(6), torch.ones(6)
    ),
    "cov": lambda x: torch.cov(torch.stack([x, x.flip(0)])).sum(),
    "corrcoef": lambda x: torch.corrcoef(torch.stack([x, x.flip(0) * 2])).sum(),
    "tolist": lambda x: x.pow(2).sum() * sum((x * 1).tolist()),
}


@pytest.mark.parametrize("op", DATA_DEPENDENT)
def test_a_data_dependent_op_gives_eager_values_and_gradients(op: str) -> None:
    if op == "tolist" and "tolist" in FakeTensor.__dict__:
        pytest.skip(
            "this build's FakeTensor answers tolist() itself, below no op (2.4: needs a ShapeEnv)"
        )
    f = DATA_DEPENDENT[op]
    torch.manual_seed(0)
    x = torch.randn(6, requires_grad=True)
    ref = x.detach().clone().requires_grad_(True)
    with trace.capture(trace.INFO) as events, fake_mode():
        loss = f(x)
        value = _values(loss)
        loss.backward()
    want = f(ref)
    want.backward()
    torch.testing.assert_close(value, want.detach())
    assert is_real(x.grad)
    torch.testing.assert_close(x.grad, ref.grad)
    # where this build's fake kernels refuse (most ops, every build; tensor_split's 0-dim
    # sections only before 2.14): made from the real kernel's outputs
    assert {e["outputs"] for e in _events(events, "propagation_rebuilt")} <= {"real"}


def test_nonzero_shape_and_values_come_from_the_real_kernel() -> None:
    with fake_mode():
        nz = torch.nonzero(torch.tensor([0, 3, 0, 4]) * 1)
        assert isinstance(nz, FakeTensor) and nz.shape == (2, 1)
        assert _values(nz).tolist() == [[1], [3]]
        assert (torch.tensor([0, 3, 0, 4]) * 1).sum().item() == 7


# -- 5. fake kernels that disagree with the real kernel --------------------------------------------


def _wrong_fake_ops() -> dict[str, Any]:
    """Custom ops whose fake kernel is wrong on purpose, one per way an output can disagree."""
    return _make_wrong_fake_ops()


@functools.cache
def _make_wrong_fake_ops() -> dict[str, Any]:
    ops: dict[str, Any] = {}

    def define(name: str, real: Callable[..., Any], fake: Callable[..., Any], schema: str) -> None:
        # an explicit schema: 2.4's inference cannot read this module's string annotations
        op = torch.library.custom_op(f"fakegrad_test::{name}", mutates_args=(), schema=schema)(real)
        op.register_fake(fake)
        ops[name] = op

    def affine(x: torch.Tensor) -> torch.Tensor:
        return x * 2 + 1

    one = "(Tensor x) -> Tensor"
    define("wrong_shape", affine, lambda x: x.new_empty(x.shape[0] + 1), one)
    define("wrong_dtype", affine, lambda x: x.new_empty(x.shape, dtype=torch.float64), one)
    define("wrong_device", affine, lambda x: torch.empty(x.shape, device="meta"), one)

    def two(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x * 2 + 1, x.sum().reshape(1)

    define(
        "wrong_second_output",
        two,
        lambda x: (torch.empty_like(x), x.new_empty(0)),
        "(Tensor x) -> (Tensor, Tensor)",
    )
    return ops


WRONG_FAKES = ["wrong_shape", "wrong_dtype", "wrong_device", "wrong_second_output"]


def _first(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


@pytest.mark.parametrize("name", WRONG_FAKES)
def test_a_wrong_fake_kernel_gives_way_to_the_real_kernels_outputs(name: str) -> None:
    op = _wrong_fake_ops()[name]
    torch.manual_seed(0)
    x = torch.randn(4)
    w = torch.randn(4, requires_grad=True)
    ref = w.detach().clone().requires_grad_(True)
    with trace.capture(trace.INFO) as events, fake_mode():
        out = _first(op(x))
        assert out.shape == (4,) and out.dtype == torch.float32 and out.device.type == "cpu"
        (out * w).sum().backward()
    (_first(op(x)) * ref).sum().backward()
    torch.testing.assert_close(w.grad, ref.grad, rtol=0, atol=0)
    rebuilt = _events(events, "propagation_rebuilt")
    assert [e["op"] for e in rebuilt] == [f"fakegrad_test.{name}.default"], events
    # MetadataMismatchError where the build's propagation checks fake kernels (2.13+); the
    # patch's own check where it does not (2.4)
    assert rebuilt[0]["reason"] in ("MetadataMismatchError", "unchecked mismatch")
    assert not _events(events, "propagation_mismatch")


@pytest.mark.parametrize("setting", ["upstream", "shape_env"])
def test_where_the_repair_is_off_or_a_tracer_owns_the_mode_upstream_refuses(setting: str) -> None:
    """``propagation="upstream"``, or a mode with a ShapeEnv (torch.compile's, export's):
    upstream's refusal, said plainly (``propagation_mismatch``)."""
    error = getattr(fake_tensor_module, "MetadataMismatchError", None)
    if error is None:
        pytest.skip("this build's propagation checks no fake kernel")
    op = _wrong_fake_ops()["wrong_shape"]
    if setting == "upstream":
        fakegrad_patch.configure(propagation="upstream")
        mode = fake_mode()
    else:
        from torch.fx.experimental.symbolic_shapes import ShapeEnv

        mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv())
    with trace.capture(trace.WARNING) as events, mode, pytest.raises(error):
        op(torch.randn(4))
    if setting == "upstream":
        assert _events(events, "propagation_mismatch")


@pytest.mark.parametrize("op", ["nonzero", "item"])
def test_with_propagation_upstream_data_dependent_ops_refuse(op: str) -> None:
    fakegrad_patch.configure(propagation="upstream")
    with fake_mode(), pytest.raises(Exception, match=r"DataDependent|DynamicOutputShape|aten"):
        y = torch.tensor([0.0, 1.0]) * 1
        torch.nonzero(y) if op == "nonzero" else y.sum().item()


@pytest.mark.parametrize(
    "make",
    [
        lambda: nn.LSTM(8, 16, num_layers=2, bidirectional=True, batch_first=True),
        lambda: nn.LSTM(8, 16),
        lambda: nn.GRU(8, 16, num_layers=2),
        lambda: nn.RNN(8, 16, nonlinearity="relu"),
    ],
    ids=["lstm_2layer_bidirectional", "lstm", "gru", "rnn"],
)
def test_recurrent_layers_on_cpu_train_like_eager(make: Callable[[], nn.Module]) -> None:
    """``nn.LSTM`` on CPU stopped at ``aten.mkldnn_rnn_layer`` (fake output[3] of size 0, real
    61440, 2.13.0): its outputs now come from the real kernel."""
    torch.manual_seed(0)
    model = make()
    reference = copy.deepcopy(model)
    x = torch.randn(5, 3, 8)
    with fake_mode():
        model(x)[0].pow(2).sum().backward()
    reference(x)[0].pow(2).sum().backward()
    for p, r in zip(model.parameters(), reference.parameters(), strict=True):
        assert is_real(p.grad)
        torch.testing.assert_close(p.grad, r.grad)


def test_an_error_out_of_the_mode_names_the_op() -> None:
    """What cannot be repaired is raised as upstream raises it, naming the op (a note)."""
    import sys

    if sys.version_info < (3, 11):
        pytest.skip("exception notes need Python 3.11")
    with fake_mode(), pytest.raises(RuntimeError) as info:
        torch.ones(2, 3) @ torch.ones(2, 3)
    assert any("aten.mm" in n for n in getattr(info.value, "__notes__", [])), info.value


# -- 7. the fast path (issue 41): exact, aliasing as eager, upstream's semantics where it must -----

#: forward -> output, from a leaf x of shape (4, 6): views of every kind, and what follows them
VIEWS: dict[str, Callable[[torch.Tensor], Any]] = {
    "view": lambda x: x.view(24),
    "transpose": lambda x: x.t(),
    "expand": lambda x: x[:1].expand(3, 6),
    "diagonal": lambda x: x.diagonal(),
    "as_strided_offset": lambda x: x.as_strided((2, 2), (6, 1), 7),
    "split": lambda x: x.split(2),
    "unbind": lambda x: x.unbind(1),
    "chunk_of_slice": lambda x: x[1:].chunk(3, dim=1),
    "unfold": lambda x: x.unfold(1, 3, 2),
    "view_as_complex": lambda x: torch.view_as_complex(x.view(4, 3, 2)),
    "real_of_complex": lambda x: torch.view_as_complex(x.view(4, 3, 2)).real,
    "conj": lambda x: torch.view_as_complex(x.view(4, 3, 2)).conj(),
    "unsqueeze_squeeze": lambda x: x.unsqueeze(0).squeeze(0),
}


def _loss(out: Any) -> torch.Tensor:
    outs = out if isinstance(out, tuple | list) else (out,)
    total = torch.zeros(())
    for i, o in enumerate(outs):
        value = torch.view_as_real(o.resolve_conj()) if o.is_complex() else o
        total = total + (value * (i + 1.5)).sin().sum()
    return total


@pytest.mark.parametrize("view", VIEWS)
def test_views_on_the_fast_path_give_eager_values_and_gradients(view: str) -> None:
    f = VIEWS[view]
    torch.manual_seed(0)
    x = torch.randn(4, 6, requires_grad=True)
    ref = x.detach().clone().requires_grad_(True)
    with fake_mode():
        y = x * 1  # a fake base
        out = f(y)
        got = [_values(o) for o in (out if isinstance(out, tuple | list) else (out,))]
        _loss(out).backward()
    want = f(ref * 1)
    _loss(want).backward()
    for g, w in zip(got, want if isinstance(want, tuple | list) else (want,), strict=True):
        torch.testing.assert_close(g.resolve_conj(), w.detach().resolve_conj(), rtol=0, atol=0)
    torch.testing.assert_close(x.grad, ref.grad)


@pytest.mark.parametrize("view", ["view", "transpose", "diagonal", "as_strided_offset", "split"])
def test_a_fast_view_aliases_its_base_as_eager(view: str) -> None:
    """An in-place update of the base reaches the view's values (the real tensors alias), and
    the fake view shares the fake base's storage (as upstream's fake view does)."""
    f = VIEWS[view]
    with fake_mode():
        base = torch.arange(24.0).view(4, 6) * 1
        out = f(base)
        first = out[0] if isinstance(out, tuple | list) else out
        assert first.untyped_storage()._cdata == base.untyped_storage()._cdata
        base.add_(100)
        got = _values(first)
    want = f(torch.arange(24.0).view(4, 6) + 100)
    torch.testing.assert_close(got, want[0] if isinstance(want, tuple | list) else want)


@pytest.mark.parametrize("view", VIEWS)
def test_a_fast_view_has_its_real_views_metadata_over_the_base_storage(view: str) -> None:
    """Each fake view: the real view's sizes, strides and offset, over the fake base's storage
    (the same storage, never grown: the fake view is made over it directly, not dispatched)."""
    f = VIEWS[view]
    with fake_mode():
        base = torch.arange(24.0).view(4, 6) * 1
        nbytes = base.untyped_storage().nbytes()
        out = f(base)
        for o in out if isinstance(out, tuple | list) else (out,):
            real = o.real_tensor
            assert (o.shape, o.stride(), o.storage_offset()) == (
                real.shape,
                real.stride(),
                real.storage_offset(),
            )
            if o.dtype == base.dtype:
                assert o.untyped_storage()._cdata == base.untyped_storage()._cdata
        assert base.untyped_storage().nbytes() == nbytes


@pytest.mark.parametrize("view", ["view", "transpose", "diagonal", "split", "real_of_complex"])
@pytest.mark.parametrize(
    "where", ["normal base", "normal base in inference mode", "inference base", "both inference"]
)
def test_a_fast_view_is_an_inference_tensor_where_eagers_is(view: str, where: str) -> None:
    """A view is an inference tensor exactly where its base is (inference mode or not, as eager's
    view); its values are eager's, and it follows its base's version counter where eager's
    does."""
    f = VIEWS[view]
    base_inference = where in ("inference base", "both inference")
    mode_inference = where in ("normal base in inference mode", "both inference")

    def run(fake: bool) -> tuple[Any, bool, int]:
        with fake_mode() if fake else contextlib.nullcontext():
            with torch.inference_mode(base_inference):
                base = torch.arange(24.0).view(4, 6) * 1
            with torch.inference_mode(mode_inference):
                out = f(base)
                first = out[0] if isinstance(out, tuple | list) else out
                inference = first.is_inference()
            if not base.is_inference():
                with torch.no_grad():
                    base.add_(1)  # a view of a normal tensor shares its version counter
            version = None if inference else first._version  # inference: no counter
            return (_values(first) if fake else first.detach()), inference, version

    got, want = run(True), run(False)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    assert got[1] == want[1]
    if (view, where) != ("real_of_complex", "normal base in inference mode"):
        assert got[2] == want[2]
    # else: a dtype-changing view takes upstream's path, and upstream's own fake ``.real`` made in
    # inference mode does not share its base's version counter (0 against eager's 1, with or
    # without the patch, with or without propagation: FakeTensorMode's, not the patch's)


def test_a_view_of_a_real_parameter_converts_it_as_upstream_does() -> None:
    """``w.t()`` inside the mode on a real Parameter: converted (D2 repaired where the build
    needs it, armed), and the gradient through the view is eager's."""
    torch.manual_seed(0)
    lin = nn.Linear(5, 3)
    ref = copy.deepcopy(lin)
    x = torch.randn(2, 5)
    with fake_mode():
        (x @ lin.weight.t() + lin.bias).square().sum().backward()
    (x @ ref.weight.t() + ref.bias).square().sum().backward()
    for p, r in zip(lin.parameters(), ref.parameters(), strict=True):
        assert is_real(p.grad)
        torch.testing.assert_close(p.grad, r.grad, rtol=0, atol=0)


@pytest.mark.parametrize("setting", ["fast", "repair"])
def test_the_fast_path_has_an_off_switch_and_counts(setting: str) -> None:
    fakegrad_patch.configure(propagation=setting)
    before = fakegrad_patch.status()["propagation"]["fast_ops"]
    with trace.capture(trace.DEBUG) as events, fake_mode():
        (torch.randn(3, 4) * 2).t().sum()
    ops = fakegrad_patch.status()["propagation"]["fast_ops"] - before
    fast = _events(events, "propagation_fast")
    if setting == "fast":
        assert ops == len(fast) >= 3, events  # mul, t, sum (randn: a constructor too)
        assert {"aten.mul.Tensor", "aten.t.default", "aten.sum.default"} <= {e["op"] for e in fast}
    else:
        assert ops == 0 and not fast


#: views that return a list (``Tensor(a -> *) self -> Tensor(a)[]``), as a program reaches them
LIST_VIEWS: dict[str, tuple[Callable[[torch.Tensor], Any], str]] = {
    "split": (lambda x: x.split(2), "aten.split.Tensor"),
    "split, sizes": (lambda x: x.split([1, 3]), "aten.split_with_sizes.default"),
    "chunk": (lambda x: x.chunk(3, dim=1), "aten.split.Tensor"),
    "unbind": (lambda x: x.unbind(1), "aten.unbind.int"),
    "iterating a tensor": (lambda x: list(x), "aten.unbind.int"),
}


@pytest.mark.parametrize("view", LIST_VIEWS)
def test_views_that_return_a_list_take_the_fast_path(view: str) -> None:
    """A list of views (an LSTM's gates ``chunk(4)``, an attention's ``qkv.split``, a loop over a
    tensor's rows) takes the fast path (one real view op, a fake view per real view over the
    base's storage), not upstream's path of the fake and the real kernels; values and gradients
    are eager's (the VIEWS tests above)."""
    f, op = LIST_VIEWS[view]
    fakegrad_patch.configure(propagation="fast")
    x = torch.randn(4, 6, requires_grad=True)
    with fake_mode():
        y = x * 1
        with trace.capture(trace.DEBUG) as events:
            out = f(y)
        assert len(out) > 1
        for o in out:
            assert o.untyped_storage()._cdata == y.untyped_storage()._cdata
            real = o.real_tensor
            assert real.untyped_storage()._cdata == y.real_tensor.untyped_storage()._cdata
            assert (o.shape, o.stride(), o.storage_offset()) == (
                real.shape,
                real.stride(),
                real.storage_offset(),
            )
    assert op in {e["op"] for e in _events(events, "propagation_fast")}, events
    want = f(x.detach())
    for o, w in zip(out, want, strict=True):
        torch.testing.assert_close(o.real_tensor, w, rtol=0, atol=0)


def test_ops_that_write_unannotated_arguments_never_take_the_fast_path() -> None:
    """Every aten schema of this build with a tensor argument named like running statistics or
    an RNN's dropout state, not marked written, is in ``HIDDEN_WRITES`` (their kernels write
    them: the write must be seen through upstream's path)."""
    from fakegrad_patch._core.dispatch import ops as _propagation

    suspects = {"running_mean", "running_var", "dropout_state"}
    found = set()
    for name in dir(torch.ops.aten):
        packet = getattr(torch.ops.aten, name, None)
        for overload in getattr(packet, "overloads", list)():
            schema = getattr(packet, overload)._schema
            base = schema.name.partition("::")[2]
            if base.endswith(("_functional", "_backward", "_no_training", "_no_update")):
                continue  # they return the new statistics instead of writing them
            for argument in schema.arguments:
                if argument.name in suspects and argument.alias_info is None:
                    found.add(base)
    assert found, "no such schema found: the scan reads nothing"
    assert found <= _propagation.HIDDEN_WRITES, found - _propagation.HIDDEN_WRITES


def test_batch_norm_statistics_are_reported_or_written_back_on_the_fast_path() -> None:
    """native_batch_norm writes its running statistics without saying so in its schema: it
    keeps upstream's path, so the lost update is reported by default and written back with
    ``buffers="write_back"``."""
    bn = nn.BatchNorm1d(3)
    x = torch.randn(4, 3)
    with warnings.catch_warnings(record=True) as caught, trace.capture(trace.WARNING) as events:
        warnings.simplefilter("always")
        fakegrad_patch._core.state.WARNED.discard("update_lost")
        with fake_mode():
            bn(x)
    assert [e for e in events if e["event"] == "update_lost"] and any(
        issubclass(c.category, FakeGradPatchWarning) for c in caught
    )
    assert bn.running_mean.abs().sum() == 0
    fakegrad_patch.configure(buffers="write_back")
    with fake_mode():
        bn(x)
    ref = nn.BatchNorm1d(3)
    ref(x)
    torch.testing.assert_close(bn.running_mean, ref.running_mean)
