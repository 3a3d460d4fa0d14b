"""Issue 46: a real tensor an op only reads is read by the real kernel itself, with no fake made.

In a propagating mode the fast path runs each op's real kernel on its arguments' values. A real
tensor without a graph (a parameter, a buffer, an input), an argument of an op that writes
nothing (or writes only other real tensors: BatchNorm's running statistics), was converted to a
fake only to have its values read once and dropped (autograd, above the mode, saved the real
tensor itself: backward converted it again). Now the kernel reads it as eager reads it
(``dispatch/fast.py``, ``_reads_directly``). The family: which arguments are read directly (a
parameter, a plain leaf that requires grad, one with a conjugate bit, a non-contiguous one,
inside a list, a buffer read by an eval BatchNorm, an input without grad, in backward's ops, a
training BatchNorm's weight and bias) and which are still converted (a view's base, an argument
of an op that writes a fake, a training BatchNorm's running statistics and a tensor over their
storage, a non-leaf that requires grad, write-back's aliases), each program against eager; no
output aliases the tensor read; a mode whose only contact with real tensors is such reads still
writes real gradients.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from _helpers import fake_mode

import fakegrad_patch

pytestmark = pytest.mark.usefixtures("propagate", "quiet")

#: tests/test_can_fail.py runs these with the patch uninstalled (conftest.py)
UNPATCHED = os.environ.get("FAKEGRAD_TEST_UNPATCHED") == "1"


class Conversions:
    """The real tensors a mode's converter converts (every call, memo hits included)."""

    def __init__(self, mode: Any) -> None:
        self.seen: list[torch.Tensor] = []
        converter = mode.fake_tensor_converter
        original = type(converter).from_real_tensor

        def spy(*args: Any, **kwargs: Any) -> Any:
            t = args[1] if len(args) > 1 else kwargs["t"]
            self.seen.append(t)
            return original(converter, *args, **kwargs)

        converter.from_real_tensor = spy

    def of(self, t: torch.Tensor) -> int:
        return sum(1 for s in self.seen if s is t)


@pytest.fixture
def mode() -> Iterator[tuple[Any, Conversions]]:
    m = fake_mode()
    yield m, Conversions(m)


def _leaf(make: Callable[[], torch.Tensor]) -> torch.Tensor:
    torch.manual_seed(0)
    return make()


#: leaves an op only reads: name -> (the leaf, the program on (x, leaf), x's shape)
READ: dict[str, tuple[Callable[[], torch.Tensor], Callable[[Any, Any], Any], tuple[int, ...]]] = {
    "parameter, mm": (
        lambda: torch.nn.Parameter(torch.randn(3, 4)),
        lambda x, p: torch.mm(x, p).sin().sum(),
        (2, 3),
    ),
    "plain leaf, mul": (
        lambda: torch.randn(2, 3, requires_grad=True),
        lambda x, p: (x * p).pow(2).sum(),
        (2, 3),
    ),
    "non-contiguous leaf": (
        lambda: torch.randn(4, 3).t().detach().requires_grad_(),
        lambda x, p: (x @ p).tanh().sum(),
        (2, 3),
    ),
    "conjugate leaf": (
        lambda: torch.nn.Parameter(torch.randn(2, 3, dtype=torch.complex64).conj()),
        lambda x, p: (x.to(torch.complex64) * p).abs().sum(),
        (2, 3),
    ),
    "inside a list (cat)": (
        lambda: torch.nn.Parameter(torch.randn(2, 3)),
        lambda x, p: torch.cat([x, p]).exp().sum(),
        (2, 3),
    ),
    "bias of addmm": (
        lambda: torch.nn.Parameter(torch.randn(4)),
        lambda x, p: torch.addmm(p, x, torch.ones(3, 4)).relu().sum(),
        (2, 3),
    ),
    "conv2d weight": (
        lambda: torch.nn.Parameter(torch.randn(2, 3, 3, 3)),
        lambda x, p: torch.nn.functional.conv2d(x, p).square().sum(),
        (1, 3, 5, 5),
    ),
    "an input without grad": (
        lambda: torch.randn(2, 3),
        lambda x, c: (x.requires_grad_() * c).sin().sum(),
        (2, 3),
    ),
    "eval batch_norm's running mean": (
        lambda: torch.randn(3),
        lambda x, mean: (
            torch.nn.functional.batch_norm(x.requires_grad_(), mean, torch.ones(3), training=False)
            .square()
            .sum()
        ),
        (4, 3),
    ),
}


