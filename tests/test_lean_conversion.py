"""Issue 46: a plain dense leaf (a parameter, an input) that the fast path must convert (a view's
base: every ``t()`` of a Linear weight) is converted without MetaConverter's Python, into the same
fake, memos and values upstream's converter gives it.

``targets.LeanConversion`` makes the fake (FakeMaker), registers it in the converter's tensor and
storage memos as ``meta_tensor`` does, and counts it; ``values._lean_values`` gives it the values
upstream's conversion would (uninitialised where D2 applies, for the D2 repair to fill or lend; a
loan or a copy where upstream clones). The first conversion of each kind of tensor is upstream's,
and a lean one of the same tensor into a scratch converter must match it, else that kind stays
upstream's. A tensor converted again by the same converter after its fake died (a weight used
at every step of an RNN, a weight two layers share, a mode kept across steps) is lean too,
checked apart: its fake over a fresh storage (``AGAIN``) or over the meta storage a live view
keeps (``OVER``: its values over that storage's real one); and so is an input of an op that
writes (BatchNorm's running statistics: never lent, a copy). The family: what each kind's fake
is (against upstream's conversion of the same tensor, lean off), the memo (a second conversion,
a view of the same storage converted later, aliasing as upstream's), values updated inside the
mode through the parameter and read through an earlier view, gradients of a step against eager,
each state met again against upstream's in the same state, programs that meet tensors again
(an RNN, a shared weight, a mode kept for steps, BatchNorm's written buffers) against eager and
upstream's, what is never made lean (a view, an offset, a larger storage, a tensor with a
gradient, a buffer flag, functorch's transforms), a build whose lean fake would differ (new, or
over a live storage), the conversion counter the trust check reads.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from _helpers import fake_mode
from _zoo import CellLoop
from torch import nn

from fakegrad_patch._core.install import current
from fakegrad_patch._core.touchpoints import targets

pytestmark = pytest.mark.usefixtures("propagate", "quiet")


def _lean() -> Any:
    applied = current()
    assert applied is not None
    lean = applied.values._lean
    if lean is None:
        pytest.skip("this build lacks what a lean conversion needs (upstream's conversions)")
    return lean


class _Made(list):  # type: ignore[type-arg]
    """The tensors converted lean; ``fakes``: their fakes (kept alive, unless ``keep`` is
    false: a program whose fakes must die as without the fixture)."""

    fakes: list[Any]
    keep = True

    def clear(self) -> None:
        super().clear()
        self.fakes.clear()


@pytest.fixture
def builds(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Any]]:
    """The tensors converted lean (into a mode's converter, not the check's scratch one)."""
    made: Any = _Made()
    build = targets.LeanConversion._build

    def counting(self: Any, meta_converter: Any, mode: Any, converter: Any, t: Any, *a: Any) -> Any:
        fake = build(self, meta_converter, mode, converter, t, *a)
        if converter is mode.fake_tensor_converter:
            made.append(t)
            if made.keep:
                fakes.append(fake)
        return fake

    over = targets.LeanConversion._over

    def counting_over(self: Any, meta: Any, mode: Any, converter: Any, t: Any, *a: Any) -> Any:
        fake = over(self, meta, mode, converter, t, *a)
        if converter is mode.fake_tensor_converter and a[-1] is not None:  # registered
            made.append(t)
            if made.keep:
                fakes.append(fake)
        return fake

    fakes: list[Any] = []
    made.fakes = fakes

    monkeypatch.setattr(targets.LeanConversion, "_build", counting)
    monkeypatch.setattr(targets.LeanConversion, "_over", counting_over)
    yield made


@pytest.fixture
def lean_off(monkeypatch: pytest.MonkeyPatch) -> Callable[[], Any]:
    """Turns lean conversions off (upstream's conversion for everything) when called."""

    def off() -> None:
        applied = current()
        assert applied is not None
        monkeypatch.setattr(applied.values, "_lean", None)

    return off


def _learned(builds: Any, *tensors: torch.Tensor) -> None:
    """Upstream converts the first tensor of each kind (later ones are lean), and ``builds``
    starts empty."""
    for t in tensors:
        for _ in range(2):
            with fake_mode():
                t.transpose(0, 1)
    builds.clear()


def _ids(tensors: list[Any]) -> list[int]:
    return [id(t) for t in tensors]


def _upstreams(t: torch.Tensor, lean_off: Callable[[], Any]) -> Any:
    """Upstream's fake of ``t``, converted the same way (a view's base, the view alive), lean
    off. The base's fake dies with the op (the view returned is autograd's view of ``t``), so
    ``from_tensor`` converts again through the storage memo the view keeps, as for ours."""
    lean_off()
    mode = fake_mode()
    with mode:
        view = t.transpose(0, 1)
    fake = mode.from_tensor(t)
    assert view.untyped_storage()._cdata == fake.untyped_storage()._cdata
    return fake


KINDS: dict[str, Callable[[], torch.Tensor]] = {
    "parameter": lambda: nn.Parameter(torch.randn(8, 6)),
    "parameter, float64": lambda: nn.Parameter(torch.randn(8, 6, dtype=torch.float64)),
    "parameter, channels_last": lambda: nn.Parameter(
        torch.randn(2, 3, 4, 5).contiguous(memory_format=torch.channels_last)
    ),
    "parameter, no grad": lambda: nn.Parameter(torch.randn(8, 6), requires_grad=False),
    "leaf requiring grad": lambda: torch.randn(8, 6, requires_grad=True),
    "input": lambda: torch.randn(8, 6),
    "parameter, 256 KiB (lent)": lambda: nn.Parameter(torch.randn(256, 256)),
}


@pytest.mark.parametrize("kind", KINDS)
def test_a_lean_fake_is_upstreams(kind: str, builds: Any, lean_off: Callable[[], Any]) -> None:
    """Converted as a view's base, the fake the memo then returns has upstream's type, dispatch
    keys, metadata, autograd flags, attributes and values."""
    _lean()
    _learned(builds, KINDS[kind]())
    torch.manual_seed(0)
    t = KINDS[kind]()
    mode = fake_mode()
    with mode:
        view = t.transpose(0, 1)
    assert _ids(builds) == [id(t)]  # made lean
    fake = mode.from_tensor(t)  # through the storage memo of the lean fake, which the view keeps
    assert view.untyped_storage()._cdata == fake.untyped_storage()._cdata
    torch.manual_seed(0)
    twin = KINDS[kind]()  # the same kind and values, never converted
    ref = _upstreams(twin, lean_off)
    _assert_same(builds.fakes[0], _first(twin), t)  # the lean fake as made, and upstream's
    _assert_same(fake, ref, t)
    assert torch.equal(view.real_tensor, t.detach().transpose(0, 1))


def _first(t: torch.Tensor) -> Any:
    """Upstream's first conversion of ``t`` (lean off by the caller)."""
    return fake_mode().from_tensor(t)


def _assert_same(fake: Any, ref: Any, t: torch.Tensor) -> None:
    assert type(fake) is type(ref)
    assert repr(torch._C._dispatch_keys(fake)) == repr(torch._C._dispatch_keys(ref))
    assert (fake.shape, fake.stride(), fake.storage_offset(), fake.dtype, fake.device) == (
        ref.shape,
        ref.stride(),
        ref.storage_offset(),
        ref.dtype,
        ref.device,
    )
    # (not ``_version``: a fake's counter moves with the copies made into its values, which
    # differ with the history of the source and the converter, for upstream's fakes too)
    assert (fake.requires_grad, fake.is_leaf, fake.grad) == (ref.requires_grad, ref.is_leaf, None)
    mine = {k: v for k, v in fake.__dict__.items() if k not in ("real_tensor", "fake_mode")}
    theirs = {k: v for k, v in ref.__dict__.items() if k not in ("real_tensor", "fake_mode")}
    assert mine == theirs
    assert fake.untyped_storage().nbytes() == ref.untyped_storage().nbytes()
    assert torch.equal(fake.real_tensor, t.detach())
    assert torch.equal(ref.real_tensor, t.detach())
    assert fake.real_tensor.stride() == ref.real_tensor.stride()


def test_the_memo_aliases_as_upstreams(builds: list[Any], lean_off: Callable[[], Any]) -> None:
    """After a lean conversion: the same tensor converted again is the same fake, and a view of
    its storage converted later aliases that fake's storage, as with upstream's conversion."""
    _lean()
    _learned(builds, nn.Parameter(torch.randn(4, 3)))

    def program() -> tuple[Any, Any, Any]:
        p = nn.Parameter(torch.randn(4, 3))
        mode = fake_mode()
        with mode:
            p.t()
        return mode.from_tensor(p), mode.from_tensor(p), mode.from_tensor(p.detach()[1])

    first, again, row = program()
    assert len(builds) == 1
    assert again is first
    assert row.untyped_storage()._cdata == first.untyped_storage()._cdata
    assert row.storage_offset() == 3
    lean_off()
    ref_first, ref_again, ref_row = program()
    assert len(builds) == 1
    assert ref_again is ref_first
    assert ref_row.untyped_storage()._cdata == ref_first.untyped_storage()._cdata


def test_an_update_inside_the_mode_reaches_an_earlier_view(builds: list[Any]) -> None:
    """A weight viewed (lean), then updated in place inside the mode under ``no_grad`` (an
    optimizer step there): FakeTensorMode runs an op whose arguments are all real on them, so
    the weight is updated, as in eager mode, and the view made before reads the update, as
    eager's view does (the patch refreshes the fakes' copies of a tensor written for real)."""
    _lean()
    _learned(builds, nn.Parameter(torch.randn(64, 64)))
    p = nn.Parameter(torch.randn(64, 64))
    before = p.detach().clone()
    with fake_mode():
        view = p.t()
        with torch.no_grad():
            p.add_(1.0)
        seen = view.real_tensor.clone()
    assert _ids(builds) == [id(p)]
    assert torch.equal(seen, (before + 1).t())
    assert torch.equal(p.detach(), before + 1)


@pytest.mark.parametrize("width", [16, 300])  # weights copied / lent
def test_gradients_of_a_step_equal_eagers(width: int, builds: list[Any]) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, 3))
    x = torch.randn(5, width)
    model(x).square().mean().backward()
    expected = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    for _ in range(3):  # the first learns; every later step is lean
        model.zero_grad(set_to_none=True)
        with fake_mode():
            model(x).square().mean().backward()
        for p, want in zip(model.parameters(), expected, strict=True):
            assert type(p.grad) is torch.Tensor
            torch.testing.assert_close(p.grad, want, rtol=0, atol=0)
    assert {id(t) for t in builds} == {id(model[0].weight), id(model[2].weight)}


