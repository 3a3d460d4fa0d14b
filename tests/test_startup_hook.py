"""The ``FAKEGRAD_PATCH=1`` start-up hook, in a venv where pip installed the wheel (issues 11, 13).

* lazy activation: until torch's import begins, nothing but the stdlib-only hook module loads
  (the exact module set is compared with the same venv's with the variable unset); every way of
  importing torch (statement, submodule, importlib, thread, before site ends, already imported,
  ``-I``) then gets the patch;
* messages: never on stdout (stderr closed), bounded and escaped (huge or hostile values), and
  agreeing with what happened (``-W error`` with an invalid policy).
"""

from __future__ import annotations

import json
import subprocess
import textwrap
from pathlib import Path

import pytest
from _activation_venv import Venv, bare_venv, clean_env, wheel_venv

from fakegrad_patch import _config
from fakegrad_patch._activation import startup as _startup

pytestmark = pytest.mark.slow

HOOK = _startup.hook_module()
NUMPY_QUIET = ("-W", "ignore:Failed to initialize NumPy:UserWarning")

#: Prints the patch state and whether a fake step gives the real parameter a real gradient.
CHECK = textwrap.dedent(
    """
    import json, sys
    import torch
    import torch._functorch.config as functorch_config
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    import fakegrad_patch, _fakegrad_patch_startup as hook

    def fake_step():
        lin = torch.nn.Linear(3, 2)
        with functorch_config.patch(fake_tensor_propagate_real_tensors=True):
            with FakeTensorMode(allow_non_fake_inputs=True):
                lin(torch.randn(4, 3)).sum().backward()
        return "fake" if isinstance(lin.weight.grad, FakeTensor) else "real"

    print(json.dumps({"installed": fakegrad_patch.is_installed(), "grad": fake_step(),
                      "state": hook.state}))
    """
)


@pytest.fixture(scope="module")
def venv() -> Venv:
    return wheel_venv()


def _modules(venv: Venv, env: dict[str, str]) -> list[str]:
    result = venv.run("import sys; print('\\n'.join(sorted(sys.modules)))", env=env)
    assert result.returncode == 0 and result.stderr == "", result.stderr
    return result.stdout.split()


# -- lazy activation (issue 13) ----------------------------------------------------------------


@pytest.mark.parametrize("value", ["1", "on"])
def test_on_loads_only_the_hook_module_until_torch(venv: Venv, value: str) -> None:
    unset = _modules(venv, {})
    on = _modules(venv, {"FAKEGRAD_PATCH": value})
    assert sorted(set(on) - set(unset)) == ["_fakegrad_patch_startup"]
    assert set(unset) <= set(on)


IMPORT_FORMS = {
    "statement": "import torch\n",
    "submodule-first": "import torch.nn\n",
    "from-import": "from torch import nn\n",
    "importlib": "import importlib\nimportlib.import_module('torch')\n",
    "thread": (
        "import threading, importlib\n"
        "t = threading.Thread(target=importlib.import_module, args=('torch',))\n"
        "t.start(); t.join()\n"
    ),
    "probe-first": (
        "import importlib.util\nassert importlib.util.find_spec('torch')\nimport torch\n"
    ),
}


@pytest.mark.parametrize("form", list(IMPORT_FORMS))
def test_every_way_of_importing_torch_activates(venv: Venv, form: str) -> None:
    result = venv.run(IMPORT_FORMS[form] + CHECK, env={"FAKEGRAD_PATCH": "1"})
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout.splitlines()[-1])
    assert (out["installed"], out["grad"]) == (True, "real")
    assert out["state"]["activated_by"] == "pth" and not out["state"]["waiting_for_torch"]
    assert result.stderr == ""


def test_torch_imported_before_site_ends(venv: Venv, tmp_path: Path) -> None:
    """A sitecustomize.py that imports torch: at the end of site torch is there, so the hook
    activates at once (no import hook needed)."""
    (tmp_path / "sitecustomize.py").write_text("import torch\n")
    result = venv.run(CHECK, env={"FAKEGRAD_PATCH": "1", "PYTHONPATH": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout.splitlines()[-1])
    assert (out["installed"], out["grad"]) == (True, "real")
    assert result.stderr == ""


def test_isolated_mode(venv: Venv) -> None:
    result = venv.run(CHECK, env={"FAKEGRAD_PATCH": "1"}, options=("-I", *NUMPY_QUIET))
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout.splitlines()[-1])
    assert (out["installed"], out["grad"]) == (True, "real")


def test_hook_and_config_agree_on_valid_policies() -> None:
    """The hook checks FAKEGRAD_ON_MISSING without importing the package: same values."""
    assert HOOK.ON_MISSING_VALUES == _config.ON_MISSING_VALUES
    assert HOOK.ENV_ON_MISSING == _config.ENV_ON_MISSING


def test_invalid_policy_is_still_reported_at_start(venv: Venv) -> None:
    """An invalid FAKEGRAD_ON_MISSING is not left for the first ``import torch``: one warning at
    start, from a process that never imports torch."""
    result = venv.run("print('ran')", env={"FAKEGRAD_PATCH": "1", "FAKEGRAD_ON_MISSING": "often"})
    assert result.returncode == 0 and result.stdout == "ran\n"
    assert result.stderr.count("FakeGradPatchWarning") == 1
    assert "FAKEGRAD_ON_MISSING" in result.stderr and "'often'" in result.stderr


# -- messages (issue 11) -----------------------------------------------------------------------


