"""Issue 18.2: ``buffers="write_back"``: in-place updates that a propagating mode applies to real
op inputs that do not require grad reach the real tensors exactly once, as in eager mode.

Families: the modules that update buffers in place (BatchNorm 1d/2d/3d, channels_last, an
InstanceNorm that tracks statistics, both spectral_norms); the ways a real tensor reaches the op
(a module buffer, a view of a flat buffer, a real input, an ``out=`` argument, an op FakeTensorMode
runs for real, two modes writing one tensor, a frozen Parameter, ``from_tensor``, a parameter);
tracers (torch.compile, export) that must not write; the switch itself (off by default, unwrapped
when off, un-aliased when turned off); the trace; threads; version counters. CPU and CUDA.

With the patch uninstalled every write-back test fails (the buffers stay stale):
tests/test_can_fail.py runs this file that way.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import os
import subprocess
import sys
import textwrap
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import _pending
import pytest
import torch
import torch._functorch.config as functorch_config
from _helpers import (
    DEVICES_CUDNN,
    assert_real_grads_equal,
    assert_verified,
    fake_mode,
    fake_path_is_exact,
    is_real,
    kernels,
    verify_two_steps,
)
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

import fakegrad_patch
from fakegrad_patch import trace

pytestmark = pytest.mark.usefixtures("propagate")


@pytest.fixture
def write_back() -> Iterator[None]:
    """The option on (configure: it never installs, so with the patch uninstalled, as
    tests/test_can_fail.py runs this file, it has no effect; conftest restores the settings)."""
    fakegrad_patch.configure(buffers="write_back")
    if fakegrad_patch.is_installed() and not fakegrad_patch.status()["write_back"]:
        pytest.skip("write-back unavailable on this build (no FakeTensorMode.dispatch)")
    yield


# -- the modules that update buffers in place ------------------------------------------------------


def _bn1d() -> nn.Module:
    return nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 2))


def _bn2d() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4, momentum=0.3), nn.ReLU())


def _bn2d_channels_last() -> nn.Module:
    return _bn2d().to(memory_format=torch.channels_last)  # type: ignore[call-overload]


def _bn3d() -> nn.Module:
    return nn.Sequential(nn.Conv3d(2, 3, 1), nn.BatchNorm3d(3))


def _instance_norm() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 4, 1), nn.InstanceNorm2d(4, track_running_stats=True))


def _spectral_norm_legacy() -> nn.Module:
    return nn.Sequential(nn.utils.spectral_norm(nn.Linear(5, 4)), nn.Tanh(), nn.Linear(4, 2))


def _spectral_norm() -> nn.Module:
    return nn.Sequential(
        nn.utils.parametrizations.spectral_norm(nn.Linear(5, 4)), nn.Tanh(), nn.Linear(4, 2)
    )


MODULES: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]] = {
    "batchnorm1d": (_bn1d, (6, 5)),
    "batchnorm2d": (_bn2d, (2, 3, 6, 6)),
    "batchnorm2d_channels_last": (_bn2d_channels_last, (2, 3, 6, 6)),
    "batchnorm3d": (_bn3d, (2, 2, 3, 3, 3)),
    "instance_norm_tracking": (_instance_norm, (2, 3, 4, 4)),
    "spectral_norm_legacy": (_spectral_norm_legacy, (3, 5)),
    "spectral_norm": (_spectral_norm, (3, 5)),
}


def _train(model: nn.Module, x: torch.Tensor, steps: int, fake: bool) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        opt.zero_grad()
        if fake:
            with fake_mode():
                model(x).pow(2).mean().backward()
        else:
            model(x).pow(2).mean().backward()
        opt.step()  # outside the mode, as a training loop does


def _pair(name: str, device: torch.device) -> tuple[nn.Module, nn.Module, torch.Tensor]:
    make, shape = MODULES[name]
    torch.manual_seed(0)
    model = make().to(device)
    reference = copy.deepcopy(model)
    x = torch.randn(shape, device=device)
    if name == "batchnorm2d_channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    return model, reference, x


def _close(a: torch.Tensor, b: torch.Tensor, name: str) -> None:
    if fake_path_is_exact():
        assert torch.equal(a, b), f"{name}: {a} != eager {b}"
    else:
        torch.testing.assert_close(a, b, msg=name)


def _assert_grads(model: nn.Module, reference: nn.Module) -> None:
    exact = fake_path_is_exact()
    assert_real_grads_equal(model, reference, atol=0 if exact else 1e-6, rtol=0 if exact else 1e-5)


def _assert_state_equal(model: nn.Module, reference: nn.Module) -> None:
    for (name, b), r in zip(model.named_buffers(), reference.buffers(), strict=True):
        assert is_real(b), name
        assert b.stride() == r.stride(), name
        _close(b, r, name)
    for (name, p), r in zip(model.named_parameters(), reference.parameters(), strict=True):
        _close(p.detach(), r.detach(), name)


def _expect_batch_norm_on_cuda(request: pytest.FixtureRequest, device: torch.device) -> None:
    if device.type == "cuda":
        _pending.xfail(request, _pending.BN_WRITE_BACK_CUDA)


@pytest.mark.parametrize("name", MODULES)
def test_buffers_updated_inside_the_mode_match_eager(
    request: pytest.FixtureRequest, write_back: None, name: str, device: torch.device
) -> None:
    """Bit for bit where the build's fake path is (2.13.0, 2.14.1)."""
    if name.startswith("batchnorm"):
        _expect_batch_norm_on_cuda(request, device)
    model, reference, x = _pair(name, device)
    _train(model, x, 2, fake=True)
    _train(reference, x, 2, fake=False)
    _assert_grads(model, reference)
    _assert_state_equal(model, reference)


