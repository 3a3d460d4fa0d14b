"""Issue 46, item 2: a parameter's values lent to its fakes, not copied (convert/lending.py).

Where the build has the primitives (2.13.0, 2.14.1, 2.15.0; not 2.4.0), the fake a propagating
mode makes of a parameter reads the parameter's own bytes; the first write to any fake over them
copies once. The family: what is lent (and what never is), every way a write can reach lent
values (the fake, a view made before, a view made after, ``out=``, a foreach list, ``copy_``,
``resize_``, the real parameter written by an op that takes it), each with lending on and off
giving the same values, the same lost-update report and an untouched parameter; reads that
follow the parameter; gradients; threads; uninstall; write-back (never lent).
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from _helpers import assert_real_grads_equal, fake_mode
from test_trace import check_schema

import fakegrad_patch
from fakegrad_patch._core.convert import lending
from fakegrad_patch._core.dispatch import standins
from fakegrad_patch.trace import _reader as _trace_reader

pytestmark = pytest.mark.usefixtures("propagate", "quiet")

#: tests/test_can_fail.py runs these with the patch uninstalled (conftest.py)
UNPATCHED = os.environ.get("FAKEGRAD_TEST_UNPATCHED") == "1"

needs_primitives = pytest.mark.skipif(
    not lending._State.available and not UNPATCHED,
    reason="this build has no storage swap (2.4): every value is copied",
)


@pytest.fixture(autouse=True)
def small_storages_lent() -> Iterator[None]:
    """These tests use small parameters; outside them storages under 64 KiB are copied (the
    copy costs less than the loan). ``test_a_small_parameter_is_copied`` checks that."""
    before = lending._State.min_bytes
    lending._State.min_bytes = 1
    try:
        yield
    finally:
        lending._State.min_bytes = before


@pytest.fixture(params=[True, False], ids=["lent", "copied"])
def lend(request: pytest.FixtureRequest) -> Iterator[bool]:
    """Lending on (where the build has it) or off, for one test."""
    before = lending.enabled()
    lending.set_enabled(request.param)
    try:
        yield request.param and lending.enabled()
    finally:
        lending.set_enabled(before)


def _lent(fake: Any) -> bool:
    real = fake.real_tensor
    return lending.is_lent(real.untyped_storage())


# -- what is lent -----------------------------------------------------------------------------


@needs_primitives
def test_a_parameter_read_inside_the_mode_is_not_copied() -> None:
    """The fake's values are the parameter's own bytes (no copy per step); a buffer's and a
    plain input's are copies (they may have hidden writes; they do not require grad)."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8))
    x = torch.randn(4, 8)
    with fake_mode():
        weight_t = model[0].weight.t()
        bias = model[0].bias.detach()
        running = model[1].running_mean.detach()
        inputs = x.detach()
        model(x).sum().backward()
    assert weight_t.real_tensor.data_ptr() == model[0].weight.data_ptr()
    assert bias.real_tensor.data_ptr() == model[0].bias.data_ptr()
    assert running.real_tensor.data_ptr() != model[1].running_mean.data_ptr()
    assert inputs.real_tensor.data_ptr() != x.data_ptr()
    assert torch.equal(weight_t.real_tensor, model[0].weight.detach().t())


@needs_primitives
def test_a_small_parameter_is_copied_a_large_one_lent() -> None:
    lending._State.min_bytes = 1 << 16
    small = torch.nn.Parameter(torch.randn(64, 64))  # 16 KiB
    large = torch.nn.Parameter(torch.randn(128, 128))  # 64 KiB
    with fake_mode():
        small_t, large_t = small.t(), large.t()
    assert small_t.real_tensor.data_ptr() != small.data_ptr()
    assert large_t.real_tensor.data_ptr() == large.data_ptr()


@needs_primitives
def test_the_d2_repair_lends_where_it_copied() -> None:
    """2.6-2.13 (D2): the repair is traced as before, with no bytes copied."""
    from fakegrad_patch import trace

    trace.set_level(trace.INFO)
    trace.clear()
    p = torch.nn.Parameter(torch.randn(5, 3))
    with fake_mode():
        p.t()
    repaired = [e for e in trace.events() if e["event"] == "d2_repaired"]
    copied = [e for e in trace.events() if e["event"] == "propagated_values_resynced"]
    assert copied == []
    assert all(e["bytes"] == 0 for e in repaired)


