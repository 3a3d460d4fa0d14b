"""Issue 3, points 4, 9 and 10: D2 repair by probe, public API, install/uninstall exactness, the
seed's upstream test, and the single touch-point module."""

from __future__ import annotations

import ast
import gc
import inspect
import pathlib

import pytest
import torch
import torch._prims as prims
from _helpers import fake_mode, is_real
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorConverter, FakeTensorMode

import fakegrad_patch
from fakegrad_patch import trace
from fakegrad_patch._core.touchpoints import probes as _probes
from fakegrad_patch._core.touchpoints import targets as _targets

PACKAGE = pathlib.Path(fakegrad_patch.__file__).parent


def _unpatched_parameter_copy_is_wrong() -> bool:
    """What the D2 probe should answer, measured independently with the patch removed."""
    fakegrad_patch.uninstall()
    try:
        import torch._functorch.config as functorch_config

        with functorch_config.patch(fake_tensor_propagate_real_tensors=True):
            values = torch.randn(32, 32)
            fake = FakeTensorMode().from_tensor(torch.nn.Parameter(values.clone()))
            return not torch.equal(fake.real_tensor, values)
    finally:
        fakegrad_patch.install()


def test_d2_probe_matches_the_behaviour_of_this_build() -> None:
    applied = fakegrad_patch._core.install.current()
    assert applied is not None
    assert applied.probes.has(_probes.D2) == _unpatched_parameter_copy_is_wrong()


@pytest.mark.usefixtures("propagate")
def test_parameter_values_are_right_under_propagation() -> None:
    """D2 repaired where present: values computed from parameters equal eager values."""
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 3)
    x = torch.randn(2, 5)
    with fake_mode():
        out = model(x)
        real_out = out.real_tensor
    torch.testing.assert_close(real_out, model(x).detach())


@pytest.mark.usefixtures("propagate")
def test_d2_repair_is_traced_only_where_the_build_needs_it() -> None:
    applied = fakegrad_patch._core.install.current()
    assert applied is not None
    needed = applied.probes.has(_probes.D2)
    trace.set_level(trace.INFO)
    trace.clear()
    model = torch.nn.Linear(4, 2)  # built outside the mode: real parameters
    with fake_mode():
        model(torch.randn(3, 4))
    repaired = [e for e in trace.events() if e["event"] == "d2_repaired"]
    assert bool(repaired) == needed


@pytest.mark.usefixtures("propagate")
@pytest.mark.parametrize("as_parameter", [False, True])
def test_upstream_fake_grad_copy_under_propagation(as_parameter: bool) -> None:
    """The seed's test_fake_grad_copy (PropagateRealTensors variant), plain tensor and Parameter:
    metadata of the fake and of its fake grad match, and the propagated values are the source's."""
    x = torch.rand([4, 4], requires_grad=True)
    if as_parameter:
        x = torch.nn.Parameter(x.detach())
    x.grad = torch.rand([4, 4])
    mode = FakeTensorMode()
    fake_x = mode.from_tensor(x)
    prims.utils.compare_tensor_meta(fake_x, x)
    prims.utils.compare_tensor_meta(fake_x.grad, x.grad)
    assert isinstance(fake_x.grad, FakeTensor)
    assert torch.equal(fake_x.real_tensor, x.detach())
    assert torch.equal(fake_x.grad.real_tensor, x.grad)


def test_import_installs_and_is_idempotent() -> None:
    assert fakegrad_patch.is_installed()
    wrapper = FakeTensorConverter.__dict__["from_real_tensor"]
    assert fakegrad_patch.install() is True
    assert FakeTensorConverter.__dict__["from_real_tensor"] is wrapper  # not wrapped twice


def test_uninstall_restores_the_original_function_exactly() -> None:
    wrapper = FakeTensorConverter.__dict__["from_real_tensor"]
    original = wrapper.__wrapped__
    assert fakegrad_patch.uninstall() is True
    try:
        assert FakeTensorConverter.__dict__["from_real_tensor"] is original
        assert not fakegrad_patch.is_installed()
        assert fakegrad_patch.uninstall() is False  # second time: nothing to do
    finally:
        fakegrad_patch.install()
    assert FakeTensorConverter.__dict__["from_real_tensor"].__wrapped__ is original