@pytest.mark.filterwarnings("ignore::fakegrad_patch.FakeGradPatchWarning")
@pytest.mark.parametrize("name", [n for n in MODULES if n.startswith("batchnorm")])
@pytest.mark.parametrize(("device", "cudnn"), DEVICES_CUDNN)
def test_batch_norm_statistics_with_and_without_cudnn_train_like_eager(
    request: pytest.FixtureRequest, write_back: None, device: str, cudnn: bool | None, name: str
) -> None:
    """Issue 38: BatchNorm's running statistics written back through each kernel (the CPU's;
    on CUDA cuDNN's and, with ``torch.backends.cudnn.flags(enabled=False)``, the native one;
    BatchNorm1d on (N, C) takes the native kernel either way): ``verify`` of two steps, the
    second backward accumulating, buffers compared strictly after the last step."""
    _expect_batch_norm_on_cuda(request, torch.device(device))
    model, _, x = _pair(name, torch.device(device))
    with kernels(cudnn):
        report = verify_two_steps(model, (x,), buffers="write_back", check_buffers="strict")
    assert_verified(report, device, {"set": 1, "accumulate": 1})
    running = [b for b in report.buffers if "running" in b.name]
    assert running and all(b.matches for b in running), report.format()
    assert any("written back" in n for n in report.notes), report.notes


@pytest.mark.parametrize("name", ["batchnorm2d", "spectral_norm"])
def test_upstream_semantics_stay_the_default(name: str) -> None:
    """Without the option the real buffers keep their values (BatchNorm's counter, an all-real
    op, still advances): upstream's semantics, unchanged."""
    assert fakegrad_patch.settings().buffers == "upstream"
    model, reference, x = _pair(name, torch.device("cpu"))
    initial = copy.deepcopy(model)
    _train(model, x, 1, fake=True)
    _train(reference, x, 1, fake=False)
    for (n, b), b0, r in zip(
        model.named_buffers(), initial.buffers(), reference.buffers(), strict=True
    ):
        if n.endswith("num_batches_tracked"):
            assert torch.equal(b, r), n
        else:
            assert torch.equal(b, b0) and not torch.equal(b, r), n


def test_eval_mode_reads_the_written_back_statistics(write_back: None) -> None:
    model, reference, x = _pair("batchnorm2d", torch.device("cpu"))
    _train(model, x, 2, fake=True)
    _train(reference, x, 2, fake=False)
    model.eval()
    reference.eval()
    with fake_mode():
        out = fakegrad_patch.materialize(model(x))
    _close(out, reference(x), "eval output")


# -- the ways a real tensor reaches the op ---------------------------------------------------------


