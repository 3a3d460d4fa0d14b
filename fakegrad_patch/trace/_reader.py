"""``python -m fakegrad_patch trace FILE...``: summarize JSONL trace files for a person or a script.

Problems come first (dropped gradients, FakeGradError, fake gradients left on leaves, gradients
without real values replaced by zeros, internal errors, skipped patches, failed trace sinks), then
one row per leaf, then what the patch itself did per process. Lines that are not JSON objects with
an ``event`` (broken) or that this reader does not know (unknown event or newer schema) are
counted and reported, never fatal; ``--strict`` turns them into exit code 1 (for tests and CI).

Standard library only and self-contained (this one file runs anywhere a trace file was copied
to: ``python _reader.py trace.jsonl``; no torch, no structlog, no wrapt). Built for big
traces: input is read in bounded chunks, never a whole line first (lines longer than
``MAX_LINE_BYTES`` are counted as broken), and memory grows with the leaves and processes shown,
not with the number of lines (backward passes are counted, not collected; every other tally is
capped at ``_MAX_DISTINCT`` distinct keys). Whatever comes from the file is escaped before it is
printed for a person, so a trace cannot send control sequences to the terminal.

Why it is long: it is one file on purpose, to run alone wherever a trace was copied. Sections: the
events it knows, the tallies (``Leaf``, ``Process``, ``Summary``), reading lines in bounded
chunks, the text report, the command line (and its Chrome-trace export).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, BinaryIO, TextIO

#: The newest schema this reader knows (fakegrad_patch.trace.SCHEMA_VERSION; a test keeps them
#: equal). Not imported: this module must not import anything of ours.
SCHEMA_VERSION = 1
#: Lines longer than this are counted as broken without being kept in memory.
MAX_LINE_BYTES = 1024 * 1024
_CHUNK = 64 * 1024
#: Distinct keys kept per tally (unknown event kinds, error messages...); the rest is summed
#: under ``_OTHER``.
_MAX_DISTINCT = 100
_OTHER = "(other)"
#: Exit code when standard output was closed early (``| head``): 128 + SIGPIPE, quietly.
EXIT_BROKEN_PIPE = 141

#: Every event kind this reader understands (docs/trace-schema.md).
KNOWN_EVENTS = frozenset(
    {
        "patch_installed",
        "patch_skipped",
        "patch_deferred",
        "patch_uninstalled",
        "defect_probed",
        "d2_repaired",
        "propagated_values_resynced",
        "standing_aside",
        "hooks_released",
        "zero_copy_calibrated",
        "leaf_armed",
        "leaf_released",
        "fake_grad_set",
        "fake_grad_accumulate",
        "fake_grad_drop",
        "fake_grad_error",
        "fake_grad_keep",
        "internal_error",
        "trace_sink_failed",
        # fake leaves: grad-copy repair, opt-in mirroring, materialize()
        "grad_copy_repaired",
        "mirrored",
        "materialized",
        # a mode converted Parameters unseen (D2 builds); DDP
        "mode_untrusted",
        "ddp_mode_seen",
        "ddp_skipped",
        # buffers="write_back"
        "write_back_enabled",
        "write_back_disabled",
        "write_back_unavailable",
        # torch.autograd.backward wrapped only while needed
        "backward_wrapper_installed",
        "backward_wrapper_removed",
        "buffer_written_back",
        "buffer_not_written_back",
        "propagation_mismatch",
        # what the patch does to propagation itself
        "propagation_rebuilt",
        "propagation_repaired",
        "propagation_fast",
        # in-place updates of real tensors inside the mode
        "update_lost",
        "optimizer_state_materialized",
        # lending: a parameter's bytes freed under its fakes by a caller the patch did not see
        "lent_values_lost",
    }
)
ACTIONS = ("set", "accumulate", "drop", "error", "keep")
_MAX_EXAMPLES = 5

#: Problem kind -> (what happened, in words). Order = order in the report.
_LEAF_PROBLEMS = {
    "error": "raised FakeGradError (on_missing='error'): no real values; the leaf kept its "
    "previous .grad",
    "drop": "dropped: the fake gradient had no real values (on_missing='drop'); the leaf kept "
    "its previous .grad",
    "keep": "left as a FakeTensor in .grad (on_missing='keep')",
    "zeros": "had no real values and was replaced by zeros (on_missing='zeros')",
}


def _tally(counter: Counter[str], key: str, n: int = 1) -> None:
    """``counter[key] += n`` for at most ``_MAX_DISTINCT`` distinct keys; the rest under
    ``_OTHER`` (a corrupt trace cannot make the summary grow with its lines)."""
    if key in counter or len(counter) < _MAX_DISTINCT:
        counter[key] += n
    else:
        counter[_OTHER] += n


class _Passes:
    """Counts backward passes without keeping their ids: graph task ids only grow within a
    process, so a pass is new when its id is above every id seen (exact for one trace read in
    order; passes running concurrently in threads can be undercounted). Ids that are not ints
    are counted when they change."""

    __slots__ = ("count", "last")

    def __init__(self) -> None:
        self.count = 0
        self.last: Any = None

    def see(self, backward_id: Any) -> bool:
        last = self.last
        if last is None or (
            backward_id > last
            if type(backward_id) is int and type(last) is int
            else backward_id != last
        ):
            self.count += 1
            self.last = backward_id
            return True
        return False


@dataclass(slots=True)
class Leaf:
    """What happened to one real leaf (key: pid + leaf_id) across the trace."""

    pid: Any
    leaf_id: Any
    name: str | None = None
    shape: list[Any] | None = None
    dtype: str | None = None
    device: str | None = None
    armed: int = 0
    released: int = 0
    arrived: int = 0
    actions: Counter[str] = field(default_factory=Counter)
    zeros: int = 0
    zero_copy: int = 0
    bytes: int = 0
    duration_us: float = 0.0
    passes: _Passes = field(default_factory=_Passes)

    def label(self) -> str:
        """For people: every part from the file escaped (the name as a repr)."""
        described = f"{self.shape} {_h(self.dtype)} {_h(self.device)}"
        return f"{_h(repr(self.name))} {described}" if self.name else described

    def problem_counts(self) -> dict[str, int]:
        counts = {kind: self.actions.get(kind, 0) for kind in ("error", "drop", "keep")}
        counts["zeros"] = self.zeros
        return {k: v for k, v in counts.items() if v}

    def as_dict(self) -> dict[str, Any]:
        return {
            "pid": self.pid,
            "leaf_id": self.leaf_id,
            "name": self.name,
            "shape": self.shape,
            "dtype": self.dtype,
            "device": self.device,
            "armed": self.armed,
            "released": self.released,
            "arrived": self.arrived,
            "actions": {a: self.actions.get(a, 0) for a in ACTIONS},
            "zeros": self.zeros,
            "zero_copy": self.zero_copy,
            "bytes": self.bytes,
            "duration_us": round(self.duration_us, 1),
            "backward_passes": self.passes.count,
            "problems": self.problem_counts(),
        }


@dataclass(slots=True)
class Process:
    """What the patch did in one process."""

    pid: Any
    torch: str | None = None
    installed: int = 0
    uninstalled: int = 0
    skipped: Counter[str] = field(default_factory=Counter)
    defects: dict[str, Any] = field(default_factory=dict)
    d2_repairs: int = 0
    grad_copy_repairs: int = 0
    #: buffers="write_back": real tensors written back, their bytes, and those not written
    buffers_written: int = 0
    buffer_bytes: int = 0
    buffers_not_written: int = 0
    #: in-place updates of real tensors that reached only a fake copy: (kind, op) -> count
    updates_lost: Counter[str] = field(default_factory=Counter)
    #: fakes whose lent values were freed under them (lending): how many storages
    values_lost: int = 0
    optimizer_states: int = 0
    #: ops whose outputs were made from the real kernel's; values repaired
    rebuilt: int = 0
    repaired: int = 0
    #: ops that took the fast path (debug-level events)
    fast: int = 0
    mirrored: int = 0
    materialize_calls: int = 0
    #: materialize() results without real values, by policy: (dropped, kept, missing) summed
    materialize_missing: Counter[str] = field(default_factory=Counter)
    internal_errors: Counter[str] = field(default_factory=Counter)
    sink_failures: Counter[str] = field(default_factory=Counter)
    passes: _Passes = field(default_factory=_Passes)

    def as_dict(self) -> dict[str, Any]:
        return {
            "pid": self.pid,
            "torch": self.torch,
            "installed": self.installed,
            "uninstalled": self.uninstalled,
            "skipped": list(self.skipped.elements()),
            "defects": self.defects,
            "d2_repairs": self.d2_repairs,
            "grad_copy_repairs": self.grad_copy_repairs,
            "buffers_written": self.buffers_written,
            "buffer_bytes": self.buffer_bytes,
            "buffers_not_written": self.buffers_not_written,
            "updates_lost": dict(self.updates_lost),
            "optimizer_states_materialized": self.optimizer_states,
            "ops_rebuilt": self.rebuilt,
            "values_repaired": self.repaired,
            "ops_fast": self.fast,
            "mirrored": self.mirrored,
            "materialize_calls": self.materialize_calls,
            "materialize_missing": dict(self.materialize_missing),
            "internal_errors": dict(self.internal_errors),
            "sink_failures": dict(self.sink_failures),
        }


@dataclass
class Summary:
    """Everything the report says; built by :meth:`add` one parsed event at a time."""

    files: list[str] = field(default_factory=list)
    unreadable: list[str] = field(default_factory=list)
    events: int = 0
    by_event: Counter[str] = field(default_factory=Counter)
    broken: int = 0
    broken_examples: list[str] = field(default_factory=list)
    unknown: int = 0
    unknown_events: Counter[str] = field(default_factory=Counter)
    leaves: dict[tuple[Any, Any], Leaf] = field(default_factory=dict)
    processes: dict[Any, Process] = field(default_factory=dict)
    too_long: int = 0

    # -- ingest ---------------------------------------------------------------------------------

    def add_broken(self, where: str) -> None:
        self.broken += 1
        if len(self.broken_examples) < _MAX_EXAMPLES:
            self.broken_examples.append(where)

    def add_line(self, line: str | bytes, where: str) -> None:
        text = line.strip()
        if not text:
            return
        try:
            record = json.loads(text)
        except (ValueError, RecursionError, MemoryError):  # deep nesting: a broken line too
            record = None
        if not isinstance(record, dict) or not isinstance(record.get("event"), str):
            self.add_broken(where)
            return
        event = record["event"]
        schema = record.get("schema")
        if (
            event not in KNOWN_EVENTS
            or type(schema) is not int
            or schema > SCHEMA_VERSION
            or schema < 1
        ):
            self.unknown += 1
            schema_text = schema if type(schema) in (int, str, float, bool) else "?"
            _tally(self.unknown_events, f"{event[:200]} (schema {schema_text!s:.20})")
            return
        if not _well_typed(record):  # right event, wrong field types
            self.add_broken(where)
            return
        self.add(record)

    def _process(self, pid: Any) -> Process:
        proc = self.processes.get(pid)
        if proc is None:
            proc = self.processes[pid] = Process(pid)
        return proc

    def _leaf(self, record: dict[str, Any]) -> Leaf:
        key = (record.get("pid"), record.get("leaf_id"))
        leaf = self.leaves.get(key)
        if leaf is None:
            leaf = self.leaves[key] = Leaf(*key)
        for attr in ("name", "shape", "dtype", "device"):
            value = record.get(attr)
            if value is not None:
                setattr(leaf, attr, value)
        return leaf

    def add(self, record: dict[str, Any]) -> None:
        event = record["event"]
        self.events += 1
        self.by_event[event] += 1
        pid = record.get("pid")
        proc = self._process(pid)
        if event == "leaf_armed":
            self._leaf(record).armed += 1
        elif event == "leaf_released":
            self._leaf(record).released += 1
        elif event.startswith("fake_grad_"):
            leaf = self._leaf(record)
            leaf.arrived += 1
            leaf.actions[event.removeprefix("fake_grad_")] += 1
            leaf.zeros += record.get("source") == "zeros"
            leaf.zero_copy += bool(record.get("zero_copy"))
            leaf.bytes += int(record.get("bytes") or 0)
            leaf.duration_us += float(record.get("duration_us") or 0.0)
            backward_id = record.get("backward_id")
            if backward_id is not None:
                leaf.passes.see(backward_id)
                proc.passes.see(backward_id)
        elif event == "patch_installed":
            proc.installed += 1
            proc.torch = record.get("torch", proc.torch)
            for defect, present in (record.get("defects") or {}).items():
                self._defect(proc, defect, present)
        elif event == "patch_skipped":
            proc.torch = record.get("torch", proc.torch)
            _tally(proc.skipped, str(record.get("reason")))
        elif event == "patch_uninstalled":
            proc.uninstalled += 1
        elif event == "defect_probed":
            self._defect(proc, str(record.get("defect")), record.get("present"))
        elif event == "d2_repaired":
            proc.d2_repairs += 1
        elif event == "grad_copy_repaired":
            proc.grad_copy_repairs += 1
        elif event == "buffer_written_back":
            proc.buffers_written += 1
            nbytes = record.get("bytes")
            if type(nbytes) is int and nbytes > 0:
                proc.buffer_bytes += nbytes
        elif event == "buffer_not_written_back":
            proc.buffers_not_written += 1
        elif event == "update_lost":
            name = record.get("name")
            what = f"{record.get('kind')} {name}" if name else str(record.get("kind"))
            _tally(proc.updates_lost, f"{what} ({record.get('op')})")
        elif event == "lent_values_lost":
            proc.values_lost += 1
        elif event == "optimizer_state_materialized":
            proc.optimizer_states += 1
        elif event == "propagation_rebuilt":
            proc.rebuilt += 1
        elif event == "propagation_repaired":
            proc.repaired += 1
        elif event == "propagation_fast":
            proc.fast += 1
        elif event == "mirrored":
            proc.mirrored += 1
        elif event == "materialized":
            proc.materialize_calls += 1
            missing = int(record.get("missing") or 0)
            if missing:
                _tally(proc.materialize_missing, str(record.get("policy")), missing)
        elif event == "internal_error":
            _tally(proc.internal_errors, f"{record.get('where')}: {record.get('error')}")
        elif event == "trace_sink_failed":
            _tally(proc.sink_failures, f"{record.get('path')}: {record.get('error')}")

    @staticmethod
    def _defect(proc: Process, defect: str, present: Any) -> None:
        if defect in proc.defects or len(proc.defects) < _MAX_DISTINCT:
            proc.defects[defect] = present

    # -- results --------------------------------------------------------------------------------

    def problems(self) -> list[dict[str, Any]]:
        """Every problem, most serious first."""
        out: list[dict[str, Any]] = []
        for pid, proc in self.processes.items():
            out += [
                {"kind": "patch_skipped", "pid": pid, "count": n, "detail": reason}
                for reason, n in proc.skipped.items()
            ]
            out += [
                {"kind": "internal_error", "pid": pid, "count": n, "detail": detail}
                for detail, n in proc.internal_errors.items()
            ]
        for kind, words in _LEAF_PROBLEMS.items():
            for leaf in self.leaves.values():
                count = leaf.problem_counts().get(kind, 0)
                if count:
                    out.append(
                        {
                            "kind": kind,
                            "pid": leaf.pid,
                            "leaf_id": leaf.leaf_id,
                            "leaf": leaf.label(),
                            "count": count,
                            "detail": words,
                        }
                    )
        for pid, proc in self.processes.items():
            out += [
                {
                    "kind": "update_lost",
                    "pid": pid,
                    "count": n,
                    "detail": f"in-place update of a real {what} reached only its fake copy "
                    "(buffers='write_back', or make it outside the mode)",
                }
                for what, n in proc.updates_lost.items()
            ]
            if proc.values_lost:
                out.append(
                    {
                        "kind": "lent_values_lost",
                        "pid": pid,
                        "count": proc.values_lost,
                        "detail": "a parameter's storage was resized or moved by a C++ caller "
                        "while fakes read its bytes: their values became NaN",
                    }
                )
        for pid, proc in self.processes.items():
            out += [
                {
                    "kind": "materialize_missing",
                    "pid": pid,
                    "count": n,
                    "detail": f"materialize() met FakeTensors without real values "
                    f"(on_missing={policy!r})",
                }
                for policy, n in proc.materialize_missing.items()
            ]
        for pid, proc in self.processes.items():
            out += [
                {"kind": "trace_sink_failed", "pid": pid, "count": n, "detail": detail}
                for detail, n in proc.sink_failures.items()
            ]
        return out

    def leaf_rows(self) -> list[Leaf]:
        """Leaves that received fake gradients; those with problems first."""
        rows = [leaf for leaf in self.leaves.values() if leaf.arrived]
        return sorted(rows, key=lambda leaf: not leaf.problem_counts())

    def as_dict(self) -> dict[str, Any]:
        armed_only = sum(1 for leaf in self.leaves.values() if not leaf.arrived)
        return {
            "schema": SCHEMA_VERSION,
            "files": self.files,
            "unreadable_files": self.unreadable,
            "events": self.events,
            "by_event": dict(self.by_event),
            "processes": len(self.processes),
            "backward_passes": sum(proc.passes.count for proc in self.processes.values()),
            "problems": self.problems(),
            "leaves": [leaf.as_dict() for leaf in self.leaf_rows()],
            "armed_without_fake_grad": armed_only,
            "patch": [proc.as_dict() for proc in self.processes.values()],
            "broken_lines": self.broken,
            "too_long_lines": self.too_long,
            "broken_examples": self.broken_examples,
            "unknown_lines": self.unknown,
            "unknown_events": dict(self.unknown_events),
        }


_NUMBER = (int, float)
_SCALAR = (str, int, float, bool)
#: key -> accepted types (None is accepted everywhere: "not known"). Everything the summary adds
#: up, keys on or prints: a line with another type is broken, so nothing nested ever reaches
#: ``str()`` (a deeply nested value would recurse) or the report.
_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "pid": (int, str),
    "leaf_id": (int, str),
    "backward_id": (int, str),
    "bytes": (int,),
    "duration_us": _NUMBER,
    "zero_copy": (bool,),
    "shape": (list,),
    "defects": (dict,),
    "hooks_removed": (int,),
    "missing": (int,),
    "name": (str,),
    "dtype": (str,),
    "device": (str,),
    "torch": (str,),
    "reason": (str,),
    "where": (str,),
    "error": (str,),
    "path": (str,),
    "policy": (str,),
    "source": (str,),
    "action": (str,),
    "defect": (str,),
    "present": (bool,),
}


def _well_typed(record: dict[str, Any]) -> bool:
    """Fields the summary adds up, keys on or prints have the documented types (checked before
    any counting, so a bad line never leaves half its effect)."""
    for key, types in _FIELD_TYPES.items():
        value = record.get(key)
        if value is None:
            continue
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            return False
    shape = record.get("shape")
    if shape is not None and not all(type(d) is int for d in shape):
        return False
    defects = record.get("defects")
    if defects is not None and not all(
        value is None or isinstance(value, _SCALAR) for value in defects.values()
    ):
        return False
    event = record["event"]
    action = record.get("action")
    return not (  # the action is the event's: fake_grad_set says "set"
        action is not None
        and event.startswith("fake_grad_")
        and action != event.removeprefix("fake_grad_")
    )


def _chunks_of(stream: BinaryIO | TextIO) -> Iterator[bytes]:
    # read1: what is there (a pipe or terminal is summarized as it comes), at most _CHUNK
    read = getattr(stream, "read1", stream.read)
    while True:
        chunk = read(_CHUNK)
        if not chunk:
            return
        yield chunk if isinstance(chunk, bytes) else chunk.encode("utf-8", "surrogatepass")


def _lines(chunks: Iterable[bytes], max_line: int) -> Iterator[bytes | None]:
    """Lines (bytes, newline removed) from chunks, never holding more than ``max_line`` bytes of
    one line: a longer line is skipped to its end and given as ``None``."""
    pending = bytearray()
    skipping = False
    for chunk in chunks:
        start = 0
        while True:
            end = chunk.find(b"\n", start)
            if end < 0:
                if not skipping:
                    pending += chunk[start:]
                    if len(pending) > max_line:
                        pending.clear()
                        skipping = True
                break
            if skipping:
                skipping = False
                yield None
            elif pending:
                pending += chunk[start:end]
                line = bytes(pending)
                pending.clear()
                yield None if len(line) > max_line else line
            else:
                yield None if end - start > max_line else chunk[start:end]
            start = end + 1
    if skipping:
        yield None
    elif pending:
        yield bytes(pending)


def _open(path: str) -> tuple[BinaryIO | TextIO, bool]:
    """(stream, close it when done); ``-`` is stdin, read as bytes when it can be."""
    if path == "-":
        stdin = sys.stdin
        if stdin is None:
            raise OSError(9, "standard input is closed")
        return getattr(stdin, "buffer", stdin), False
    return open(path, "rb"), True


def summarize(paths: Iterable[str], max_line: int = MAX_LINE_BYTES) -> Summary:
    """Read every file (``-`` is stdin); unreadable files are recorded, not raised."""
    summary = Summary()
    for path in paths:
        try:
            stream, owned = _open(path)
            try:
                for number, line in enumerate(_lines(_chunks_of(stream), max_line), 1):
                    if line is None:
                        summary.too_long += 1
                        summary.add_broken(f"{path}:{number}")
                    else:
                        summary.add_line(line.decode("utf-8", "replace"), f"{path}:{number}")
            finally:
                if owned:
                    stream.close()
        except (OSError, ValueError) as exc:  # ValueError: a NUL in the path
            summary.unreadable.append(f"{path}: {getattr(exc, 'strerror', None) or exc}")
            continue
        summary.files.append(path)
    return summary


def _h(value: Any) -> str:
    """``value`` as text for a person: characters that are not printable (ESC, BEL, other
    controls, bidi overrides) as ``\\xNN``/``\\uNNNN`` escapes."""
    text = value if isinstance(value, str) else str(value)
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


# -- text report ----------------------------------------------------------------------------------


def _human_bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"  # pragma: no cover


def _plural(n: int, word: str, plural: str | None = None) -> str:
    if n == 1:
        return f"{n} {word}"
    return f"{n} {plural or (word + 'es' if word.endswith('s') else word + 's')}"


def render_text(summary: Summary, out: TextIO) -> None:
    """The human report (format documented in docs/trace-schema.md)."""
    data = summary.as_dict()
    w = out.write
    w(
        f"fakegrad_patch trace: {_plural(len(summary.files), 'file')}, "
        f"{_plural(summary.events, 'event')}, {_plural(data['processes'], 'process')}, "
        f"{_plural(data['backward_passes'], 'backward pass')}\n"
    )
    problems = data["problems"]
    w(f"\nPROBLEMS ({len(problems)})\n" if problems else "\nPROBLEMS: none\n")
    for p in problems:
        pid = _h(p["pid"])
        where = f"{p['leaf']} (pid {pid})" if "leaf" in p else f"pid {pid}"
        w(f"  ! {p['kind']} x{p['count']}: {where}: {_h(p['detail'])}\n")

    rows = summary.leaf_rows()
    w(f"\nLEAVES ({len(rows)} received fake gradients)\n")
    if rows:
        header = ("pid", "leaf", "arrived", "set", "accum", "drop", "error", "keep", "zeros")
        w(
            f"  {header[0]:<8} {header[1]:<36}"
            + "".join(f" {h:>7}" for h in header[2:])
            + f" {'zero-copy':>9} {'bytes copied':>13}\n"
        )
        for leaf in rows:
            counts = [leaf.arrived, *(leaf.actions.get(a, 0) for a in ACTIONS), leaf.zeros]
            mark = "!" if leaf.problem_counts() else " "
            w(
                f"{mark} {_h(leaf.pid):<8} {leaf.label():<36}"
                + "".join(f" {c:>7}" for c in counts)
                + f" {leaf.zero_copy:>9} {_human_bytes(leaf.bytes):>13}\n"
            )
    if data["armed_without_fake_grad"]:
        armed = _plural(data["armed_without_fake_grad"], "leaf", "leaves")
        w(f"  ({armed} armed but no fake gradient arrived: forward-only fake runs)\n")

    w("\nPATCH\n")
    for proc in summary.processes.values():
        state = []
        if proc.installed:
            state.append(f"installed x{proc.installed}")
        if proc.skipped:
            state.append(f"SKIPPED x{sum(proc.skipped.values())}")
        if proc.uninstalled:
            state.append(f"uninstalled x{proc.uninstalled}")
        defects = ", ".join(
            f"{_h(k)}={'present' if v else 'absent'}" for k, v in sorted(proc.defects.items())
        )
        w(
            f"  pid {_h(proc.pid)}: torch {_h(proc.torch or '?')}; "
            f"{', '.join(state) or 'no patch events'}"
            f"; defects: {defects or 'none probed'}; D2 repairs: {proc.d2_repairs}\n"
        )
        extras = [
            f"{label}: {n}"
            for label, n in (
                ("grad-copy repairs", proc.grad_copy_repairs),
                ("buffers written back", proc.buffers_written),
                ("bytes written back", proc.buffer_bytes),
                ("buffers NOT written back", proc.buffers_not_written),
                ("updates lost", sum(proc.updates_lost.values())),
                ("optimizer states made real", proc.optimizer_states),
                ("ops from the real kernel's outputs", proc.rebuilt),
                ("propagated values repaired", proc.repaired),
                ("ops on the fast path", proc.fast),
                ("mirrored", proc.mirrored),
                ("materialize() calls", proc.materialize_calls),
            )
            if n
        ]
        if extras:
            w(f"    {'; '.join(extras)}\n")

    if summary.broken or summary.unknown or summary.unreadable:
        w("\nTRACE INPUT ISSUES\n")
        for item in summary.unreadable:
            w(f"  unreadable file: {_h(item)}\n")
        if summary.broken:
            too_long = (
                f", {summary.too_long} longer than {_human_bytes(MAX_LINE_BYTES)}"
                if summary.too_long
                else ""
            )
            w(
                f"  {_plural(summary.broken, 'broken line')} (not a JSON object with an 'event'"
                f"{too_long}): {_h(', '.join(summary.broken_examples))}"
                + (" ..." if summary.broken > len(summary.broken_examples) else "")
                + "\n"
            )
        if summary.unknown:
            kinds = ", ".join(f"{_h(k)} x{n}" for k, n in summary.unknown_events.most_common())
            w(f"  {_plural(summary.unknown, 'unknown line')}: {kinds}\n")


def main(argv: list[str]) -> int:
    """Exit codes: 0 normally; 1 with ``--strict`` when some line was broken or unknown; 2 when a
    file could not be read; 141 (quietly) when standard output was closed early (``| head``)."""
    parser = argparse.ArgumentParser(
        prog="python -m fakegrad_patch trace",
        description="Summarize fakegrad_patch trace files (JSONL, FAKEGRAD_TRACE=path). "
        "Problems are listed first.",
    )
    parser.add_argument("files", nargs="+", metavar="FILE", help="trace file(s); - for stdin")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.add_argument(
        "--strict", action="store_true", help="exit 1 when any line is broken or unknown"
    )
    parser.add_argument(
        "--chrome",
        metavar="OUT",
        help="write the trace as Chrome trace-event JSON to OUT (Perfetto, chrome://tracing) "
        "instead of the summary",
    )
    parser.add_argument(
        "--chrome-merge",
        metavar="PROFILE",
        help="with --chrome: merge into this torch.profiler Chrome export (its events first, "
        "ours on its time base, in its processes)",
    )
    args = parser.parse_args(argv)
    if args.chrome_merge is not None and args.chrome is None:
        parser.error("--chrome-merge needs --chrome OUT")
    if args.chrome is not None:
        return _main_chrome(args.files, args.chrome, args.strict, args.chrome_merge)
    summary = summarize(args.files)
    out = sys.stdout
    try:
        if out is not None:
            with contextlib.suppress(AttributeError):
                out.reconfigure(errors="backslashreplace")  # type: ignore[union-attr]
            if args.json:  # ensure_ascii: control characters are \u escapes
                json.dump(summary.as_dict(), out, indent=2, default=str)
                out.write("\n")
            else:
                render_text(summary, out)
            out.flush()
    except BrokenPipeError:
        _silence_stdout()
        return EXIT_BROKEN_PIPE
    for item in summary.unreadable:
        with contextlib.suppress(OSError):
            print(f"fakegrad_patch trace: cannot read {_h(item)}", file=sys.stderr)
    if summary.unreadable:
        return 2
    if args.strict and (summary.broken or summary.unknown):
        return 1
    return 0


def _file_lines(path: str, max_line: int = MAX_LINE_BYTES) -> Iterator[bytes | None]:
    """The lines of one file (``-``: stdin) as :func:`summarize` reads them."""
    stream, owned = _open(path)
    try:
        yield from _lines(_chunks_of(stream), max_line)
    finally:
        if owned:
            stream.close()


def _main_chrome(files: list[str], destination: str, strict: bool, merge: str | None = None) -> int:
    """``--chrome OUT``: the timeline export (trace/_chrome.py); exit codes as for the summary."""
    try:
        from . import _chrome
    except ImportError:  # this file run on its own, _chrome.py next to it
        import _chrome  # type: ignore[no-redef]
    profile = None
    if merge is not None:
        try:
            profile = _chrome.load_profile(merge)
        except (OSError, ValueError) as exc:  # ValueError: not JSON, not a Chrome trace
            with contextlib.suppress(OSError):
                print(
                    f"fakegrad_patch trace: cannot merge into {_h(merge)}: {_h(exc)}",
                    file=sys.stderr,
                )
            return 2
    try:
        stats = _chrome.export_to(files, destination, _file_lines, profile)
    except OSError as exc:
        with contextlib.suppress(OSError):
            print(
                f"fakegrad_patch trace: cannot write {_h(destination)}: {_h(exc)}", file=sys.stderr
            )
        return 2
    skipped = f", {stats.skipped} lines skipped" if stats.skipped else ""
    with contextlib.suppress(OSError):
        print(
            f"fakegrad_patch trace: wrote {_h(destination)}: {stats.slices} slices, "
            f"{stats.instants} instants, {stats.processes} processes, {stats.threads} threads"
            f"{skipped} (open it in https://ui.perfetto.dev or chrome://tracing)",
            file=sys.stderr,
        )
        for item in stats.unreadable:
            print(f"fakegrad_patch trace: cannot read {_h(item)}", file=sys.stderr)
    if stats.unreadable:
        return 2
    return 1 if strict and stats.skipped else 0


def _silence_stdout() -> None:
    """The reader of our output went away: point stdout at /dev/null so the interpreter's final
    flush does not print 'Exception ignored ... BrokenPipeError'."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):
        return
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, fd)
        os.close(devnull)
    except OSError:
        pass


if __name__ == "__main__":  # the file on its own: python _reader.py trace.jsonl
    sys.exit(main(sys.argv[1:]))
