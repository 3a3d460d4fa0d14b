"""Issue 3, point 5: fake gradients without real values follow the ``on_missing`` policy."""

from __future__ import annotations

import warnings

import pytest
import torch
from _helpers import fake_mode, is_real
from torch._subclasses.fake_tensor import FakeTensor

import fakegrad_patch
from fakegrad_patch import _config, trace

pytestmark = pytest.mark.usefixtures("no_propagate")


def _linear() -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(3, 2)


def _fake_backward(model: torch.nn.Module) -> None:
    with fake_mode():
        model(torch.randn(4, 3)).sum().backward()


def test_default_without_real_values_is_upstream_untouched() -> None:
    """Issue 17: a mode that does not propagate real values (memory and FLOP estimators,
    tracers) gets upstream's FakeTensor gradients by default: no hook, no warning, no event, no
    probe run for it."""
    assert not fakegrad_patch.settings().on_missing_explicit
    model = _linear()
    model.bias.grad = torch.ones(2)
    prior = model.bias.grad
    known = dict(fakegrad_patch.status()["defects"])
    fakegrad_patch._core.state.WARNED.discard("drop")
    with (
        warnings.catch_warnings(record=True) as caught,
        trace.capture("debug") as events,
        fake_mode(),
    ):
        warnings.simplefilter("always")
        model(torch.randn(4, 3)).sum().backward()
        assert fakegrad_patch.status()["armed_leaves"] == 0
    assert not [w for w in caught if issubclass(w.category, fakegrad_patch.FakeGradPatchWarning)]
    assert events == []
    assert isinstance(model.weight.grad, FakeTensor)  # upstream: a FakeTensor .grad
    assert model.bias.grad is prior  # upstream: the in-place add ran on a fake copy
    assert fakegrad_patch.status()["defects"] == known


def test_explicit_drop_warns_once_and_traces_every_drop() -> None:
    fakegrad_patch.configure(on_missing="drop")
    assert fakegrad_patch.settings().on_missing == "drop"
    model = _linear()
    model.bias.grad = torch.ones(2)
    prior = model.bias.grad
    applied = fakegrad_patch._core.install.current()
    assert applied is not None
    fakegrad_patch._core.state.WARNED.discard("drop")  # the once-per-process flag, for this test
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _fake_backward(model)
        _fake_backward(model)
    drops = [w for w in caught if issubclass(w.category, fakegrad_patch.FakeGradPatchWarning)]
    assert len(drops) == 1
    assert "dropped" in str(drops[0].message)
    assert model.weight.grad is None  # had nothing, keeps nothing
    assert model.bias.grad is prior and torch.equal(prior, torch.ones(2))  # keeps what it had
    events = [e for e in trace.events() if e["event"] == "fake_grad_drop"]
    assert len(events) >= 4  # two leaves, two backwards: every drop is traced


def test_zeros_policy_gives_real_zeros_and_keeps_prior(quiet: None) -> None:
    model = _linear()
    model.bias.grad = torch.full((2,), 3.0)
    prior = model.bias.grad
    with fakegrad_patch.patched(on_missing="zeros"):
        _fake_backward(model)
    assert is_real(model.weight.grad)
    assert torch.count_nonzero(model.weight.grad) == 0
    assert model.weight.grad.device == model.weight.device
    assert model.bias.grad is prior and torch.equal(prior, torch.full((2,), 3.0))


def test_error_policy_raises_naming_the_leaf_and_leaf_keeps_its_grad() -> None:
    model = _linear()
    fakegrad_patch.name_parameters(model, prefix="head")
    model.weight.grad = torch.ones(2, 3)
    prior = model.weight.grad
    with (
        fakegrad_patch.patched(on_missing="error"),
        pytest.raises(fakegrad_patch.FakeGradError) as info,
    ):
        _fake_backward(model)
    message = str(info.value)
    assert "shape=(" in message and "dtype=float32" in message and "device=cpu" in message
    assert "fake_tensor_propagate_real_tensors" in message
    assert "head." in message
    assert model.weight.grad is prior and torch.equal(prior, torch.ones(2, 3))
    assert model.bias.grad is None or is_real(model.bias.grad)


