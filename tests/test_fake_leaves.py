"""Issue 7: fake leaves made from real leaves (``mode.from_tensor``) and their real sources.

Grad-copy fidelity (probe D4), opt-in mirroring onto the real sources, materialize()."""

from __future__ import annotations

import collections
import copy
import gc
import weakref
from collections.abc import Callable

import pytest
import torch
import torch._prims as prims
from _helpers import fake_mode, is_real
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.func import functional_call

import fakegrad_patch
from fakegrad_patch import trace
from fakegrad_patch._core.convert import fakeleaves as _fakeleaves
from fakegrad_patch._core.touchpoints import probes as _probes


def _current() -> fakegrad_patch._core.install._Applied:
    applied = fakegrad_patch._core.install.current()
    assert applied is not None
    return applied


# --- 1. grad-copy fidelity ------------------------------------------------------------------------

GRAD_LAYOUTS: dict[str, Callable[[torch.device], tuple[torch.Tensor, torch.Tensor]]] = {
    "contiguous": lambda d: (torch.rand(4, 6, device=d), torch.rand(4, 6, device=d)),
    "transposed": lambda d: (torch.rand(4, 6, device=d), torch.rand(6, 4, device=d).t()),
    "transposed_leaf": lambda d: (torch.rand(6, 4, device=d).t(), torch.rand(6, 4, device=d).t()),
    "sliced": lambda d: (torch.rand(4, 6, device=d), torch.rand(4, 12, device=d)[:, ::2]),
    "offset": lambda d: (torch.rand(4, 6, device=d), torch.rand(5, 6, device=d)[1:]),
    "channels_last": lambda d: (
        torch.rand(2, 3, 4, 5, device=d),
        torch.rand(2, 3, 4, 5, device=d).contiguous(memory_format=torch.channels_last),
    ),
    "float64": lambda d: (
        torch.rand(3, 5, device=d, dtype=torch.float64),
        torch.rand(5, 3, device=d, dtype=torch.float64).t(),
    ),
}


@pytest.mark.usefixtures("propagate")
@pytest.mark.parametrize("layout", sorted(GRAD_LAYOUTS))
@pytest.mark.parametrize("as_parameter", [False, True], ids=["plain", "parameter"])
def test_converted_leaf_carries_an_exact_grad_copy(
    device: torch.device, layout: str, as_parameter: bool
) -> None:
    """The seed's test_fake_grad_copy (propagation on), widened: metadata of fake and fake grad
    match the sources, and the propagated values, strides and device are the source grad's."""
    data, grad = GRAD_LAYOUTS[layout](device)
    x = torch.nn.Parameter(data) if as_parameter else data.requires_grad_()
    x.grad = grad
    fake_x = FakeTensorMode().from_tensor(x)
    prims.utils.compare_tensor_meta(fake_x, x)
    prims.utils.compare_tensor_meta(fake_x.grad, x.grad)
    assert isinstance(fake_x.grad, FakeTensor)
    assert torch.equal(fake_x.real_tensor, x.detach())  # D2 repaired where the build has it
    real_grad = fake_x.grad.real_tensor
    assert is_real(real_grad)
    assert real_grad.device == grad.device
    assert real_grad.stride() == grad.stride()
    assert torch.equal(real_grad, grad)
    assert real_grad.data_ptr() != grad.data_ptr()  # a copy: fake accumulation never hits x.grad


def _grad_copy_is_wrong_unpatched() -> bool:
    """What probe D4 should answer, measured independently with the patch removed."""
    fakegrad_patch.uninstall()
    try:
        import torch._functorch.config as functorch_config

        with functorch_config.patch(fake_tensor_propagate_real_tensors=True):
            for as_parameter in (False, True):
                x = torch.randn(6, 8)
                x = torch.nn.Parameter(x) if as_parameter else x.requires_grad_()
                x.grad = torch.randn(8, 6).t()
                real = FakeTensorMode().from_tensor(x).grad.real_tensor
                if real.stride() != x.grad.stride() or not torch.equal(real, x.grad):
                    return True
            return False
    finally:
        fakegrad_patch.install()


def test_grad_copy_probe_matches_this_build() -> None:
    assert _current().probes.has(_probes.GRAD_COPY) == _grad_copy_is_wrong_unpatched()
    assert "D4_grad_copy_real_tensor" in _current().probes.detected()


