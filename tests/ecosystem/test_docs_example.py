"""docs/verify.md's Hugging Face example runs as printed: as a script (``verify`` on the model,
verdict OK) and through the command (``python -m fakegrad_patch verify file:factory``)."""

from __future__ import annotations

import pathlib
import runpy

import pytest

from fakegrad_patch.__main__ import main

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "verify.md"
FIRST_LINE = "# hf_llama.py"


def _example() -> str:
    text = DOC.read_text(encoding="utf-8")
    start = text.index(f"```python\n{FIRST_LINE}") + len("```python\n")
    return text[start : text.index("```", start)]


@pytest.fixture
def example(tmp_path: pathlib.Path) -> pathlib.Path:
    pytest.importorskip("transformers")
    path = tmp_path / "hf_llama.py"
    path.write_text(_example(), encoding="utf-8")
    return path


@pytest.mark.filterwarnings("ignore::fakegrad_patch.FakeGradPatchWarning")
def test_hf_example_runs_as_a_script(example: pathlib.Path, capsys: pytest.CaptureFixture) -> None:
    runpy.run_path(str(example), run_name="__main__")  # assert_ok() inside raises on a mismatch
    out = capsys.readouterr().out
    assert "verdict: OK" in out and "model.embed_tokens.weight" in out, out


@pytest.mark.filterwarnings("ignore::fakegrad_patch.FakeGradPatchWarning")
def test_hf_example_runs_through_the_command(
    example: pathlib.Path, capsys: pytest.CaptureFixture
) -> None:
    assert main(["verify", f"{example}:factory"]) == 0, capsys.readouterr().out
    assert "verdict: OK" in capsys.readouterr().out
