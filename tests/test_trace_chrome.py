"""Issue 27.4: ``python -m fakegrad_patch trace FILE... --chrome OUT`` writes the trace as Chrome
trace-event JSON (Perfetto, chrome://tracing): validated against the format, from synthetic
lines, from a real patched run and from two processes appending to one trace file."""

from __future__ import annotations

import calendar
import itertools
import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
TRACE_DIR = ROOT / "fakegrad_patch" / "trace"

#: A real program: two propagated fake steps (set, then accumulate), one with a name missing.
PROGRAM = textwrap.dedent(
    """
    import sys, torch, fakegrad_patch
    import torch._functorch.config as fc
    from torch._subclasses.fake_tensor import FakeTensorMode

    fc.fake_tensor_propagate_real_tensors = True
    torch.manual_seed(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
    m = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    fakegrad_patch.name_parameters(m, prefix="net")
    for _ in range(int(sys.argv[2]) if len(sys.argv) > 2 else 2):
        with FakeTensorMode(allow_non_fake_inputs=True):
            m(torch.randn(4, 3)).sum().backward()
    assert all(type(p.grad) is torch.Tensor for p in m.parameters())
    """
)


def _env(path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FAKEGRAD_")}
    env.update(
        FAKEGRAD_TRACE=str(path),
        FAKEGRAD_TRACE_LEVEL="debug",
        PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]),
    )
    return env


def _run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fakegrad_patch", "trace", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


def _micros(timestamp: str) -> int:
    seconds = calendar.timegm(time.strptime(timestamp[:19], "%Y-%m-%dT%H:%M:%S"))
    return seconds * 1_000_000 + int(timestamp[20:26])


def validate(doc: Any) -> list[dict[str, Any]]:
    """Check ``doc`` against the trace-event format as viewers read it; return its X/i events."""
    assert isinstance(doc, dict) and isinstance(doc["traceEvents"], list)
    named_processes: set[int] = set()
    named_threads: set[tuple[int, int]] = set()
    last_ts: dict[tuple[int, int], float] = {}
    timed = []
    for event in doc["traceEvents"]:
        assert {"ph", "name", "pid", "tid"} <= event.keys(), event
        assert type(event["pid"]) is int and type(event["tid"]) is int, event
        assert 0 <= event["tid"] < 2**31, event  # viewers keep 32-bit thread ids
        assert isinstance(event["name"], str) and event["name"]
        track = (event["pid"], event["tid"])
        if event["ph"] == "M":
            assert event["name"] in ("process_name", "thread_name"), event
            assert isinstance(event["args"]["name"], str)
            if event["name"] == "process_name":
                named_processes.add(event["pid"])
            else:
                named_threads.add(track)
            continue
        assert event["ph"] in ("X", "i"), event
        assert event["cat"] == "fakegrad_patch"
        assert isinstance(event["args"], dict)
        assert type(event["ts"]) in (int, float) and event["ts"] > 0
        if event["ph"] == "X":
            assert type(event["dur"]) in (int, float) and event["dur"] >= 0
        else:
            assert event["s"] == "t"
        # every track is named before its first event, and its timestamps never go back
        assert event["pid"] in named_processes and track in named_threads, event
        assert event["ts"] >= last_ts.get(track, 0.0), (event, last_ts[track])
        last_ts[track] = event["ts"]
        timed.append(event)
    return timed


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _check_against_source(timed: list[dict[str, Any]], source: list[dict[str, Any]]) -> None:
    """One timeline event per trace event, in order; slices end at the event's timestamp and last
    its ``duration_us``."""
    assert len(timed) == len(source)
    for event, record in zip(timed, source, strict=True):
        assert event["name"] == record["event"]
        assert event["pid"] == record["pid"]
        end = _micros(record["timestamp"])
        if "duration_us" in record:
            assert event["ph"] == "X"
            assert event["dur"] == record["duration_us"]
            assert event["ts"] + event["dur"] == pytest.approx(end, abs=0.01)
        else:
            assert event["ph"] == "i" and event["ts"] == end
        expected_args = {
            k: v
            for k, v in record.items()
            if k not in ("event", "timestamp", "pid", "tid", "schema")
        }
        assert event["args"] == expected_args


@pytest.fixture(scope="module")
def real_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("chrome") / "run.jsonl"
    result = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", PROGRAM],
        env=_env(path),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, result.stderr
    return path