@pytest.mark.usefixtures("propagate")
def test_grad_copy_repair_runs_only_where_the_build_needs_it() -> None:
    needed = _current().probes.has(_probes.GRAD_COPY)
    trace.set_level(trace.INFO)
    trace.clear()
    x = torch.nn.Parameter(torch.randn(3, 4))
    x.grad = torch.randn(4, 3).t()
    FakeTensorMode().from_tensor(x)
    repaired = [e for e in trace.events() if e["event"] == "grad_copy_repaired"]
    assert bool(repaired) == needed


@pytest.mark.usefixtures("propagate")
def test_grad_copy_repair_restores_values_and_strides() -> None:
    """The repair itself (applied on builds where D4 is found): a wrong copy is made right."""
    x = torch.nn.Parameter(torch.randn(3, 4))
    x.grad = torch.randn(4, 3).t()
    fake_x = FakeTensorMode().from_tensor(x)
    fake_x.grad.real_tensor.fill_(float("nan"))  # what a broken build would hand us
    resolved = _current().resolved
    assert _fakeleaves.repair_grad_copy(fake_x, x, resolved.disable_current_modes)
    assert torch.equal(fake_x.grad.real_tensor, x.grad)
    assert fake_x.grad.real_tensor.stride() == x.grad.stride()
    assert fake_x.grad.real_tensor.data_ptr() != x.grad.data_ptr()


# --- 2. mirroring ---------------------------------------------------------------------------------


def _mlp(device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3)).to(
        device
    )


def _fake_step(mode: FakeTensorMode, model: torch.nn.Module, x: torch.Tensor) -> dict[str, object]:
    """The usual fakeify-then-run pattern: fake parameters from the real ones, functional call."""
    fakes = {n: mode.from_tensor(p) for n, p in model.named_parameters()}
    with mode:
        functional_call(model, fakes, (x,)).square().sum().backward()
    return fakes


def _eager_grads(model: torch.nn.Module, x: torch.Tensor, steps: int = 1) -> list[torch.Tensor]:
    ref = copy.deepcopy(model)
    for _ in range(steps):
        ref(x).square().sum().backward()
    return [p.grad for p in ref.parameters()]


@pytest.mark.usefixtures("propagate")
def test_mirroring_is_off_by_default(device: torch.device) -> None:
    model = _mlp(device)
    model[0].weight.grad = torch.ones_like(model[0].weight)
    held = model[0].weight.grad
    fakes = _fake_step(fake_mode(), model, torch.randn(5, 4, device=device))
    assert model[0].weight.grad is held and torch.equal(held, torch.ones_like(held))
    assert all(p.grad is None for p in list(model.parameters())[1:])
    assert all(isinstance(f.grad, FakeTensor) for f in fakes.values())  # upstream: fake grads


@pytest.mark.usefixtures("propagate")
def test_mirroring_writes_eager_grads_onto_the_sources(device: torch.device) -> None:
    model = _mlp(device)
    x = torch.randn(5, 4, device=device)
    expected = _eager_grads(model, x)
    mode = fake_mode()
    trace.set_level(trace.INFO)
    trace.clear()
    with fakegrad_patch.mirror_to_sources(mode):
        fakes = _fake_step(mode, model, x)
    for p, e in zip(model.parameters(), expected, strict=True):
        assert is_real(p.grad) and p.grad.device == p.device and p.grad.stride() == e.stride()
        torch.testing.assert_close(p.grad, e)
    for f, e in zip(fakes.values(), expected, strict=True):
        assert isinstance(f.grad, FakeTensor)  # the fake leaf keeps its fake grad
        torch.testing.assert_close(f.grad.real_tensor, e)
    ids = {id(p) for p in model.parameters()}
    mirrored = [e for e in trace.events() if e["event"] == "mirrored"]
    written = [e for e in trace.events() if e["event"] == "fake_grad_set"]
    assert {e["leaf_id"] for e in mirrored} == ids
    assert {e["leaf_id"] for e in written} == ids  # the real source, never the fake


