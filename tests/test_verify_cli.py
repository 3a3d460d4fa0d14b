"""``python -m fakegrad_patch verify module:factory`` and the ``fakegrad_verify`` pytest fixture:
the table (problems first), ``--json``, exit codes 0 / 1 (any mismatch) / 2 (cannot compare)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from typing import Any

import pytest

pytest_plugins = ["pytester"]

ROOT = pathlib.Path(__file__).resolve().parents[1]
ZOO = ROOT / "tests" / "_zoo.py"

#: A factory file that also switches a broken materializer on, in the child process (test only):
#: the gradients of the named parameters get +1 after the real rule wrote them.
BROKEN = textwrap.dedent(
    """
    import torch
    from fakegrad_patch._core.convert import leaves as _leaves
    from fakegrad_patch._core.accumulate.hooks import Materializer

    CORRUPT = {"0.weight", "2.bias"}
    _original = Materializer._write

    def _broken(self, leaf, *args, **kwargs):
        outcome = _original(self, leaf, *args, **kwargs)
        if _leaves.name_of(leaf) in CORRUPT:
            with self._resolved.no_dispatch(), torch.no_grad():
                leaf.grad.add_(1.0)
        return outcome

    Materializer._write = _broken
    """
)
FACTORY = textwrap.dedent(
    """
    import torch

    def factory():
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)
        )
        return model, torch.randn(3, 4)
    """
)


def _env() -> dict[str, str]:
    """The worktree's package and pytest plugin first on the path (the installed plugin module
    may be an older copy)."""
    paths = [str(ROOT), str(ROOT / "fakegrad_patch" / "_activation" / "hooks")]
    old = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths + ([old] if old else []))}


def _verify(*args: str, cwd: pathlib.Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fakegrad_patch", "verify", *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=cwd,
        env=_env(),
    )


def test_cli_prints_the_table_and_exits_0_when_everything_matches() -> None:
    out = _verify(f"{ZOO}:conv_bn_channels_last")
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("fakegrad_patch verify: ConvNet, 2 step(s), optimizer SGD")
    assert lines[2] == "verdict: OK, 9 parameter(s) match eager"
    assert "PROBLEMS: none" in lines
    assert "PARAMETERS (9)" in lines and "BUFFERS (6) (info) buffers=upstream" in lines
    assert not [line for line in lines if line.startswith("! ")]


def test_cli_names_exactly_the_broken_parameters_and_exits_1(tmp_path: pathlib.Path) -> None:
    (tmp_path / "broken.py").write_text(BROKEN + FACTORY)
    out = _verify(f"{tmp_path / 'broken.py'}:factory")
    assert out.returncode == 1, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert lines[2].startswith("verdict: MISMATCH, 2 of 4 parameter(s) differ")
    problems = lines[lines.index("PROBLEMS (2)") + 1 : lines.index("PROBLEMS (2)") + 3]
    assert [p.split("'")[1] for p in problems] == ["0.weight", "2.bias"]
    assert {line.split()[1] for line in lines if line.startswith("! ")} == {"0.weight", "2.bias"}


def test_cli_json_names_the_broken_parameters_and_exits_1(
    tmp_path: pathlib.Path,
    monkeypatch: pytest.MonkeyPatch,
    in_process: Callable[..., tuple[int, str, str]],
) -> None:
    namespace: dict[str, Any] = {}
    exec(BROKEN.replace("Materializer._write = _broken", ""), namespace)
    monkeypatch.setattr(namespace["Materializer"], "_write", namespace["_broken"])
    (tmp_path / "plain.py").write_text(FACTORY)
    code, out, err = in_process(f"{tmp_path / 'plain.py'}:factory", "--json")
    assert code == 1, err
    data = json.loads(out)
    assert data["ok"] is False and data["mismatched"] == ["0.weight", "2.bias"]
    rows = {p["name"]: p for p in data["parameters"]}
    assert rows["0.weight"]["max_abs"] == pytest.approx(1.0, rel=1e-6)
    assert rows["0.bias"]["max_abs"] == 0.0 and rows["0.bias"]["ok"] is True


@pytest.fixture
def in_process(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> Iterator[Callable[..., tuple[int, str, str]]]:
    """Run the command's ``main`` in this process (no interpreter start-up): exit code, stdout,
    stderr. ``sys.path`` is restored and the factories' modules forgotten afterwards."""
    from fakegrad_patch._tools import verify_cli as _verify_cli

    monkeypatch.setattr(sys, "path", list(sys.path))
    before = set(sys.modules)

    def run(*args: str, cwd: pathlib.Path | None = None) -> tuple[int, str, str]:
        if cwd is not None:
            monkeypatch.chdir(cwd)
        code = _verify_cli.main(list(args))
        out = capsys.readouterr()
        return code, out.out, out.err

    yield run
    for name in set(sys.modules) - before:  # the factories' modules, not torch's lazy imports
        if name.startswith(("_fakegrad_verify_", "fgp_")):
            del sys.modules[name]