@pytest.mark.usefixtures("propagate")
def test_graph_armed_before_uninstall_finishes_with_real_grads() -> None:
    """uninstall() leaves new graphs to upstream, but a graph armed while installed finishes with
    real gradients (never a silent FakeTensor in .grad); new graphs are upstream's again."""
    w = torch.randn(3, 3, requires_grad=True)
    x = torch.randn(2, 3)
    expected = x.sum(0)[:, None].expand(3, 3)
    gc.collect()
    # hooks on nodes that earlier tests of this worker keep alive (a zoo model's graph, say)
    before = fakegrad_patch.status()["armed_leaves"]
    with fake_mode():
        loss = (x @ w).sum()
        assert fakegrad_patch.status()["armed_leaves"] == before  # arming happens at backward
        fakegrad_patch.uninstall()
        try:
            # uninstall armed w's node (and, again, any live converter's earlier leaves)
            assert fakegrad_patch.status()["armed_leaves"] >= before + 1
            loss.backward()
            finished = w.grad
            w.grad = None
            del loss  # its graph held w's armed AccumulateGrad node
            (x @ w).sum().backward()  # a graph built after uninstall: upstream behaviour
            after = w.grad
        finally:
            fakegrad_patch.install()
    assert is_real(finished)
    torch.testing.assert_close(finished, expected)
    assert isinstance(after, FakeTensor)


@pytest.mark.usefixtures("propagate")
def test_patched_context_manager_is_scoped() -> None:
    fakegrad_patch.uninstall()
    try:
        with fakegrad_patch.patched(on_missing="zeros"):
            assert fakegrad_patch.is_installed()
            assert fakegrad_patch.settings().on_missing == "zeros"
            w = torch.randn(3, 3, requires_grad=True)
            with fake_mode():
                (torch.randn(2, 3) @ w).sum().backward()
            assert is_real(w.grad)
        assert not fakegrad_patch.is_installed()
        assert fakegrad_patch.settings().on_missing == "drop"
    finally:
        fakegrad_patch.install()


def test_public_api_is_small_and_documented() -> None:
    for name in fakegrad_patch.__all__:
        obj = getattr(fakegrad_patch, name)
        if inspect.isfunction(obj) or inspect.isclass(obj):
            assert obj.__doc__, f"{name} has no docstring"
    assert issubclass(fakegrad_patch.FakeGradError, RuntimeError)


def test_name_parameters_is_weak() -> None:
    gc.collect()  # names of other tests' dead parameters must not count below
    model = torch.nn.Linear(2, 2)
    assert fakegrad_patch.name_parameters(model, prefix="enc") == 2
    from fakegrad_patch._core.convert import leaves as _leaves

    assert _leaves.name_of(model.weight) == "enc.weight"
    before = len(_leaves._names)
    del model
    gc.collect()
    assert len(_leaves._names) == before - 2


def _private_torch_uses(path: pathlib.Path) -> list[str]:
    """Attribute chains starting at ``torch`` that go through a private (``_x``) name."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute):
            chain = []
            cur: ast.AST = node
            while isinstance(cur, ast.Attribute):
                chain.append(cur.attr)
                cur = cur.value
            if isinstance(cur, ast.Name) and cur.id == "torch":
                dotted = ".".join(["torch", *reversed(chain)])
                if any(p.startswith("_") and not p.startswith("__") for p in chain):
                    found.append(dotted)
        elif isinstance(node, ast.ImportFrom):
            parts = (node.module or "").split(".")
            if parts[0] == "torch" and any(p.startswith("_") for p in parts):
                found.append(node.module or "")
    return found


#: Not patch code: the demo is a user program and imports FakeTensorMode the way users do.
USER_PROGRAMS = {"_tools/demo.py"}
#: the one module allowed to touch private torch names
TARGETS_MODULE = "_core/touchpoints/targets.py"


def test_private_torch_is_touched_only_in_targets_module() -> None:
    offenders = {}
    scanned = set()
    for path in PACKAGE.rglob("*.py"):
        name = path.relative_to(PACKAGE).as_posix()
        if name == TARGETS_MODULE or name in USER_PROGRAMS:
            continue
        scanned.add(name)
        uses = _private_torch_uses(path)
        if uses:
            offenders[name] = uses
    # every part of the package was read (a moved module must not escape the check)
    assert {
        "_core/convert/values.py",
        "_core/accumulate/arming.py",
        "trace/__init__.py",
        "_tools/verify.py",
    } <= scanned
    assert "_activation/hooks/fakegrad_patch_pytest.py" in scanned
    assert _private_torch_uses(PACKAGE / TARGETS_MODULE), "the check finds private names at all"
    assert offenders == {}


def test_every_target_has_a_banner_and_resolves_here() -> None:
    for target, reason in _targets.report():
        assert target.why and target.checked_on
        if target not in _targets.OPTIONAL_TARGETS:
            assert reason is None, f"{target.dotted}: {reason}"


def test_every_module_of_the_package_compiles_on_this_interpreter() -> None:
    """Every env of the CI command runs this file, so every supported Python (3.10 in
    ``oldest``, which leaves the build-independent files to 3.12 and 3.13 for CI time) compiles
    every module of the package, the start-up hooks and the CLI included, which the build's
    tests may never import: syntax newer than the interpreter fails here, not at a user's."""
    modules = sorted(PACKAGE.rglob("*.py"))
    assert len(modules) > 50, modules  # the whole package, not an empty glob
    for path in modules:
        compile(path.read_text(encoding="utf-8"), str(path), "exec", dont_inherit=True)