@pytest.mark.usefixtures("propagate")
def test_mirroring_accumulates_in_place_and_never_aliases_the_fake(device: torch.device) -> None:
    model = _mlp(device)
    x = torch.randn(5, 4, device=device)
    ref = copy.deepcopy(model)
    for p in [*model.parameters(), *ref.parameters()]:
        p.grad = torch.full_like(p, 0.5)
    held = [p.grad for p in model.parameters()]
    mode = fake_mode()
    with fakegrad_patch.mirror_to_sources(mode):
        for _ in range(2):  # the second backward adds into the fake grad in place, too
            _fake_step(mode, model, x)
    for _ in range(2):
        ref(x).square().sum().backward()
    for p, r, h in zip(model.parameters(), ref.parameters(), held, strict=True):
        assert p.grad is h
        torch.testing.assert_close(p.grad, r.grad)


@pytest.mark.usefixtures("propagate")
def test_repeated_backward_without_prior_grad_counts_each_gradient_once() -> None:
    """The first mirrored grad is a copy: were it the fake grad's propagated buffer, the fake
    leaf's in-place accumulation on the second backward would also add into the real .grad."""
    model = _mlp(torch.device("cpu"))
    x = torch.randn(5, 4)
    expected = _eager_grads(model, x, steps=3)
    mode = fake_mode()
    with fakegrad_patch.mirror_to_sources(mode):
        for _ in range(3):
            fakes = _fake_step(mode, model, x)
    for p, f, e in zip(model.parameters(), fakes.values(), expected, strict=True):
        torch.testing.assert_close(p.grad, e)
        assert p.grad.data_ptr() != f.grad.real_tensor.data_ptr()


@pytest.mark.usefixtures("propagate")
@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
def test_mirroring_with_retain_graph_and_create_graph() -> None:
    model = _mlp(torch.device("cpu"))
    ref = copy.deepcopy(model)
    x = torch.randn(5, 4)
    mode = fake_mode()
    with fakegrad_patch.mirror_to_sources(mode):
        fakes = {n: mode.from_tensor(p) for n, p in model.named_parameters()}
        with mode:
            loss = functional_call(model, fakes, (x,)).square().sum()
            loss.backward(create_graph=True, retain_graph=True)
            loss.backward(retain_graph=True)
    for fake in fakes.values():
        fake.grad = None  # create_graph: .grad -> its graph -> the leaf, a cycle gc cannot break
    ref_loss = ref(x).square().sum()
    ref_loss.backward(create_graph=True, retain_graph=True)
    ref_loss.backward()
    for p, r in zip(model.parameters(), ref.parameters(), strict=True):
        assert is_real(p.grad)
        torch.testing.assert_close(p.grad, r.grad.detach())


@pytest.mark.usefixtures("propagate")
def test_mirroring_follows_the_layout_contract() -> None:
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
    x = torch.randn(2, 3, 6, 6).contiguous(memory_format=torch.channels_last)
    ref = copy.deepcopy(conv)
    ref(x).mean().backward()
    mode = fake_mode()
    with fakegrad_patch.mirror_to_sources(mode):
        fakes = {n: mode.from_tensor(p) for n, p in conv.named_parameters()}
        with mode:
            functional_call(conv, fakes, (x,)).mean().backward()
    assert conv.weight.grad.stride() == conv.weight.stride() == ref.weight.grad.stride()
    torch.testing.assert_close(conv.weight.grad, ref.weight.grad, atol=1e-6, rtol=1e-5)


@pytest.mark.usefixtures("propagate")
def test_mirroring_is_scoped_to_its_mode_its_block_and_accumulation() -> None:
    model = _mlp(torch.device("cpu"))
    x = torch.randn(5, 4)
    mode, other = fake_mode(), fake_mode()
    with fakegrad_patch.mirror_to_sources(mode):
        _fake_step(other, model, x)  # another mode's fakes: not mirrored
        fakes = {n: mode.from_tensor(p) for n, p in model.named_parameters()}
        with mode:
            out = functional_call(model, fakes, (x,)).sum()
            torch.autograd.grad(out, list(fakes.values()))  # nothing accumulates: not mirrored
            late = functional_call(model, fakes, (x,)).sum()
    with mode:
        late.backward()  # lands after the block: not mirrored
    assert all(p.grad is None for p in model.parameters())
    assert all(isinstance(f.grad, FakeTensor) for f in fakes.values())
    assert not _fakeleaves._mirrors and _fakeleaves._Active.count == 0  # nothing left registered