def test_W_error_bad_policy_message_agrees_with_state(venv: Venv) -> None:
    """``-W error`` turns the policy warning into an exception inside the hook: the patch is
    installed (default policy), and the one line says so, not 'not activated'. (torch itself
    does not import under ``-W error``, so the check stops before torch.)"""
    code = (
        "import json, fakegrad_patch, _fakegrad_patch_startup as hook\n"
        "s1 = fakegrad_patch.settings().on_missing; s2 = fakegrad_patch.settings().on_missing\n"
        "print(json.dumps([fakegrad_patch.status()['wanted'], s1, s2, hook.state]))\n"
    )
    env = {"FAKEGRAD_PATCH": "1", "FAKEGRAD_ON_MISSING": "bogus"}
    result = venv.run(code, env=env, options=("-W", "error", *NUMPY_QUIET))
    assert result.returncode == 0, result.stderr
    wanted, s1, s2, state = json.loads(result.stdout.splitlines()[0])
    assert (wanted, s1, s2) == (True, "drop", "drop")
    assert state["activated_by"] == "pth" and state["error"] is None
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert "not activated" not in lines[0] and "without the patch" not in lines[0]
    assert "FAKEGRAD_ON_MISSING" in lines[0] and "'drop'" in lines[0]
    assert lines[0] == state["warning"]


def _stderr_closed(venv: Venv, code: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """Run ``code`` with file descriptor 2 closed, as ``python -c code 2>&-`` does."""
    return subprocess.run(
        ["sh", "-c", 'exec "$0" "$@" 2>&-', venv.python, "-c", code],
        env=clean_env(env),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.parametrize(
    ("env", "code"),
    [
        ({"FAKEGRAD_PATCH": "maybe"}, "print('OUT')"),
        ({"FAKEGRAD_PATCH": "1", "FAKEGRAD_ON_MISSING": "bogus"}, "print('OUT')"),
        ({"FAKEGRAD_PATCH": "1", "BROKEN_WRAPT": "1"}, "import torch\nprint('OUT')"),
    ],
    ids=["invalid-value", "invalid-policy", "activation-failure"],
)
def test_closed_stderr_never_writes_to_stdout(
    venv: Venv, tmp_path: Path, env: dict[str, str], code: str
) -> None:
    if env.pop("BROKEN_WRAPT", None):
        (tmp_path / "wrapt").mkdir()
        (tmp_path / "wrapt" / "__init__.py").write_text("raise ImportError('broken wrapt')\n")
        env["PYTHONPATH"] = str(tmp_path)
    # Control: with stderr open, there is a message (so the test below can fail).
    open_run = venv.run(code, env=env)
    assert open_run.stdout == "OUT\n" and "fakegrad_patch" in open_run.stderr
    closed = _stderr_closed(venv, code, env)
    assert closed.returncode == 0
    assert closed.stdout == "OUT\n"


def test_sitecustomize_route_with_closed_stderr(tmp_path: Path) -> None:
    (tmp_path / "sitecustomize.py").write_text(HOOK.sitecustomize_line() + "\n")
    bare = bare_venv()
    env = {"FAKEGRAD_PATCH": "bogus", "PYTHONPATH": str(tmp_path)}
    assert "not understood" in bare.run("print('OUT')", env=env).stderr
    closed = _stderr_closed(bare, "print('OUT')", env)
    assert closed.returncode == 0 and closed.stdout == "OUT\n"


HOSTILE = {
    "huge": "x" * 100_000,
    "escape-sequence": "\x1b[31mred\x1b[0m",
    "bell-and-cr": "on\x07\rfake",
    "newline": "1\nfakegrad_patch: activated",
    "bidi": "\u202eno",
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_bogus_value_is_echoed_bounded_and_escaped(venv: Venv, tmp_path: Path, name: str) -> None:
    raw = HOSTILE[name]
    bare = bare_venv()
    (tmp_path / "sitecustomize.py").write_text(HOOK.sitecustomize_line() + "\n")
    for route, run in (
        ("pth", venv.run("pass", env={"FAKEGRAD_PATCH": raw})),
        (
            "sitecustomize",
            bare.run("pass", env={"FAKEGRAD_PATCH": raw, "PYTHONPATH": str(tmp_path)}),
        ),
    ):
        assert run.returncode == 0
        assert run.stderr.endswith("\n") and run.stderr.count("\n") == 1, (route, run.stderr)
        assert len(run.stderr) < 300, (route, len(run.stderr))
        assert run.stderr.isascii() and run.stderr[:-1].isprintable(), (route, run.stderr)
        assert "not understood" in run.stderr


def test_without_wrapt_the_hook_warns_once_and_torch_imports_unpatched(
    venv: Venv, tmp_path: Path
) -> None:
    """wrapt missing (a sitecustomize.py blocks it): the hook still activates the package when
    torch's import begins, install() warns once, torch is untouched, the program runs."""
    (tmp_path / "sitecustomize.py").write_text(
        "import sys\n"
        "class _NoWrapt:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'wrapt':\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, _NoWrapt())\n"
    )
    result = venv.run(CHECK, env={"FAKEGRAD_PATCH": "1", "PYTHONPATH": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout.splitlines()[-1])
    assert (out["installed"], out["grad"]) == (False, "fake")
    assert out["state"]["activated_by"] == "pth" and out["state"]["error"] is None
    assert result.stderr.count("FakeGradPatchWarning") == 1, result.stderr
    assert "wrapt is not installed; not patching" in result.stderr
