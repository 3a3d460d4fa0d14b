"""Issue 11: the trace file sink in shared places. Links are not followed, special files never
block or get written, wide permissions are pointed out, the file is capped and rotated (also
with several writers), and ``sink_problem`` says all of that without writing anything."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import fakegrad_patch
from fakegrad_patch import trace

posix_only = pytest.mark.skipif(os.name != "posix", reason="POSIX file types")

#: Emits three events into FAKEGRAD_TRACE and reports what happened, as JSON on stdout.
_PROGRAM = textwrap.dedent(
    """
    import json, sys, warnings
    warnings.simplefilter("always")
    with warnings.catch_warnings(record=True) as caught:
        from fakegrad_patch import trace
        for i in range(3):
            trace.emit("fake_grad_drop", trace.WARNING, leaf_id=i)
    print(json.dumps({
        "warnings": [str(w.message) for w in caught if w.category.__name__ ==
                     "FakeGradPatchWarning"],
        "events": [e["event"] for e in trace.events()],
        "failed": [e for e in trace.events() if e["event"] == "trace_sink_failed"],
    }))
    """
)


def _run_with_trace(path: Path, timeout: float = 30, **env: str) -> dict[str, Any]:
    """Run ``_PROGRAM`` with ``FAKEGRAD_TRACE=path``; a hang is a failure, not a stuck suite."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("FAKEGRAD_")}
    full_env.update(FAKEGRAD_TRACE=str(path), **env)
    try:
        result = subprocess.run(
            [sys.executable, "-c", _PROGRAM],
            env=full_env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"the program hung with FAKEGRAD_TRACE={path}")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.splitlines()[-1])


def _symlink_to_file(tmp_path: Path) -> tuple[Path, Path]:
    target = tmp_path / "victim.txt"
    target.write_text("precious\n")
    link = tmp_path / "trace.jsonl"
    link.symlink_to(target)
    return link, target


def _dangling_symlink(tmp_path: Path) -> tuple[Path, Path]:
    target = tmp_path / "created-through-the-link"
    link = tmp_path / "trace.jsonl"
    link.symlink_to(target)
    return link, target


def _fifo(tmp_path: Path) -> tuple[Path, Path]:
    path = tmp_path / "trace.jsonl"
    os.mkfifo(path)
    return path, path


def _directory(tmp_path: Path) -> tuple[Path, Path]:
    path = tmp_path / "trace.jsonl"
    path.mkdir()
    return path, path


def _char_device(tmp_path: Path) -> tuple[Path, Path]:
    return Path("/dev/null"), Path("/dev/null")


REFUSED: dict[str, tuple[Callable[[Path], tuple[Path, Path]], str]] = {
    "symlink": (_symlink_to_file, "symbolic link"),
    "dangling-symlink": (_dangling_symlink, "symbolic link"),
    "fifo": (_fifo, "FIFO"),
    "directory": (_directory, "directory"),
    "char-device": (_char_device, "device"),
}


@posix_only
@pytest.mark.parametrize("kind", sorted(REFUSED))
def test_what_is_not_a_regular_file_is_refused_once_and_the_program_continues(
    kind: str, tmp_path: Path
) -> None:
    make, words = REFUSED[kind]
    path, target = make(tmp_path)
    before = target.read_bytes() if target.is_file() else None
    report = _run_with_trace(path)
    (message,) = report["warnings"]  # exactly one warning
    assert "cannot write the trace file" in message and words in message
    assert report["events"].count("fake_grad_drop") == 3  # the buffer has everything
    (failed,) = report["failed"]
    assert failed["path"] == str(path) and words in failed["error"]
    if kind == "symlink":
        assert target.read_bytes() == before  # nothing written through the link
    if kind == "dangling-symlink":
        assert not os.path.lexists(target)  # the link did not create its target
    if kind == "fifo":
        assert stat.S_ISFIFO(os.lstat(path).st_mode)


@posix_only
def test_a_fifo_with_a_reader_is_refused_too(tmp_path: Path) -> None:
    """With a reader the open succeeds; fstat still refuses it (nothing is written into it)."""
    path, _ = _fifo(tmp_path)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        report = _run_with_trace(path)
        assert len(report["warnings"]) == 1 and "FIFO" in report["warnings"][0]
        assert os.read(fd, 100) == b""  # end of file, the writer is gone: nothing was written
    finally:
        os.close(fd)


