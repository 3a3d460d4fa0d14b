"""Issue 5: the tracer. Every event kind through real scenarios, the sinks, the buffer, the level
rules, and that tracing never touches the host's structlog/logging configuration."""

from __future__ import annotations

import gc
import json
import logging
import os
import stat
import subprocess
import sys
import textwrap
import warnings
import weakref
from pathlib import Path
from typing import Any

import pytest
import structlog
import torch
import torch._functorch.config as functorch_config
from _helpers import fake_mode, is_real
from torch._subclasses.fake_tensor import FakeTensor

import fakegrad_patch
from fakegrad_patch import trace
from fakegrad_patch._core import install as _patch
from fakegrad_patch._core.touchpoints.targets import FROM_REAL_TENSOR, MissingTargetError

ENVELOPE = {"event", "level", "timestamp", "schema", "pid", "tid"}
LEAF_KEYS = {"leaf_id", "name", "shape", "dtype", "device"}
GRAD_KEYS = (
    ENVELOPE
    | LEAF_KEYS
    | {
        "backward_id",
        "source",
        "action",
        "zero_copy",
        "bytes",
        "duration_us",
    }
)
#: event -> (level, exact key set); the schema docs/trace-schema.md documents.
SCHEMA: dict[str, tuple[str, set[str]]] = {
    "patch_installed": ("info", ENVELOPE | {"torch", "target", "defects"}),
    "patch_skipped": ("warning", ENVELOPE | {"torch", "reason"}),
    "patch_deferred": ("info", ENVELOPE | {"torch", "reason"}),
    "patch_uninstalled": ("info", ENVELOPE | {"hooks_removed", "hooks_left"}),
    "defect_probed": ("info", ENVELOPE | {"defect", "present"}),
    "d2_repaired": ("info", ENVELOPE | {"leaf_id", "name", "shape", "dtype", "device", "bytes"}),
    "propagated_values_resynced": ("info", ENVELOPE | LEAF_KEYS | {"bytes"}),
    "standing_aside": ("info", ENVELOPE | {"defect"}),
    "hooks_released": ("info", ENVELOPE | {"hooks_removed"}),
    "zero_copy_calibrated": ("info", ENVELOPE | {"enabled"}),
    "leaf_armed": ("debug", ENVELOPE | LEAF_KEYS),
    "leaf_released": ("debug", ENVELOPE | LEAF_KEYS),
    "fake_grad_set": ("info", GRAD_KEYS),
    "fake_grad_accumulate": ("info", GRAD_KEYS),
    "fake_grad_drop": ("warning", GRAD_KEYS),
    "fake_grad_error": ("warning", GRAD_KEYS),
    "fake_grad_keep": ("info", GRAD_KEYS),
    "internal_error": ("error", ENVELOPE | {"where", "error"}),
    "trace_sink_failed": ("error", ENVELOPE | {"path", "error"}),
    "buffer_written_back": ("info", ENVELOPE | LEAF_KEYS | {"bytes", "via"}),
    "buffer_not_written_back": ("warning", ENVELOPE | LEAF_KEYS | {"reason"}),
    "update_lost": ("warning", ENVELOPE | LEAF_KEYS | {"kind", "op", "bytes", "fix"}),
    "lent_values_lost": ("warning", ENVELOPE | {"bytes"}),
    "optimizer_state_materialized": ("info", ENVELOPE | LEAF_KEYS | {"key", "bytes"}),
    "write_back_enabled": ("info", ENVELOPE),
    "write_back_disabled": ("info", ENVELOPE | {"unaliased"}),
    "propagation_mismatch": ("warning", ENVELOPE | {"op", "output", "cause", "known"}),
    "propagation_rebuilt": ("info", ENVELOPE | {"op", "reason", "cause", "outputs"}),
    "propagation_repaired": ("info", ENVELOPE | {"op", "repair", "values"}),
    "propagation_fast": ("debug", ENVELOPE | {"op"}),
    "backward_wrapper_installed": ("debug", ENVELOPE | {"modes", "explicit_policy"}),
    "backward_wrapper_removed": ("debug", ENVELOPE | {"modes", "explicit_policy"}),
}


