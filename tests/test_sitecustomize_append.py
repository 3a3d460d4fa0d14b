"""``python -m fakegrad_patch sitecustomize --append PATH`` changes the user's own file: it must
write through the path given (a symlink stays a link, the mode stays), refuse read-only files,
keep every other byte, and never leave a file that no longer compiles (issue 11).

Each case runs the real command in a subprocess (the package from this checkout)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from fakegrad_patch._activation import startup as _startup

ROOT = Path(__file__).resolve().parents[1]
LINE = _startup.sitecustomize_line()


def append(path: Path | str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FAKEGRAD_")}
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run(
        [sys.executable, "-m", "fakegrad_patch", "sitecustomize", "--append", str(path)],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_read_only_file_is_refused_and_left_alone(tmp_path: Path) -> None:
    target = tmp_path / "sitecustomize.py"
    target.write_text("A = 1\n")
    target.chmod(0o444)
    result = append(target, tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "read-only" in result.stderr and str(target) in result.stderr
    assert not result.stdout.startswith("added")
    assert target.read_text() == "A = 1\n"
    assert stat.S_IMODE(target.stat().st_mode) == 0o444


@pytest.mark.parametrize("mode", [0o600, 0o640, 0o664, 0o755])
def test_mode_is_kept(tmp_path: Path, mode: int) -> None:
    target = tmp_path / "sitecustomize.py"
    target.write_text("A = 1\n")
    target.chmod(mode)
    result = append(target, tmp_path)
    assert result.returncode == 0 and result.stdout.startswith("added"), result.stderr
    assert stat.S_IMODE(target.stat().st_mode) == mode
    assert target.read_text() == "A = 1\n" + LINE + "\n"


@pytest.mark.parametrize("relative", [False, True])
def test_symlink_is_kept_and_its_target_updated(tmp_path: Path, relative: bool) -> None:
    real_dir = tmp_path / "real"
    real_dir.mkdir()
    real = real_dir / "custom.py"
    real.write_text("A = 1\n")
    real.chmod(0o640)
    link = tmp_path / "sitecustomize.py"
    link.symlink_to(os.path.relpath(real, tmp_path) if relative else real)
    result = append(link, tmp_path)
    assert result.returncode == 0 and result.stdout.startswith("added"), result.stderr
    assert link.is_symlink() and link.resolve() == real.resolve()
    assert real.read_text() == "A = 1\n" + LINE + "\n"
    assert stat.S_IMODE(real.stat().st_mode) == 0o640
    assert sorted(p.name for p in real_dir.iterdir()) == ["custom.py"]  # no temp file left


def test_symlink_to_read_only_target_is_refused(tmp_path: Path) -> None:
    real = tmp_path / "custom.py"
    real.write_text("A = 1\n")
    real.chmod(0o444)
    link = tmp_path / "sitecustomize.py"
    link.symlink_to(real)
    result = append(link, tmp_path)
    assert result.returncode == 1 and "read-only" in result.stderr
    assert link.is_symlink() and real.read_text() == "A = 1\n"


#: Characters ``str.splitlines`` treats as line breaks although Python source does not.
SPLITLINES_ONLY = ["\f", "\v", "\x1c", "\x1d", "\x1e", "\x85", "\u2028", "\u2029"]


@pytest.mark.parametrize("char", SPLITLINES_ONLY, ids=[f"U+{ord(c):04X}" for c in SPLITLINES_ONLY])
@pytest.mark.parametrize("action", ["added", "updated"])
def test_odd_line_breaks_inside_strings_survive(tmp_path: Path, char: str, action: str) -> None:
    target = tmp_path / "sitecustomize.py"
    before = f"S = 'a{char}b'\n"
    old_line = "import os  " + _startup.hook_module().SITECUSTOMIZE_MARKER + "\n"
    text = before + (old_line if action == "updated" else "") + f"T = 'c{char}d'\n"
    target.write_bytes(text.encode("utf-8"))
    result = append(target, tmp_path)
    assert result.returncode == 0 and result.stdout.startswith(action), result.stderr
    after = target.read_bytes().decode("utf-8")
    compile(after, str(target), "exec")
    namespace: dict[str, object] = {}
    exec(compile(after.replace(LINE, "pass"), str(target), "exec"), namespace)
    assert namespace["S"] == f"a{char}b" and namespace["T"] == f"c{char}d"
    if action == "added":
        assert after == text + LINE + "\n"
    else:
        assert after == before + LINE + "\n" + f"T = 'c{char}d'\n"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("A = 1\r\nB = 2\r\n", "A = 1\r\nB = 2\r\n" + LINE + "\r\n"),
        ("A = 1", "A = 1\n" + LINE + "\n"),  # no final newline: one is added before our line
        ("", LINE + "\n"),
    ],
    ids=["crlf", "no-final-newline", "empty"],
)
def test_every_other_byte_is_kept(tmp_path: Path, text: str, expected: str) -> None:
    target = tmp_path / "sitecustomize.py"
    target.write_bytes(text.encode())
    result = append(target, tmp_path)
    assert result.returncode == 0, result.stderr
    assert target.read_bytes() == expected.encode()
    assert append(target, tmp_path).stdout.startswith("present")
    assert target.read_bytes() == expected.encode()


def test_result_that_would_not_compile_is_refused(tmp_path: Path) -> None:
    """A file left open (unterminated triple-quoted string) would swallow our line: refuse."""
    target = tmp_path / "sitecustomize.py"
    text = 'DOC = """never closed\n'
    target.write_text(text)
    result = append(target, tmp_path)
    assert result.returncode == 1, result.stdout
    assert "would not compile" in result.stderr
    assert target.read_text() == text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sitecustomize.py"]


def test_new_file_gets_the_umask_mode(tmp_path: Path) -> None:
    target = tmp_path / "sub" / "sitecustomize.py"
    result = append(target, tmp_path)
    assert result.returncode == 0 and result.stdout.startswith("added"), result.stderr
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(target.stat().st_mode) == 0o666 & ~umask
    assert target.read_text() == LINE + "\n"