@posix_only
def test_a_trace_file_readable_by_others_is_warned_about_once_and_appended(
    tmp_path: Path,
) -> None:
    path = tmp_path / "trace.jsonl"
    path.write_text("")
    path.chmod(0o644)
    report = _run_with_trace(path)
    (message,) = report["warnings"]
    assert "0644" in message and "wider than 0600" in message
    assert report["failed"] == []
    assert len(path.read_text().splitlines()) == 3  # appended as before
    assert stat.S_IMODE(path.stat().st_mode) == 0o644  # not changed behind the owner's back


# -- size cap and rotation ------------------------------------------------------------------------


def _seqs(path: Path) -> list[int]:
    return [json.loads(line)["seq"] for line in path.read_text().splitlines()]


def test_the_file_is_rotated_to_dot_1_at_max_bytes(tmp_path: Path, restore_trace: None) -> None:
    path = tmp_path / "trace.jsonl"
    trace.configure_trace(path=path, level="info", max_bytes=4000)
    assert trace.current_config().max_bytes == 4000
    for i in range(200):
        trace.emit("fake_grad_set", trace.INFO, seq=i, pad="x" * 200)
    line = len(path.read_text().splitlines()[0]) + 1
    assert path.stat().st_size <= 4000 + line
    rotated = Path(f"{path}.1")
    assert 4000 <= rotated.stat().st_size <= 4000 + line
    assert not Path(f"{path}.2").exists()  # one old file, never more: bounded disk use
    assert _seqs(rotated) + _seqs(path) == list(range(200 - len(_seqs(rotated) + _seqs(path)), 200))
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_max_bytes_zero_means_no_limit_and_is_validated(
    tmp_path: Path, restore_trace: None
) -> None:
    path = tmp_path / "trace.jsonl"
    trace.configure_trace(path=path, level="info", max_bytes=0)
    for i in range(100):
        trace.emit("fake_grad_set", trace.INFO, seq=i, pad="x" * 200)
    assert _seqs(path) == list(range(100)) and not Path(f"{path}.1").exists()
    for bad in (-1, "lots", True):
        with pytest.raises(ValueError, match="max_bytes"):
            trace.configure_trace(max_bytes=bad)  # type: ignore[arg-type]
    assert trace.TraceConfig().max_bytes == trace.DEFAULT_MAX_BYTES > 0


