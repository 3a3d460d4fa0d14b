"""Issue 11: ``python -m fakegrad_patch trace`` on hostile or huge input. Nesting, control
characters, a closed pipe, non-UTF-8 stdin, bounded memory and line length, and a reader that
needs nothing but the standard library."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from fakegrad_patch import trace
from fakegrad_patch.trace import _reader as _trace_reader

ROOT = Path(__file__).resolve().parents[1]


def _event(event: str = "fake_grad_set", **fields: Any) -> dict[str, Any]:
    record: dict[str, Any] = {
        "event": event,
        "level": "info",
        "timestamp": "2026-01-01T00:00:00.000000Z",
        "schema": 1,
        "pid": 1,
        "tid": 1,
    }
    if event.startswith("fake_grad_"):
        record.update(backward_id=0, leaf_id=5, name=None, shape=[4], dtype="float32", device="cpu")
        record.update(source="propagated", action=event.removeprefix("fake_grad_"))
        record.update(zero_copy=False, bytes=16, duration_us=1.0)
    record.update(fields)
    return record


def _write(path: Path, *records: dict[str, Any] | str | bytes) -> Path:
    with path.open("wb") as fh:
        for r in records:
            if isinstance(r, dict):
                r = json.dumps(r, ensure_ascii=False)
            fh.write((r.encode("utf-8") if isinstance(r, str) else r) + b"\n")
    return path


def _summary(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict[str, Any]]:
    code = _trace_reader.main([*argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


def _cli(*argv: str, input: bytes | None = None, **kw: Any) -> subprocess.CompletedProcess[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FAKEGRAD_")}
    return subprocess.run(
        [sys.executable, "-m", "fakegrad_patch", "trace", *argv],
        input=input,
        capture_output=True,
        env=env,
        timeout=120,
        **kw,
    )


# -- broken lines ------------------------------------------------------------------------------

NESTED = [
    "[" * 100_000 + "]" * 100_000,
    '{"event": "fake_grad_set", "schema": 1, "x": ' + "[" * 50_000 + "]" * 50_000 + "}",
    '{"a":' * 30_000 + "1" + "}" * 30_000,
]


def test_deeply_nested_lines_are_broken_lines_not_a_crash(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _write(tmp_path / "t.jsonl", _event(), *NESTED, _event("fake_grad_drop"))
    code, summary = _summary(capsys, str(path))
    assert code == 0
    assert summary["broken_lines"] == len(NESTED) and summary["events"] == 2
    assert [p["kind"] for p in summary["problems"]] == ["drop"]  # the summary is all there
    assert _trace_reader.main([str(path), "--strict"]) == 1
    assert "LEAVES (1" in capsys.readouterr().out


def test_nested_values_where_text_is_expected_are_broken_lines(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A value the report would ``str()`` (a reason, an error, a name...) must be text: a deep
    list there would recurse in ``str`` and a list is no reason anyway."""
    deep_reason = json.dumps(_event("patch_skipped", reason=0)).replace(
        '"reason": 0', '"reason": ' + "[" * 900 + "]" * 900
    )
    lines = [
        deep_reason,
        json.dumps(_event("internal_error", where="convert", error={"x": 1})),
        json.dumps(_event("fake_grad_set", name=["n"])),
        json.dumps(_event("fake_grad_set", shape=[2, "3"])),
        json.dumps(_event("fake_grad_set", action="drop")),  # contradicts the event
        json.dumps(_event("patch_installed", torch="2.13", defects={"D2": [1]})),
    ]
    path = _write(tmp_path / "t.jsonl", *lines, _event())
    code, summary = _summary(capsys, str(path))
    assert code == 0
    assert summary["broken_lines"] == len(lines) and summary["events"] == 1


# -- what reaches the terminal ------------------------------------------------------------------

CONTROL = "\x1b]0;owned\x07\x1b[2J\u202e"