def check_schema(event: dict[str, Any]) -> None:
    """``event`` has exactly the documented keys and level, plain JSON values, no tensors."""
    level, keys = SCHEMA[event["event"]]
    assert set(event) == keys, (event["event"], set(event) ^ keys)
    assert event["level"] == level
    assert event["schema"] == trace.SCHEMA_VERSION
    assert event["pid"] == os.getpid() or isinstance(event["pid"], int)
    assert isinstance(event["tid"], int)
    assert isinstance(event["timestamp"], str) and event["timestamp"].endswith("Z")
    json.dumps(event)  # plain data only: no default= fallback needed
    # plain types (the hot paths hand their fields over unscrubbed: emit_fields(owned=True))
    assert all(_plain(v) for v in event.values()), {k: v for k, v in event.items() if not _plain(v)}
    if event["event"].startswith("fake_grad_"):
        assert event["action"] == event["event"].removeprefix("fake_grad_")
        assert event["source"] in ("propagated", "zeros", "none")
        assert isinstance(event["zero_copy"], bool)
        assert isinstance(event["bytes"], int) and event["bytes"] >= 0
        assert isinstance(event["duration_us"], float) and event["duration_us"] >= 0
        assert isinstance(event["shape"], list)


def _plain(value: Any) -> bool:
    """Lists and dicts of exact type (never a ``torch.Size``), scalars (``torch.__version__``
    is a ``str``), never a tensor."""
    if type(value) is list:
        return all(_plain(v) for v in value)
    if type(value) is dict:
        return all(type(k) is str and _plain(v) for k, v in value.items())
    return isinstance(value, (str, int, float, bool, type(None)))


def _model() -> torch.nn.Linear:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    fakegrad_patch.name_parameters(model, prefix="lin")
    return model


def _fake_backward(model: torch.nn.Module, *, propagate: bool) -> None:
    with functorch_config.patch(fake_tensor_propagate_real_tensors=propagate), fake_mode():
        model(torch.randn(4, 3)).sum().backward()


def _kinds(events: list[dict[str, Any]]) -> list[str]:
    return [e["event"] for e in events]


# -- levels and the cheap guard -------------------------------------------------------------------


def test_enabled_follows_the_level_and_set_level_returns_the_previous_one() -> None:
    previous = trace.set_level("info")
    try:
        assert not trace.enabled(trace.DEBUG)
        assert trace.enabled(trace.INFO) and trace.enabled(trace.ERROR)
        assert trace.set_level(trace.ERROR) == trace.INFO
        assert not trace.enabled(trace.WARNING)
    finally:
        trace.set_level(previous)


def test_filtered_events_reach_nothing(restore_trace: None) -> None:
    trace.configure_trace(level="warning")
    trace.clear()
    with trace.capture("error") as captured:
        trace.emit("fake_grad_set", trace.INFO, leaf_id=1)
    assert trace.events() == [] and captured == []


def test_level_defaults_info_with_a_sink_else_warning(tmp_path: Path, restore_trace: None) -> None:
    trace.restore(trace.TraceConfig())  # no sink, no explicit level
    assert trace.current_config().effective_level == trace.WARNING
    trace.configure_trace(path=tmp_path / "t.jsonl")
    assert trace.current_config().effective_level == trace.INFO
    trace.configure_trace(path="-")
    assert trace.current_config().effective_level == trace.INFO
    trace.configure_trace(level="error")
    assert trace.current_config().effective_level == trace.ERROR


def test_configure_trace_returns_previous_and_validates(restore_trace: None) -> None:
    before = trace.current_config()
    previous = trace.configure_trace(level="debug", buffer_size=7)
    assert previous == before
    assert trace.current_config().level == trace.DEBUG
    assert trace.current_config().buffer_size == 7
    with pytest.raises(ValueError, match="debug, info, warning, error"):
        trace.configure_trace(level="verbose")
    with pytest.raises(ValueError, match="buffer_size"):
        trace.configure_trace(buffer_size=-1)
    trace.restore(previous)
    assert trace.current_config() == before


