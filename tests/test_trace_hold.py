"""Issue 46.6: what the trace at ``info`` costs a traced step, and what must not change for it.

Two savings, each with the behaviour that must stay what it was:

* the memory buffer keeps an owned event (the hot paths': a materialized gradient, a repaired
  conversion) as a compact record while nothing else wants it, and ``events()`` spreads it out:
  the same dict, key order and values as the envelope the pipeline builds otherwise;
* the JSONL file sink holds a thread's lines during one outermost op of a propagating mode and
  one armed backward call, and writes them (rendered then) with one ``os.write`` when it ends:
  the same bytes, in the same order, nothing lost (nested holds, other threads, a sink replaced
  while lines are held, an exception inside the op, the cap on held lines).
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import fakegrad_patch
from fakegrad_patch import trace
from fakegrad_patch.trace import _pipeline, _sinks


def _owned(i: int) -> dict[str, Any]:
    return {"leaf_id": i, "name": f"p{i}", "shape": [i, 2], "dtype": "float32", "bytes": 8 * i}


def _lines(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines()]


class _Writes:
    """The ``os.write`` calls made on the configured file sink's descriptor."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[bytes] = []
        real = os.write

        def write(fd: int, data: Any) -> int:
            sink = _pipeline.sink
            if isinstance(sink, _sinks.FileSink) and fd == sink._fd:
                self.calls.append(bytes(data))
            return real(fd, data)

        monkeypatch.setattr(_sinks.os, "write", write)


# -- the memory buffer's records -----------------------------------------------------------------


def test_an_owned_event_kept_as_a_record_reads_back_as_the_envelope_would_be(
    restore_trace: None,
) -> None:
    trace.configure_trace(path=None, level="info")
    trace.clear()
    before = time.time()
    trace.emit_fields("fake_grad_set", trace.INFO, _owned(3), owned=True)
    after = time.time()
    assert type(_pipeline.buffer[-1]) is tuple  # the compact form: nothing else wanted it
    with trace.capture("info") as captured:  # a capture block: the dict path, for comparison
        trace.emit_fields("fake_grad_set", trace.INFO, _owned(3), owned=True)
    record, full = trace.events()[-2:]
    assert type(_pipeline.buffer[-1]) is dict
    assert list(record) == list(full) == list(captured[0])
    assert {k: v for k, v in record.items() if k != "timestamp"} == {
        k: v for k, v in full.items() if k != "timestamp"
    }
    assert record["event"] == "fake_grad_set" and record["level"] == "info"
    assert record["pid"] == os.getpid() and record["tid"] == threading.get_ident()
    stamp = time.mktime(time.strptime(record["timestamp"][:19], "%Y-%m-%dT%H:%M:%S"))
    stamp -= time.timezone if time.daylight == 0 else time.altzone
    stamp += int(record["timestamp"][20:26]) / 1e6
    assert before - 1e-3 <= stamp <= after + 1e-3, (before, record["timestamp"], after)
    # each call of events() gives fresh dicts
    first = trace.events()[-2]
    first["event"] = "changed"
    assert trace.events()[-2]["event"] == "fake_grad_set"


def test_records_and_dicts_share_the_buffer_in_order_and_within_its_size(
    restore_trace: None,
) -> None:
    trace.configure_trace(path=None, level="info", buffer_size=5)
    trace.clear()
    for i in range(8):
        if i % 2:
            trace.emit("plain_event", trace.INFO, leaf_id=i)  # keywords: the dict path
        else:
            trace.emit_fields("owned_event", trace.INFO, _owned(i), owned=True)
    got = trace.events()
    assert [e["leaf_id"] for e in got] == [3, 4, 5, 6, 7]
    assert [e["event"] for e in got] == ["plain_event", "owned_event"] * 2 + ["plain_event"]