def test_every_field_printed_for_people_is_escaped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    records = [
        _event("fake_grad_drop", dtype=f"f32{CONTROL}", device=f"cpu{CONTROL}", pid=f"p{CONTROL}"),
        _event("fake_grad_keep", name=f"w{CONTROL}", leaf_id=6),
        _event("patch_skipped", torch=f"2.13{CONTROL}", reason=f"why{CONTROL}"),
        _event("patch_installed", defects={f"D9{CONTROL}": True}),
        _event("internal_error", where="convert", error=f"boom{CONTROL}"),
        _event("trace_sink_failed", path=f"/tmp/x{CONTROL}", error="e"),
        _event("materialized", missing=1, policy=f"drop{CONTROL}"),
        _event(f"new_kind{CONTROL}"),
    ]
    path = _write(tmp_path / f"t{CONTROL[:3]}.jsonl", *records, "garbage")
    assert _trace_reader.main([str(path), str(tmp_path / f"missing{CONTROL}")]) == 2
    captured = capsys.readouterr()
    for text in (captured.out, captured.err):
        assert not any(c in text for c in "\x1b\x07\u202e"), text
    out = captured.out
    assert out.count("\\x1b") >= 10 and "\\u202e" in out and "\\x07" in out
    for word in ("f32", "cpu", "'w", "2.13", "why", "D9", "boom", "/tmp/x", "new_kind"):
        assert word + "\\x1b" in out, word
    assert "missing\\x1b" in captured.err
    _trace_reader.main([str(path), "--json"])
    assert not any(c in capsys.readouterr().out for c in "\x1b\x07\u202e")


# -- streams -----------------------------------------------------------------------------------


def _many_leaves(path: Path, leaves: int = 3000) -> Path:
    return _write(path, *(_event(leaf_id=i) for i in range(leaves)))