def test_env_max_bytes_caps_the_file_and_a_bad_value_warns(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    _run_with_trace(path, FAKEGRAD_TRACE_MAX_BYTES="150")
    lines = path.read_text().splitlines()
    assert len(lines) == 1 and Path(f"{path}.1").exists()  # each ~140-byte line rotated
    bad = tmp_path / "bad.jsonl"
    report = _run_with_trace(bad, FAKEGRAD_TRACE_MAX_BYTES="a lot")
    assert any("FAKEGRAD_TRACE_MAX_BYTES" in w for w in report["warnings"])
    assert len(bad.read_text().splitlines()) == 3


def test_an_oversized_existing_file_is_rotated_before_the_first_line(
    tmp_path: Path, restore_trace: None
) -> None:
    path = tmp_path / "trace.jsonl"
    path.write_text("old\n" * 1000)
    path.chmod(0o600)
    trace.configure_trace(path=path, level="info", max_bytes=1000)
    trace.emit("fake_grad_set", trace.INFO, seq=0)
    assert _seqs(path) == [0]
    assert Path(f"{path}.1").read_text() == "old\n" * 1000


_APPENDER = textwrap.dedent(
    """
    import sys
    from fakegrad_patch import trace
    trace.configure_trace(path=sys.argv[1], level="info", max_bytes=int(sys.argv[3]))
    sys.stdin.readline()  # start together
    for i in range(int(sys.argv[2])):
        trace.emit("fake_grad_set", trace.INFO, seq=i, pad="x" * 1000)
    """
)


def test_several_writers_share_one_capped_file(tmp_path: Path) -> None:
    """Each writer rotates or follows the rotation: whole lines only, two files only, and what
    is left of each writer is the end of what it wrote, in order."""
    path = tmp_path / "shared.jsonl"
    count, cap, writers = 2000, 256 * 1024, 3
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _APPENDER, str(path), str(count), str(cap)],
            stdin=subprocess.PIPE,
        )
        for _ in range(writers)
    ]
    for proc in procs:
        assert proc.stdin is not None
        proc.stdin.write(b"go\n")
        proc.stdin.close()
    for proc in procs:
        assert proc.wait(timeout=120) == 0
    rotated = Path(f"{path}.1")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shared.jsonl", "shared.jsonl.1"]
    # each writer checks every cap/16 bytes it wrote: that much before the rotation, as much
    # again before it notices that another writer rotated the file
    slack = 2 * writers * (cap // 16 + 1200)
    for file in (rotated, path):
        assert file.stat().st_size <= cap + slack
        assert stat.S_IMODE(file.stat().st_mode) == 0o600
    by_pid: dict[int, list[int]] = {}
    for file in (rotated, path):
        for line in file.read_text().splitlines():
            record = json.loads(line)  # every line is whole
            by_pid.setdefault(record["pid"], []).append(record["seq"])
    assert set(by_pid) <= {p.pid for p in procs}
    assert rotated.stat().st_size >= cap  # rotated when full, not earlier
    for seqs in by_pid.values():
        assert seqs == list(range(count - len(seqs), count))


# -- sink_problem -------------------------------------------------------------------------------


def _problem_cases(tmp_path: Path) -> dict[str, tuple[Path, str | None]]:
    """name -> (path, words the answer contains; None: no problem)."""
    regular = tmp_path / "ok.jsonl"
    regular.write_text("")
    regular.chmod(0o600)
    wide = tmp_path / "wide.jsonl"
    wide.write_text("")
    wide.chmod(0o644)
    afile = tmp_path / "afile"
    afile.write_text("")
    for sub in ("l1", "l2", "f"):
        (tmp_path / sub).mkdir()
    link, _ = _symlink_to_file(tmp_path / "l1")
    dangling, _ = _dangling_symlink(tmp_path / "l2")
    fifo, _ = _fifo(tmp_path / "f")
    directory = tmp_path / "adir"
    directory.mkdir()
    return {
        "new file": (tmp_path / "new.jsonl", None),
        "private file": (regular, None),
        "missing directory": (tmp_path / "no" / "such" / "t.jsonl", "does not exist"),
        "parent is a file": (afile / "t.jsonl", "not a directory"),
        "symlink": (link, "symbolic link"),
        "dangling symlink": (dangling, "symbolic link"),
        "fifo": (fifo, "FIFO"),
        "directory": (directory, "directory"),
        "device": (Path("/dev/null"), "device"),
        "wide mode": (wide, "notice: "),
    }


@posix_only
def test_sink_problem_names_every_kind_of_problem_without_writing(tmp_path: Path) -> None:
    cases = _problem_cases(tmp_path)
    before = {
        p: (os.lstat(p).st_mtime_ns if os.path.lexists(p) else None) for p, _ in cases.values()
    }
    for name, (path, words) in cases.items():
        answer = trace.sink_problem(str(path))
        if words is None:
            assert answer is None, (name, answer)
        else:
            assert answer is not None, name
            assert words.lower() in answer.lower() and str(path) in answer, (name, answer)
    after = {
        p: (os.lstat(p).st_mtime_ns if os.path.lexists(p) else None) for p, _ in cases.values()
    }
    assert after == before  # nothing created, nothing written
    assert not (tmp_path / "l2" / "created-through-the-link").exists()
    assert trace.sink_problem("-") is None
    assert "impossible" in (trace.sink_problem("bad\0path") or "")


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root can write anywhere")
def test_sink_problem_sees_an_unwritable_directory(tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        assert "not writable" in (trace.sink_problem(str(locked / "t.jsonl")) or "")
    finally:
        locked.chmod(0o700)


def test_sink_problem_checks_the_configured_sink(tmp_path: Path, restore_trace: None) -> None:
    trace.configure_trace(path=None)
    assert trace.sink_problem() is None
    trace.configure_trace(path="-")
    assert trace.sink_problem() is None
    bad = tmp_path / "missing" / "t.jsonl"
    trace.configure_trace(path=bad)
    assert "does not exist" in (trace.sink_problem() or "")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fakegrad_patch.FakeGradPatchWarning)
        trace.emit("fake_grad_drop", trace.WARNING, leaf_id=1)
    assert "failed in this process" in (trace.sink_problem() or "")
    trace.configure_trace(path=tmp_path / "fine.jsonl")
    assert trace.sink_problem() is None


def test_sink_problem_from_the_environment_in_a_fresh_process(tmp_path: Path) -> None:
    """What ``doctor`` calls: the env-configured path, standard library only, no events."""
    code = textwrap.dedent(
        """
        import sys
        from fakegrad_patch import trace
        print(trace.sink_problem())
        print(sorted(m for m in ("structlog", "torch", "json") if m in sys.modules))
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("FAKEGRAD_")}
    env["FAKEGRAD_TRACE"] = str(tmp_path / "missing" / "t.jsonl")
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    ).stdout.splitlines()
    assert "does not exist" in out[0]
    assert "structlog" not in out[1] and "torch" not in out[1]
    assert not (tmp_path / "missing").exists()