# -- every event kind, from real scenarios --------------------------------------------------------


def test_propagated_backward_events_set_then_accumulate() -> None:
    model = _model()
    with trace.capture() as captured:
        _fake_backward(model, propagate=True)
        _fake_backward(model, propagate=True)
        gc.collect()  # the fake graphs are gone: their AccumulateGrad nodes and our hooks too
    for event in captured:
        check_schema(event)
    grads = [e for e in captured if e["event"].startswith("fake_grad_")]
    assert _kinds(grads) == ["fake_grad_set"] * 2 + ["fake_grad_accumulate"] * 2
    assert {e["name"] for e in grads} == {"lin.weight", "lin.bias"}
    weight = next(e for e in grads if e["name"] == "lin.weight")
    assert weight["shape"] == [2, 3] and weight["dtype"] == "float32" and weight["device"] == "cpu"
    assert weight["leaf_id"] == id(model.weight)
    assert weight["source"] == "propagated"
    backward_ids = [e["backward_id"] for e in grads]
    assert backward_ids[0] == backward_ids[1] != backward_ids[2] == backward_ids[3]
    armed = [e for e in captured if e["event"] == "leaf_armed"]
    assert {e["name"] for e in armed} == {"lin.weight", "lin.bias"}
    released = [e for e in captured if e["event"] == "leaf_released"]
    assert sorted(e["leaf_id"] for e in released) == sorted(e["leaf_id"] for e in armed)
    applied = _patch.current()
    assert applied is not None
    d2 = applied.probes.detected()["D2_parameter_real_tensor"]
    assert ("d2_repaired" in _kinds(captured)) == d2
    assert is_real(model.weight.grad)


@pytest.mark.parametrize(
    ("policy", "event", "source"),
    [
        ("drop", "fake_grad_drop", "none"),
        ("zeros", "fake_grad_set", "zeros"),
        ("keep", "fake_grad_keep", "none"),
    ],
)
def test_policy_events(policy: str, event: str, source: str) -> None:
    model = _model()
    with (
        warnings.catch_warnings(),
        fakegrad_patch.patched(on_missing=policy),  # type: ignore[arg-type]
        trace.capture("info") as captured,
    ):
        warnings.simplefilter("ignore", fakegrad_patch.FakeGradPatchWarning)
        _fake_backward(model, propagate=False)
    grads = [e for e in captured if e["event"].startswith("fake_grad_")]
    assert _kinds(grads) == [event, event]
    for e in grads:
        check_schema(e)
        assert e["source"] == source
    if policy == "keep":
        assert isinstance(model.weight.grad, FakeTensor)


def test_drop_is_in_the_memory_buffer_at_the_default_level() -> None:
    fakegrad_patch.configure(on_missing="drop")  # explicit: applies without real values
    trace.clear()
    model = _model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fakegrad_patch.FakeGradPatchWarning)
        _fake_backward(model, propagate=False)
    kinds = _kinds(trace.events())
    assert kinds.count("fake_grad_drop") == 2
    assert "fake_grad_set" not in kinds and "leaf_armed" not in kinds  # info/debug filtered


def test_error_policy_event_precedes_the_exception() -> None:
    model = _model()
    with (
        fakegrad_patch.patched(on_missing="error"),
        trace.capture("warning") as captured,
        pytest.raises(fakegrad_patch.FakeGradError),
    ):
        _fake_backward(model, propagate=False)
    assert _kinds(captured)[:1] == ["fake_grad_error"]
    check_schema(captured[0])
    assert captured[0]["name"] in ("lin.weight", "lin.bias")