def _x(shape: tuple[int, ...]) -> torch.Tensor:
    """The program's input: made inside the mode, a fake (an activation), as eager makes it."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("name", list(READ))
def test_a_leaf_an_op_only_reads_is_not_converted(mode: Any, name: str) -> None:
    """The parameter never becomes a fake, in forward or backward; the program's values and
    gradients are eager's."""
    m, conversions = mode
    make, program, shape = READ[name]
    p_e = _leaf(make)
    loss_e = program(_x(shape), p_e)
    loss_e.backward()
    p = _leaf(make)
    with m:
        loss = program(_x(shape), p)
        loss.backward()
    assert conversions.of(p) == 0 or UNPATCHED
    torch.testing.assert_close(loss.real_tensor, loss_e.detach())
    if p.requires_grad:
        assert type(p.grad) is torch.Tensor
        torch.testing.assert_close(p.grad, p_e.grad)
    assert torch.equal(p.detach(), p_e.detach())  # read, never written


def test_a_linear_layer_converts_only_its_weight_for_the_view() -> None:
    """``linear`` = ``t()`` of the weight (a view: its fake aliases the weight's fake, so the
    weight is converted) + ``addmm`` (the bias: read directly); backward converts neither."""
    lin = torch.nn.Linear(3, 4)
    x = torch.randn(2, 3)
    m = fake_mode()
    conversions = Conversions(m)
    with m:
        lin(x).square().sum().backward()
    assert conversions.of(lin.weight) == 1
    assert conversions.of(lin.bias) == 0 or UNPATCHED
    expected = torch.nn.Linear(3, 4)
    expected.load_state_dict(lin.state_dict())
    expected(x).square().sum().backward()
    torch.testing.assert_close(lin.weight.grad, expected.weight.grad)
    torch.testing.assert_close(lin.bias.grad, expected.bias.grad)


def test_no_output_aliases_the_parameter(mode: Any) -> None:
    m, _ = mode
    p = torch.nn.Parameter(torch.randn(3, 3))
    with m:
        eye = torch.eye(3)
        outs = [p + eye * 0, torch.mm(eye, p), torch.cat([p, eye]), torch.clone(p)]
    for out in outs:
        assert out.real_tensor.untyped_storage().data_ptr() != p.untyped_storage().data_ptr()
        torch.testing.assert_close(out.real_tensor[:3], p.detach())


# -- still converted ------------------------------------------------------------------------


def test_the_base_of_a_view_is_converted(mode: Any) -> None:
    m, conversions = mode
    p = torch.nn.Parameter(torch.randn(3, 4))
    with m:
        view = p.t()
    assert conversions.of(p) == 1
    torch.testing.assert_close(view.real_tensor, p.detach().t())


def test_an_argument_of_an_op_that_writes_is_converted_and_the_update_reported(
    mode: Any,
) -> None:
    """``fake.add_(p)`` reads p (converted: the op writes); ``p.mul_(fake)`` under no_grad
    writes the parameter: converted, the update reaches only the copy and is reported, p
    untouched (an op on real tensors alone runs on them for real, upstream's way)."""
    from fakegrad_patch import trace

    m, conversions = mode
    p = torch.nn.Parameter(torch.randn(3))
    before = p.detach().clone()
    with m:
        acc = torch.zeros(3)
        acc.add_(p)
    assert conversions.of(p) == 1
    torch.testing.assert_close(acc.real_tensor, before)
    trace.set_level(trace.WARNING)
    trace.clear()
    with m, torch.no_grad():
        p.mul_(m.from_tensor(torch.tensor(2.0)))
    assert conversions.of(p) == 2
    lost = [e for e in trace.events() if e["event"] == "update_lost"]
    assert len(lost) == 1 or UNPATCHED
    torch.testing.assert_close(p.detach(), before)


def test_a_non_leaf_that_requires_grad_is_converted(mode: Any) -> None:
    m, conversions = mode
    t = torch.randn(3, 4, requires_grad=True) * 2
    with m:
        out = torch.mm(torch.ones(2, 3), t)  # ones: a fake
    assert conversions.of(t) == 1
    torch.testing.assert_close(out.real_tensor, torch.ones(2, 3) @ t.detach())


