"""Issue 5: ``python -m fakegrad_patch trace FILE...`` on traces from a real run and on corrupt
input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from fakegrad_patch.trace import _reader as _trace_reader

#: A real program: propagation on (set, accumulate), then off under every policy.
PROGRAM = textwrap.dedent(
    """
    import torch, fakegrad_patch
    import torch._functorch.config as fc
    from torch._subclasses.fake_tensor import FakeTensorMode

    def step(m):
        with FakeTensorMode(allow_non_fake_inputs=True):
            m(torch.randn(4, 3)).sum().backward()

    torch.manual_seed(0)
    m = torch.nn.Linear(3, 2); fakegrad_patch.name_parameters(m, prefix="lin")
    fc.fake_tensor_propagate_real_tensors = True
    step(m); step(m)
    fc.fake_tensor_propagate_real_tensors = False
    for policy in ("drop", "zeros", "keep"):
        with fakegrad_patch.patched(on_missing=policy):
            step(m)
    with fakegrad_patch.patched(on_missing="error"):
        try:
            step(m)
        except fakegrad_patch.FakeGradError:
            pass
    fakegrad_patch.uninstall()
    """
)


@pytest.fixture(scope="module")
def real_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("reader") / "run.jsonl"
    env = {k: v for k, v in os.environ.items() if not k.startswith("FAKEGRAD_")}
    env.update(FAKEGRAD_TRACE=str(path), FAKEGRAD_TRACE_LEVEL="debug")
    result = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", PROGRAM],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, result.stderr
    return path


def _main(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = _trace_reader.main(list(argv))
    return code, capsys.readouterr().out


def _records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_json_summary_matches_the_raw_events(
    real_trace: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out = _main(capsys, str(real_trace), "--json")
    assert code == 0
    summary = json.loads(out)
    records = _records(real_trace)
    assert summary["events"] == len(records)
    assert summary["broken_lines"] == 0 and summary["unknown_lines"] == 0
    leaves = {leaf["name"]: leaf for leaf in summary["leaves"]}
    assert set(leaves) == {"lin.weight", "lin.bias"}
    for name, leaf in leaves.items():
        mine = [r for r in records if r["event"].startswith("fake_grad_") and r["name"] == name]
        assert leaf["arrived"] == len(mine)
        assert leaf["actions"] == {
            a: sum(r["action"] == a for r in mine)
            for a in ("set", "accumulate", "drop", "error", "keep")
        }
        assert leaf["zero_copy"] == sum(r["zero_copy"] for r in mine)
        assert leaf["bytes"] == sum(r["bytes"] for r in mine)
        assert leaf["zeros"] == sum(r["source"] == "zeros" for r in mine)
    # the program: 2 propagated passes, then drop, zeros, keep for both leaves; error for one
    weight, bias = leaves["lin.weight"], leaves["lin.bias"]
    assert weight["actions"]["drop"] == bias["actions"]["drop"] == 1
    assert weight["actions"]["keep"] == bias["actions"]["keep"] == 1
    assert weight["actions"]["error"] + bias["actions"]["error"] == 1
    assert summary["backward_passes"] == len(
        {r["backward_id"] for r in records if r["event"].startswith("fake_grad_")}
    )
    kinds = Counter(p["kind"] for p in summary["problems"])
    assert kinds == {"error": 1, "drop": 2, "keep": 2, "zeros": 2}
    (proc,) = summary["patch"]
    assert proc["installed"] == 1 and proc["uninstalled"] == 1
    assert "D1_fake_grad_in_real_leaf" in proc["defects"]


def test_text_summary_puts_problems_first(
    real_trace: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out = _main(capsys, str(real_trace))
    assert code == 0
    assert out.index("PROBLEMS (7)") < out.index("LEAVES (2") < out.index("PATCH")
    problems = out[out.index("PROBLEMS") : out.index("LEAVES")]
    order = [line.split()[1] for line in problems.splitlines() if line.startswith("  !")]
    assert order == ["error", "drop", "drop", "keep", "keep", "zeros", "zeros"]
    assert "'lin.weight' [2, 3] float32 cpu" in problems
    assert "TRACE INPUT ISSUES" not in out


def test_cli_entry_point(real_trace: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "fakegrad_patch", "trace", str(real_trace)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("fakegrad_patch trace: 1 file,")


def test_clean_trace_says_no_problems(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "clean.jsonl"
    line = {
        "event": "fake_grad_set",
        "level": "info",
        "timestamp": "2026-01-01T00:00:00Z",
        "schema": 1,
        "pid": 1,
        "tid": 1,
        "backward_id": 0,
        "leaf_id": 5,
        "name": None,
        "shape": [4],
        "dtype": "float16",
        "device": "cpu",
        "source": "propagated",
        "action": "set",
        "zero_copy": False,
        "bytes": 2048,
        "duration_us": 3.5,
    }
    path.write_text(json.dumps(line) + "\n")
    code, out = _main(capsys, str(path))
    assert code == 0
    assert "PROBLEMS: none" in out
    assert "[4] float16 cpu" in out and "2.0 KiB" in out


CORRUPT = [
    "",  # blank lines are ignored
    "{not json",
    "[1, 2, 3]",
    '{"no_event": 1}',
    '{"event": 42, "schema": 1}',
    '{"event": "fake_grad_set", "schema": 1, "pid": 1, "leaf_id": 2, "bytes": "many"}',
    '{"event": "something_new", "schema": 1}',
    '{"event": "fake_grad_set", "schema": 99}',
    "\x00\x01binary",
    '{"event": "fake_grad_drop", "schema": 1, "pid": 1, "leaf_id": 2, "action": "drop"}',
]


def test_corrupt_input_is_counted_not_fatal(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "corrupt.jsonl"
    path.write_text("\n".join(CORRUPT) + "\n")
    code, out = _main(capsys, str(path), "--json")
    assert code == 0
    summary = json.loads(out)
    assert summary["broken_lines"] == 6
    assert summary["unknown_lines"] == 2
    assert summary["events"] == 1  # the one good drop
    assert [p["kind"] for p in summary["problems"]] == ["drop"]
    code, out = _main(capsys, str(path))
    assert code == 0
    assert "6 broken lines" in out and "2 unknown lines" in out
    assert "something_new (schema 1) x1" in out


def test_strict_fails_on_broken_or_unknown_lines(
    tmp_path: Path, real_trace: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _main(capsys, str(real_trace), "--strict")[0] == 0
    path = tmp_path / "unknown.jsonl"
    path.write_text('{"event": "something_new", "schema": 1}\n')
    assert _main(capsys, str(path), "--strict")[0] == 1
    path.write_text("garbage\n")
    assert _main(capsys, str(real_trace), str(path), "--strict")[0] == 1


def test_unreadable_file_exits_2_after_reporting_the_rest(
    tmp_path: Path, real_trace: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = _trace_reader.main([str(real_trace), str(tmp_path / "nope.jsonl")])
    captured = capsys.readouterr()
    assert code == 2
    assert "LEAVES (2" in captured.out
    assert "cannot read" in captured.err and "nope.jsonl" in captured.err


def test_fake_leaf_events_are_known_and_missing_values_are_problems(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    envelope = {"level": "info", "timestamp": "2026-01-01T00:00:00Z", "schema": 1, "pid": 9}
    lines = [
        {"event": "mirrored", "leaf_id": 1, "fake_id": 2, "source": "propagated", **envelope},
        {"event": "grad_copy_repaired", "leaf_id": 1, "bytes": 16, **envelope},
        {"event": "materialized", "fakes": 3, "missing": 0, "policy": "drop", **envelope},
        {"event": "materialized", "fakes": 3, "missing": 2, "policy": "drop", **envelope},
    ]
    path = tmp_path / "fake_leaves.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    code, out = _main(capsys, str(path), "--json", "--strict")
    assert code == 0
    summary = json.loads(out)
    assert summary["unknown_lines"] == 0
    (proc,) = summary["patch"]
    assert proc["mirrored"] == 1 and proc["grad_copy_repairs"] == 1
    assert proc["materialize_calls"] == 2
    assert [(p["kind"], p["count"]) for p in summary["problems"]] == [("materialize_missing", 2)]