def test_a_real_run_round_trips_to_a_valid_timeline(real_trace: Path, tmp_path: Path) -> None:
    out = tmp_path / "timeline.json"
    result = _run(str(real_trace), "--chrome", str(out), "--strict")
    assert result.returncode == 0, result.stderr
    assert "wrote" in result.stderr and "slices" in result.stderr
    assert not (tmp_path / "timeline.json.tmp").exists()
    doc = json.loads(out.read_text())
    timed = validate(doc)
    source = _lines(real_trace)
    _check_against_source(timed, source)
    slices = [e for e in timed if e["ph"] == "X"]
    # two steps x four parameters: a set, then an accumulate, each a slice named after its event
    assert sorted(e["name"] for e in slices) == ["fake_grad_accumulate"] * 4 + ["fake_grad_set"] * 4
    assert {e["args"]["name"] for e in slices} == {
        "net.0.weight",
        "net.0.bias",
        "net.1.weight",
        "net.1.bias",
    }
    assert {"patch_installed", "leaf_armed", "leaf_released"} <= {
        e["name"] for e in timed if e["ph"] == "i"
    }
    # one process, one thread here (CPU backward runs on the calling thread)
    meta = [e for e in doc["traceEvents"] if e["ph"] == "M"]
    assert [m["name"] for m in meta] == ["process_name", "thread_name"]
    assert meta[1]["args"]["name"] == f"thread {source[0]['tid']}"


def test_two_processes_appending_to_one_file_get_one_track_each(tmp_path: Path) -> None:
    path = tmp_path / "shared.jsonl"
    procs = [
        subprocess.Popen(
            [sys.executable, "-W", "ignore", "-c", PROGRAM, str(seed), "6"],
            env=_env(path),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for seed in (1, 2)
    ]
    for proc in procs:
        _out, err = proc.communicate(timeout=240)
        assert proc.returncode == 0, err
    source = _lines(path)
    pids = {r["pid"] for r in source}
    assert pids == {p.pid for p in procs}
    out = tmp_path / "timeline.json"
    result = _run(str(path), "--chrome", str(out))
    assert result.returncode == 0, result.stderr
    doc = json.loads(out.read_text())
    timed = validate(doc)
    _check_against_source(timed, source)
    processes = [e for e in doc["traceEvents"] if e["name"] == "process_name"]
    assert sorted(e["pid"] for e in processes) == sorted(pids)
    for pid in pids:  # each process: its own track, all of its slices on it
        mine = [e for e in timed if e["pid"] == pid and e["ph"] == "X"]
        assert len(mine) == 6 * 4
        assert {e["tid"] for e in mine} == {1}
        # slices of one thread never overlap: each interception ends before the next starts
        ordered = sorted(mine, key=lambda e: e["ts"])
        for a, b in itertools.pairwise(ordered):
            assert a["ts"] + a["dur"] <= b["ts"] + 0.01, (a, b)


def _line(event: str, ts: str, tid: int = 7, **fields: Any) -> str:
    record = {"event": event, "level": "info", "timestamp": ts, "schema": 1, "pid": 42, "tid": tid}
    record.update(fields)
    return json.dumps(record)


def test_synthetic_lines_threads_and_what_cannot_be_placed(tmp_path: Path) -> None:
    big_tid = 139841027361664
    lines = [
        _line("patch_installed", "2026-11-30T22:23:41.231261Z", tid=big_tid, torch="2.13.0"),
        _line("fake_grad_set", "2026-11-30T22:23:43.124069Z", tid=big_tid, duration_us=121.2),
        _line("fake_grad_set", "2026-11-30T22:23:43.124070Z", tid=5, duration_us=3.0),
        _line("some_future_event", "2026-11-30T22:23:44.000000Z", tid=5),
        "not json",
        "[1, 2]",
        _line("fake_grad_set", "yesterday", duration_us=1.0),
        json.dumps({"event": "x", "timestamp": "2026-11-30T22:23:44.000000Z", "pid": "42"}),
        _line("fake_grad_set", "2026-11-30T22:23:45.000000Z", duration_us=-1),  # instant then
        _line("fake_grad_set", "2026-11-30T22:23:46.000000Z", duration_us=float("nan")),
    ]
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(lines) + "\n")
    out = tmp_path / "o.json"
    result = _run(str(trace), "--chrome", str(out))
    assert result.returncode == 0, result.stderr
    assert "5 lines skipped" in result.stderr  # NaN too: the timeline must stay valid JSON
    doc = json.loads(out.read_text(), parse_constant=pytest.fail)
    timed = validate(doc)
    assert [(e["name"], e["ph"], e["tid"]) for e in timed] == [
        ("patch_installed", "i", 1),
        ("fake_grad_set", "X", 1),
        ("fake_grad_set", "X", 2),
        ("some_future_event", "i", 2),
        ("fake_grad_set", "i", 3),
    ]
    assert timed[1]["dur"] == 121.2
    assert timed[1]["ts"] == pytest.approx(_micros("2026-11-30T22:23:43.124069Z") - 121.2)
    threads = {
        e["tid"]: e["args"]["name"]
        for e in doc["traceEvents"]
        if e["ph"] == "M" and e["name"] == "thread_name"
    }
    assert threads == {1: f"thread {big_tid}", 2: "thread 5", 3: "thread 7"}
    # --strict: lines that could not be placed make the exit code 1
    assert _run(str(trace), "--chrome", str(out), "--strict").returncode == 1


