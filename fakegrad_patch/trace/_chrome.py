"""``python -m fakegrad_patch trace FILE... --chrome OUT``: a trace as a timeline (Chrome JSON).

Writes the JSONL trace files (rotated pairs oldest first: ``run.jsonl.1 run.jsonl``) as one
Chrome trace-event JSON object (``{"traceEvents": [...]}``), which Perfetto
(https://ui.perfetto.dev), ``chrome://tracing`` and ``edge://tracing`` open, next to a
``torch.profiler`` export of the same run (both put ``ts`` in microseconds since the Unix epoch):

* one track per process and thread: ``M`` metadata events name each process
  (``fakegrad_patch pid N``) and thread (``thread <threading.get_ident()>``); thread ids are
  numbered 1, 2, ... per process in the order they appear (Python's thread identifiers do not fit
  the 32 bits viewers keep), the real identifier is in the thread's name;
* an event with ``duration_us`` (``fake_grad_*``, ``materialized``) is a complete slice
  (``ph: "X"``) that ends at its ``timestamp`` (written when the interception finished) and lasts
  ``duration_us``: ``ts = timestamp - duration_us``, ``dur = duration_us``;
* every other event is a thread-scoped instant (``ph: "i"``, ``s: "t"``) at its ``timestamp``;
* a slice's or instant's ``name`` is the event kind (``fake_grad_set``), its ``cat``
  ``fakegrad_patch``, its ``args`` every other key of the event (``name`` of the parameter,
  ``shape``, ``bytes``, ``zero_copy``, ``backward_id``, ``level``...).

Streamed: lines are read in bounded chunks (the reader's own line splitter) and each event is
written as soon as it is read, so memory grows with the processes and threads seen, not with the
trace. The output is written to ``OUT.tmp`` and renamed over ``OUT`` at the end: a failed export
never leaves half a file. Events appear in the order of the input; within one thread, that is the
order they were emitted in, so each track's timestamps are non-decreasing (viewers sort anyway).
Lines that are not JSON objects with an ``event``, or without a usable ``pid``, ``tid`` and
``timestamp``, are skipped and counted.

Standard library only and importing nothing of ours, like the reader: ``_reader.py``'s ``main``
imports it for ``--chrome`` and hands it the reader's own bounded line splitter (next to a copied
``_reader.py`` it works as ``python _reader.py run.jsonl --chrome out.json``).
"""

from __future__ import annotations

import calendar
import contextlib
import json
import os
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, TextIO

CATEGORY = "fakegrad_patch"
#: Keys of the envelope that become the slice's own fields (ts, pid, tid, name), not its args.
_ENVELOPE = frozenset({"event", "timestamp", "pid", "tid", "schema"})
#: Distinct threads numbered per export; a corrupt trace with more shares one last track.
_MAX_THREADS = 10_000
#: The key and name of that shared track.
_OTHER_THREADS = "(other threads)"
#: Merged into a torch.profiler export, our thread ids start here (its are OS thread ids, far below)
_MERGED_TID_BASE = 1_000_000_000


@dataclass
class ChromeStats:
    """What one export wrote and skipped."""

    lines: int = 0
    slices: int = 0
    instants: int = 0
    skipped: int = 0
    processes: int = 0
    threads: int = 0
    unreadable: list[str] = field(default_factory=list)
    skipped_examples: list[str] = field(default_factory=list)


class _Clock:
    """``2026-11-30T21:54:22.081334Z`` -> microseconds since the epoch (int); the date and time of
    day are converted once per second, like the writer formats them."""

    def __init__(self) -> None:
        self._prefix = ""
        self._seconds = 0

    def micros(self, text: Any) -> int | None:
        if type(text) is not str or len(text) != 27 or text[19] != "." or text[26] != "Z":
            return None
        fraction = text[20:26]
        if not fraction.isdigit():
            return None
        prefix = text[:19]
        if prefix != self._prefix:
            try:
                parsed = time.strptime(prefix, "%Y-%m-%dT%H:%M:%S")
            except ValueError:
                return None
            self._seconds = calendar.timegm(parsed)
            self._prefix = prefix
        return self._seconds * 1_000_000 + int(fraction)


def _no_constant(name: str) -> Any:
    """``NaN``/``Infinity`` in a line: not JSON, and not writable into a valid timeline."""
    raise ValueError(f"{name} is not JSON")


def _number(value: Any) -> float | None:
    if type(value) in (int, float) and value == value and 0 <= value < 1e15:
        return float(value)
    return None