@needs_primitives
@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.nn.Parameter(torch.randn(4, 3), requires_grad=False),
        lambda: torch.randn(4, 3),
        lambda: torch.randn(4, 3, dtype=torch.complex64).conj().requires_grad_(),
        lambda: torch.randn(4, 3).to_sparse().requires_grad_(),
    ],
    ids=["frozen", "plain", "conj", "sparse"],
)
def test_what_is_never_lent(make: Callable[[], torch.Tensor]) -> None:
    t = make()
    with fake_mode():
        fake = t * 1 if t.layout != torch.strided else None
        view = t.detach()
    if fake is not None:
        assert not lending.any_lent() or not _lent(view)
    assert view.real_tensor is None or view.real_tensor.layout != torch.strided or not _lent(view)


@needs_primitives
def test_nothing_is_lent_under_write_back() -> None:
    fakegrad_patch.configure(buffers="write_back")
    p = torch.nn.Parameter(torch.randn(4, 3))
    with fake_mode():
        view = p.t()
        assert not _lent(view)


@needs_primitives
def test_a_tracer_conversion_is_never_lent() -> None:
    """``from_tensor`` with a source (dynamo, export) keeps upstream's copy."""
    p = torch.nn.Parameter(torch.randn(4, 3))
    mode = fake_mode()
    fake = mode.from_tensor(p)
    assert fake.real_tensor is None or fake.real_tensor.data_ptr() != p.data_ptr()


# -- writes ------------------------------------------------------------------------------------

WRITES: dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor | None]] = {
    "parameter.add_": lambda p, view, two: p.add_(two),
    "earlier view.mul_": lambda p, view, two: view.mul_(two),
    "new view.mul_": lambda p, view, two: p.t().mul_(two),
    "detach().zero_": lambda p, view, two: p.detach().zero_(),
    "out=": lambda p, view, two: torch.mul(torch.ones(3, 4), two, out=view),
    "foreach": lambda p, view, two: (torch._foreach_mul_([view], two), view)[1],
    "copy_": lambda p, view, two: view.copy_(torch.zeros(3, 4) * two),
    "resize_": lambda p, view, two: p.detach().resize_(20).fill_(1),
}


