"""The README's promises: its example runs and does what it says; CI runs its test command."""

from __future__ import annotations

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _blocks(lang: str) -> list[str]:
    """Bodies of the fenced code blocks whose info string is ``lang``."""
    blocks, body, info = [], [], None
    for line in README.splitlines():
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


def test_ci_runs_the_readme_test_command() -> None:
    commands = [b.strip() for b in _blocks("") if "tox" in b]
    assert len(commands) == 2, commands  # exactly two commands for a new user
    demo, suite = commands
    assert demo.endswith("tox -e demo")
    assert "torch213" in suite and "torch214" in suite
    ci = (ROOT / ".ci" / "run").read_text()
    assert suite in ci.splitlines()


def test_readme_example_runs_and_ends_with_eager_gradients(tmp_path: pathlib.Path) -> None:
    (example,) = _blocks("python")
    script = example + (
        "\nref = torch.nn.Linear(8, 2)\n"
        "assert isinstance(model.weight.grad, torch.Tensor)\n"
        "from torch._subclasses.fake_tensor import FakeTensor\n"
        "assert not isinstance(model.weight.grad, FakeTensor)\n"
        "print('ok')\n"
    )
    path = tmp_path / "example.py"
    path.write_text(script)
    out = subprocess.run(
        [sys.executable, str(path)], capture_output=True, text=True, timeout=300, check=False
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[0] == "Tensor"
    assert out.stdout.splitlines()[-1] == "ok"