def test_keep_policy_is_upstream_behaviour() -> None:
    model = _linear()
    with fakegrad_patch.patched(on_missing="keep"):
        _fake_backward(model)
    assert isinstance(model.weight.grad, FakeTensor)


def test_fake_grad_left_by_an_unpatched_run_is_rescued_not_lost() -> None:
    """A FakeTensor with real values already in .grad (left by an unpatched or ``keep`` run under
    propagation) counts as the prior gradient: the next patched backward materializes it and
    accumulates onto it, so nothing is lost."""
    import torch._functorch.config as functorch_config

    model = _linear()
    x = torch.randn(4, 3)
    with functorch_config.patch(fake_tensor_propagate_real_tensors=True):
        fakegrad_patch.uninstall()
        try:
            with fake_mode():
                model(x).sum().backward()
        finally:
            fakegrad_patch.install()
        if isinstance(model.weight.grad, FakeTensor):  # upstream behaviour (D1)
            with fake_mode():
                model(x).sum().backward()
    assert is_real(model.weight.grad)
    torch.testing.assert_close(model.weight.grad, 2 * torch.ones(2, 1) * x.sum(0))


def test_configure_rejects_invalid_values_naming_valid_ones() -> None:
    with pytest.raises(ValueError) as info:
        fakegrad_patch.configure(on_missing="ignore")  # type: ignore[arg-type]
    for valid in ("drop", "zeros", "error", "keep"):
        assert repr(valid) in str(info.value)
    assert fakegrad_patch.settings().on_missing == "drop"  # unchanged


def test_configure_returns_previous_settings() -> None:
    previous = fakegrad_patch.configure(on_missing="zeros")
    try:
        assert previous.on_missing == "drop"
        assert fakegrad_patch.settings().on_missing == "zeros"
    finally:
        fakegrad_patch.configure(on_missing=previous.on_missing)


@pytest.mark.parametrize(
    ("raw", "expected"),
    [("", "drop"), ("zeros", "zeros"), (" ERROR ", "error"), ("keep", "keep")],
)
def test_env_var_is_parsed(raw: str, expected: str) -> None:
    assert _config.settings_from_env({"FAKEGRAD_ON_MISSING": raw}).on_missing == expected


def test_invalid_env_var_warns_and_falls_back() -> None:
    with pytest.warns(fakegrad_patch.FakeGradPatchWarning, match="'drop', 'zeros'"):
        settings = _config.settings_from_env({"FAKEGRAD_ON_MISSING": "sometimes"})
    assert settings.on_missing == "drop"


# -- issue 11: warnings under the user's filters, once per process ---------------------------------


def test_drop_under_warnings_as_errors_is_recorded_and_not_called_internal() -> None:
    """``-W error``: the drop warning becomes the user's exception out of backward. The event is
    recorded first, the leaf keeps what it had, and nothing is labelled an internal error."""
    fakegrad_patch._core.state.WARNED.discard("drop")
    fakegrad_patch.configure(on_missing="drop")
    model = _linear()
    model.bias.grad = torch.ones(2)
    trace.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error", fakegrad_patch.FakeGradPatchWarning)
        with pytest.raises(fakegrad_patch.FakeGradPatchWarning) as info:
            _fake_backward(model)
    assert "dropped" in str(info.value) and "internal error" not in str(info.value)
    kinds = [e["event"] for e in trace.events()]
    assert "fake_grad_drop" in kinds and "internal_error" not in kinds
    assert torch.equal(model.bias.grad, torch.ones(2)) and is_real(model.bias.grad)


def test_drop_warning_is_shown_once_per_process_across_installs_and_leaf_shapes() -> None:
    fakegrad_patch._core.state.WARNED.discard("drop")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(20):
            fakegrad_patch.uninstall()
            with fakegrad_patch.patched(on_missing="drop"):
                model = torch.nn.Linear(3 + i, 2)
                with fake_mode():
                    model(torch.randn(4, 3 + i)).sum().backward()
    drops = [w for w in caught if issubclass(w.category, fakegrad_patch.FakeGradPatchWarning)]
    assert len(drops) == 1, [str(w.message)[:80] for w in drops]