@pytest.mark.parametrize("write", list(WRITES))
def test_a_write_inside_the_mode_never_reaches_the_parameter(lend: bool, write: str) -> None:
    """Lent or copied: the parameter keeps its values, the update is reported lost once, the
    written fake and the fakes over the same values read the write (as eager's views would)."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(4, 3))
    before = p.detach().clone()
    lost = standins.lost_count()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with fake_mode() as mode:
            two = mode.from_tensor(torch.tensor(2.0))
            view = p.t()  # values lent (a read), or copied
            assert _lent(view) == lend
            with torch.no_grad():
                written = WRITES[write](p, view, two)
            values = None if written is None or written is p else written.real_tensor.clone()
            view_values = view.real_tensor.clone()
            view_lent = _lent(view)
            p.t().sum()  # read again: the memo's fake re-synced (D2) or as it was
    assert torch.equal(p.detach(), before), "the write reached the real parameter"
    assert standins.lost_count() - lost == 1
    if write in ("earlier view.mul_", "new view.mul_", "detach().zero_", "foreach", "copy_"):
        assert not view_lent  # its values were copied at the first write to them
    if write in ("earlier view.mul_", "new view.mul_", "foreach"):
        assert torch.equal(values, before.t() * 2)
        assert torch.equal(view_values, before.t() * 2)
    if write in ("detach().zero_", "copy_"):
        assert torch.equal(view_values, torch.zeros(3, 4))


def test_the_same_results_lent_or_copied_across_writes_and_reads() -> None:
    """One program of reads and writes of two parameters (one tied into two modules), run with
    lending on and off: every fake value and every real gradient equal."""

    def run(on: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        lending.set_enabled(on)
        torch.manual_seed(0)
        emb = torch.nn.Embedding(10, 6)
        head = torch.nn.Linear(6, 10, bias=False)
        head.weight = emb.weight  # tied
        idx = torch.tensor([1, 2, 3])
        seen: list[torch.Tensor] = []
        with fake_mode() as mode:
            h = emb(idx)
            out = head(h).sum()
            seen.append(out.real_tensor.clone())
            out.backward()
            with torch.no_grad():
                emb.weight.detach().mul_(mode.from_tensor(torch.tensor(0.5)))
            seen.append(head(emb(idx)).sum().real_tensor.clone())
            seen.append(emb.weight.t().real_tensor.clone())
        return seen, [emb.weight.grad.clone()]

    before = lending.enabled()
    try:
        lent = run(True)
        copied = run(False)
    finally:
        lending.set_enabled(before)
    for a, b in zip(lent[0] + lent[1], copied[0] + copied[1], strict=True):
        assert torch.equal(a, b)


# -- reads -------------------------------------------------------------------------------------


@needs_primitives
def test_lent_values_follow_the_parameter_updated_outside_the_mode() -> None:
    """A view made inside the mode reads the parameter's bytes as eager's view of it would,
    after an update made outside the mode (an optimizer step between two graphs)."""
    p = torch.nn.Parameter(torch.randn(4, 3))
    mode = fake_mode()
    with mode:
        view = p.t()
    with torch.no_grad():
        p.add_(1)
    with mode:
        out = view * 1
    assert torch.equal(out.real_tensor, p.detach().t())


def test_a_parameter_given_new_data_is_read_anew(lend: bool) -> None:
    """``p.data = other`` between two ops of one mode: the next op reads ``other``."""
    p = torch.nn.Parameter(torch.randn(4, 3))
    x = torch.randn(2, 3)
    with fake_mode():
        first = torch.mm(x, p.t())
        p.data = torch.randn(4, 3)
        second = torch.mm(x, p.t())
    torch.testing.assert_close(first.real_tensor.shape, (2, 4))
    assert torch.equal(second.real_tensor, x @ p.detach().t())


# -- gradients, threads, uninstall -------------------------------------------------------------


def _models() -> dict[str, Callable[[], torch.nn.Module]]:
    return {
        "mlp": lambda: torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4)
        ),
        "conv_bn": lambda: torch.nn.Sequential(
            torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU()
        ),
        "rnn_cell": lambda: torch.nn.RNNCell(8, 8),
    }


def _step(model: torch.nn.Module) -> None:
    if isinstance(model, torch.nn.RNNCell):
        h = torch.zeros(2, 8)
        for x in torch.randn(4, 2, 8, generator=torch.Generator().manual_seed(1)):
            h = model(x, h)
        h.pow(2).sum().backward()
    elif isinstance(model[0], torch.nn.Conv2d):
        model(torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(1))).sum().backward()
    else:
        model(torch.randn(5, 8, generator=torch.Generator().manual_seed(1))).pow(2).sum().backward()


@pytest.mark.parametrize("name", list(_models()))
def test_gradients_equal_eager_lent_or_copied(lend: bool, name: str) -> None:
    import copy

    torch.manual_seed(0)
    model = _models()[name]()
    reference = copy.deepcopy(model)
    for _ in range(2):  # a prior real grad accumulated, the parameters read twice
        with fake_mode():
            _step(model)
        _step(reference)
    assert_real_grads_equal(model, reference)


def test_threads_sharing_parameters(lend: bool) -> None:
    """Four threads, each its own mode, the same parameters; one of them writes a view of a
    parameter inside its mode: every parameter keeps its values, every thread's values are
    eager's."""
    model = torch.nn.Linear(16, 16)
    before = [p.detach().clone() for p in model.parameters()]
    x = torch.randn(3, 16)
    expected = x @ model.weight.detach().t() + model.bias.detach()
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            with torch._functorch.config.patch(fake_tensor_propagate_real_tensors=True):
                steps(i)
        except BaseException as exc:  # reported below
            errors.append(exc)

    def steps(i: int) -> None:
        for _ in range(20):
            with fake_mode() as mode:
                out = model(x)
                assert torch.allclose(out.real_tensor, expected)
                if i == 0:
                    with torch.no_grad():
                        model.weight.t().mul_(mode.from_tensor(torch.tensor(3.0)))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    for p, b in zip(model.parameters(), before, strict=True):
        assert torch.equal(p.detach(), b)


@needs_primitives
def test_uninstall_gives_every_lent_fake_its_own_values() -> None:
    p = torch.nn.Parameter(torch.randn(4, 3))
    before = p.detach().clone()
    with fake_mode():
        view = p.t()
    assert _lent(view)
    fakegrad_patch.uninstall()
    try:
        assert not _lent(view)
        assert view.real_tensor.data_ptr() != p.data_ptr()
        assert torch.equal(view.real_tensor, before.t())
        with torch.no_grad():
            view.real_tensor.zero_()
        assert torch.equal(p.detach(), before)
    finally:
        fakegrad_patch.install()


def test_a_gradient_over_lent_values_is_copied_not_adopted(lend: bool) -> None:
    """A user gradient made of another parameter's values (``p2.detach()``: lent) passed through
    unchanged to a leaf: the leaf's ``.grad`` has its own storage, as eager's does."""
    p1 = torch.nn.Parameter(torch.randn(4, 3))
    p2 = torch.nn.Parameter(torch.randn(4, 3))
    with fake_mode():
        y = p1 + 0
        y.backward(p2.detach())
    assert p1.grad is not None
    assert torch.equal(p1.grad, p2.detach())
    assert p1.grad.data_ptr() != p2.data_ptr()