def test_uninstall_and_install_events() -> None:
    with trace.capture("info") as captured:
        assert fakegrad_patch.uninstall()
        fakegrad_patch.install()
    assert _kinds(captured) == ["patch_uninstalled", "patch_installed"]
    for e in captured:
        check_schema(e)
    assert isinstance(captured[0]["hooks_removed"], int)
    assert captured[1]["torch"] == torch.__version__
    assert captured[1]["target"] == FROM_REAL_TENSOR.dotted
    assert isinstance(captured[1]["defects"], dict)


def test_skipped_patch_event(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing() -> None:
        raise MissingTargetError(FROM_REAL_TENSOR, "gone in this build")

    fakegrad_patch.uninstall()
    from fakegrad_patch._core.install import applied as _applied

    monkeypatch.setattr(_applied, "Applied", missing)
    try:
        with warnings.catch_warnings(), trace.capture("info") as captured:
            warnings.simplefilter("ignore", fakegrad_patch.FakeGradPatchWarning)
            assert not fakegrad_patch.install()
    finally:
        monkeypatch.undo()
        fakegrad_patch.uninstall()
        fakegrad_patch.install()
    skipped = [e for e in captured if e["event"] == "patch_skipped"]
    assert len(skipped) == 1
    check_schema(skipped[0])
    assert "gone in this build" in skipped[0]["reason"]


def test_internal_error_event(monkeypatch: pytest.MonkeyPatch) -> None:
    applied = _patch.current()
    assert applied is not None

    def broken(leaf: Any, grad: Any) -> None:
        raise RuntimeError("boom")

    applied.ready()  # first-need probes and calibration run with the real materializer
    monkeypatch.setattr(applied.materializer, "on_fake_grad", broken)
    model = _model()
    with warnings.catch_warnings(), trace.capture("error") as captured:
        warnings.simplefilter("ignore", fakegrad_patch.FakeGradPatchWarning)
        _fake_backward(model, propagate=True)
    assert _kinds(captured) == ["internal_error", "internal_error"]
    check_schema(captured[0])
    assert captured[0]["where"] == "materialize" and "boom" in captured[0]["error"]


# -- values never carry tensors -------------------------------------------------------------------


def test_tensors_are_never_stored_or_reprd(tmp_path: Path, restore_trace: None) -> None:
    path = tmp_path / "t.jsonl"
    trace.configure_trace(path=path, level="info")
    t = torch.ones(3)
    ref = weakref.ref(t)
    with trace.capture("info") as captured:
        trace.emit("custom", trace.INFO, value=t, nested={"list": [t, 1]})
        with fake_mode() as mode:
            fake = mode.from_tensor(torch.ones(2))
            trace.emit("custom", trace.INFO, value=fake)
    del t
    gc.collect()
    assert ref() is None  # nothing kept it alive
    assert captured[0]["value"] == "<Tensor>" and captured[0]["nested"] == {"list": ["<Tensor>", 1]}
    assert captured[1]["value"] == "<FakeTensor>"
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line["value"] for line in lines] == ["<Tensor>", "<FakeTensor>"]


# -- sinks -----------------------------------------------------------------------------------------


def test_file_sink_is_lazy_private_and_appends(tmp_path: Path, restore_trace: None) -> None:
    path = tmp_path / "trace.jsonl"
    trace.restore(trace.TraceConfig())  # no explicit level (the suite's conftest sets one)
    trace.configure_trace(path=path)  # level defaults to info
    trace.emit("leaf_armed", trace.DEBUG, leaf_id=1)
    assert not path.exists()  # nothing written yet: no file
    trace.emit("fake_grad_set", trace.INFO, leaf_id=1, bytes=0)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    trace.emit("fake_grad_drop", trace.WARNING, leaf_id=2)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert _kinds(records) == ["fake_grad_set", "fake_grad_drop"]
    assert list(records[0])[:6] == list(trace.ENVELOPE_KEYS)
    # a new configuration appends to what is there
    trace.configure_trace(path=None)
    trace.configure_trace(path=path)
    trace.emit("fake_grad_set", trace.INFO, leaf_id=3)
    assert len(path.read_text().splitlines()) == 3


