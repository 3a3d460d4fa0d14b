"""Programs, not single ops: what a propagating pass must keep from eager across several ops.

Each program runs eagerly and in one patched propagating pass, for both settings that act on
propagation (``fast``, the default, and ``repair``), from the same leaves and random state, and
compares what the program can read: every output's values (a fake's propagated values, read
with the fake's own conjugate and negative bits), its metadata (sizes, strides, offset, dtype,
the bits), the leaves' gradients, and the random state after. Families found by the
differential fuzzer (tests/fuzz_programs.py) and the complex OpInfo sweep land here as
regression tests.
"""

from __future__ import annotations

import contextlib
import functools
import json
import subprocess
import sys
import textwrap
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from _helpers import fake_mode

import fakegrad_patch

pytestmark = pytest.mark.usefixtures("propagate")

SETTINGS = ("fast", "repair")


@pytest.fixture(params=SETTINGS)
def setting(request: pytest.FixtureRequest) -> str:
    fakegrad_patch.configure(propagation=request.param)
    return str(request.param)


def logical(t: torch.Tensor) -> torch.Tensor:
    """The values ``t`` stands for, as a plain real tensor: a fake's propagated values are its
    raw storage, read with the fake's own conjugate and negative bits."""
    real = getattr(t, "real_tensor", t)
    assert real is not None, "a fake output without propagated values"
    view = real.detach().view(real.shape)
    torch._C._set_conj(view, t.is_conj())
    torch._C._set_neg(view, t.is_neg())
    return view.clone()


def metadata(t: torch.Tensor) -> tuple[Any, ...]:
    return (tuple(t.shape), t.stride(), t.storage_offset(), t.dtype, t.is_conj(), t.is_neg())


def outputs(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, list | tuple):
        return [t for v in value for t in outputs(v)]
    return []


def run(
    program: Callable[..., Any], make_leaves: Callable[[], Sequence[torch.Tensor]], fake: bool
) -> tuple[list[torch.Tensor], list[tuple[Any, ...]], list[Any], torch.Tensor]:
    torch.manual_seed(0)
    leaves = make_leaves()
    torch.manual_seed(1)
    if fake:
        with fake_mode():
            result = outputs(program(*leaves))
    else:
        result = outputs(program(*leaves))
    values = [logical(t) for t in result]
    grads = [leaf.grad for leaf in leaves]
    return values, [metadata(t) for t in result], grads, torch.get_rng_state()


def _same(f: torch.Tensor, e: torch.Tensor, what: str, exact: bool) -> None:
    if exact:
        assert torch.equal(f, e), f"{what}: max abs {(f - e).abs().max().item():.3g}"
    else:
        torch.testing.assert_close(f, e, rtol=1e-5, atol=1e-5)


def assert_like_eager(
    program: Callable[..., Any],
    make_leaves: Callable[[], Sequence[torch.Tensor]],
    exact: bool = False,
) -> None:
    """Eager against one patched pass; ``exact``: values and gradients to the bit."""
    e_values, e_meta, e_grads, e_rng = run(program, make_leaves, fake=False)
    f_values, f_meta, f_grads, f_rng = run(program, make_leaves, fake=True)
    assert f_meta == e_meta
    for i, (f, e) in enumerate(zip(f_values, e_values, strict=True)):
        _same(f, e, f"output {i}", exact)
    for i, (f, e) in enumerate(zip(f_grads, e_grads, strict=True)):
        if e is None:
            assert f is None
            continue
        assert type(f) is torch.Tensor, f"a fake or missing gradient: {type(f).__name__}"
        assert (f.stride(), f.dtype) == (e.stride(), e.dtype)
        _same(f, e, f"leaf {i}", exact)
    assert torch.equal(f_rng, e_rng), "the program drew random numbers differently"


# -- ZeroTensors: autograd's zero gradients (double backward, forward AD) --------------------------

#: Each program takes its leaves and runs a double backward whose formulas make
#: ``aten._efficientzerotensor`` (a ZeroTensor: no storage). A fake made from a real ZeroTensor
#: lost the ZeroTensor key, and the next op's real kernel read its null data pointer: SIGSEGV.
ZERO_TENSOR_PROGRAMS = {
    "pow_tensor_exponent": """
        y = torch.pow(w.logsumexp(0).abs() + 0.1, e); loss = (y * y).sum()
        (g,) = torch.autograd.grad(loss, [w], create_graph=True)
        (g.pow(2).sum() + loss).backward()""",
    "xlogy": """
        y = torch.xlogy(w.abs().sum() + 0.5, e.abs() + 0.5).sum()
        (g,) = torch.autograd.grad(y, [w], create_graph=True)
        (g * g).sum().backward()""",
    "scalar_times_dual": """
        with fwAD.dual_level():
            d = fwAD.make_dual(e, torch.ones_like(e))
            t = fwAD.unpack_dual((d * 2).sin()).tangent
        (w * t.sum()).sum().backward()""",
}