@pytest.mark.usefixtures("propagate")
def test_nested_switches_mirror_once() -> None:
    model = _mlp(torch.device("cpu"))
    x = torch.randn(5, 4)
    expected = _eager_grads(model, x)
    mode = fake_mode()
    with fakegrad_patch.mirror_to_sources(mode), fakegrad_patch.mirror_to_sources(mode):
        _fake_step(mode, model, x)
    for p, e in zip(model.parameters(), expected, strict=True):
        torch.testing.assert_close(p.grad, e)


@pytest.mark.usefixtures("no_propagate")
@pytest.mark.parametrize("policy", ["drop", "zeros", "error", "keep"])
def test_mirroring_applies_the_on_missing_policy(policy: str, quiet: None) -> None:
    fakegrad_patch.configure(on_missing=policy)  # type: ignore[arg-type]
    model = _mlp(torch.device("cpu"))
    mode = fake_mode()
    with fakegrad_patch.mirror_to_sources(mode):
        if policy == "error":
            with pytest.raises(fakegrad_patch.FakeGradError):
                _fake_step(mode, model, torch.randn(5, 4))
            return
        _fake_step(mode, model, torch.randn(5, 4))
    for p in model.parameters():
        if policy == "zeros":
            assert is_real(p.grad) and torch.equal(p.grad, torch.zeros_like(p))
        else:  # drop and keep: the real source is left alone (never a FakeTensor)
            assert p.grad is None


def test_mirroring_keeps_nothing_alive() -> None:
    import torch._functorch.config as functorch_config

    def run() -> tuple[weakref.ref[torch.nn.Module], weakref.ref[FakeTensorMode]]:
        with functorch_config.patch(fake_tensor_propagate_real_tensors=True):
            model = _mlp(torch.device("cpu"))
            mode = fake_mode()
            with fakegrad_patch.mirror_to_sources(mode):
                _fake_step(mode, model, torch.randn(5, 4))
            assert is_real(model[0].weight.grad)
            return weakref.ref(model), weakref.ref(mode)

    model_ref, mode_ref = run()
    gc.collect()
    assert model_ref() is None
    assert mode_ref() is None


def test_mirror_to_sources_wants_a_fake_mode() -> None:
    with (
        pytest.raises(TypeError, match="FakeTensorMode"),
        fakegrad_patch.mirror_to_sources(object()),
    ):
        pass


@pytest.mark.slow
@pytest.mark.usefixtures("propagate")
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_torch_compile_never_writes_real_grads_through_its_fakes(backend: str) -> None:
    """Dynamo/AOTAutograd fakeify the real parameters internally; the only real grads must be the
    eager ones from running the compiled model (no extra, no fake, no doubling)."""
    torch._dynamo.reset()
    model = _mlp(torch.device("cpu"))
    x = torch.randn(5, 4)
    expected = _eager_grads(model, x)
    compiled = torch.compile(model, backend=backend)
    compiled(x).square().sum().backward()
    for p, e in zip(model.parameters(), expected, strict=True):
        assert is_real(p.grad)
        torch.testing.assert_close(p.grad, e)


@pytest.mark.usefixtures("propagate")
def test_torch_export_never_touches_real_grads() -> None:
    model = _mlp(torch.device("cpu"))
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.5)
    held = [p.grad for p in model.parameters()]
    torch.export.export(model, (torch.randn(5, 4),))
    for p, h in zip(model.parameters(), held, strict=True):
        assert p.grad is h and torch.equal(h, torch.full_like(h, 0.5))


# --- 3. materialize() -----------------------------------------------------------------------------

Pair = collections.namedtuple("Pair", "a b")


def _fake_grads(propagating: bool) -> tuple[list[torch.Tensor], tuple[object, ...], list[object]]:
    """Real params, the autograd.grad results on a fake graph, and the eager grads."""
    import torch._functorch.config as functorch_config

    torch.manual_seed(0)
    w = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    b = torch.randn(3, requires_grad=True)
    x = torch.randn(2, 4, dtype=torch.float64)
    with functorch_config.patch(fake_tensor_propagate_real_tensors=propagating):
        mode = fake_mode()
        fw, fb = mode.from_tensor(w), mode.from_tensor(b)
        with mode:
            grads = torch.autograd.grad(((x @ fw).float() + fb).sin().sum(), (fw, fb))
    eager = torch.autograd.grad(((x @ w).float() + b).sin().sum(), (w, b))
    return [w, b], grads, list(eager)