def test_a_view_of_a_flat_buffer_is_written_through_to_the_base(
    request: pytest.FixtureRequest, write_back: None, device: torch.device
) -> None:
    _expect_batch_norm_on_cuda(request, device)
    torch.manual_seed(0)
    x = torch.randn(4, 3, 5, device=device, requires_grad=True)

    def run(flat: torch.Tensor) -> None:
        torch.batch_norm(x, None, None, flat[:3], flat[3:6], True, 0.1, 1e-5, False)

    flat, expected = torch.zeros(6, device=device), torch.zeros(6, device=device)
    expected[3:] = flat[3:] = 1
    with fake_mode():
        run(flat)
    run(expected)
    assert torch.equal(flat, expected)


def test_a_real_input_updated_in_place_is_updated_as_in_eager(
    write_back: None, device: torch.device
) -> None:
    x = torch.arange(4.0, device=device)
    with fake_mode() as mode:
        y = mode.from_tensor(torch.ones(4, device=device))
        x.mul_(y + 1)
    assert torch.equal(x, torch.arange(4.0, device=device) * 2)


def test_an_out_argument_is_written(write_back: None, device: torch.device) -> None:
    out = torch.zeros(3, device=device)
    a = torch.tensor([1.0, 2.0, 3.0], device=device, requires_grad=True)
    with fake_mode():
        torch.mul(a.detach() * 2, 3, out=out)
    assert torch.equal(out, torch.tensor([6.0, 12.0, 18.0], device=device))


def test_ops_fakemode_runs_for_real_are_applied_exactly_once(
    write_back: None, device: torch.device
) -> None:
    """All-real arguments: FakeTensorMode runs the op for real, then converts the arguments: an
    alias would apply it twice."""
    buf = torch.full((5,), 3.0, device=device)
    counter = torch.tensor(0, dtype=torch.long, device=device)
    with fake_mode():
        buf.mul_(2)
        counter.add_(1)
        buf.add_(1)
    assert torch.equal(buf, torch.full((5,), 7.0, device=device))
    assert int(counter) == 1


def test_a_decomposed_op_updates_once(
    request: pytest.FixtureRequest, write_back: None, device: torch.device
) -> None:
    """``native_batch_norm`` runs for real, then its decomposition runs under the mode and would
    update the running statistics a second time."""
    _expect_batch_norm_on_cuda(request, device)
    torch.manual_seed(0)
    x = torch.randn(4, 3, 5, 5, device=device, requires_grad=True)
    mean, var = torch.zeros(3, device=device), torch.ones(3, device=device)
    mean_e, var_e = mean.clone(), var.clone()
    with fake_mode():
        torch.nn.functional.batch_norm(x, mean, var, training=True, momentum=0.1)
    torch.nn.functional.batch_norm(x, mean_e, var_e, training=True, momentum=0.1)
    assert torch.equal(mean, mean_e) and torch.equal(var, var_e)


def test_two_modes_writing_one_buffer_apply_both_updates_in_order(write_back: None) -> None:
    model, reference, x = _pair("batchnorm1d", torch.device("cpu"))
    modes = [fake_mode(), fake_mode()]
    for mode in (*modes, modes[0]):
        with mode:
            model(x).sum().backward()
    for _ in range(3):
        reference(x).sum().backward()
    _assert_state_equal(model, reference)
    _assert_grads(model, reference)


