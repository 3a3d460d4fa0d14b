"""Issue 13: the fast pipeline keeps the schema: timestamps, the JSON both serializers write,
lines no serializer can write as they are."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Any

import pytest

from fakegrad_patch import trace
from fakegrad_patch.trace import _pipeline


def test_timestamps_are_utc_with_microseconds_even_on_a_whole_second(
    monkeypatch: pytest.MonkeyPatch, restore_trace: None
) -> None:
    whole = datetime.datetime(2026, 11, 30, 21, 54, 22, tzinfo=datetime.timezone.utc)
    ns = int(whole.timestamp()) * 1_000_000_000
    clock = iter([ns, ns + 81_334_999, ns + 1_000_000_000])
    monkeypatch.setattr("time.time_ns", lambda: next(clock))
    with trace.capture("info") as captured:
        for _ in range(3):
            trace.emit("fake_grad_set", trace.INFO, leaf_id=1)
    assert [e["timestamp"] for e in captured] == [
        "2026-11-30T21:54:22.000000Z",
        "2026-11-30T21:54:22.081334Z",
        "2026-11-30T21:54:23.000000Z",
    ]


_EVENTS: list[dict[str, Any]] = [
    {"leaf_id": 2**40, "name": "layers.0.weight", "shape": [512, 512], "dtype": "float32"},
    {"name": "ünïcødé → 名前", "shape": [], "zero_copy": False, "bytes": 0, "duration_us": 0.5},
    {"name": None, "nested": {"a": [1, 2.5, "x", None, True]}, "shape": (2, 3)},
    {"value": object(), "items": [object(), {1: object()}]},
]


def _plain(value: Any) -> bool:
    """Plain data as ``trace.emit_fields(owned=True)`` requires it (exact types: no Size)."""
    if type(value) is dict:
        return all(type(k) is str and _plain(v) for k, v in value.items())
    if type(value) is list:
        return all(_plain(v) for v in value)
    return type(value) in (str, int, float, bool, type(None))


def _lines_with(backend: str, tmp_path: Path) -> list[bytes]:
    code = textwrap.dedent(
        """
        import sys, pickle
        from fakegrad_patch import trace
        from fakegrad_patch.trace import _pipeline
        out = [_pipeline.render_line(e) for e in pickle.loads(sys.stdin.buffer.read())]
        sys.stdout.write(repr((trace.json_backend, out)))
        """
    )
    envelope = {"event": "fake_grad_set", "level": "info", "timestamp": "t", "schema": 1}
    import pickle

    events = [_pipeline.envelope(None, "info", {"event": "e", **e}) for e in _EVENTS]
    for e in events:
        e.update(envelope)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FAKEGRAD_")}
    if backend == "stdlib":
        env["FAKEGRAD_TRACE_JSON"] = "stdlib"
    result = subprocess.run(
        [sys.executable, "-c", code],
        input=pickle.dumps(events),
        env=env,
        capture_output=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    used, lines = eval(result.stdout)  # our own repr of (str, list[bytes])
    if backend == "orjson" and used != "orjson":
        pytest.skip("orjson is not installed (the 'fast' extra)")
    assert used == ("json" if backend == "stdlib" else "orjson")
    return lines


def test_orjson_and_the_stdlib_write_the_same_lines(tmp_path: Path) -> None:
    stdlib = _lines_with("stdlib", tmp_path)
    fast = _lines_with("orjson", tmp_path)
    assert fast == stdlib
    for line in stdlib:
        assert line.endswith(b"\n") and line.count(b"\n") == 1
        json.loads(line)


def test_lines_no_serializer_takes_as_they_are_are_still_valid_json(
    tmp_path: Path, restore_trace: None
) -> None:
    """A lone surrogate (a file name decoded with surrogateescape) and an int beyond 64 bits."""
    path = tmp_path / "t.jsonl"
    trace.configure_trace(path=path, level="info")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trace.emit("fake_grad_set", trace.INFO, name="bad\udc80name", leaf_id=1)
        trace.emit("fake_grad_set", trace.INFO, name="ok", leaf_id=2**70)
    first, second = (json.loads(line) for line in path.read_bytes().splitlines())
    assert first["name"] == "bad\udc80name"
    assert second["leaf_id"] == 2**70


def test_emit_fields_records_what_emit_records_and_keeps_nothing_of_the_dict(
    tmp_path: Path, restore_trace: None
) -> None:
    path = tmp_path / "t.jsonl"
    trace.configure_trace(path=path, level="info")
    trace.clear()
    fields = {"leaf_id": 1, "shape": [2, 3], "name": "w", "value": object()}
    trace.emit("fake_grad_set", trace.INFO, **fields)
    trace.emit_fields("fake_grad_set", trace.INFO, fields)
    trace.emit_fields("leaf_armed", trace.DEBUG, fields)  # filtered: nothing
    assert fields["shape"] == [2, 3] and len(fields) == 4  # read, not changed
    fields["shape"].append(4)  # not kept: the recorded events do not change
    via_kwargs, via_dict = trace.events()
    assert {k: v for k, v in via_kwargs.items() if k != "timestamp"} == {
        k: v for k, v in via_dict.items() if k != "timestamp"
    }
    assert via_dict["shape"] == [2, 3] and via_dict["value"] == "<object>"
    first, second = (json.loads(line) for line in path.read_bytes().splitlines())
    assert first.pop("timestamp") and second.pop("timestamp")
    assert first == second


def test_the_one_step_pipeline_records_and_writes_what_the_separate_steps_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, restore_trace: None
) -> None:
    """Issue 27: envelope, fan-out and renderer run as one processor; same dict in the buffer and
    in captures, same bytes in the file, as the three steps give, for every kind of field."""
    monkeypatch.setattr(_pipeline, "timestamp", lambda: "2026-11-30T21:54:22.081334Z")
    path = tmp_path / "t.jsonl"
    trace.configure_trace(path=path, level="info")
    trace.clear()
    expected_lines = []
    expected_dicts = []
    with trace.capture("info") as captured:
        for fields in _EVENTS:
            step = _pipeline.envelope(
                None, "info", {"event": "e", "_fakegrad_fields": dict(fields)}
            )
            expected_dicts.append(step)
            expected_lines.append(_pipeline.render_line(step))
            trace.emit_fields("e", trace.INFO, fields)
            if _plain(fields):
                # owned=True (the hot paths' call) skips the scrubbing, not the result
                expected_dicts.append(step)
                expected_lines.append(expected_lines[-1])
                trace.emit_fields("e", trace.INFO, dict(fields), owned=True)
        assert len(expected_dicts) > len(_EVENTS)  # _EVENTS has plain ones
        trace.emit("e", trace.DEBUG, leaf_id=1)  # below the sink's level: nothing anywhere
    assert path.read_bytes() == b"".join(expected_lines)
    assert trace.events() == expected_dicts
    assert captured == expected_dicts
    # the sink does not want debug events, a capture does: recorded there, not written
    with trace.capture("debug") as debug:
        trace.emit("e", trace.DEBUG, leaf_id=1)
    assert [e["leaf_id"] for e in debug] == [1]
    assert path.read_bytes() == b"".join(expected_lines)