NEVER: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "a view": lambda p: p.detach()[1:],
    "a storage offset": lambda p: torch.empty(0).set_(p.detach().untyped_storage(), 6, (7, 6)),
    "a larger storage": lambda p: torch.empty(0).set_(
        torch.randn(100).untyped_storage(), 0, (8, 6), (6, 1)
    ),
    "a gradient": lambda p: _with_grad(p),
    "a buffer flag": lambda p: _flagged(torch.randn(8, 6)),
}


def _with_grad(p: torch.Tensor) -> torch.Tensor:
    p.grad = torch.ones_like(p)
    return p


def _flagged(t: torch.Tensor) -> torch.Tensor:
    t._is_buffer = True  # type: ignore[attr-defined]
    return t


@pytest.mark.parametrize("case", NEVER)
def test_never_lean(case: str, builds: list[Any]) -> None:
    """What a lean conversion does not describe takes upstream's conversion, values equal."""
    _lean()
    _learned(builds, nn.Parameter(torch.randn(8, 6)), torch.randn(8, 6))
    t = NEVER[case](nn.Parameter(torch.randn(8, 6)))
    with fake_mode():
        view = t.t()
    assert builds == []
    assert torch.equal(view.real_tensor, t.detach().t())


def test_never_lean_where_functorch_transforms_run(
    builds: Any, lean_off: Callable[[], Any]
) -> None:
    """MetaConverter clears functorch's interpreter stack around its work; a lean conversion
    does not run while one is active. (Where an op reaches the mode inside ``torch.func.grad``
    the transform has popped its layer: the conversion sees none, as upstream's does, and the
    result is the same with lean conversions on and off.)"""
    lean = _lean()
    _learned(builds, torch.randn(8, 6))
    t = torch.randn(8, 6)
    kinds: list[Any] = []
    seen: list[Any] = []

    def f(x: torch.Tensor) -> torch.Tensor:
        kinds.append(lean.kind(t))
        with fake_mode():
            seen.append(tuple(t.t().shape))
        return x.sum()

    torch.func.grad(f)(torch.ones(2))
    assert kinds == [None]
    assert lean.kind(t) is not None  # outside the transform: a lean kind
    lean_off()
    torch.func.grad(f)(torch.ones(2))
    assert seen[0] == seen[1] == (6, 8)


