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

import json
import subprocess
import sys
import textwrap
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


def assert_like_eager(
    program: Callable[..., Any], make_leaves: Callable[[], Sequence[torch.Tensor]]
) -> None:
    e_values, e_meta, e_grads, e_rng = run(program, make_leaves, fake=False)
    f_values, f_meta, f_grads, f_rng = run(program, make_leaves, fake=True)
    assert f_meta == e_meta
    for f, e in zip(f_values, e_values, strict=True):
        torch.testing.assert_close(f, e, rtol=1e-5, atol=1e-5)
    for f, e in zip(f_grads, e_grads, strict=True):
        if e is None:
            assert f is None
            continue
        assert type(f) is torch.Tensor, f"a fake or missing gradient: {type(f).__name__}"
        assert (f.stride(), f.dtype) == (e.stride(), e.dtype)
        torch.testing.assert_close(f, e, rtol=1e-5, atol=1e-5)
    assert torch.equal(f_rng, e_rng), "the program drew random numbers differently"


# -- ZeroTensors: autograd's zero gradients (double backward, forward AD) -----------------------

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


# -- complex values: conjugate and negative bits ------------------------------------------------

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
}


def _complex_leaves() -> tuple[torch.Tensor, torch.Tensor]:
    return (
        torch.randn(4, dtype=torch.complex64, requires_grad=True),
        torch.randn(4, dtype=torch.complex64, requires_grad=True),
    )


@pytest.mark.parametrize("name", COMPLEX_PROGRAMS)
def test_complex_programs_follow_eager(setting: str, name: str) -> None:
    fn = COMPLEX_PROGRAMS[name]

    def program(a: torch.Tensor, b: torch.Tensor) -> Any:
        out = fn(a, b)
        loss = sum(t.abs().sum() for t in outputs(out))
        loss.backward()  # type: ignore[union-attr]
        return out

    assert_like_eager(program, _complex_leaves)


# -- random numbers: drawn once, as eager draws them ---------------------------------------------


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