def test_a_frozen_parameter_updated_as_an_ema_follows_eager(
    write_back: None, device: torch.device
) -> None:
    """A Parameter that does not require grad (an EMA copy of the weights) is written back; on
    builds with defect D2 its propagated values would otherwise be uninitialised."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3).to(device)
    ema = nn.Parameter(model.weight.detach().clone(), requires_grad=False)
    ema_e = ema.detach().clone()
    x = torch.randn(2, 4, device=device)
    with fake_mode():
        model(x).sum().backward()
        with torch.no_grad():
            ema.mul_(0.9).add_(model.weight * 2, alpha=0.1)
    ema_e.mul_(0.9).add_(model.weight.detach() * 2, alpha=0.1)
    assert torch.equal(ema.detach(), ema_e)


def test_from_tensor_fakes_are_never_written_back(write_back: None) -> None:
    """``mode.from_tensor`` is how tracers (and users) make fakes of their own: upstream's
    semantics, the real tensor is never changed through them."""
    buf = torch.zeros(3)
    with fake_mode() as mode:
        fake = mode.from_tensor(buf)
        fake.add_(1)
    assert torch.equal(buf, torch.zeros(3))


@pytest.mark.parametrize("order", ["from_tensor_first", "op_input_first"])
def test_a_from_tensor_fake_shared_with_op_inputs_is_never_written_back(
    write_back: None, order: str
) -> None:
    """The converter's memo returns one fake for ``from_tensor(buf)`` and for ``buf`` as an op
    input: the caller holds it and may update it expecting upstream's semantics, so that buffer
    keeps them in that mode, whichever came first."""
    buf = torch.zeros(3)
    with fake_mode() as mode:
        if order == "op_input_first":
            buf.add_(mode.from_tensor(torch.ones(3)))  # aliased and written back: buf = 1
        held = mode.from_tensor(buf)
        held.add_(10)  # never reaches buf
        buf.add_(mode.from_tensor(torch.ones(3)))  # the memo returns `held`: not aliased
        values = fakegrad_patch.materialize(held, copy=True)
    assert values.tolist() == ([12.0] * 3 if order == "op_input_first" else [11.0] * 3)
    assert torch.equal(buf, torch.ones(3) if order == "op_input_first" else torch.zeros(3))


def test_a_parameter_updated_in_place_under_no_grad_is_written_back(write_back: None) -> None:
    """An op that takes the parameter itself, under ``no_grad`` (an optimizer step): aliased for
    that op only, so the update reaches it once; later ops of the mode see the new values."""
    param = nn.Parameter(torch.ones(3))
    fakegrad_patch.name_parameters(nn.ParameterList([param]))
    with fake_mode() as mode, trace.capture(trace.INFO) as events:
        delta = mode.from_tensor(torch.ones(3))
        with torch.no_grad():
            param.add_(delta)
        doubled = fakegrad_patch.materialize(param * 2, copy=True)
    assert torch.equal(param.detach(), torch.full((3,), 2.0))
    assert torch.equal(doubled, torch.full((3,), 4.0))
    assert [e["event"] for e in events if e["level"] == "warning"] == []
    assert [e["name"] for e in events if e["event"] == "buffer_written_back"] == ["0"]


def test_a_tensor_updated_through_a_detached_view_is_written_back_once(write_back: None) -> None:
    """A write through ``.detach()`` of a parameter's copy (``nn.Embedding(max_norm=...)``): the
    op's real run updates the copy once; it is copied to the parameter when the op returns."""
    param = nn.Parameter(torch.ones(3))
    fakegrad_patch.name_parameters(nn.ParameterList([param]))
    with fake_mode(), trace.capture(trace.INFO) as events, torch.no_grad():
        param.detach().mul_(3)
    assert torch.equal(param.detach(), torch.full((3,), 3.0))
    assert [e["event"] for e in events if e["level"] == "warning"] == []
    assert [(e["name"], e["via"]) for e in events if e["event"] == "buffer_written_back"] == [
        ("0", "view")
    ]


# -- tracers never write ---------------------------------------------------------------------------


def test_torch_compile_of_a_training_batchnorm_updates_once(write_back: None) -> None:
    """Dynamo fakifies with ``from_tensor`` into a mode with a ShapeEnv (propagating here): it
    must never write the real buffers while tracing; the compiled code updates them once."""
    torch._dynamo.reset()
    model, reference, x = _pair("batchnorm2d", torch.device("cpu"))
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(x), reference(x), atol=0, rtol=0)
    _assert_state_equal(model, reference)
    torch._dynamo.reset()


def test_export_never_writes_the_real_buffers(write_back: None) -> None:
    model, _, x = _pair("batchnorm2d", torch.device("cpu"))
    before = copy.deepcopy(model)
    torch.export.export(model, (x,))
    _assert_state_equal(model, before)


# -- the switch ------------------------------------------------------------------------------------


def _dispatch_is_wrapped() -> bool:
    # upstream's dispatch is a plain function (no ``__wrapped__``): a wrapt wrapper has one
    return hasattr(FakeTensorMode.__dict__["dispatch"], "__wrapped__")