def test_cli_json_options_and_a_dotted_module_returning_a_tuple(
    tmp_path: pathlib.Path, in_process: Callable[..., tuple[int, str, str]]
) -> None:
    (tmp_path / "fgp_cli_models.py").write_text(
        "import functools, torch\n"
        "def build():\n"
        "    torch.manual_seed(0)\n"
        "    m = torch.nn.Linear(3, 2)\n"
        "    return m, torch.randn(4, 3), None, functools.partial(torch.optim.SGD, lr=0.1)\n"
    )
    code, out, err = in_process(
        "fgp_cli_models:build", "--json", "--steps", "3", "--zero-grad", "never", cwd=tmp_path
    )
    assert code == 0, out + err
    data = json.loads(out)
    assert (data["ok"], data["steps"], data["zero_grad"], data["optimizer"]) == (
        True,
        3,
        "never",
        "SGD",
    )
    assert [p["outcomes"] for p in data["parameters"]] == [{"set": 1, "accumulate": 2}] * 2
    assert all(p["identity"] == "kept" for p in data["parameters"])


@pytest.mark.parametrize(
    ("spec", "body", "message"),
    [
        ("nocolon", None, "expected module:factory"),
        ("{file}:missing", "x = 1\n", "has no attribute 'missing'"),
        ("{file}:f", "def f():\n    raise RuntimeError('boom')\n", "failed: RuntimeError: boom"),
        ("{file}:f", "def f():\n    return 42\n", "must return (model, inputs"),
        ("{file}:f", "def f():\n    return {'model': 1, 'input': 2}\n", "unknown keys ['input']"),
        (
            "{file}:f",
            "import torch\ndef f():\n    with torch.device('meta'):\n"
            "        return torch.nn.Linear(2, 2), torch.randn(1, 2)\n",
            "meta device",
        ),
        ("{file}:f", "import torch\ndef f():\n    return 'm', 1\n", "must be a torch.nn.Module"),
        ("fgp_no_such_module_xyz:f", None, "cannot import 'fgp_no_such_module_xyz'"),
    ],
)
def test_cli_exits_2_when_it_cannot_compare(
    tmp_path: pathlib.Path,
    in_process: Callable[..., tuple[int, str, str]],
    spec: str,
    body: str | None,
    message: str,
) -> None:
    path = tmp_path / "case.py"
    if body is not None:
        path.write_text(body)
    code, out, err = in_process(spec.format(file=path), cwd=tmp_path)
    assert code == 2, out + err
    assert message in err
    assert out == ""


def test_verify_is_listed_in_the_command_usage() -> None:
    from fakegrad_patch.__main__ import COMMANDS

    assert COMMANDS["verify"][0] == "fakegrad_patch._tools.verify_cli"


# -- the pytest fixture ---------------------------------------------------------------------------