class ChromeWriter:
    """Turns trace events (dicts) into trace-event JSON on ``out``, one event at a time."""

    def __init__(self, out: TextIO, profile: dict[str, Any] | None = None) -> None:
        self._out = out
        self._clock = _Clock()
        self._first = True
        #: pid -> {tid from the file -> small tid}
        self._threads: dict[Any, dict[Any, int]] = {}
        self._thread_count = 0
        self.stats = ChromeStats()
        #: merging into a torch.profiler export: its events come first, ours are shifted onto its
        #: time base and get thread ids far from its OS thread ids
        self._profile = profile
        self._base_us = 0.0
        self._tid_base = 0
        self._named: set[Any] = set()
        if profile is not None:
            base = profile.get("baseTimeNanoseconds", 0)
            self._base_us = base / 1000 if type(base) in (int, float) else 0.0
            self._tid_base = _MERGED_TID_BASE

    def begin(self) -> None:
        profile = self._profile
        if profile is None:
            self._out.write('{"displayTimeUnit":"ms","traceEvents":[\n')
            return
        head = "".join(
            f"{json.dumps(key)}:{json.dumps(value, default=str)},"
            for key, value in profile.items()
            if key not in ("traceEvents", "fakegrad_patch")
        )
        self._out.write("{" + head + '"traceEvents":[\n')
        for event in profile.get("traceEvents") or ():
            if isinstance(event, dict):
                if event.get("ph") == "M" and event.get("name") == "process_name":
                    self._named.add(event.get("pid"))
                self._write(event)

    def end(self) -> None:
        other = {"source": "fakegrad_patch trace", "slices": self.stats.slices}
        key = "otherData" if self._profile is None else "fakegrad_patch"
        self._out.write(f'\n],"{key}":{json.dumps(other)}}}\n')

    def _write(self, event: dict[str, Any]) -> None:
        text = json.dumps(event, separators=(",", ":"), default=str)
        self._out.write(text if self._first else ",\n" + text)
        self._first = False

    def _track(self, pid: int, tid: Any) -> int:
        threads = self._threads.get(pid)
        if threads is None:
            threads = self._threads[pid] = {}
            self.stats.processes += 1
            if pid not in self._named:  # merged: the profiler's own name for it stays
                self._meta("process_name", pid, 0, f"fakegrad_patch pid {pid}")
        small = threads.get(tid)
        if small is None:
            if self._thread_count >= _MAX_THREADS:  # a corrupt trace: one shared last track
                tid, small = _OTHER_THREADS, self._tid_base + _MAX_THREADS + 1
                if tid in threads:
                    return small
            else:
                small = self._tid_base + len(threads) + 1
                self._thread_count += 1
            threads[tid] = small
            self.stats.threads += 1
            self._meta("thread_name", pid, small, f"thread {tid}")
        return small

    def _meta(self, kind: str, pid: int, tid: int, name: str) -> None:
        self._write({"ph": "M", "name": kind, "pid": pid, "tid": tid, "args": {"name": name}})

    def add(self, record: dict[str, Any], where: str) -> bool:
        """Write one event; False (and counted) when it cannot be placed on a timeline."""
        pid, tid, name = record.get("pid"), record.get("tid"), record.get("event")
        end = self._clock.micros(record.get("timestamp"))
        if (
            end is None
            or type(pid) is not int
            or type(tid) not in (int, str)
            or type(name) is not str
        ):
            self._skip(where)
            return False
        track = self._track(pid, tid)
        args = {k: v for k, v in record.items() if k not in _ENVELOPE}
        duration = _number(record.get("duration_us"))
        out: dict[str, Any] = {"name": name, "cat": CATEGORY, "pid": pid, "tid": track}
        if duration is not None:
            out["ph"] = "X"
            out["ts"] = round(end - self._base_us - duration, 3)
            out["dur"] = duration
            self.stats.slices += 1
        else:
            out["ph"] = "i"
            out["s"] = "t"
            out["ts"] = end - self._base_us if self._base_us else end
            self.stats.instants += 1
        out["args"] = args
        self._write(out)
        return True

    def _skip(self, where: str) -> None:
        self.stats.skipped += 1
        if len(self.stats.skipped_examples) < 5:
            self.stats.skipped_examples.append(where)

    def add_line(self, line: bytes | None, where: str) -> None:
        self.stats.lines += 1
        if line is None:  # longer than the reader's limit
            self._skip(where)
            return
        try:
            record = json.loads(line, parse_constant=_no_constant)
        except (ValueError, RecursionError):
            self._skip(where)
            return
        if not isinstance(record, dict):
            self._skip(where)
            return
        self.add(record, where)


#: ``path -> its lines`` (bytes without the newline; ``None`` for a line too long to keep), the
#: reader's bounded splitter; opening errors are raised when iteration starts.
LineSource = Callable[[str], Iterator["bytes | None"]]


def export(
    paths: Iterable[str],
    out: TextIO,
    lines_of: LineSource,
    profile: dict[str, Any] | None = None,
) -> ChromeStats:
    """Write every file to ``out`` as one trace-event JSON object (merged into ``profile``, a
    loaded ``torch.profiler`` export, when given); unreadable files are recorded in the returned
    stats, not raised."""
    writer = ChromeWriter(out, profile)
    writer.begin()
    for path in paths:
        try:
            for number, line in enumerate(lines_of(path), 1):
                writer.add_line(line, f"{path}:{number}")
        except (OSError, ValueError) as exc:  # ValueError: a NUL in the path
            writer.stats.unreadable.append(f"{path}: {getattr(exc, 'strerror', None) or exc}")
    writer.end()
    return writer.stats


def load_profile(path: str) -> dict[str, Any]:
    """A ``torch.profiler`` Chrome export (``prof.export_chrome_trace(path)``), read whole: a JSON
    object with a ``traceEvents`` list. ValueError when it is not one."""
    with open(path, encoding="utf-8") as stream:
        profile = json.load(stream)
    if not isinstance(profile, dict) or not isinstance(profile.get("traceEvents"), list):
        raise ValueError(f"{path!r} is not a Chrome trace (no traceEvents list)")
    return profile


def export_to(
    paths: Iterable[str],
    destination: str,
    lines_of: LineSource,
    profile: dict[str, Any] | None = None,
) -> ChromeStats:
    """:func:`export` into the file ``destination`` (``-``: standard output), written to a
    temporary file next to it and renamed over it when complete."""
    if destination == "-":
        import sys

        return export(paths, sys.stdout, lines_of, profile)
    temporary = f"{destination}.tmp"
    try:
        with open(temporary, "w", encoding="utf-8") as out:
            stats = export(paths, out, lines_of, profile)
        os.replace(temporary, destination)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
    return stats