@pytest.mark.parametrize("where", ["under inference_mode", "an inference tensor"])
def test_never_lean_in_inference_mode(where: str, builds: Any) -> None:
    """MetaConverter makes a fake under ``inference_mode(t.is_inference())``: a conversion in
    inference mode, or of an inference tensor, is upstream's (a fake that is not an inference
    tensor for a normal one, one that is for an inference tensor)."""
    _lean()
    _learned(builds, torch.randn(8, 6))
    if where == "an inference tensor":
        with torch.inference_mode():
            t = torch.randn(8, 6)
        with fake_mode():
            view = t.t()
    else:
        t = torch.randn(8, 6)
        with torch.inference_mode(), fake_mode():
            view = t.t()
    assert builds == []
    assert torch.equal(view.real_tensor, t.t())


def test_a_build_whose_lean_fake_differs_keeps_upstreams(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check made into a scratch converter finds a difference (here: an attribute upstream's
    fake lacks): that kind is never made lean."""
    lean = targets.LeanConversion(_lean()._make)
    build = targets.LeanConversion._build

    def differing(self: Any, *args: Any) -> Any:
        fake = build(self, *args)
        fake.extra = 1
        return fake

    monkeypatch.setattr(targets.LeanConversion, "_build", differing)
    p = nn.Parameter(torch.randn(4, 3))
    mode = fake_mode()
    fake = mode.from_tensor(p)
    kind = lean.kind(p)
    lean.learn(mode.fake_tensor_converter, mode, p, kind, fake)
    assert lean._checked == {kind: False}
    other = nn.Parameter(torch.randn(4, 3))
    assert lean.kind(other) == kind
    assert lean.convert(fake_mode().fake_tensor_converter, mode, other, kind, torch.clone) is None


def test_a_lean_conversion_is_counted(builds: list[Any]) -> None:
    """The converter's ``hit`` counter (what the untrusted-mode check reads) counts a lean
    conversion as one of upstream's."""
    _lean()
    _learned(builds, nn.Parameter(torch.randn(4, 3)))
    p = nn.Parameter(torch.randn(4, 3))
    mode = fake_mode()
    made = targets.resolve_all().conversions_made
    before = made(mode.fake_tensor_converter)
    with mode:
        p.t()
    assert _ids(builds) == [id(p)]
    assert made(mode.fake_tensor_converter) == (before or 0) + 1


# -- a tensor converted again by the same converter ------------------------------------------


def _met_again(lean: Any, t: torch.Tensor, state: str, lean_on: bool, builds: Any) -> Any:
    """In one mode: a view of ``t`` (its fake dies with the op), then, the view dropped
    (``again``) or kept (``over``), ``t`` converted again: by the fast path (``lean_on``: the
    fake it made) or by upstream's ``from_tensor`` (the reference). (first view or None, fake)."""
    mode = fake_mode()
    conv = mode.fake_tensor_converter
    with mode:
        first: Any = t.transpose(0, 1)
        builds.clear()  # (it keeps the fakes it saw alive)
        if state == "again":
            first = None
        expected = targets.AGAIN if state == "again" else targets.OVER
        assert lean.when(conv, t, lean.kind(t))[-1:] == expected
        if not lean_on:
            return first, mode.from_tensor(t)
        second = t.transpose(0, 1)
        assert _ids(builds) == [id(t)]  # made lean
        fake = builds.fakes[-1]
        assert torch.equal(second.real_tensor, t.detach().transpose(0, 1))
        return first, fake


AGAIN_KINDS = ["parameter", "leaf requiring grad", "input", "parameter, 256 KiB (lent)"]


@pytest.mark.parametrize("state", ["again", "over"])
@pytest.mark.parametrize("kind", AGAIN_KINDS)
def test_a_tensor_met_again_is_lean_and_upstreams(
    kind: str, state: str, builds: Any, lean_off: Callable[[], Any]
) -> None:
    """Converted again after its fake died, its storage dead too (``again``: a fresh storage) or
    kept by a view (``over``: the same meta storage, values over the same real storage): the
    lean fake is upstream's fake in the same state (type, keys, metadata, autograd flags,
    attributes, values), and aliases the live view as upstream's does."""
    lean = _lean()
    _learn_again(lean, kind, state, builds)
    torch.manual_seed(0)
    t = KINDS[kind]()
    first, fake = _met_again(lean, t, state, True, builds)
    torch.manual_seed(0)
    twin = KINDS[kind]()
    lean_off()
    ref_first, ref = _met_again(lean, twin, state, False, builds)
    _assert_same(fake, ref, t)
    if state == "over":
        for f, view in ((fake, first), (ref, ref_first)):
            assert f.untyped_storage()._cdata == view.untyped_storage()._cdata
            real_view = view.real_tensor.untyped_storage()
            assert f.real_tensor.untyped_storage()._cdata == real_view._cdata


def _learn_again(lean: Any, kind: str, state: str, builds: Any) -> None:
    """Upstream converts the first tensor of ``kind`` met again in ``state`` (the check runs
    then); the next one is lean."""
    for _ in range(2):
        t = KINDS[kind]()
        mode = fake_mode()
        with mode:
            first = t.transpose(0, 1)
            builds.clear()
            if state == "again":
                del first
            t.transpose(0, 1)
    builds.clear()


@contextlib.contextmanager
def _upstream_conversions() -> Iterator[list[Any]]:
    """The tensors MetaConverter (upstream's conversion) converts meanwhile."""
    from torch._subclasses import meta_utils

    seen: list[Any] = []
    call = meta_utils.MetaConverter.__call__

    def counting(self: Any, t: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append((tuple(t.shape), t.dtype))
        return call(self, t, *args, **kwargs)

    meta_utils.MetaConverter.__call__ = counting  # type: ignore[method-assign]
    try:
        yield seen
    finally:
        meta_utils.MetaConverter.__call__ = call  # type: ignore[method-assign]


class _Shared(nn.Module):
    """Two layers sharing one weight: converted twice in one forward, a view of the first
    conversion saved for backward."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(12, 12)
        self.second = nn.Linear(12, 12)
        self.second.weight = self.first.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.tanh(self.first(x)))


PROGRAMS: dict[str, Callable[[], tuple[nn.Module, torch.Tensor, int]]] = {
    # (model, input, steps in one mode)
    # a GRU cell and a readout at every time step (a view saved for backward keeps the meta
    # storage of the readout's first conversion alive)
    "a GRU cell over 5 steps": lambda: (CellLoop(), torch.randn(5, 4, 6), 1),
    "two layers sharing a weight": lambda: (_Shared(), torch.randn(4, 12), 1),
    # (gradients set to None between steps: a tensor with a gradient is upstream's)
    "one mode kept for 3 steps": lambda: (
        nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 2)),
        torch.randn(5, 8),
        3,
    ),
    "a BatchNorm net in training (buffers written)": lambda: (
        nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten()),
        torch.randn(2, 3, 6, 6),
        1,
    ),
}


@pytest.mark.parametrize("program", PROGRAMS)
def test_programs_that_meet_a_tensor_again_are_lean_and_eagers(
    program: str, builds: Any, lean_off: Callable[[], Any]
) -> None:
    """Programs in which one converter meets a tensor again after its fake died, or converts
    an input for an op that writes: those conversions are lean (after the first program
    learned each kind and state), and the gradients of the last step, the buffers and the
    values are eager's, bit for bit, as with upstream's conversions."""
    _lean()
    builds.keep = False

    def run(fake: bool) -> tuple[list[torch.Tensor], list[torch.Tensor], Any]:
        torch.manual_seed(0)
        model, x, steps = PROGRAMS[program]()
        if fake:
            mode = fake_mode()
            with mode:
                for _ in range(steps):
                    model.zero_grad(set_to_none=True)
                    out = model(x)
                    out.square().mean().backward()
            values = out.real_tensor
        else:
            for _ in range(steps):
                model.zero_grad(set_to_none=True)
                out = model(x)
                out.square().mean().backward()
            values = out.detach()
        grads = [p.grad for p in model.parameters()]
        return grads, [b.clone() for b in model.buffers()], values

    eager_grads, _, eager_out = run(False)
    run(True)  # learns each kind and state
    builds.clear()
    with _upstream_conversions() as upstream:
        grads, buffers, out = run(True)
    # every conversion lean, but BatchNorm's counter's (``num_batches_tracked += 1``: an
    # in-place op on a real tensor, upstream's path)
    assert len(upstream) == (1 if "BatchNorm" in program else 0), upstream
    assert len(builds) > len({id(t) for t in builds}) or "BatchNorm" in program
    for grad, want in zip(grads, eager_grads, strict=True):
        assert type(grad) is torch.Tensor
        torch.testing.assert_close(grad, want, rtol=0, atol=0)
    torch.testing.assert_close(out, eager_out, rtol=0, atol=0)
    lean_off()
    builds.clear()
    ref_grads, ref_buffers, ref_out = run(True)
    assert builds == []
    for grad, ref in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(grad, ref, rtol=0, atol=0)
    for buffer, ref in zip(buffers, ref_buffers, strict=True):  # the same policy's result
        torch.testing.assert_close(buffer, ref, rtol=0, atol=0)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=0)


def test_a_build_whose_fake_over_a_live_storage_differs_keeps_upstreams(
    monkeypatch: pytest.MonkeyPatch, builds: Any
) -> None:
    """The check of a conversion over a live storage (against upstream's fake over the same
    storage) finds a difference: that kind and state are never made lean, and the program's
    values stay upstream's; a tensor whose fake lives is the memo's (``when``: None)."""
    lean = _lean()
    over = targets.LeanConversion._over

    def differing(self: Any, *args: Any) -> Any:
        fake = over(self, *args)
        if fake is not None:
            fake.extra = 1
        return fake

    _learned(builds, nn.Parameter(torch.randn(5, 4)))
    builds.keep = False
    monkeypatch.setattr(targets.LeanConversion, "_over", differing)
    checked = dict(lean._checked)
    for kind in checked:
        if kind[-1:] == targets.OVER:
            del lean._checked[kind]
    try:
        for _ in range(3):
            p = nn.Parameter(torch.randn(5, 4))
            mode = fake_mode()
            with mode:
                first = p.t()
                state = lean.when(mode.fake_tensor_converter, p, lean.kind(p))
                second = p.t()
                held = mode.from_tensor(p)  # its fake alive: the memo's
                assert lean.when(mode.fake_tensor_converter, p, lean.kind(p)) is None
                del held
            assert state[-1:] == targets.OVER
            assert lean._checked[state] is False
            assert not hasattr(second, "extra")
            assert torch.equal(first.real_tensor, second.real_tensor)
    finally:
        lean._checked.clear()
        lean._checked.update(checked)