INNER = textwrap.dedent(
    """
    import functools
    import pytest
    import torch

    import fakegrad_patch
    from fakegrad_patch._core.convert import leaves as _leaves
    from fakegrad_patch._core.accumulate.hooks import Materializer

    def _model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))

    def test_matches(fakegrad_verify):
        report = fakegrad_verify(
            _model(), torch.randn(2, 4), steps=2,
            optimizer=functools.partial(torch.optim.SGD, lr=0.1),
        )
        assert report.ok and len(report.parameters) == 4

    def test_broken(fakegrad_verify, monkeypatch):
        original = Materializer._write
        def broken(self, leaf, *args, **kwargs):
            outcome = original(self, leaf, *args, **kwargs)
            if _leaves.name_of(leaf) == "2.weight":
                with self._resolved.no_dispatch(), torch.no_grad():
                    leaf.grad.mul_(3.0)
            return outcome
        monkeypatch.setattr(Materializer, "_write", broken)
        fakegrad_verify(_model(), torch.randn(2, 4))

    @pytest.fixture
    def uninstalled():
        fakegrad_patch.uninstall()

    def test_leaves_the_patch_as_found(uninstalled, fakegrad_verify):
        assert fakegrad_verify(_model(), torch.randn(2, 4)).ok

    def test_after(uninstalled):
        assert not fakegrad_patch.is_installed()
    """
)


def test_fixture_passes_matching_models_and_fails_with_the_report(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTHONPATH", _env()["PYTHONPATH"])
    pytester.makepyfile(test_inner=INNER)
    pytester.makeini("[pytest]\nfilterwarnings = ignore::UserWarning\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-q")
    result.assert_outcomes(passed=3, failed=1)
    text = result.stdout.str()
    assert "test_broken" in text and "the patched run differs from eager" in text
    assert "! '2.weight': step 1: gradient differs from eager" in text
    assert "'0.weight'" not in text.split("PARAMETERS (")[0]  # only 2.weight in PROBLEMS


# -- docs/verify.md -------------------------------------------------------------------------------

DOC = (ROOT / "docs" / "verify.md").read_text()


def _doc_blocks(lang: str) -> list[str]:
    blocks, body, info = [], [], None
    for line in DOC.splitlines():
        if line.startswith("```"):
            if info is None:
                info, body = line[3:].strip(), []
            else:
                if info == lang:
                    blocks.append("\n".join(body) + "\n")
                info = None
        elif info is not None:
            body.append(line)
    return blocks


EXAMPLES = [b for b in _doc_blocks("python") if b.startswith("# ") and ".py:" in b.split()[1]]


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda b: b.split()[1].rstrip(":"))
def test_docs_copy_paste_examples_pass_through_the_command(
    tmp_path: pathlib.Path, in_process: Callable[..., tuple[int, str, str]], example: str
) -> None:
    name = example.split()[1].rstrip(":")
    (tmp_path / name).write_text(example)
    code, out, err = in_process(f"{name}:factory", cwd=tmp_path)
    assert code == 0, out + err
    assert out.splitlines()[2].startswith("verdict: OK, ")
    assert "torchvision" not in example.replace("no torchvision", "")
    assert "transformers" not in example.replace("no transformers", "")


def test_docs_has_both_examples() -> None:
    assert sorted(b.split()[1] for b in EXAMPLES) == ["my_cnn.py:", "tiny_gpt.py:"]


def _shape(report: str) -> list[str]:
    """What a pasted report must share with a fresh run on any build: the header without the
    torch version, the verdict, the problems, and the parameter rows' names and marks."""
    lines = report.strip().splitlines()
    keep = [lines[0].rsplit(", torch ", 1)[0], lines[2]]
    keep += [line.split(": step")[0] for line in lines if line.startswith("  ! ")]
    start, end = lines.index(next(x for x in lines if x.startswith("PARAMETERS ("))), None
    for i in range(start + 1, len(lines)):
        if not lines[i].strip():
            end = i
            break
    keep += [line[:1] + line.split()[0 if line[0] == " " else 1] for line in lines[start:end]]
    return keep


PASTED = [b for b in _doc_blocks("") if b.startswith("fakegrad_patch verify: ")]


@pytest.mark.parametrize("pasted", PASTED, ids=lambda b: b.split()[2].rstrip(","))
def test_docs_pasted_reports_are_what_the_command_prints(
    in_process: Callable[..., tuple[int, str, str]], pasted: str
) -> None:
    command = DOC[: DOC.index(pasted)].rsplit("python -m fakegrad_patch verify ", 1)[1]
    spec = command.split("`")[0].split()[0]
    code, out, err = in_process(spec, cwd=ROOT)
    assert code == (0 if "verdict: OK" in pasted else 1), err
    assert _shape(out) == _shape(pasted)
    assert len(PASTED) == 2