def test_real_run_to_file_records_every_interception(tmp_path: Path, restore_trace: None) -> None:
    path = tmp_path / "run.jsonl"
    trace.configure_trace(path=path, level="debug")
    model = _model()
    _fake_backward(model, propagate=True)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    for record in records:
        check_schema(record)
    assert _kinds(records).count("fake_grad_set") == 2
    assert _kinds(records).count("leaf_armed") == 2


def test_unwritable_path_warns_once_and_continues(tmp_path: Path, restore_trace: None) -> None:
    path = tmp_path / "missing-dir" / "trace.jsonl"
    trace.configure_trace(path=path, level="info")
    trace.clear()
    with pytest.warns(fakegrad_patch.FakeGradPatchWarning, match="cannot write the trace file"):
        trace.emit("fake_grad_drop", trace.WARNING, leaf_id=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second warning would raise here
        trace.emit("fake_grad_drop", trace.WARNING, leaf_id=2)
        model = _model()
        _fake_backward(model, propagate=True)  # the program keeps working
    assert is_real(model.weight.grad)
    kinds = _kinds(trace.events())
    assert kinds.count("trace_sink_failed") == 1
    assert kinds.count("fake_grad_drop") == 2  # the memory buffer still has everything
    failed = next(e for e in trace.events() if e["event"] == "trace_sink_failed")
    check_schema(failed)
    assert not path.exists()


def test_warnings_as_errors_never_break_the_caller(tmp_path: Path, restore_trace: None) -> None:
    trace.configure_trace(path=tmp_path, level="info")  # a directory: cannot be opened
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trace.emit("fake_grad_drop", trace.WARNING, leaf_id=1)  # must not raise


def test_stderr_sink(capsys: pytest.CaptureFixture[str], restore_trace: None) -> None:
    trace.restore(trace.TraceConfig())
    trace.configure_trace(path="-")
    trace.emit("leaf_armed", trace.DEBUG, leaf_id=1)
    trace.emit("fake_grad_set", trace.INFO, leaf_id=7, shape=[2])
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1
    record = json.loads(err[0])
    assert record["event"] == "fake_grad_set" and record["leaf_id"] == 7


_APPENDER = textwrap.dedent(
    """
    import sys
    from fakegrad_patch import trace
    trace.configure_trace(path=sys.argv[1], level="info")
    sys.stdin.readline()  # start together
    for i in range(int(sys.argv[2])):
        trace.emit("fake_grad_set", trace.INFO, seq=i, pad="x" * 5000)
    """
)


def test_two_processes_append_whole_lines(tmp_path: Path) -> None:
    path = tmp_path / "shared.jsonl"
    count = 1500
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _APPENDER, str(path), str(count)],
            stdin=subprocess.PIPE,
        )
        for _ in range(2)
    ]
    for proc in procs:
        assert proc.stdin is not None
        proc.stdin.write(b"go\n")
        proc.stdin.close()
    for proc in procs:
        assert proc.wait(timeout=120) == 0
    lines = path.read_text().splitlines()
    assert len(lines) == 2 * count
    records = [json.loads(line) for line in lines]  # every line is whole, valid JSON
    by_pid: dict[int, list[int]] = {}
    for record in records:
        by_pid.setdefault(record["pid"], []).append(record["seq"])
    assert sorted(by_pid) == sorted(p.pid for p in procs)
    assert all(seqs == list(range(count)) for seqs in by_pid.values())
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


# -- memory buffer and capture ---------------------------------------------------------------------


def test_memory_buffer_is_bounded_and_returns_copies(restore_trace: None) -> None:
    trace.configure_trace(level="info", buffer_size=5)
    trace.clear()
    for i in range(12):
        trace.emit("fake_grad_set", trace.INFO, seq=i)
    events = trace.events()
    assert [e["seq"] for e in events] == list(range(7, 12))
    events[0]["seq"] = "changed"
    assert trace.events()[0]["seq"] == 7
    trace.configure_trace(buffer_size=2)
    assert [e["seq"] for e in trace.events()] == [10, 11]  # keeps the newest
    trace.clear()
    assert trace.events() == []


