"""The README's promises: its example runs and does what it says; CI runs its test command."""

from __future__ import annotations

import configparser
import pathlib
import subprocess
import sys

import pytest

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
    envs = suite.rsplit(" -e ", 1)[1].split(",")
    # the oldest supported build, the local CPU build, 2.14.1, the newest, the lowest wrapt and
    # structlog, lint and the wheel/sdist check
    assert set(envs) >= {"lint", "dist", "oldest", "torch213", "torch214", "newest", "lowest"}
    ci = (ROOT / ".ci" / "run").read_text()
    assert suite in ci.splitlines()


def _tox_ini() -> configparser.ConfigParser:
    ini = configparser.ConfigParser(interpolation=None)
    ini.read(ROOT / "tox.ini")
    return ini


def _suite_envs() -> list[str]:
    """The envs of the README's test command (``tox -p ... -e a,b,...``), in its order."""
    (suite,) = [b.strip() for b in _blocks("") if "tox -p " in b]
    return suite.rsplit(" -e ", 1)[1].split(",")


def test_every_env_the_readme_runs_exists_and_ci_runs_the_env_list() -> None:
    ini = _tox_ini()
    envs = _suite_envs()
    for env in envs:
        assert ini.has_section(f"testenv:{env}"), env
    env_list = [e.strip() for e in ini["tox"]["env_list"].split(",")]
    assert env_list == envs


def test_declared_ranges_are_the_tested_ones() -> None:
    """pyproject's torch floor is the `oldest` env's build, its newest classifier Python is
    the newest env's first interpreter, and requires-python is the lowest interpreter used."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+; the other envs check it

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    ini = _tox_ini()
    oldest = ini["testenv:oldest"]["deps"].strip()
    assert f"torch>={oldest.split('==')[1]}" in project["dependencies"]
    pythons = set()
    for section in ini.sections():
        if section.startswith("testenv:") and "base_python" in ini[section]:
            first = ini[section]["base_python"].split(",")[0].strip()
            pythons.add(first.removeprefix("python"))
    classified = {
        c.rsplit(" :: ", 1)[1]
        for c in project["classifiers"]
        if c.startswith("Programming Language :: Python :: 3.")
    }
    assert pythons <= classified, (pythons, classified)
    lowest = min(classified, key=lambda v: tuple(map(int, v.split("."))))
    assert project["requires-python"] == f">={lowest}"


def test_ci_does_not_hide_failures() -> None:
    """`set -e` and no `|| true`/ignored commands: pytest's exit 5 must reach CI."""
    ci = (ROOT / ".ci" / "run").read_text()
    assert "set -euo pipefail" in ci
    assert "|| true" not in ci
    ini = (ROOT / "tox.ini").read_text()
    assert "ignore_outcome" not in ini and "ignore_errors" not in ini
    for line in ini.splitlines():
        assert not line.strip().startswith("- "), line  # tox's "ignore this exit code" prefix


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


def _lines(ini: configparser.ConfigParser, section: str, key: str) -> list[str]:
    """An env's ``key`` (``set_env``, ``deps``) line by line, tox's ``{[section]key}``
    references expanded in place."""
    raw = ini[section].get(key, "") if ini.has_section(section) else ""
    ref = f"]{key}}}"
    out: list[str] = []
    for line in raw.strip().splitlines():
        line = line.strip()
        if line.startswith("{[") and line.endswith(ref):
            out += _lines(ini, line[2 : -len(ref)], key)
        elif line:
            out.append(line)
    return out


def _set_env(ini: configparser.ConfigParser, section: str) -> dict[str, str]:
    """An env's ``set_env``, with tox's ``{[section]set_env}`` references expanded."""
    pairs = (line.split("=", 1) for line in _lines(ini, section, "set_env") if "=" in line)
    return {key.strip(): value.strip() for key, value in pairs}


def _ci_runs() -> dict[str, set[str]]:
    """The test files each torch env of the CI command runs (lint and dist left out)."""
    import _scopes

    ini = _tox_ini()
    envs = [e for e in _suite_envs() if e not in ("lint", "dist")]
    files = {p.name for p in (ROOT / "tests").glob("test_*.py")}
    runs: dict[str, set[str]] = {}
    for env in envs:
        values = {**_set_env(ini, "testenv"), **_set_env(ini, f"testenv:{env}")}
        scope = values.get("FAKEGRAD_TEST_SCOPE", "all")
        assert scope in _scopes.SCOPES, (env, scope)
        left = _scopes.left_out(scope, _scopes.elsewhere(values.get("FAKEGRAD_TEST_ELSEWHERE", "")))
        runs[env] = files - left
    return runs


def _torch_pin(ini: configparser.ConfigParser, section: str) -> str:
    """The ``torch==X`` an env's ``deps`` pin, ``{[section]deps}`` references followed."""
    pins = [line for line in _lines(ini, section, "deps") if line.startswith("torch==")]
    return pins[0][len("torch==") :] if pins else ""


def test_every_test_file_runs_in_an_env_of_the_ci_command() -> None:
    """Envs leave files to each other (FAKEGRAD_TEST_SCOPE, FAKEGRAD_TEST_ELSEWHERE: issue 26);
    none may be left out everywhere, and the builds keep what is theirs: every torch build of
    the CI command runs PT2 coexistence and can_fail, the newest build PT2's inductor groups,
    and the build-independent files run on the lowest wrapt/structlog (lowest) and on the
    newest Python (newest)."""
    import _scopes

    runs = _ci_runs()
    files = {p.name for p in (ROOT / "tests").glob("test_*.py")}
    nowhere = files - set().union(*runs.values())
    assert not nowhere, f"left out by every env of the CI command: {sorted(nowhere)}"
    for env in ("oldest", "torch213", "torch214", "newest"):  # one env per torch build
        assert {"test_pt2_coexistence.py", "test_can_fail.py"} <= runs[env], env
    assert "test_pt2_inductor.py" in runs["newest"]  # inductor's groups (test_pt2_inductor.py)
    assert runs["lowest"] >= _scopes.BUILD_INDEPENDENT
    assert runs["newest"] >= _scopes.BUILD_INDEPENDENT


def test_the_ci_builds_run_every_window_of_the_fuzz_gate() -> None:
    """tests/test_fuzz.py: each build runs one window of seeds; the CI command's builds that run
    the gate must run every window, each once (no seed of the gate left out, none twice)."""
    import test_fuzz

    ini = _tox_ini()
    windows = []
    for env, files in _ci_runs().items():
        if "test_fuzz.py" in files:
            pin = _torch_pin(ini, f"testenv:{env}")
            assert pin, f"{env}: no torch==X in its deps"
            windows.append(test_fuzz.gate_seeds(pin)[0] // test_fuzz.WINDOW)
    assert sorted(windows) == list(range(len(test_fuzz.WINDOWS))), windows