def test_dispatch_is_wrapped_only_while_a_propagating_user_mode_lives() -> None:
    """A fresh interpreter: importing the patch, torch, a mode without real values, a mode with
    a ShapeEnv wrap nothing; a propagating user mode wraps ``dispatch`` (the reports need it)
    and the mode's entry ``__torch_dispatch__`` (``prim.device`` answered there)
    while it lives, and torch's own function (the same object) is back once it is collected, so
    a later plain fake pass, a tracer's, pays nothing per op (issue 28: P2 plain); write-back on
    keeps it wrapped without any mode; ``uninstall()`` puts torch's back even while a mode
    lives."""
    code = textwrap.dedent(
        """
        import gc, json, torch, fakegrad_patch
        import torch._functorch.config as config
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx.experimental.symbolic_shapes import ShapeEnv
        NAMES = ("dispatch", "__torch_dispatch__")
        ORIGINAL = {name: FakeTensorMode.__dict__[name] for name in NAMES}
        def one(name):
            attr = FakeTensorMode.__dict__[name]
            if attr is ORIGINAL[name]:
                return "own"
            return "wrapped" if getattr(attr, "__wrapped__", None) is ORIGINAL[name] else "other"
        def state():  # the mode's entry (prim.device answered there) follows dispatch
            found = {one(name) for name in NAMES}
            return found.pop() if len(found) == 1 else "mixed"
        seen = [state()]
        with FakeTensorMode(allow_non_fake_inputs=True):
            torch.ones(2).add_(1)
        seen.append(state())
        with config.patch(fake_tensor_propagate_real_tensors=True):
            tracer = FakeTensorMode(shape_env=ShapeEnv())
            seen.append(state())
            mode = FakeTensorMode(allow_non_fake_inputs=True)
            seen.append(state())
            with mode:
                (torch.nn.Parameter(torch.ones(2)) * 2).sum().backward()
            del mode
            gc.collect()
            seen.append(state())  # the tracer's mode still lives: it needs nothing
            with FakeTensorMode(allow_non_fake_inputs=True) as mode:
                seen.append(state())  # a mode converting after the first one died
            del mode
            gc.collect()
            seen.append(state())
            fakegrad_patch.configure(buffers="write_back")
            seen.append(state())
            fakegrad_patch.configure(buffers="upstream")
            seen.append(state())
            mode = FakeTensorMode(allow_non_fake_inputs=True)
            seen.append(state())
        fakegrad_patch.uninstall()
        seen.append(state())
        print(json.dumps(seen))
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("FAKEGRAD_")}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=False
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [
        "own",
        "own",
        "own",
        "wrapped",
        "own",
        "wrapped",
        "own",
        "wrapped",
        "own",
        "wrapped",
        "own",
    ]


def test_turning_write_back_off_gives_live_fakes_their_own_copy_again() -> None:
    model, _, x = _pair("batchnorm1d", torch.device("cpu"))
    mode = fake_mode()
    with fakegrad_patch.patched(buffers="write_back"), mode:
        model(x)
    after_first = copy.deepcopy(model)
    with mode:  # the same mode (its converter memo holds the aliased fakes)
        model(x)
    bn: Any = model.get_submodule("1")
    bn_first: Any = after_first.get_submodule("1")
    assert torch.equal(bn.running_mean, bn_first.running_mean)
    assert torch.equal(bn.running_var, bn_first.running_var)
    assert int(bn.num_batches_tracked) == 2  # an all-real op: upstream runs it for real


def test_uninstall_turns_write_back_off() -> None:
    fakegrad_patch.configure(buffers="write_back")
    try:
        assert _dispatch_is_wrapped()
        fakegrad_patch.uninstall()
        assert not _dispatch_is_wrapped()
        fakegrad_patch.install()
        assert _dispatch_is_wrapped()
    finally:
        fakegrad_patch.configure(buffers="upstream")


# -- the trace, threads, versions ------------------------------------------------------------------


def test_every_write_back_is_traced_with_its_bytes(write_back: None) -> None:
    model, _, x = _pair("batchnorm2d", torch.device("cpu"))
    fakegrad_patch.name_parameters(model)
    with trace.capture(trace.INFO) as events:
        _train(model, x, 2, fake=True)
    written = [e for e in events if e["event"] == "buffer_written_back"]
    assert sorted((e["name"], e["bytes"], e["via"]) for e in written) == sorted(
        (f"1.{s}", 16, "op") for s in ("running_mean", "running_var") for _ in range(2)
    )


def test_threads_each_with_their_own_mode_and_model(write_back: None) -> None:
    pairs = [_pair("batchnorm1d", torch.device("cpu")) for _ in range(4)]
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(pairs))

    def work(model: nn.Module, x: torch.Tensor) -> None:
        try:
            barrier.wait()
            with functorch_config.patch(fake_tensor_propagate_real_tensors=True):  # per thread
                _train(model, x, 3, fake=True)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(m, x)) for m, _, x in pairs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for model, reference, x in pairs:
        _train(reference, x, 3, fake=False)
        _assert_state_equal(model, reference)


def _version_after(fake: bool, op: Callable[[torch.Tensor, Any], None]) -> int:
    buf = torch.zeros(3)
    other = torch.ones(3)
    if fake:
        with fake_mode() as mode:
            op(buf, mode.from_tensor(other))
    else:
        op(buf, other)
    return buf._version


@pytest.mark.parametrize(
    "op",
    [
        pytest.param(lambda b, o: b.add_(o), id="add_"),
        pytest.param(lambda b, o: b.add_(o).mul_(o), id="add_mul_"),
        pytest.param(lambda b, o: torch.add(o, 1, out=b), id="out"),
    ],
)
def test_versions_move_as_in_eager(write_back: None, op: Callable[..., None]) -> None:
    """The real run of the op on the alias bumps the real tensor's version, as eager does (other
    converters' stale-copy re-sync and autograd's saved-tensor checks read it)."""
    assert _version_after(True, op) == _version_after(False, op)


def test_verify_reports_buffers_equal_with_the_option_and_names_it_without() -> None:
    make, shape = MODULES["batchnorm2d"]
    torch.manual_seed(0)
    model, x = make(), torch.randn(shape)
    sgd = functools.partial(torch.optim.SGD, lr=0.1)
    report = fakegrad_patch.verify(
        model, x, steps=2, optimizer=sgd, check_buffers="strict", buffers="write_back"
    )
    assert report.ok, report.format()
    assert all(b.matches for b in report.buffers) and report.buffers_mode == "write_back"
    assert any("written back" in n for n in report.notes)
    default = fakegrad_patch.verify(model, x, steps=2, optimizer=sgd)
    assert not all(b.matches for b in default.buffers)
    assert any('buffers="write_back"' in n for n in default.notes), default.notes
    assert 'buffers="write_back"' in default.format()


def test_write_back_events_follow_the_documented_schema() -> None:
    from test_trace import check_schema

    model, _, x = _pair("batchnorm1d", torch.device("cpu"))
    param = nn.Parameter(torch.ones(2))
    with trace.capture(trace.DEBUG) as events, fakegrad_patch.patched(buffers="write_back"):
        _train(model, x, 1, fake=True)
        with fake_mode(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with torch.no_grad():
                param.detach().add_(1)  # through a view: copied back (buffer_written_back)
            fakegrad_patch.configure(buffers="upstream")
            param.detach().add_(1)  # write-back off: reported (update_lost)
            fakegrad_patch.configure(buffers="write_back")
        opt = torch.optim.SGD([param], lr=0.1, momentum=0.9)
        with fake_mode():
            (param * 2).sum().backward()
            opt.step()  # the momentum buffer is born fake: made real
    kinds = {e["event"] for e in events}
    wanted = {
        "write_back_enabled",
        "buffer_written_back",
        "update_lost",
        "optimizer_state_materialized",
        "write_back_disabled",
    }
    assert wanted <= kinds, kinds
    for event in events:
        if event["event"] in wanted:
            check_schema(event)


def test_the_environment_variable_turns_it_on_at_import() -> None:
    code = textwrap.dedent(
        """
        import json, torch, fakegrad_patch
        import torch._functorch.config as config
        from torch._subclasses.fake_tensor import FakeTensorMode
        bn = torch.nn.BatchNorm1d(3)
        x = torch.randn(4, 3, requires_grad=True)
        with config.patch(fake_tensor_propagate_real_tensors=True):
            with FakeTensorMode(allow_non_fake_inputs=True):
                bn(x)
        print(json.dumps([fakegrad_patch.settings().buffers, fakegrad_patch.status()["write_back"],
                          bool(bn.running_mean.abs().sum() > 0)]))
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("FAKEGRAD_")}
    env["FAKEGRAD_BUFFERS"] = "write_back"
    env["PYTHONWARNINGS"] = "ignore"
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.splitlines()[-1]) == ["write_back", True, True]