def test_zero_tensors_of_double_backward_and_forward_ad_do_not_crash(setting: str) -> None:
    """In a child process (a regression is a segfault): every program ends, with eager's
    gradients."""
    script = textwrap.dedent(
        """
        import json, sys, torch, fakegrad_patch
        import torch.autograd.forward_ad as fwAD
        import torch._functorch.config as config
        from torch._subclasses.fake_tensor import FakeTensorMode
        fakegrad_patch.configure(propagation=sys.argv[1])
        config.fake_tensor_propagate_real_tensors = True
        programs = json.loads(sys.argv[2])
        for name, body in programs.items():
            grads = []
            for fake in (False, True):
                w = torch.tensor([0.3, -1.2], requires_grad=True)
                e = torch.tensor([0.5, -0.7, 1.0])
                if fake:
                    with FakeTensorMode(allow_non_fake_inputs=True):
                        exec(body)
                else:
                    exec(body)
                grads.append(w.grad)
            same = type(grads[1]) is torch.Tensor and torch.allclose(*grads, atol=1e-5)
            print(json.dumps([name, same]), flush=True)
        """
    )
    programs = {name: textwrap.dedent(body) for name, body in ZERO_TENSOR_PROGRAMS.items()}
    out = subprocess.run(
        [sys.executable, "-c", script, setting, json.dumps(programs)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    done = dict(json.loads(line) for line in out.stdout.splitlines() if line.startswith("["))
    assert out.returncode == 0, (out.returncode, done, out.stderr[-2000:])
    assert done == dict.fromkeys(ZERO_TENSOR_PROGRAMS, True)


FORWARD_AD = {
    "unary": lambda d, x: d.sin(),
    "times_a_number": lambda d, x: d * 2,
    "times_itself": lambda d, x: d * d,
    "reduction": lambda d, x: d.sum(),
    "view_then_op": lambda d, x: d.view(2, 2).t().exp(),
    "with_a_real_tensor": lambda d, x: torch.addcmul(x, d, x, value=0.5),
}


@pytest.mark.parametrize("op", FORWARD_AD)
def test_forward_ad_tangents_are_eager_ones(setting: str, op: str) -> None:
    fn = FORWARD_AD[op]

    def program(x: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with fwAD.dual_level():
            primal, tangent = fwAD.unpack_dual(fn(fwAD.make_dual(x, t), x))
        return primal, tangent

    assert_like_eager(program, lambda: (torch.randn(4), torch.randn(4)))


def test_torch_func_jvp(setting: str) -> None:
    def program(x: torch.Tensor, t: torch.Tensor) -> Any:
        return torch.func.jvp(lambda v: (v.sin() * 2).sum(), (x,), (t,))

    assert_like_eager(program, lambda: (torch.randn(4), torch.randn(4)))


# -- complex values: conjugate and negative bits ---------------------------------------------------

#: Real kernels called inside a dispatch mode run with the Conjugate and Negative keys excluded:
#: they read a conjugate view's raw storage, and a composite kernel's own conjugate views
#: (``linalg.pinv``'s ``mH``) raw; the converter gives a conjugate view's fake the bit and a raw
#: copy without it.
COMPLEX_PROGRAMS: dict[str, Callable[[torch.Tensor, torch.Tensor], Any]] = {
    "times_own_conj": lambda a, b: a * a.conj(),
    "one_element_times_own_conj": lambda a, b: a[:1] * a[:1].conj(),
    "conj_imag": lambda a, b: a.conj().imag * 2,
    "neg_view": lambda a, b: torch._neg_view(a) + 1,
    "conj_transpose_matmul": lambda a, b: a.reshape(2, 2).mH @ b.reshape(2, 2),
    "conj_view_of_a_view": lambda a, b: a.conj().view(2, 2).t().sum(0),
    "conj_twice": lambda a, b: a.conj().conj() * b,
    "in_place_on_a_conj_view": lambda a, b: a.clone().conj().mul_(b),
    "item_of_a_conj": lambda a, b: a * a.conj()[0].item(),
    "real_and_imag_of_a_conj": lambda a, b: (a.conj().real + a.conj().imag) * b.abs(),
    "vecdot": lambda a, b: torch.linalg.vecdot(a, b),
    "vdot": lambda a, b: torch.vdot(a, b),
    "pinv": lambda a, b: torch.linalg.pinv(a.reshape(2, 2) + 3 * torch.eye(2)),
    "lstsq": lambda a, b: (
        torch.linalg.lstsq(a.reshape(2, 2) + 3 * torch.eye(2), b.reshape(2, 2)).solution
    ),
    "conj_physical_": lambda a, b: a.clone().conj_physical_() * b,
    "abs_of_a_conj": lambda a, b: a.conj().abs() * b,
    "conj_of_a_real_input": lambda a, b: b.detach().conj() * a,
    "lu_solve_from_the_right": lambda a, b: torch.linalg.lu_solve(
        *torch.linalg.lu_factor(a.reshape(2, 2) + 3 * torch.eye(2)), b.reshape(2, 2), left=False
    ),
    "lu_solve_adjoint_from_the_right": lambda a, b: torch.linalg.lu_solve(
        *torch.linalg.lu_factor(a.reshape(2, 2) + 3 * torch.eye(2)),
        b.reshape(2, 2),
        left=False,
        adjoint=True,
    ),
    "inverse_of_an_empty_batch": lambda a, b: torch.linalg.inv(a[:0].reshape(0, 2, 2)) * b.sum(),
    "conj_of_a_one_element_leaf": lambda a, b: a[:1].conj() * 1,
    "conj_of_a_zero_dim_leaf": lambda a, b: a[0].conj() * 1,
}


def test_a_real_conjugate_tensor_that_is_not_a_view_reads_as_in_eager(setting: str) -> None:
    """The converter copies such a tensor's values (copy_ resolves the bit) and gives only the
    fake the bit; read with the fake's bit, the values were conjugated twice."""
    a = torch.randn(2, 2, dtype=torch.complex64) + 3 * torch.eye(2)
    b = torch.randn(2, 2, dtype=torch.complex64)
    solved = torch.linalg.lu_solve(*torch.linalg.lu_factor(a), b, left=False)
    assert solved.is_conj() and solved._base is None  # a kernel's conj output, not a view

    def program(x: torch.Tensor) -> Any:
        return solved * x, solved + 0, solved.t() * 1

    assert_like_eager(program, lambda: (torch.randn(2, 2, dtype=torch.complex64),))


def _real_cotangent(out: torch.Tensor) -> torch.Tensor:
    with torch._subclasses.fake_tensor.unset_fake_temporarily():
        return torch.full(out.shape, 1 - 2j, dtype=out.dtype)


@pytest.mark.parametrize("shape", [(), (1,), (3,)], ids=str)
def test_a_conj_gradient_given_a_real_cotangent_keeps_its_bit(
    setting: str, shape: tuple[int, ...]
) -> None:
    """``x.conj() * 1`` backward with a real complex cotangent: a small gradient becomes an
    upstream constant, whose fake keeps the conjugate bit of ``conj``'s backward while its
    values do not: the leaf got the conjugate of eager's gradient."""

    def program(x: torch.Tensor) -> Any:
        out = x.conj() * 1
        out.backward(_real_cotangent(out))
        return out

    assert_like_eager(
        program, lambda: (torch.randn(shape, dtype=torch.complex64).requires_grad_(),)
    )


def _complex_leaves() -> tuple[torch.Tensor, torch.Tensor]:
    return (
        torch.randn(4, dtype=torch.complex64, requires_grad=True),
        torch.randn(4, dtype=torch.complex64, requires_grad=True),
    )


@functools.cache
def _upstream_refuses_complex_scalars() -> str | None:
    """2.4's propagation runs ``aten._conj`` of a complex Python scalar (the backward of
    ``tensor * complex``) on the scalar itself and raises; the patch leaves that error to
    upstream (it names the op). The message, where the build raises it; None otherwise."""
    before = fakegrad_patch.settings().propagation
    fakegrad_patch.configure(propagation="upstream")
    try:
        a = torch.ones(2, dtype=torch.complex64, requires_grad=True)
        with fake_mode():
            (a * complex(1, 2)).abs().sum().backward()
    except RuntimeError as exc:
        return str(exc).splitlines()[0]
    finally:
        fakegrad_patch.configure(propagation=before)
    return None


@pytest.mark.parametrize("name", COMPLEX_PROGRAMS)
def test_complex_programs_follow_eager(setting: str, name: str) -> None:
    fn = COMPLEX_PROGRAMS[name]
    if name == "item_of_a_conj" and _upstream_refuses_complex_scalars():
        pytest.skip(f"upstream raises itself on this build: {_upstream_refuses_complex_scalars()}")

    def program(a: torch.Tensor, b: torch.Tensor) -> Any:
        out = fn(a, b)
        loss = sum(t.abs().sum() for t in outputs(out))
        loss.backward()  # type: ignore[union-attr]
        return out

    assert_like_eager(program, _complex_leaves)


# -- kernels that read a conjugate or negative bit themselves -------------------------------------


def _column_major(t: torch.Tensor) -> torch.Tensor:
    return t.mT.contiguous().mT


#: Eager hands a conjugate or negative view as it is to the kernels that read the bit themselves
#: (mm, addmm, bmm, dot, linalg.solve_triangular: BLAS's conjugate transpose); the others get
#: it materialized by the bit's fallback. Under ``repair`` upstream's real run read every such
#: argument materialized: the same numbers rounded otherwise (~1e-7), which svd_lowrank's
#: backward amplified to 2e-5 of a gradient without a word (the complex64 OpInfo sweep); ops
#: that write (``addmm_``, ``mm(out=)``, into a conjugate view or not) read them so until
#: 2026-12-07, in both settings.
#: Compared to the bit, at two sizes (BLAS and ATen's own small-matrix loops).
BIT_READING_PROGRAMS: dict[str, Callable[..., Any]] = {
    "mm_of_an_adjoint": lambda a, b, v: torch.mm(a.mH, b),
    "matmul_of_a_conj": lambda a, b, v: a @ b.conj(),
    "batched_matmul_of_an_adjoint": lambda a, b, v: torch.matmul(a.mH.expand(2, -1, -1), b),
    "addmm": lambda a, b, v: torch.addmm(v, a.mH, b),
    "baddbmm": lambda a, b, v: torch.baddbmm(b[None], a.mH[None], b[None]),
    "dot_and_vdot": lambda a, b, v: (torch.dot(v.conj(), a[0]), torch.vdot(v, a[0].conj())),
    "mv_of_an_adjoint": lambda a, b, v: torch.mv(a.mH, v),
    "mm_of_a_negative_view": lambda a, b, v: torch.mm(torch._neg_view(a), b),
    "addmm_in_place": lambda a, b, v: (a * 1).addmm_(a.mH, b),
    "solve_triangular_of_an_adjoint": lambda a, b, v: torch.linalg.solve_triangular(
        a.triu() + 4 * torch.eye(a.shape[0]), b.mH, upper=True
    ),
    "linear_with_a_conj_weight": lambda a, b, v: torch.nn.functional.linear(b, a.conj(), v),
    "einsum_of_an_adjoint": lambda a, b, v: torch.einsum("ij,jk->ik", a.mH, b),
    "svd_lowrank_of_a_low_rank_product": lambda a, b, v: torch.svd_lowrank(
        a[:, :2] @ b[:2, :], q=2
    ),
    # column-major operands (as linalg_qr's Q, which svd_lowrank multiplies): another BLAS call
    "mm_of_column_major_operands": lambda a, b, v: torch.mm(a.mH, _column_major(b)),
    "addmm_in_place_of_column_major_operands": lambda a, b, v: (a * 1).addmm_(
        a.mH, _column_major(b)
    ),
    "mm_out_of_column_major_operands": lambda a, b, v: (
        a * torch.mm(a.detach().mH, _column_major(b.detach()), out=torch.empty_like(a))
    ),
    "baddbmm_in_place_of_column_major_operands": lambda a, b, v: (b * 1)[None].baddbmm_(
        a.mH[None], _column_major(b)[None]
    ),
    # writes into a conjugate view
    "addmm_into_a_conj_view": lambda a, b, v: (b * 1).conj().addmm_(a.mH, _column_major(b)),
    "mm_out_into_a_conj_view": lambda a, b, v: (
        a * torch.mm(a.detach().mH, _column_major(b.detach()), out=torch.empty_like(a).conj())
    ),
}


@pytest.mark.parametrize("n", [3, 5])
@pytest.mark.parametrize("name", BIT_READING_PROGRAMS)
def test_kernels_that_read_a_bit_themselves_give_eagers_values_to_the_bit(
    setting: str, name: str, n: int
) -> None:
    fn = BIT_READING_PROGRAMS[name]

    def program(a: torch.Tensor, b: torch.Tensor, v: torch.Tensor) -> Any:
        out = fn(a, b, v)
        loss = sum(t.abs().sum() for t in outputs(out))
        loss.backward()  # type: ignore[union-attr]
        return out

    def leaves() -> tuple[torch.Tensor, ...]:
        shapes = ((n, n), (n, n), (n,))
        return tuple(torch.randn(s, dtype=torch.complex64, requires_grad=True) for s in shapes)

    assert_like_eager(program, leaves, exact=True)


@pytest.mark.parametrize("bit", ["conj", "neg"])
def test_values_without_their_fakes_bit_are_read_through_it(setting: str, bit: str) -> None:
    """A fake whose propagated values lack its bit (an upstream constant's can: the conj
    gradient above) stands for its values' raw storage read with its own bit: a kernel that
    reads the bit itself is handed an alias with the fake's bit (not the values as they are,
    the bit lost; nor a materialized copy, rounded otherwise than eager's kernel)."""
    a = torch.randn(3, 3, dtype=torch.complex64)
    b = torch.randn(3, 2, dtype=torch.complex64)
    viewed = (lambda t: t.mH) if bit == "conj" else torch._neg_view
    want = torch.mm(viewed(a), b)
    with fake_mode():
        y = viewed(a * 1)
        assert y.is_conj() or y.is_neg()
        with torch._subclasses.fake_tensor.unset_fake_temporarily():
            stripped = torch.ops.aten.alias.default(y.real_tensor)
            torch._C._set_conj(stripped, False)
            torch._C._set_neg(stripped, False)
        y.real_tensor = stripped
        got = logical(torch.mm(y, b))
    assert torch.equal(got, want), f"max abs {(got - want).abs().max().item():.3g}"


# -- random numbers: drawn once, as eager draws them -----------------------------------------------


def _linear_inside(x: torch.Tensor) -> Any:
    layer = torch.nn.Linear(4, 3)  # kaiming init: uniform_ inside the mode
    return layer.weight, layer.bias, layer(x)


def _conv_inside(x: torch.Tensor) -> Any:
    conv = torch.nn.Conv2d(1, 2, 3)
    return conv.weight, conv(x.reshape(1, 1, 2, 2).repeat(1, 1, 2, 2))


RANDOM_PROGRAMS: dict[str, Callable[[torch.Tensor], Any]] = {
    "uniform_": lambda x: torch.empty(5).uniform_(-2, 2) * x.sum(),
    "uniform_then_rand": lambda x: (torch.empty(3).uniform_(), torch.rand(3)),
    "uniform_with_a_generator": lambda x: torch.empty(3).uniform_(
        generator=torch.Generator().manual_seed(3)
    ),
    "normal_": lambda x: torch.empty(4).normal_() + x,
    "linear_built_inside": _linear_inside,
    "conv_built_inside": _conv_inside,
    "dropout": lambda x: torch.nn.functional.dropout(x, 0.5) * 2,
    "bernoulli_": lambda x: torch.empty(4).bernoulli_(0.3) * x,
    "randperm_and_randint": lambda x: (torch.randperm(6), torch.randint(0, 9, (3,))),
    "randn_like_of_a_leaf": lambda x: torch.randn_like(x) * x,
    "exponential_": lambda x: torch.empty(4).exponential_() + x,
    "rrelu_training": lambda x: torch.nn.functional.rrelu(x, training=True),
}


@pytest.mark.parametrize("name", RANDOM_PROGRAMS)
def test_random_numbers_are_drawn_as_eager_draws_them(setting: str, name: str) -> None:
    fn = RANDOM_PROGRAMS[name]

    def program(x: torch.Tensor) -> Any:
        out = fn(x)
        (x.sum() + sum(t.float().sum() for t in outputs(out) if t.requires_grad)).backward()
        return (*outputs(out), torch.rand(2))  # the draw after the program too

    assert_like_eager(program, lambda: (torch.randn(4, requires_grad=True),))


# -- FakeTensorMode's own semantics: constants -----------------------------------------------------


def _constants() -> dict[str, Any]:
    """What FakeTensorMode's constant tracking says about a few programs (in a propagating mode
    without ``allow_non_fake_inputs``, as PyTorch's own tests run it)."""
    seen: dict[str, Any] = {}
    with torch._subclasses.fake_tensor.FakeTensorMode():
        a = torch.tensor([4.0])
        seen["literal"] = a.constant
        seen["view_of_literal"] = a[:].constant
        seen["folded_div"] = torch.div(4, 4, rounding_mode="trunc").constant
        seen["folded_op_on_constants"] = (a * 2).constant
        x = torch.tensor([1])
        y = x.expand([4])
        y[0] = 5  # a write through a view invalidates the constant it aliases
        seen["after_a_write_through_a_view"] = x.constant
        real = x.real_tensor
    seen["real_value_after_the_write"] = real.clone()
    return seen


def test_constant_tracking_is_upstreams(setting: str) -> None:
    """The fast path stood in front of it: ``tensor([4.0])[:]`` lost its constant,
    ``div(4, 4)`` was not folded, and a write through a view of a constant did not invalidate
    it (``x.item()`` then read the stale constant)."""
    ours = _constants()
    fakegrad_patch.configure(propagation="upstream")
    theirs = _constants()
    assert ours.keys() == theirs.keys()
    for key in ours:
        if theirs[key] is None:
            assert ours[key] is None, key
        else:
            assert ours[key] is not None and torch.equal(ours[key], theirs[key]), key
    assert ours["after_a_write_through_a_view"] is None
    assert torch.equal(ours["real_value_after_the_write"], torch.tensor([5]))


def test_item_after_a_write_through_a_view_of_a_constant_is_the_written_value(
    setting: str,
) -> None:
    with torch._subclasses.fake_tensor.FakeTensorMode():
        x = torch.tensor([1])
        x.expand([4])[0] = 5
        assert x.item() == 5  # upstream refuses (data-dependent); never the stale 1


# -- in-place updates of real tensors, then read again inside the mode -----------------------------

WRITES_THEN_READ: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "through_a_view_of_a_view": lambda x: x.view(2, 3)[:, :2].add_(1),
    "directly": lambda x: x.add_(1),
    "through_a_slice": lambda x: x[:2].add_(1),
    "through_a_full_view": lambda x: x.view(6).add_(1),
}


@pytest.mark.parametrize("write", WRITES_THEN_READ)
def test_a_buffer_written_inside_the_mode_is_read_back_with_the_write(
    setting: str, write: str
) -> None:
    """With write-back, the buffer and what the mode reads of it afterwards are eager's: the
    fake that aliased the buffer died with the views, and the converter's storage memo gave the
    next conversion the copy of the first one (stale: [0, 1, 2, ...] after the write)."""
    fakegrad_patch.configure(buffers="write_back")

    def program(x: torch.Tensor) -> Any:
        written = WRITES_THEN_READ[write](x)  # the view stays alive while x is read
        return x * 1, x.sum(), written

    def make() -> tuple[torch.Tensor]:
        return (torch.arange(6.0),)

    e_values, _, _, _ = run(program, make, fake=False)
    torch.manual_seed(0)
    buffer = make()[0]
    with fake_mode():
        read = [logical(t) for t in program(buffer)]
    for f, e in zip(read, e_values, strict=True):
        assert torch.equal(f, e)
    assert torch.equal(buffer, e_values[0])


# -- `.data` assignment inside the mode ------------------------------------------------------------

DATA_ASSIGNMENTS: dict[str, Callable[[torch.Tensor], Any]] = {
    "scaled_copy_of_itself": lambda p: p.data * 2,
    "new_values_of_the_same_shape": lambda p: torch.ones(3),
    "another_shape": lambda p: torch.arange(6.0).reshape(2, 3),
}


def test_data_of_a_tensor_made_inside_the_mode(setting: str) -> None:
    """``fake.data = other_fake``: set_data carries the metadata, not the propagated values
    (a Python attribute): the fake kept its old values."""

    def program(x: torch.Tensor) -> Any:
        y = x * 2
        y.data = torch.randn_like(y) + 5
        return y * 1, y

    assert_like_eager(program, lambda: (torch.randn(3),))


@pytest.mark.parametrize("assignment", DATA_ASSIGNMENTS)
def test_data_assigned_inside_the_mode_is_eagers(setting: str, assignment: str) -> None:
    """``real.data = fake`` made the real Parameter a meta tensor (every later op failed; after
    the mode it was garbage)."""
    new = DATA_ASSIGNMENTS[assignment]

    def program(p: torch.Tensor) -> Any:
        p.data = new(p)
        (p * 3).sum().backward()
        return p * 1

    def make() -> tuple[torch.Tensor]:
        return (torch.nn.Parameter(torch.arange(3.0)),)

    assert_like_eager(program, make)
    (p,) = make()
    with fake_mode():
        program(p)
    assert type(p) is torch.nn.Parameter and p.device.type == "cpu"


def test_the_data_property_is_torchs_own_once_no_propagating_mode_lives() -> None:
    import gc

    mode = fake_mode()
    with mode:
        torch.ones(1) * 2
        assert "data" in torch.Tensor.__dict__  # ours, while the mode lives
    del mode
    gc.collect()
    assert "data" not in torch.Tensor.__dict__


# -- set_(): a tensor made to alias another's storage ----------------------------------------------

SET_STORAGE: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "real_storage_with_offset": lambda a: torch.empty(0).set_(a.untyped_storage(), 1, (2,), (1,)),
    "real_storage_whole": lambda a: torch.empty(0).set_(a.untyped_storage()),
    "fake_source": lambda a: torch.empty(0).set_(a * 2),
    "fake_source_with_offset": lambda a: torch.empty(0).set_(a * 2, 1, (2,), (2,)),
    "fake_storage": lambda a: torch.empty(0).set_((a * 2).untyped_storage(), 2, (2,), (1,)),
}


@pytest.mark.parametrize("how", SET_STORAGE)
def test_set_storage_inside_the_mode_is_eagers(setting: str, how: str) -> None:
    """Upstream's real run got a fake's meta storage, or its fake side a real storage, and
    both refused ('set the storage of a tensor on device cpu to a storage on different device
    meta')."""

    def program(a: torch.Tensor) -> Any:
        t = SET_STORAGE[how](a)
        return t * 1, t

    assert_like_eager(program, lambda: (torch.arange(6.0),))


# -- a real leaf updated for real inside the mode (all-real arguments), viewed before --------------

LEAF_UPDATES: dict[str, Callable[[torch.Tensor], None]] = {
    # every argument real: FakeTensorMode runs these on the leaf itself, whatever the setting
    "sgd_like_add_": lambda p: p.add_(p.grad, alpha=-0.1),
    "mul_": lambda p: p.mul_(0.5),
    # a fake argument (copy_) or none that FakeTensorMode runs for real (zero_): the update
    # reaches the leaf with buffers="write_back" (reported, and lost, without it)
    "copy_": lambda p: p.copy_(p.detach() * 3),
    "zero_": lambda p: p.zero_(),
}


@pytest.mark.parametrize("update", LEAF_UPDATES)
def test_views_made_before_a_real_update_of_their_leaf_read_it(setting: str, update: str) -> None:
    """The views made of the leaf earlier are over the fake's copy, which followed only at the
    leaf's next conversion: they read the old values until then."""
    if update in ("copy_", "zero_"):
        fakegrad_patch.configure(buffers="write_back")

    def program(p: torch.Tensor) -> Any:
        view = p.unsqueeze(0).expand(2, 3, 4)
        other = p.t()
        (view.sum() + other.sum()).backward()
        with torch.no_grad():
            LEAF_UPDATES[update](p)
        return view * 1, other * 1, view, other

    assert_like_eager(program, lambda: (torch.nn.Parameter(torch.randn(3, 4)),))


def test_a_write_through_a_tensor_set_to_a_real_storage_is_reported_or_written_back(
    setting: str,
) -> None:
    """The real tensor over the storage that the conversion made died at once: the write
    reached the copy, and nothing said so. Reported by default; written with write-back."""
    from fakegrad_patch import trace

    for buffers in ("upstream", "write_back"):
        fakegrad_patch.configure(buffers=buffers)
        buf = torch.zeros(3, 4)
        with trace.capture("warning") as events, fake_mode():
            t = torch.empty(0)
            t.set_(buf.untyped_storage())
            t.view(12, 1)[0] = 1.5
        lost = [e for e in events if e["event"] == "update_lost"]
        if buffers == "write_back":
            assert buf[0, 0] == 1.5 and not lost
        else:
            assert buf[0, 0] == 0 and lost


# -- metadata-changing ops on real tensors inside the mode -----------------------------------------

METADATA_CHANGES: dict[str, Callable[[torch.Tensor, torch.Tensor], Any]] = {
    "resize_": lambda x, y: x.resize_(2, 3),
    "t_": lambda x, y: x.t_(),
    "squeeze_": lambda x, y: x.unsqueeze_(0).squeeze_(0),
    "as_strided_": lambda x, y: x.as_strided_((2, 2), (1, 2)),
    "fake_resize_as_real": lambda x, y: (x * 1).resize_as_(y),
}


@pytest.mark.parametrize("change", METADATA_CHANGES)
def test_metadata_changes_of_real_tensors_are_eagers(setting: str, change: str) -> None:
    """FakeTensorMode refuses every such op with a real tensor among its arguments ('Can't
    call metadata mutating ops on non-Fake Tensor inputs'); eager changes the real tensor."""

    def program(x: torch.Tensor, y: torch.Tensor) -> Any:
        out = METADATA_CHANGES[change](x, y)
        return out, x * 1, x

    assert_like_eager(program, lambda: (torch.randn(3, 4), torch.randn(2, 2)))


# -- constants written in place --------------------------------------------------------------------

CONSTANT_WRITES: dict[str, Callable[[], torch.Tensor]] = {
    "literal_zeroed": lambda: torch.tensor([2.5]).zero_(),
    "literal_through_a_view": lambda: (lambda u: (u.view(1).add_(1.0), u)[1])(torch.tensor([2.5])),
    "zero_dim_literal_iadd": lambda: (lambda v: v.add_(1.5))(torch.tensor(2.5)),
    "op_on_a_literal_then_fill_": lambda: (torch.tensor([2.0]).abs() + 0.5).reciprocal().fill_(3),
    "clamp_of_a_literal_then_mul_": lambda: torch.tensor([2.0]).clamp(0, 1).mul_(4),
}


@pytest.mark.parametrize("write", CONSTANT_WRITES)
def test_a_constant_written_in_place_reads_the_write(setting: str, write: str) -> None:
    """FakeTensorMode folds ops on constants (one-element literals) on the ``constant`` copy and
    never updates the propagated one: ``torch.tensor([2.5]).zero_()`` read 2.5 (upstream too)."""

    def program(x: torch.Tensor) -> Any:
        out = CONSTANT_WRITES[write]()
        return out, out * x

    assert_like_eager(program, lambda: (torch.ones(1),))


@pytest.mark.parametrize("shape", [(), (3,)], ids=str)
def test_a_view_of_a_zero_dim_leaf_follows_its_real_update(setting: str, shape: Any) -> None:
    """The fast path's view outlives the fake of the leaf it was made of; the leaf's copy was
    refreshed through that fake only, so the view read the old value."""

    def program(p: torch.Tensor) -> Any:
        v = p.view(-1)
        with torch.no_grad():
            p.add_(0.5)
        return v * 1, v

    assert_like_eager(program, lambda: (torch.ones(shape, requires_grad=True),))


# -- tolist() -------------------------------------------------------------------------------------


def _sibling_of_a_written_unbind_output(x: torch.Tensor) -> Any:
    outs = x.unbind(1)
    with torch.no_grad():
        outs[1].div_(2.0)
    return outs[2].tolist()


TOLISTS: dict[str, Callable[[torch.Tensor], Any]] = {
    "two_dims": lambda x: (x * 2).tolist(),
    "zero_dims": lambda x: x.sum().tolist(),
    "a_sibling_of_an_unbind_output_written_in_place": _sibling_of_a_written_unbind_output,
}


@pytest.mark.parametrize("read", TOLISTS)
def test_tolist_reads_the_values_as_eager(setting: str, read: str) -> None:
    """FakeTensor.tolist iterates the fake (unbind: autograd refused a multi-output view whose
    sibling was written, where eager reads), and 2.4's had none ('NYI for higher dims')."""
    lists = []
    for fake in (False, True):
        torch.manual_seed(0)
        x = torch.randn(4, 3, requires_grad=True)
        with fake_mode() if fake else contextlib.nullcontext():
            lists.append(TOLISTS[read](x))
    assert lists[0] == lists[1]


@pytest.mark.parametrize("buffers", ["upstream", "write_back"])
def test_retain_grad_after_the_tensor_entered_the_mode_gives_a_real_grad(
    setting: str, buffers: str
) -> None:
    """``buf += leaf`` makes a real buffer a non-leaf; ``retain_grad()`` called after it had
    entered the mode: its retained gradient was a FakeTensor on a real tensor."""
    fakegrad_patch.configure(buffers=buffers)
    grads = []
    for fake in (False, True):
        torch.manual_seed(0)
        a = torch.randn(3, 4, requires_grad=True)
        buf = torch.zeros(3, 4)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", fakegrad_patch.FakeGradPatchWarning)
            with fake_mode() if fake else contextlib.nullcontext():
                buf += a
                view = buf[:, ::2]
                buf.retain_grad()
                view.sin().sum().backward()
        grads.append(buf.grad)
    assert type(grads[1]) is torch.Tensor
    torch.testing.assert_close(grads[1], grads[0])