#: the public methods that free or move a tensor's bytes, as Python calls them (seen: guarded)
FREES: dict[str, Callable[[torch.nn.Parameter], Any]] = {
    "storage.resize_(0)": lambda p: p.untyped_storage().resize_(0),
    "storage.resize_(grow)": lambda p: p.untyped_storage().resize_(1 << 20),
    "tensor.resize_": lambda p: p.data.resize_(1 << 18),
    "tensor.resize_as_": lambda p: p.data.resize_as_(torch.empty(512, 512)),
    "tensor.set_(storage, grown)": lambda p: p.data.set_(p.untyped_storage(), 0, (512, 512)),
    "other.set_(tensor, grown)": lambda p: torch.empty(0).set_(p.data, 0, (512, 512)),
    "typed_storage._resize_": lambda p: p.data._typed_storage()._resize_(1 << 18),
    "tensor.share_memory_": lambda p: p.share_memory_(),
    "storage._share_fd_cpu_": lambda p: p.untyped_storage()._share_fd_cpu_(),
    "storage._share_filename_cpu_": lambda p: p.untyped_storage()._share_filename_cpu_(),
}


@needs_primitives
@pytest.mark.parametrize("how", list(FREES))
def test_a_parameter_whose_bytes_are_freed_leaves_its_fakes_their_values(how: str) -> None:
    """FSDP frees an unsharded parameter's storage after its forward (``resize_(0)``) and gathers
    it again for backward; ``set_`` grows the storage it is given; sharing moves the bytes into
    shared memory: the lent values are copied first, so the fakes keep theirs (the FSDP2 test in
    tests/test_distributed.py is the whole program)."""
    p = torch.nn.Parameter(torch.randn(4, 3))
    before = p.detach().clone()
    with fake_mode():
        view = p.t()
    assert _lent(view)
    with warnings.catch_warnings():
        warnings.simplefilter("error", fakegrad_patch.FakeGradPatchWarning)
        with torch.no_grad():
            FREES[how](p)
    assert not _lent(view)
    assert torch.equal(view.real_tensor, before.t())


#: C++ callers that grow a parameter's storage (not seen when they do it: found afterwards)
UNSEEN_FREES: dict[str, Callable[[torch.nn.Parameter], Any]] = {
    "out= kernel": lambda p: torch.mm(torch.randn(512, 4), torch.randn(4, 512), out=p.data),
    "aten.resize_": lambda p: torch.ops.aten.resize_.default(p.data, (512, 512)),
    "torch.resize_as_": lambda p: torch.resize_as_(p.data, torch.empty(512, 512)),
}


@needs_primitives
@pytest.mark.parametrize("how", list(UNSEEN_FREES))
def test_bytes_freed_by_a_cpp_caller_are_never_read_and_reported(lend: bool, how: str) -> None:
    """A C++ caller grows the parameter's storage while a saved fake reads its bytes: a copied
    fake keeps the old values; a lent one cannot (freed), so before the backward reads them it
    gets NaN and the patch says so (trace event and one warning), never freed memory."""
    from fakegrad_patch import trace

    trace.set_level(trace.WARNING)
    trace.clear()
    fakegrad_patch._core.state.WARNED.discard("lent_values_lost")
    p = torch.nn.Parameter(torch.randn(4, 3))
    x = torch.randn(2, 3, requires_grad=True)
    expected = torch.autograd.grad(torch.nn.functional.linear(x, p.detach()).sin().sum(), x)[0]
    with fake_mode():
        y = torch.nn.functional.linear(x, p).sin().sum()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with torch.no_grad():
            UNSEEN_FREES[how](p)
        y.backward()
    lost = [e for e in trace.events() if e["event"] == "lent_values_lost"]
    said = [w for w in seen if "resized or moved" in str(w.message)]
    if lend:
        assert len(lost) == 1 and lost[0]["bytes"] == 48
        check_schema(lost[0])
        assert len(said) == 1
        assert x.grad is not None and bool(x.grad.isnan().all())
        summary = _trace_reader.Summary()
        summary.add(lost[0])
        assert [p["kind"] for p in summary.problems()] == ["lent_values_lost"]
    else:
        assert lost == [] and said == []
        assert x.grad is not None and torch.equal(x.grad, expected)