def test_the_optimizer_hook_is_registered_only_from_the_first_propagating_mode_on() -> None:
    """Write-back's global optimizer step post-hook is torch's to call in every step, and
    TorchDynamo calls it where it traces one (a function of ours there was a graph break:
    tests/test_pt2_coexistence.py, ``optimizer_hooks``). On for a whole process, it is
    registered only once a propagating user mode lives, still makes state born in the mode
    real, stays when the mode dies (a garbage-collected mode must not change the dict torch may
    be iterating) and goes with write-back."""
    code = textwrap.dedent(
        """
        import gc, json, torch, fakegrad_patch
        import torch._functorch.config as config
        from torch.optim import optimizer as optim_module
        from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

        hooks = optim_module._global_optimizer_post_hooks
        seen = {"enabled": fakegrad_patch.status()["write_back"], "at_import": len(hooks)}
        p = torch.nn.Parameter(torch.ones(3))
        opt = torch.optim.SGD([p], lr=0.1, momentum=0.9)
        (p * 2).sum().backward()
        opt.step()  # real, no mode: nothing of ours in the loop
        seen["after_real_step"] = len(hooks)
        with config.patch(fake_tensor_propagate_real_tensors=True):
            mode = FakeTensorMode(allow_non_fake_inputs=True)
        seen["mode_built"] = len(hooks)
        q = torch.nn.Parameter(torch.ones(3))
        opt2 = torch.optim.SGD([q], lr=0.1, momentum=0.9)
        with mode:
            (q * 2).sum().backward()
            opt2.step()  # the momentum buffer is born fake: made real
        buf = opt2.state[q]["momentum_buffer"]
        seen["state_real"] = not isinstance(buf, FakeTensor) and buf.tolist() == [2.0] * 3
        del mode
        gc.collect()
        seen["mode_dead"] = len(hooks)
        fakegrad_patch.configure(buffers="upstream")
        seen["write_back_off"] = len(hooks)
        fakegrad_patch.configure(buffers="write_back")
        seen["on_again_no_mode"] = len(hooks)
        with config.patch(fake_tensor_propagate_real_tensors=True):
            mode = FakeTensorMode(allow_non_fake_inputs=True)
        seen["second_mode"] = len(hooks)
        fakegrad_patch.uninstall()
        seen["uninstalled"] = len(hooks)
        print(json.dumps(seen))
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("FAKEGRAD_")}
    env["FAKEGRAD_BUFFERS"] = "write_back"
    env["PYTHONWARNINGS"] = "ignore"
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.splitlines()[-1]) == {
        "enabled": True,
        "at_import": 0,
        "after_real_step": 0,
        "mode_built": 1,
        "state_real": True,
        "mode_dead": 1,
        "write_back_off": 0,
        "on_again_no_mode": 0,
        "second_mode": 1,
        "uninstalled": 0,
    }


def _scaled_steps(fake: bool) -> tuple[Any, list[float], list[str]]:
    """A GradScaler first used inside the mode (its scale and growth tracker are born there),
    two steps (the second overflows: the scale halves), then a real step after the mode."""
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=1)
    x = torch.ones(2, 3)

    def step(overflow: bool = False) -> None:
        loss = model(x).sum() * (float("inf") if overflow else 1.0)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()

    with trace.capture(trace.WARNING) as events:
        with fake_mode() if fake else contextlib.nullcontext():
            step()
            step(overflow=True)
        step()
    return (
        scaler,
        model.weight.detach().flatten().tolist(),
        [(e["event"], e.get("op")) for e in events],
    )


@pytest.mark.usefixtures("propagate")
def test_a_grad_scaler_first_used_inside_the_mode_gets_real_state(write_back: None) -> None:
    """Its scale was created by ``torch.full`` inside the mode: a FakeTensor the scaler kept for
    every later step, inside the mode or not, without a word."""
    scaler, weights, events = _scaled_steps(fake=True)
    reference, expected, _ = _scaled_steps(fake=False)
    assert type(scaler._scale) is torch.Tensor and type(scaler._growth_tracker) is torch.Tensor
    assert scaler.get_scale() == reference.get_scale()
    assert weights == expected and not events


@pytest.mark.usefixtures("propagate", "quiet")
def test_a_grad_scaler_first_used_inside_the_mode_is_reported_without_write_back() -> None:
    _, _, events = _scaled_steps(fake=True)
    assert ("update_lost", "GradScaler._scale") in events