@pytest.mark.parametrize("as_json", [False, True], ids=["text", "json"])
def test_a_closed_pipe_ends_quietly(tmp_path: Path, as_json: bool) -> None:
    """``... | head -1``: far more output than a pipe holds, the reader of it goes away."""
    path = _many_leaves(tmp_path / "t.jsonl")
    env = {k: v for k, v in os.environ.items() if not k.startswith("FAKEGRAD_")}
    argv = [sys.executable, "-m", "fakegrad_patch", "trace", str(path)]
    proc = subprocess.Popen(
        argv + (["--json"] if as_json else []),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    assert proc.stdout is not None and proc.stderr is not None
    assert proc.stdout.readline()
    proc.stdout.close()
    code = proc.wait(timeout=120)
    stderr = proc.stderr.read().decode()
    assert stderr == ""
    assert code == _trace_reader.EXIT_BROKEN_PIPE


def test_non_utf8_stdin_is_read_not_fatal() -> None:
    good = json.dumps(_event()).encode()
    latin1 = (
        json.dumps(_event("fake_grad_drop", name="caf\xe9", leaf_id=6))
        .encode()
        .replace(b"caf\\u00e9", b"caf\xe9")
    )
    data = good + b"\n\xff\xfe\xfd not utf-8 at all\n" + latin1 + b"\n"
    result = _cli("-", "--json", input=data)
    assert result.returncode == 0 and result.stderr == b""
    summary = json.loads(result.stdout)
    assert summary["events"] == 2 and summary["broken_lines"] == 1
    assert {leaf["name"] for leaf in summary["leaves"]} == {None, "caf\ufffd"}
    text = _cli("-", input=data)  # the text report too, with stdout in ASCII
    assert text.returncode == 0 and text.stderr == b""


def test_non_ascii_output_with_an_ascii_stdout_does_not_fail(tmp_path: Path) -> None:
    path = _write(tmp_path / "t.jsonl", _event("fake_grad_drop", name="名前"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("FAKEGRAD_")}
    env["PYTHONIOENCODING"] = "ascii"
    result = subprocess.run(
        [sys.executable, "-m", "fakegrad_patch", "trace", str(path)],
        capture_output=True,
        env=env,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert b"\\u540d\\u524d" in result.stdout


# -- bounded memory and line length --------------------------------------------------------------

_PEAK = textwrap.dedent(
    """
    import json, sys
    from fakegrad_patch.trace import _reader as _trace_reader
    summary = _trace_reader.summarize(sys.argv[1:])
    # VmHWM: this process's peak resident set (ru_maxrss would include the parent's at fork)
    with open("/proc/self/status") as fh:
        peak_kib = next(int(l.split()[1]) for l in fh if l.startswith("VmHWM:"))
    print(json.dumps({"peak_kib": peak_kib, **summary.as_dict()}))
    """
)


def _peak(*paths: Path) -> dict[str, Any]:
    result = subprocess.run(
        [sys.executable, "-c", _PEAK, *map(str, paths)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def _steps(path: Path, steps: int, leaves: int = 4) -> Path:
    """``steps`` backward passes over ``leaves`` leaves, short lines."""
    with path.open("w") as fh:
        for step in range(steps):
            for leaf in range(leaves):
                fh.write(
                    f'{{"event":"fake_grad_set","schema":1,"pid":7,"leaf_id":{leaf},'
                    f'"backward_id":{step},"bytes":4}}\n'
                )
    return path


@pytest.mark.skipif(sys.platform != "linux", reason="/proc/self/status VmHWM")
def test_memory_does_not_grow_with_the_number_of_lines(tmp_path: Path) -> None:
    small = _peak(_steps(tmp_path / "small.jsonl", 10_000))
    big = _peak(_steps(tmp_path / "big.jsonl", 150_000))
    assert big["events"] == 600_000 and big["backward_passes"] == 150_000
    assert all(leaf["backward_passes"] == 150_000 for leaf in big["leaves"])
    assert small["backward_passes"] == 10_000
    assert big["peak_kib"] - small["peak_kib"] < 8 * 1024, (small["peak_kib"], big["peak_kib"])


@pytest.mark.skipif(sys.platform != "linux", reason="/proc/self/status VmHWM")
def test_a_huge_line_is_counted_as_broken_without_being_kept(tmp_path: Path) -> None:
    small = _peak(_write(tmp_path / "small.jsonl", _event(), _event()))
    path = tmp_path / "huge.jsonl"
    with path.open("wb") as fh:
        fh.write(json.dumps(_event()).encode() + b"\n")
        fh.write(b'{"event": "fake_grad_set", "name": "' + b"x" * (96 * 1024 * 1024) + b'"}\n')
        fh.write(json.dumps(_event()).encode() + b"\n")
        fh.write(b"y" * (_trace_reader.MAX_LINE_BYTES + 1))  # the last line, no newline
    big = _peak(path)
    assert big["events"] == 2 and big["broken_lines"] == 2 and big["too_long_lines"] == 2
    assert big["broken_examples"] == [f"{path}:2", f"{path}:4"]
    assert big["peak_kib"] - small["peak_kib"] < 16 * 1024, (small["peak_kib"], big["peak_kib"])


def test_lines_are_split_the_same_whatever_the_chunks() -> None:
    rng = random.Random(0)
    limit = 50
    lines = [
        bytes(rng.choice(b"ab{}") for _ in range(rng.choice([0, 1, 49, 50, 51, 120])))
        for _ in range(300)
    ]
    data = b"\n".join(lines)
    expected = [line if len(line) <= limit else None for line in lines]
    if expected and expected[-1] == b"":
        expected.pop()  # no final line after the last newline
    for _ in range(30):
        cuts = sorted(rng.sample(range(1, len(data)), rng.randint(1, 200)))
        chunks = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]
        assert list(_trace_reader._lines(chunks, limit)) == expected


def test_tallies_of_text_from_the_file_are_capped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Distinct unknown kinds / error messages / policies / reasons: bounded, all counted."""
    n = 3000
    records = [_event(f"kind_{i}") for i in range(n)]
    records += [_event("internal_error", where="convert", error=f"e{i}") for i in range(n)]
    records += [_event("patch_skipped", reason=f"r{i}") for i in range(n)]
    path = _write(tmp_path / "t.jsonl", *records)
    code, summary = _summary(capsys, str(path))
    assert code == 0
    assert len(summary["unknown_events"]) <= 101 and sum(summary["unknown_events"].values()) == n
    (proc,) = summary["patch"]
    assert len(proc["internal_errors"]) <= 101 and sum(proc["internal_errors"].values()) == n
    assert len(summary["problems"]) <= 202 + 5
    assert sum(p["count"] for p in summary["problems"] if p["kind"] == "patch_skipped") == n


# -- standard library only ---------------------------------------------------------------------


def test_the_reader_is_one_file_that_needs_only_the_standard_library(tmp_path: Path) -> None:
    """Copied alone next to a trace, run with no site-packages (-S) and an isolated path (-I)."""
    copy = tmp_path / "reader.py"
    shutil.copy(ROOT / "fakegrad_patch" / "trace" / "_reader.py", copy)
    path = _write(tmp_path / "t.jsonl", _event(), _event("fake_grad_drop"))
    code = textwrap.dedent(
        f"""
        import runpy, sys
        sys.argv = ["reader.py", {str(path)!r}, "--json"]
        try:
            runpy.run_path({str(copy)!r}, run_name="__main__")
        except SystemExit as exc:
            status = exc.code
        foreign = sorted(
            m for m in sys.modules
            if m.split(".")[0] not in sys.stdlib_module_names and m != "__main__"
        )
        print(status, foreign, file=sys.stderr)
        """
    )
    result = subprocess.run(
        [sys.executable, "-I", "-S", "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert result.stderr.strip() == "0 []", result.stderr
    summary = json.loads(result.stdout)
    assert summary["events"] == 2 and [p["kind"] for p in summary["problems"]] == ["drop"]


def test_the_reader_knows_the_schema_the_tracer_writes() -> None:
    assert _trace_reader.SCHEMA_VERSION == trace.SCHEMA_VERSION