def test_materialize_nested_pytree() -> None:
    _, (gw, gb), (ew, eb) = _fake_grads(propagating=True)
    real = torch.ones(2)
    tree = {"grads": [gw, Pair(gb, 7)], "other": (real, "text", None)}
    trace.set_level(trace.INFO)
    trace.clear()
    out = fakegrad_patch.materialize(tree)
    assert type(out["grads"][1]) is Pair and out["grads"][1].b == 7
    got_w, got_b = out["grads"][0], out["grads"][1].a
    assert is_real(got_w) and is_real(got_b) and not got_w.requires_grad
    torch.testing.assert_close(got_w, ew)
    torch.testing.assert_close(got_b, eb)
    assert out["other"] is tree["other"]  # unchanged subtrees are returned as they are
    assert out["other"][0] is real
    (event,) = [e for e in trace.events() if e["event"] == "materialized"]
    assert event["fakes"] == 2 and event["propagated"] == 2


def test_materialize_like_a_device_or_a_matching_tree() -> None:
    params, grads, eager = _fake_grads(propagating=True)
    same = fakegrad_patch.materialize(list(grads), like="cpu")
    assert [g.dtype for g in same] == [torch.float64, torch.float32]
    like = [params[0].float(), None]  # per position: dtype of the counterpart, None = own
    out = fakegrad_patch.materialize(list(grads), like=like)
    assert out[0].dtype == torch.float32 and out[1].dtype == torch.float32
    torch.testing.assert_close(out[0], eager[0].float())
    with pytest.raises(ValueError, match="does not match"):
        fakegrad_patch.materialize(list(grads), like=[params[0]])


def test_materialize_follows_the_layout_of_like_and_copy() -> None:
    _, grads, _ = _fake_grads(propagating=True)
    col_major = torch.empty(3, 4, dtype=torch.float64).t()  # (4, 3) with strides (1, 4)
    out = fakegrad_patch.materialize(grads[0], like=col_major)
    assert out.stride() == col_major.stride()
    torch.testing.assert_close(out, grads[0].real_tensor)
    shared = fakegrad_patch.materialize(grads[0])
    fresh = fakegrad_patch.materialize(grads[0], copy=True)
    assert shared.data_ptr() == grads[0].real_tensor.data_ptr()
    assert fresh.data_ptr() != grads[0].real_tensor.data_ptr()


def test_materialize_inside_the_mode() -> None:
    import torch._functorch.config as functorch_config

    w = torch.randn(3, 3, requires_grad=True)
    with functorch_config.patch(fake_tensor_propagate_real_tensors=True):
        mode = fake_mode()
        fw = mode.from_tensor(w)
        with mode:
            (g,) = torch.autograd.grad((fw * 2).sum(), fw)
            out = fakegrad_patch.materialize(g)
            doubled = out * 2  # still inside the mode: a real input meets a real tensor here
    assert is_real(out)
    torch.testing.assert_close(out, torch.full((3, 3), 2.0))
    assert isinstance(doubled, FakeTensor)  # the mode is still the mode (we only paused it)


@pytest.mark.parametrize("policy", ["drop", "zeros", "error", "keep"])
def test_materialize_applies_on_missing(policy: str) -> None:
    _, (gw, gb), _ = _fake_grads(propagating=False)
    assert getattr(gw, "real_tensor", None) is None
    tree = {"w": gw, "rest": [gb, 3]}
    if policy == "error":
        with pytest.raises(fakegrad_patch.FakeGradError, match=r"\['w'\].*\['rest'\]\[0\]"):
            fakegrad_patch.materialize(tree, on_missing=policy)
        return
    out = fakegrad_patch.materialize(tree, on_missing=policy)
    assert out["rest"][1] == 3
    if policy == "drop":
        assert out["w"] is None and out["rest"][0] is None
    elif policy == "keep":
        assert out["w"] is gw and out["rest"][0] is gb
    else:
        for got, fake in ((out["w"], gw), (out["rest"][0], gb)):
            assert is_real(got) and torch.equal(got, torch.zeros(fake.shape, dtype=fake.dtype))


def test_materialize_uses_the_configured_policy() -> None:
    _, (gw, _gb), _ = _fake_grads(propagating=False)
    fakegrad_patch.configure(on_missing="zeros")
    assert is_real(fakegrad_patch.materialize(gw))
    with pytest.raises(ValueError, match="invalid on_missing"):
        fakegrad_patch.materialize(gw, on_missing="nope")