def test_capture_records_its_level_and_restores(restore_trace: None) -> None:
    trace.configure_trace(level="warning")
    trace.clear()
    assert not trace.enabled(trace.DEBUG)
    with trace.capture() as outer:
        assert trace.enabled(trace.DEBUG)
        with trace.capture("warning") as inner:
            trace.emit("leaf_armed", trace.DEBUG, leaf_id=1)
            trace.emit("fake_grad_drop", trace.WARNING, leaf_id=1)
        trace.emit("fake_grad_set", trace.INFO, leaf_id=1)
    assert not trace.enabled(trace.DEBUG) and not trace.enabled(trace.INFO)
    assert _kinds(outer) == ["leaf_armed", "fake_grad_drop", "fake_grad_set"]
    assert _kinds(inner) == ["fake_grad_drop"]
    assert _kinds(trace.events()) == ["fake_grad_drop"]  # the buffer kept its own level


# -- a library citizen ----------------------------------------------------------------------------


def test_host_structlog_and_logging_config_untouched_and_ignored(restore_trace: None) -> None:
    saved = structlog.get_config()
    root_handlers = list(logging.getLogger().handlers)
    seen: list[Any] = []

    def host_processor(logger: Any, name: str, event_dict: Any) -> Any:
        seen.append(event_dict)
        raise structlog.DropEvent

    structlog.configure(processors=[host_processor])
    try:
        configured = structlog.get_config()
        with trace.capture("info") as captured:
            trace.emit("fake_grad_set", trace.INFO, leaf_id=1)
        assert _kinds(captured) == ["fake_grad_set"]
        assert seen == []  # the host's pipeline never saw our event
        assert structlog.get_config() == configured
    finally:
        structlog.configure(**saved)
    assert logging.getLogger().handlers == root_handlers


def _run(code: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> str:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("FAKEGRAD_")}
    full_env.update(env or {})
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=full_env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_import_stays_light_even_with_a_sink_configured(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    out = _run(
        """
        import sys, os
        import fakegrad_patch
        print(sorted(m for m in ("torch", "structlog") if m in sys.modules))
        print(os.path.exists(os.environ["FAKEGRAD_TRACE"]))
        """,
        env={"FAKEGRAD_TRACE": str(path)},
    )
    assert out.split("\n")[:2] == ["[]", "False"]


def test_env_sink_and_level_in_a_real_program(tmp_path: Path) -> None:
    _run(
        """
        import torch, fakegrad_patch
        import torch._functorch.config as fc
        from torch._subclasses.fake_tensor import FakeTensorMode
        fc.fake_tensor_propagate_real_tensors = True
        m = torch.nn.Linear(3, 2); fakegrad_patch.name_parameters(m)
        with FakeTensorMode(allow_non_fake_inputs=True):
            m(torch.randn(4, 3)).sum().backward()
        """,
        env={"FAKEGRAD_TRACE": "rel.jsonl"},
        cwd=tmp_path,
    )
    path = tmp_path / "rel.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()]
    kinds = _kinds(records)
    assert "leaf_armed" not in kinds  # default level with a sink: info
    assert kinds.count("fake_grad_set") == 2 and kinds[0] == "patch_installed"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_invalid_env_level_warns_and_uses_the_default() -> None:
    out = _run(
        """
        import warnings
        warnings.simplefilter("always")
        with warnings.catch_warnings(record=True) as caught:
            from fakegrad_patch import trace
        print(trace.current_config().effective_level)
        print([str(w.message) for w in caught])
        """,
        env={"FAKEGRAD_TRACE_LEVEL": "loud"},
    )
    level, messages = out.splitlines()[:2]
    assert level == str(trace.WARNING)
    assert "FAKEGRAD_TRACE_LEVEL" in messages and "loud" in messages