def test_unreadable_input_and_unwritable_output(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text(_line("patch_installed", "2026-11-30T22:23:41.231261Z") + "\n")
    out = tmp_path / "o.json"
    result = _run(str(trace), str(tmp_path / "missing.jsonl"), "--chrome", str(out))
    assert result.returncode == 2
    assert "cannot read" in result.stderr
    assert validate(json.loads(out.read_text()))  # what could be read is still written
    result = _run(str(trace), "--chrome", str(tmp_path / "no" / "such" / "dir.json"))
    assert result.returncode == 2 and "cannot write" in result.stderr
    assert not list((tmp_path).glob("**/*.tmp"))


def test_the_reader_copied_alone_with_its_exporter_still_exports(
    real_trace: Path, tmp_path: Path
) -> None:
    for name in ("_reader.py", "_chrome.py"):
        shutil.copy(TRACE_DIR / name, tmp_path / name)
    out = tmp_path / "o.json"
    result = subprocess.run(
        [sys.executable, "-E", "-s", "_reader.py", str(real_trace), "--chrome", str(out)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    _check_against_source(validate(json.loads(out.read_text())), _lines(real_trace))


PROFILED = textwrap.dedent(
    """
    import sys, torch, fakegrad_patch
    import torch._functorch.config as fc
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.profiler import ProfilerActivity, profile

    fc.fake_tensor_propagate_real_tensors = True
    m = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    fakegrad_patch.name_parameters(m, prefix="net")
    def step():
        with FakeTensorMode(allow_non_fake_inputs=True):
            m(torch.randn(4, 3)).sum().backward()
    step()
    m.zero_grad(set_to_none=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    prof.export_chrome_trace(sys.argv[1])
    """
)


def test_merged_into_a_torch_profiler_export_on_its_time_base(tmp_path: Path) -> None:
    """--chrome-merge: the profiler's events unchanged, ours in its process on its time base:
    each fake_grad_set slice lies where the profiler saw the same parameter's
    fakegrad_patch::materialize range."""
    path, profile_path = tmp_path / "run.jsonl", tmp_path / "profile.json"
    result = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", PROFILED, str(profile_path)],
        env=_env(path),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, result.stderr
    out = tmp_path / "merged.json"
    result = _run(str(path), "--chrome", str(out), "--chrome-merge", str(profile_path))
    assert result.returncode == 0, result.stderr
    profile = json.loads(profile_path.read_text())
    merged = json.loads(out.read_text())
    theirs = profile["traceEvents"]
    assert merged["traceEvents"][: len(theirs)] == theirs
    assert {k: v for k, v in merged.items() if k not in ("traceEvents", "fakegrad_patch")} == {
        k: v for k, v in profile.items() if k != "traceEvents"
    }
    ours = merged["traceEvents"][len(theirs) :]
    pid = next(e["pid"] for e in theirs if e.get("name", "").startswith("fakegrad_patch::"))
    assert all(e["pid"] == pid for e in ours)  # the traced process is the profiled one
    assert not [e for e in ours if e["name"] == "process_name"]  # its name is the profiler's
    assert all(e["tid"] >= 10**9 for e in ours)  # never one of its OS thread ids
    materialize = {
        e["name"].removeprefix("fakegrad_patch::materialize: "): e
        for e in theirs
        if e.get("ph") == "X" and e["name"].startswith("fakegrad_patch::materialize: ")
    }
    sets = [e for e in ours if e["name"] == "fake_grad_set"]
    assert len(sets) == 8  # the unprofiled step, then the profiled one
    profiled = sets[4:]
    assert (
        {e["args"]["name"] for e in profiled}
        == set(materialize)
        == {
            "net.0.weight",
            "net.0.bias",
            "net.1.weight",
            "net.1.bias",
        }
    )
    for event in profiled:
        span = materialize[event["args"]["name"]]
        # Two clocks (the trace's wall clock, read when the event is written; the profiler's, read
        # when its range opens): the same interception within 50 ms. A preemption between the two
        # reads on a loaded 2-core CI machine reached 5.7 ms; a wrong time base (the profile's
        # base ignored, a unit slip) is off by seconds to years.
        assert abs(event["ts"] - span["ts"]) < 50_000, (event, span)
    # without a profile the same events are on the Unix epoch: the shift is the profile's base
    plain = tmp_path / "plain.json"
    assert _run(str(path), "--chrome", str(plain)).returncode == 0
    plain_sets = [
        e for e in validate(json.loads(plain.read_text())) if e["name"] == "fake_grad_set"
    ]
    base_us = profile.get("baseTimeNanoseconds", 0) / 1000
    for a, b in zip(plain_sets, sets, strict=True):
        assert a["ts"] - base_us == pytest.approx(b["ts"], abs=0.5)  # doubles near 1.8e15 µs


def test_merge_needs_a_chrome_output_and_a_chrome_trace(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text(_line("patch_installed", "2026-11-30T22:23:41.231261Z") + "\n")
    assert _run(str(trace), "--chrome-merge", str(trace)).returncode == 2  # usage error
    bad = tmp_path / "bad.json"
    bad.write_text('{"no": "events"}')
    result = _run(str(trace), "--chrome", str(tmp_path / "o.json"), "--chrome-merge", str(bad))
    assert result.returncode == 2 and "cannot merge" in result.stderr
    assert not (tmp_path / "o.json").exists()
