"""Issue 18.1 and 19.3: one real tensor converted by several modes (converters) of one process,
and forwards that straddle uninstall()/install().

Family for 18.1: the ways one real Parameter (or a view of one, a buffer, a managed ``.grad``, a
FakeTensor of another mode) can be converted by more than one converter before, between and after
backward; the D2 repair and the stale-copy re-sync must hold per converter. On builds with D2
(2.4 ... 2.13) the upstream results are uninitialised memory; on every build the stale cases are
wrong upstream. Each case compares every gradient with eager.

Family for 19.3: a forward whose conversions happened partly while the patch was not installed.
On D2 builds those values were uninitialised; the patch must never write a real gradient computed
from them (trace + warning + on_missing), while modes it saw from the start stay exact.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch
from _helpers import fake_mode, is_real

import fakegrad_patch
from fakegrad_patch import trace
from fakegrad_patch._core.touchpoints import probes as _probes

pytestmark = pytest.mark.usefixtures("propagate")


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def _assert_grads_equal(model: torch.nn.Module, ref: torch.nn.Module) -> None:
    for (name, p), r in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert is_real(p.grad), f"{name}: {type(p.grad).__name__}"
        torch.testing.assert_close(p.grad, r.grad, msg=name)


X1 = torch.linspace(-1, 1, 12).reshape(3, 4)
X2 = torch.linspace(2, -2, 12).reshape(3, 4)


def _two_modes_sequential(m: torch.nn.Module) -> None:
    with fake_mode():
        l1 = m(X1).sum()
    with fake_mode():
        l2 = m(X2).sum()
    l1.backward()
    l2.backward()


def _nested_modes(m: torch.nn.Module) -> None:
    with fake_mode():
        l1 = m(X1).sum()
        with fake_mode():
            l2 = m(X2).sum()
    (l2).backward()
    (l1).backward()


def _mode_per_micro_batch_summed_in_the_last(m: torch.nn.Module) -> None:
    losses = []
    for x in (X1, X2):
        with fake_mode():
            losses.append(m(x).sum())
    with fake_mode():
        total = losses[0] + losses[1]  # fakes of two other modes meet here
    total.backward()


def _loss_summed_outside_the_modes(m: torch.nn.Module) -> None:
    with fake_mode():
        l1 = m(X1).sum()
    with fake_mode():
        l2 = m(X2).sum()
    (l1 + l2).backward()  # FakeTensor dispatch converts one mode's fake into the other


def _module_output_feeds_another_mode(m: torch.nn.Module) -> None:
    with fake_mode():
        h = m[0](X1)
    with fake_mode():
        out = m[2](torch.tanh(h)).sum()
    with fake_mode():
        out2 = m(X2).sum()
    out.backward()
    out2.backward()


def _view_of_a_parameter_in_two_modes(m: torch.nn.Module) -> None:
    wt = m[0].weight.t()  # a real view taken outside the modes
    with fake_mode():
        a = (X1 @ wt).sum()
    with fake_mode():
        b = (X2 @ wt).sum() + m(X2).sum()
    a.backward()
    b.backward()


def _eager(cases: str, m: torch.nn.Module) -> None:
    if cases == "module_output_feeds_another_mode":
        m[2](torch.tanh(m[0](X1))).sum().backward()
        m(X2).sum().backward()
    elif cases == "view_of_a_parameter_in_two_modes":
        wt = m[0].weight.t()
        (X1 @ wt).sum().backward()
        ((X2 @ wt).sum() + m(X2).sum()).backward()
    else:
        m(X1).sum().backward()
        m(X2).sum().backward()


CASES: dict[str, Callable[[torch.nn.Module], None]] = {
    "two_modes_sequential": _two_modes_sequential,
    "nested_modes": _nested_modes,
    "mode_per_micro_batch_summed_in_the_last": _mode_per_micro_batch_summed_in_the_last,
    "loss_summed_outside_the_modes": _loss_summed_outside_the_modes,
    "module_output_feeds_another_mode": _module_output_feeds_another_mode,
    "view_of_a_parameter_in_two_modes": _view_of_a_parameter_in_two_modes,
}


@pytest.mark.parametrize("case", list(CASES))
def test_one_parameter_converted_by_several_modes_gets_eager_gradients(case: str) -> None:
    model, ref = _mlp(), _mlp()
    with warnings.catch_warnings():
        warnings.simplefilter("error", fakegrad_patch.FakeGradPatchWarning)  # nothing dropped
        CASES[case](model)
    _eager(case, ref)
    _assert_grads_equal(model, ref)


def test_each_converter_resyncs_its_own_stale_copy_after_an_optimizer_step() -> None:
    """Two long-lived modes alternate over the same parameters with optimizer steps between
    (a converter returns the copy of its first conversion): every build needs the re-sync, per
    converter (a single record per tensor let the second mode's sync hide the first's)."""
    model, ref = _mlp(), _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.3)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.3)
    modes = [fake_mode(), fake_mode()]
    kept = []
    for step in range(4):
        mode = modes[step % 2]
        x = X1 if step % 2 else X2
        with mode:
            loss = model(x).pow(2).sum()
            loss.backward(retain_graph=True)
            kept.append(loss)  # its fakes stay alive: the converter memo keeps returning them
        ref(x).pow(2).sum().backward()
        _assert_grads_equal(model, ref)
        opt.step()
        ropt.step()
        opt.zero_grad()
        ropt.zero_grad()
    del kept


def test_a_buffer_changed_between_two_graphs_of_one_mode_is_resynced() -> None:
    """A plain tensor (no grad) read by the mode, changed in place outside it, read again by the
    same mode: the second graph must see the new values."""
    w = torch.randn(4, requires_grad=True)
    scale = torch.ones(4)
    ref = w.detach().clone().requires_grad_()
    mode = fake_mode()
    with mode:
        first = (w * scale).sum()  # keeps the fake of ``scale`` alive
        first.backward(retain_graph=True)
    scale.mul_(3)
    w.grad = None
    with mode:
        (w * scale).sum().backward()
    (ref * scale).sum().backward()
    assert is_real(w.grad)
    torch.testing.assert_close(w.grad, ref.grad)
    del first


def test_a_fake_without_values_converted_by_a_propagating_mode_gives_no_values() -> None:
    """Mode A does not propagate; its fake enters propagating mode B. B's copy must not carry
    uninitialised memory as values: the gradient follows on_missing (drop: traced, warned),
    never a wrong real number. (2.14+ refuses the conversion itself, loudly: fine too.)"""
    import torch._functorch.config as functorch_config

    w = torch.randn(4, requires_grad=True)
    with functorch_config.patch(fake_tensor_propagate_real_tensors=False), fake_mode():
        h = torch.randn(4) * 2  # a fake of A, no real values
    fakegrad_patch._core.state.WARNED.discard("drop")
    with warnings.catch_warnings(record=True) as caught, trace.capture("warning") as events:
        warnings.simplefilter("always")
        with fake_mode():
            try:
                loss = (h * w).sum()
            except AssertionError as exc:  # upstream's own refusal on builds that have one
                assert "real_tensor" in str(exc)
                return
            loss.backward()
    assert w.grad is None  # dropped, never uninitialised values
    assert [e["event"] for e in events] == ["fake_grad_drop"]
    assert any("dropped" in str(c.message) for c in caught)


# -- 19.3: forwards that straddle uninstall()/install() -------------------------------------------


def _has_d2() -> bool:
    applied = fakegrad_patch._core.install.current()
    assert applied is not None
    return applied.probes.has(_probes.D2)


def _backward(loss: torch.Tensor, d2: bool) -> None:
    """``loss.backward()``; on D2 builds (``on_missing="error"``) refused: nothing is written
    from the untrusted values."""
    if d2:
        with pytest.raises(fakegrad_patch.FakeGradError, match="could not repair"):
            loss.backward()
    else:
        loss.backward()


@pytest.mark.usefixtures("quiet")
@pytest.mark.parametrize("first_half", ["uninstalled", "installed"])
def test_forward_straddling_uninstall_install_is_never_silently_wrong(first_half: str) -> None:
    """Half of a forward while the patch is off, half while on, one backward. Where the
    unpatched half computed from uninitialised values (D2 builds), no real gradient may be
    written (the policy applies: here ``error``); elsewhere the gradients equal eager."""
    model, ref = _mlp(), _mlp()
    mode = fake_mode()
    fakegrad_patch.configure(on_missing="error")
    capture = trace.capture("warning")
    events = capture.__enter__()
    if first_half == "uninstalled":
        fakegrad_patch.uninstall()
    try:
        with mode:
            l1 = model(X1).sum()
    finally:
        if first_half == "uninstalled":
            fakegrad_patch.install()
        else:
            fakegrad_patch.uninstall()
    try:
        with mode:
            l2 = model(X2).sum()
    finally:
        fakegrad_patch.install()
    ref(X1).sum().backward()
    ref(X2).sum().backward()
    try:
        if _has_d2():
            with pytest.raises(fakegrad_patch.FakeGradError, match="could not repair"):
                (l1 + l2).backward()
            assert "mode_untrusted" in [e["event"] for e in events]
            for p in model.parameters():
                assert p.grad is None  # nothing written from untrusted values
        else:
            (l1 + l2).backward()
            _assert_grads_equal(model, ref)
    finally:
        capture.__exit__(None, None, None)


@pytest.mark.usefixtures("quiet")
def test_a_forward_straddling_uninstall_then_backward_while_uninstalled_is_never_wrong() -> None:
    """Issue 25, case 6: layer 0 converted while installed, ``uninstall()`` inside the mode,
    layer 2 and the backward while uninstalled. Layer 0's hooks outlive ``uninstall()``; on D2
    builds its gradient flows through layer 2's uninitialised values: it must not be written
    (the policy applies), never a real, wrong gradient. Elsewhere it equals eager."""
    model, ref = _mlp(), _mlp()
    ref(X1).sum().backward()
    fakegrad_patch.configure(on_missing="error")
    d2 = _has_d2()
    with trace.capture("warning") as events:
        try:
            with fake_mode():
                hidden = model[0](X1)
                fakegrad_patch.uninstall()
                out = model[2](model[1](hidden)).sum()
                _backward(out, d2)
        finally:
            fakegrad_patch.install()
    first = [model[0].weight, model[0].bias]
    if d2:
        assert "mode_untrusted" in [e["event"] for e in events]
        assert all(p.grad is None for p in first)
    else:
        for p, r in zip(first, [ref[0].weight, ref[0].bias], strict=True):
            assert is_real(p.grad)
            torch.testing.assert_close(p.grad, r.grad)


@pytest.mark.usefixtures("quiet")
def test_a_removed_installation_finishing_a_conversion_vouches_for_nothing() -> None:
    """The re-install stress test's wrong real gradients (tests/_lock_order.py, 2026-12-06): a
    thread converting a weight through installation A had passed A's ``active`` test when
    ``uninstall()`` ran on another thread. A's wrapper finished after it: the weight's values
    repaired, and its first contact with the converter made in the generation ``uninstall()``
    had just started, marking the converter checked. The forward's next op ran before
    ``install()``: upstream converted the bias unseen (D2: uninitialised values). The new
    installation then found the converter checked and wrote real gradients computed from those
    values. Now each installation starts a generation of its own and checks again: on D2 builds
    the mode is untrusted (the policy applies: ``error``); elsewhere the gradients equal eager.
    The interleaving is made by hand: A's wrapper's remaining work runs after ``uninstall()``."""
    from fakegrad_patch._core.install import current

    model, ref = _mlp(), _mlp()
    ref(X1).sum().backward()
    fakegrad_patch.configure(on_missing="error")
    first = current()
    assert first is not None
    d2 = _has_d2()
    linear = model[0]
    mode = fake_mode()
    with trace.capture("warning") as events:
        try:
            with mode:
                conv = mode.fake_tensor_converter
                fakegrad_patch.uninstall()
                # A's wrapper, past its `active` test: torch's conversion, then the rest of it
                weight = conv.from_real_tensor(mode, linear.weight)
                first.values._propagating(conv, mode, linear.weight, weight, True)
                # before install(): t() finds the weight's fake in the memo, addmm converts the
                # bias unseen
                hidden = linear(X1)
                fakegrad_patch.install()
                out = model[2](model[1](hidden)).sum()
                _backward(out, d2)
        finally:
            fakegrad_patch.install()
    if d2:
        assert "mode_untrusted" in [e["event"] for e in events]
        assert all(p.grad is None for p in linear.parameters())
    else:
        _assert_grads_equal(model, ref)
    del weight


@pytest.mark.usefixtures("quiet")
def test_a_mode_used_before_the_first_install_is_not_trusted_on_d2_builds() -> None:
    """``import torch; (use a mode); import fakegrad_patch`` in one process: the same straddle."""
    model = _mlp()
    mode = fake_mode()
    fakegrad_patch.uninstall()
    try:
        with mode:
            loss = model(X1).sum()
    finally:
        fakegrad_patch.install()
    fakegrad_patch._core.state.WARNED.discard("untrusted")
    with warnings.catch_warnings(record=True) as caught, mode:
        warnings.simplefilter("always")
        loss.backward()
    if _has_d2():
        assert all(p.grad is None for p in model.parameters())
        assert any("could not repair" in str(c.message) for c in caught)
    else:
        assert all(is_real(p.grad) for p in model.parameters())


def test_modes_seen_from_the_start_stay_trusted_across_uninstall_install() -> None:
    """The detection never refuses a mode whose conversions the patch all saw."""
    model, ref = _mlp(), _mlp()
    mode = fake_mode()
    with mode:
        model(X1).sum().backward()
    fakegrad_patch.uninstall()
    fakegrad_patch.install()
    with warnings.catch_warnings():
        warnings.simplefilter("error", fakegrad_patch.FakeGradPatchWarning)
        with mode:
            model(X2).sum().backward()
    ref(X1).sum().backward()
    ref(X2).sum().backward()
    _assert_grads_equal(model, ref)
