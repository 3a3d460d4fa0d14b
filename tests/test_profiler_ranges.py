"""Issue 27.3: the patch's work is visible in torch.profiler: ``fakegrad_patch::arm``,
``fakegrad_patch::disarm`` and ``fakegrad_patch::materialize[: name]`` ranges, in
``key_averages()`` and in the exported Chrome trace, nested inside the backward that caused them;
and nothing when no profiler records."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.profiler import ProfilerActivity, profile, record_function

import fakegrad_patch
from fakegrad_patch._core.accumulate import profiling

pytestmark = pytest.mark.skipif(
    not profiling.available(), reason="this torch lacks the profiler touch points"
)

BACKWARD = "test::backward"


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    fakegrad_patch.name_parameters(model, prefix="net")
    return model


def _fake_step(model: torch.nn.Module) -> None:
    with FakeTensorMode(allow_non_fake_inputs=True):
        loss = model(torch.randn(5, 4)).sum()
        with record_function(BACKWARD):
            loss.backward()


def _slices(path: Path) -> list[dict[str, Any]]:
    data = json.loads(path.read_text())
    return [e for e in data["traceEvents"] if e.get("ph") == "X"]


def _inside(inner: dict[str, Any], outer: dict[str, Any]) -> bool:
    return (
        inner["tid"] == outer["tid"]
        and outer["ts"] <= inner["ts"]
        and inner["ts"] + inner["dur"] <= outer["ts"] + outer["dur"]
    )


def test_a_propagating_fake_backward_shows_arm_and_materialize_ranges(
    propagate: None, tmp_path: Path
) -> None:
    model = _model()
    _fake_step(model)  # first need (probes, calibration) outside the profile
    model.zero_grad(set_to_none=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _fake_step(model)
    assert all(type(p.grad) is torch.Tensor for p in model.parameters())

    names = {e.key for e in prof.key_averages()}
    expected = {f"fakegrad_patch::materialize: net.{n}" for n, _ in model.named_parameters()}
    assert expected <= names, sorted(names)
    assert {"fakegrad_patch::arm", "fakegrad_patch::disarm"} <= names
    counts = {e.key: e.count for e in prof.key_averages()}
    assert all(counts[name] == 1 for name in expected)
    assert counts["fakegrad_patch::arm"] == 1

    trace_file = tmp_path / "profile.json"
    prof.export_chrome_trace(str(trace_file))
    slices = _slices(trace_file)
    # record_function inside a FakeTensorMode records its enter op too, a second slice of the
    # same name whose length depends on the load and the collector (under a busy machine it can
    # be the longer one): the call is the one slice that holds every step of the engine
    nodes = [s for s in slices if s["name"].startswith("autograd::engine::")]
    assert nodes
    (backward,) = [s for s in slices if s["name"] == BACKWARD and all(_inside(n, s) for n in nodes)]
    ours = [s for s in slices if s["name"].startswith("fakegrad_patch::")]
    assert {s["name"] for s in ours} == expected | {"fakegrad_patch::arm", "fakegrad_patch::disarm"}
    for span in ours:  # every range of ours lies inside the backward call that caused it
        assert _inside(span, backward), (span, backward)
    engine = [
        s
        for s in slices
        if s["name"].endswith("evaluate_function: torch::autograd::AccumulateGrad")
    ]
    for span in ours:
        if span["name"].startswith("fakegrad_patch::materialize"):
            # ... and inside the engine's AccumulateGrad step that received the fake gradient
            assert any(_inside(span, node) for node in engine), span
    (arm,) = [s for s in ours if s["name"] == "fakegrad_patch::arm"]
    first_node = min(s["ts"] for s in nodes)
    assert arm["ts"] + arm["dur"] <= first_node  # arming happens before the engine runs


def test_unnamed_leaves_get_the_plain_range_name(propagate: None) -> None:
    leaf = torch.nn.Parameter(torch.ones(3))
    with FakeTensorMode(allow_non_fake_inputs=True):
        (leaf * 2).sum().backward()
    leaf.grad = None
    with (
        profile(activities=[ProfilerActivity.CPU]) as prof,
        FakeTensorMode(allow_non_fake_inputs=True),
    ):
        (leaf * 2).sum().backward()
    assert type(leaf.grad) is torch.Tensor
    assert "fakegrad_patch::materialize" in {e.key for e in prof.key_averages()}


def test_the_autograd_profiler_sees_them_too(propagate: None) -> None:
    model = _model()
    _fake_step(model)
    with torch.autograd.profiler.profile() as prof:
        _fake_step(model)
    names = {e.key for e in prof.key_averages()}
    assert "fakegrad_patch::arm" in names
    assert "fakegrad_patch::materialize: net.0.weight" in names


def test_real_backward_and_unprofiled_runs_open_no_range(
    propagate: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    opened: list[str] = []
    real_range = profiling._Range

    def counting(name: str) -> Any:
        opened.append(name)
        return real_range(name)

    monkeypatch.setattr(profiling, "_Range", counting)
    model = _model()
    _fake_step(model)  # no profiler: not one range object is built
    assert opened == []
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        model(torch.randn(5, 4)).sum().backward()  # a real backward: the patch stays out
    assert opened == []
    assert not [e.key for e in prof.key_averages() if e.key.startswith("fakegrad_patch::")]
    with profile(activities=[ProfilerActivity.CPU]):
        _fake_step(model)
    assert "fakegrad_patch::arm" in opened


def test_the_feature_switch_turns_every_range_off(propagate: None) -> None:
    model = _model()
    _fake_step(model)
    previous = profiling.set_enabled(False)
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            _fake_step(model)
    finally:
        profiling.set_enabled(previous)
    assert previous is True
    assert not [e.key for e in prof.key_averages() if e.key.startswith("fakegrad_patch::")]