def test_a_record_below_the_level_is_not_kept(restore_trace: None) -> None:
    trace.configure_trace(path=None, level="warning")
    trace.clear()
    trace.emit_fields("fake_grad_set", trace.INFO, _owned(1), owned=True)
    assert trace.events() == []


# -- held lines ------------------------------------------------------------------------------------


def test_held_lines_are_written_at_release_in_one_write_with_the_same_bytes(
    tmp_path: Path, restore_trace: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "t.jsonl"
    trace.configure_trace(path=str(path), level="info")
    writes = _Writes(monkeypatch)
    trace.emit("opened", trace.INFO)  # opens the file
    held = trace.hold()
    assert held is not None
    for i in range(5):
        trace.emit_fields("fake_grad_set", trace.INFO, _owned(i), owned=True)
    trace.emit("fake_grad_drop", trace.WARNING, leaf_id=9)  # any level: held with the rest
    assert len(_lines(path)) == 1  # nothing of the held ones yet
    trace.release(held)
    lines = _lines(path)
    assert [e["event"] for e in lines] == ["opened"] + ["fake_grad_set"] * 5 + ["fake_grad_drop"]
    assert len(writes.calls) == 2  # "opened", then the held group
    # the same bytes as the pipeline renders for each event
    expected = b"".join(_pipeline.render_line(e) for e in trace.events()[-6:])
    assert writes.calls[1] == expected


def test_holds_nest_and_the_outermost_release_writes(
    tmp_path: Path, restore_trace: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "t.jsonl"
    trace.configure_trace(path=str(path), level="info")
    writes = _Writes(monkeypatch)
    outer = trace.hold()
    trace.emit("a", trace.INFO)
    inner = trace.hold()
    trace.emit("b", trace.INFO)
    trace.release(inner)
    assert _lines(path) == []
    trace.emit("c", trace.INFO)
    trace.release(outer)
    assert [e["event"] for e in _lines(path)] == ["a", "b", "c"]
    assert len(writes.calls) == 1


def test_a_thread_holds_only_its_own_lines(tmp_path: Path, restore_trace: None) -> None:
    path = tmp_path / "t.jsonl"
    trace.configure_trace(path=str(path), level="info")
    held = trace.hold()
    trace.emit("mine", trace.INFO)
    other = threading.Thread(target=trace.emit, args=("theirs", trace.INFO))
    other.start()
    other.join()
    assert [e["event"] for e in _lines(path)] == ["theirs"]  # written at once
    trace.release(held)
    assert [e["event"] for e in _lines(path)] == ["theirs", "mine"]


def test_many_held_lines_are_written_in_groups_of_the_cap(
    tmp_path: Path, restore_trace: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "t.jsonl"
    trace.configure_trace(path=str(path), level="info")
    writes = _Writes(monkeypatch)
    cap = _sinks.HOLD_MAX_LINES
    held = trace.hold()
    for i in range(cap + 3):
        trace.emit_fields("e", trace.INFO, {"i": i}, owned=True)
    assert len(_lines(path)) == cap  # the first group, written when the cap was reached
    trace.release(held)
    assert [e["i"] for e in _lines(path)] == list(range(cap + 3))
    assert len(writes.calls) == 2


def test_replacing_the_sink_writes_what_is_held_and_the_hold_goes_on(
    tmp_path: Path, restore_trace: None
) -> None:
    first, second = tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    trace.configure_trace(path=str(first), level="info")
    held = trace.hold()
    trace.emit("before", trace.INFO)
    trace.configure_trace(path=str(second))  # the old sink closes: its held lines written
    assert [e["event"] for e in _lines(first)] == ["before"]
    trace.emit("after", trace.INFO)  # the new sink: this thread holds nothing there
    assert [e["event"] for e in _lines(second)] == ["after"]
    trace.release(held)  # the old sink's hold ends: nothing left, nothing lost, no error
    assert [e["event"] for e in _lines(first)] == ["before"]


@pytest.mark.parametrize("path", [None, "-"], ids=["no sink", "stderr"])
def test_nothing_is_held_where_the_sink_is_not_a_file(
    path: str | None, restore_trace: None, capsys: pytest.CaptureFixture[str]
) -> None:
    trace.configure_trace(path=path, level="info")
    assert trace.file_sink_on is False
    held = trace.hold()
    assert held is None
    trace.emit("at_once", trace.INFO)
    if path == "-":
        assert "at_once" in capsys.readouterr().err  # not held: written as it happens
    trace.release(held)


def test_a_failed_file_sink_holds_nothing(tmp_path: Path, restore_trace: None) -> None:
    target = tmp_path / "a_directory"
    target.mkdir()
    trace.configure_trace(path=str(target), level="info")
    with pytest.warns(UserWarning):
        trace.emit("first", trace.INFO)  # the sink fails (a directory) and stays off
    assert trace.hold() is None


# -- the patch's holds -------------------------------------------------------------------------


class _Leaves(torch.nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.leaves = torch.nn.ParameterList(
            torch.nn.Parameter(torch.randn(3, generator=gen)) for _ in range(n)
        )

    def forward(self) -> torch.Tensor:
        return torch.stack(list(self.leaves)).square().sum()


def test_an_armed_backward_writes_its_lines_once_when_it_returns(
    propagate: None, tmp_path: Path, restore_trace: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    with FakeTensorMode(allow_non_fake_inputs=True):
        _Leaves(1)().backward()  # the first need (probes and their events) before the trace
    path = tmp_path / "t.jsonl"
    trace.configure_trace(path=str(path), level="info")
    model = _Leaves(12)
    with FakeTensorMode(allow_non_fake_inputs=True):
        loss = model()
        writes = _Writes(monkeypatch)
        before = len(_lines(path))
        loss.backward()
        after = _lines(path)[before:]
    grads = [e for e in after if e["event"].startswith("fake_grad_")]
    if not grads:
        pytest.skip("this build writes real gradients itself: nothing is materialized")
    assert len(grads) == 12 and all(type(p.grad) is torch.Tensor for p in model.parameters())
    assert len(writes.calls) == 1, [c.count(b"\n") for c in writes.calls]
    assert {e["leaf_id"] for e in grads} == {id(p) for p in model.parameters()}


def test_one_op_converting_many_parameters_writes_its_lines_once(
    propagate: None, tmp_path: Path, restore_trace: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Upstream's path (``propagation="repair"``) converts all twelve in the one op (the fast
    path reads them directly: no conversion, nothing to repair)."""
    path = tmp_path / "t.jsonl"
    trace.configure_trace(path=str(path), level="info")
    model = _Leaves(12)
    writes = _Writes(monkeypatch)
    with fakegrad_patch.patched(propagation="repair"), FakeTensorMode(allow_non_fake_inputs=True):
        torch.stack(list(model.leaves))
    repaired = [e for e in _lines(path) if e["event"] == "d2_repaired"]
    if not repaired:
        pytest.skip("this build converts parameters with their values (no D2 repair to trace)")
    assert len(repaired) == 12
    assert len(writes.calls) == 1, [c.count(b"\n") for c in writes.calls]


def test_an_op_that_raises_still_writes_what_it_held(
    propagate: None, tmp_path: Path, restore_trace: None
) -> None:
    path = tmp_path / "t.jsonl"
    trace.configure_trace(path=str(path), level="info")
    trace.clear()
    model = _Leaves(4)
    with FakeTensorMode(allow_non_fake_inputs=True):
        with pytest.raises(RuntimeError):
            torch.cat([*model.leaves, torch.ones(2, 2)])  # converted, then the shapes disagree
        sink = _pipeline.sink
        assert isinstance(sink, _sinks.FileSink)
        assert not sink._held  # the op's hold ended with it
        torch.stack(list(model.leaves))
    # every event the buffer has reached the file, in the same order
    assert [e["event"] for e in _lines(path)] == [e["event"] for e in trace.events()]