def test_training_batch_norm_converts_its_running_statistics(mode: Any) -> None:
    """BatchNorm's kernel writes its running statistics (a hidden write of real buffers):
    those are converted, the update reaches the copies and is reported lost, as before; the
    weight, bias and input it only reads are read directly (the op writes real tensors only,
    none over their storages). Values and gradients are eager's."""
    from fakegrad_patch import trace

    m, conversions = mode
    torch.manual_seed(0)
    bn = torch.nn.BatchNorm1d(3)
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-1, 1)
    eager = torch.nn.BatchNorm1d(3)
    eager.load_state_dict(bn.state_dict())
    before = bn.running_mean.clone()
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(2))
    out_e = eager(x)
    out_e.square().sum().backward()
    trace.set_level(trace.WARNING)
    trace.clear()
    with m:
        out = bn(x)
        out.square().sum().backward()
    assert conversions.of(bn.running_mean) >= 1
    assert conversions.of(bn.running_var) >= 1
    assert conversions.of(bn.weight) == 0 or UNPATCHED
    assert conversions.of(bn.bias) == 0 or UNPATCHED
    assert conversions.of(x) == 0 or UNPATCHED
    assert torch.equal(bn.running_mean, before) or UNPATCHED
    lost = [e for e in trace.events() if e["event"] == "update_lost"]
    assert lost or UNPATCHED
    torch.testing.assert_close(out.real_tensor, out_e.detach())
    torch.testing.assert_close(bn.weight.grad, eager.weight.grad)
    torch.testing.assert_close(bn.bias.grad, eager.bias.grad)


def test_a_tensor_over_a_written_storage_is_converted(mode: Any) -> None:
    """The op writes a real tensor and reads another over the same storage (BatchNorm's weight
    is its running mean): the read is converted too, so the kernel reads the copy it writes,
    as eager's reads the buffer it writes (the CPU kernel updates the running mean, then
    scales by the weight). Read directly, it would read the values before the update."""
    m, conversions = mode
    stats = torch.randn(2, 3).abs()
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(3))

    def program(stats: torch.Tensor, x: torch.Tensor) -> Any:
        mean, var = stats[0], stats[1]  # real views of one storage, made outside the mode
        return mean, lambda: torch.nn.functional.batch_norm(
            x, mean, var, weight=mean, training=True
        )

    expected = program(stats.clone(), x)[1]()
    mean, run = program(stats.clone(), x)
    with m:
        out = run()
    assert conversions.of(mean) == 2 or UNPATCHED  # the running mean and the weight
    assert conversions.of(x) == 0 or UNPATCHED
    torch.testing.assert_close(out.real_tensor, expected)


def test_write_back_converts_every_argument() -> None:
    fakegrad_patch.configure(buffers="write_back")
    m = fake_mode()
    conversions = Conversions(m)
    p = torch.nn.Parameter(torch.randn(3, 4))
    with m:
        torch.mm(torch.ones(2, 3), p)
    assert conversions.of(p) == 1  # write-back's conversion aliases p: its values are p


def test_a_mode_that_only_reads_parameters_still_writes_real_gradients() -> None:
    """Every input made inside the mode, the parameters only read: no conversion at all, and
    backward still gives the parameters real gradients (the mode is followed as a converting
    one is)."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    bias = model[2].bias
    with fake_mode():
        x = torch.randn(5, 3)
        (x.sum() * bias).sum().backward()
    assert type(bias.grad) is torch.Tensor
    torch.testing.assert_close(bias.grad, x.real_tensor.sum().reshape(1))


def test_threads_read_the_same_parameter() -> None:
    import threading

    p = torch.nn.Parameter(torch.randn(8, 8))
    x = torch.randn(4, 8)
    errors: list[BaseException] = []

    def work() -> None:
        try:
            with torch._functorch.config.patch(fake_tensor_propagate_real_tensors=True):
                for _ in range(20):
                    with fake_mode() as m:
                        out = torch.mm(m.from_tensor(x), p)
                    torch.testing.assert_close(out.real_tensor, x @ p.detach())
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def test_a_graph_over_parameters_read_directly_finishes_after_uninstall() -> None:
    """``uninstall()`` arms the leaves of live graphs it knows of: those read directly too, so
    the backward finishes with real gradients (never a FakeTensor in ``.grad``)."""
    p = torch.nn.Parameter(torch.randn(3))
    with fake_mode():
        x = torch.randn(2, 3, generator=torch.Generator().manual_seed(1))
        loss = (x * p).sum()
        fakegrad_patch.uninstall()
        try:
            loss.backward()
        finally:
            fakegrad_patch.install()
    assert type(p.grad) is torch.Tensor
    expected = torch.randn(2, 3, generator=torch.Generator().manual_seed(1)).sum(0)
    torch.testing.assert_close(p.grad, expected)
