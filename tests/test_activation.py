"""Activation: ``import fakegrad_patch``, ``FAKEGRAD_PATCH=1`` (the ``.pth`` / ``.start`` start-up
hook), the sitecustomize route, ``pytest -p fakegrad_patch``, the version gate, and the promise
never to break the host program. Every behaviour is checked in a fresh interpreter of a venv
where pip really installed the package (see tests/_activation_venv.py)."""

from __future__ import annotations

import json
import pkgutil
import sys
import textwrap
from pathlib import Path

import pytest
from _activation_venv import ROOT, Venv, bare_venv, editable_venv, run, startup_overhead, wheel_venv

import fakegrad_patch
from fakegrad_patch._activation import startup as _startup

pytestmark = pytest.mark.slow

HOOK = _startup.hook_module()
HOOKS_DIR = ROOT / "fakegrad_patch" / "_activation" / "hooks"
WATCHED = ("fakegrad_patch", "_fakegrad_patch_startup", "wrapt", "structlog", "torch")

#: Prints which of our (or heavy) modules the start-up imported, then the hook's state.
PROBE = textwrap.dedent(
    f"""
    import json, sys
    watched = {WATCHED!r}
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in watched)
    hook = sys.modules.get("_fakegrad_patch_startup")
    print(json.dumps({{"loaded": loaded, "state": hook.state if hook else None}}))
    """
)

#: A fake training step: with the patch, the real parameter receives a real gradient; upstream
#: (no patch) it receives a FakeTensor.
FAKE_STEP = textwrap.dedent(
    """
    import torch
    import torch._functorch.config as functorch_config
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    def fake_step():
        lin = torch.nn.Linear(3, 2)
        with functorch_config.patch(fake_tensor_propagate_real_tensors=True):
            with FakeTensorMode(allow_non_fake_inputs=True):
                lin(torch.randn(4, 3)).sum().backward()
        return "fake" if isinstance(lin.weight.grad, FakeTensor) else "real"
    """
)

#: Is the converter wrapped exactly once by us, and is the original function object back after
#: uninstall? ``ORIGINAL`` is captured before fakegrad_patch is imported.
WRAP_STATE = textwrap.dedent(
    """
    import wrapt
    from torch._subclasses.fake_tensor import FakeTensorConverter as C

    def wrap_state():
        attr = C.__dict__.get("from_real_tensor")
        if attr is ORIGINAL:
            return "original"
        assert isinstance(attr, wrapt.FunctionWrapper), type(attr)
        assert attr.__wrapped__ is ORIGINAL, "double-wrapped or wrong original"
        return "wrapped-once"
    """
)


@pytest.fixture(scope="module")
def venv() -> Venv:
    return wheel_venv()


@pytest.fixture(scope="module")
def bare() -> Venv:
    return bare_venv()


def probe(venv: Venv, env: dict[str, str] | None = None, options: tuple[str, ...] = ()) -> dict:
    result = venv.run(PROBE, env=env, options=options)
    assert result.returncode == 0, result.stderr
    return {**json.loads(result.stdout.strip().splitlines()[-1]), "stderr": result.stderr}


# -- the shipped files -----------------------------------------------------------------------------


def test_hook_files_match_the_hook_module() -> None:
    pth = (HOOKS_DIR / "fakegrad_patch.pth").read_text(encoding="ascii").splitlines()
    assert pth == [HOOK.PTH_LINE]
    start = [
        line
        for line in (HOOKS_DIR / "fakegrad_patch.start").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert start == [HOOK.START_ENTRY]


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (None, False),
        ("", False),
        ("  ", False),
        ("0", False),
        ("false", False),
        ("No", False),
        ("OFF", False),
        ("1", True),
        ("true", True),
        (" YES ", True),
        ("On", True),
        ("2", None),
        ("enable", None),
        ("1;", None),
    ],
)
def test_values_are_parsed_strictly(raw: str | None, expected: bool | None) -> None:
    assert HOOK.parse(raw) is expected


def test_pth_line_and_hook_parse_the_same_off_values() -> None:
    """The .pth line filters off-values itself (nothing imported); it must agree with parse()."""
    for raw in ["", "0", "false", "no", "off", " Off ", "1", "on", "garbage"]:
        namespace: dict[str, object] = {}
        code = HOOK.PTH_LINE.replace('__import__("_fakegrad_patch_startup").init()', "CALLED()")
        called: list[bool] = []
        env_code = code.replace('os.environ.get("FAKEGRAD_PATCH", "")', repr(raw))
        exec(env_code, {"CALLED": lambda calls=called: calls.append(True)}, namespace)
        assert bool(called) == (HOOK.parse(raw) is not False), raw


def test_wheel_installs_hook_at_site_packages_root(venv: Venv) -> None:
    for name in ("fakegrad_patch.pth", "fakegrad_patch.start", "_fakegrad_patch_startup.py"):
        assert (venv.site_packages / name).is_file(), name
    assert (venv.site_packages / "fakegrad_patch" / "_activation" / "startup.py").is_file()
    assert not (venv.site_packages / "sitecustomize.py").exists()


# -- FAKEGRAD_PATCH off: nothing at all ------------------------------------------------------------


@pytest.mark.parametrize("value", [None, "", "0", "off", "No", "FALSE"])
def test_off_imports_nothing(venv: Venv, bare: Venv, value: str | None) -> None:
    env = {} if value is None else {"FAKEGRAD_PATCH": value}
    result = probe(venv, env)
    assert result["loaded"] == [] and result["state"] is None
    assert result["stderr"] == ""
    # The exact module set equals that of the same venv without fakegrad_patch installed.
    code = "import sys; print(sorted(sys.modules))"
    with_pkg, without = venv.run(code, env=env), bare.run(code, env=env)
    assert with_pkg.stdout == without.stdout and with_pkg.stdout


def test_python_S_never_processes_the_hook(venv: Venv) -> None:
    result = probe(venv, {"FAKEGRAD_PATCH": "1"}, options=("-S",))
    assert result["loaded"] == [] and result["state"] is None


# -- FAKEGRAD_PATCH on -----------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["1", "true", "YES", " on "])
def test_on_arms_the_hook_and_imports_nothing_else_until_torch(venv: Venv, value: str) -> None:
    """Until torch's import begins only the stdlib-only hook module is loaded (issue 13: a
    process that never imports torch must not pay for wrapt or the package); then it activates."""
    result = probe(venv, {"FAKEGRAD_PATCH": value})
    assert result["loaded"] == ["_fakegrad_patch_startup"]
    assert result["state"]["waiting_for_torch"] is True
    assert result["state"]["activated_by"] is None
    assert result["stderr"] == ""
    after = venv.run("import torch\n" + PROBE, env={"FAKEGRAD_PATCH": value})
    state = json.loads(after.stdout.strip().splitlines()[-1])
    assert "fakegrad_patch" in state["loaded"] and "wrapt" in state["loaded"]
    assert state["state"]["activated_by"] == "pth"
    assert state["state"]["waiting_for_torch"] is False
    assert after.stderr == ""


def test_on_patches_once_torch_is_imported_and_bad_policy_only_warns(venv: Venv) -> None:
    code = FAKE_STEP + textwrap.dedent(
        """
        import fakegrad_patch, _fakegrad_patch_startup as hook
        print(fakegrad_patch.is_installed(), hook.state["activated_by"], fake_step())
        """
    )
    env = {"FAKEGRAD_PATCH": "1", "FAKEGRAD_ON_MISSING": "garbage"}
    result = venv.run(code, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "pth", "real"]
    assert "FAKEGRAD_ON_MISSING" in result.stderr
    assert result.stderr.count("FakeGradPatchWarning") == 1


def test_variable_plus_import_plus_second_pth_apply_once(venv: Venv) -> None:
    """The hook run again (same .pth seen twice), explicit import and install(): one wrapper."""
    code = (
        "from torch._subclasses.fake_tensor import FakeTensorConverter as C\n"
        "import fakegrad_patch\n"
        "ORIGINAL = C.from_real_tensor.__wrapped__\n"
        + WRAP_STATE
        + textwrap.dedent(
            """
            import site, sysconfig, _fakegrad_patch_startup as hook
            site.addpackage(sysconfig.get_paths()["purelib"], "fakegrad_patch.pth", set())
            hook.init()
            fakegrad_patch.install()
            import fakegrad_patch as again
            again.install()
            print(wrap_state(), hook.state["activated_by"])
            """
        )
    )
    result = venv.run(code, env={"FAKEGRAD_PATCH": "1"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["wrapped-once", "pth"]
    assert result.stderr == ""


def test_invalid_value_warns_once_and_activates_nothing(venv: Venv) -> None:
    code = PROBE + (
        "import site, sysconfig, _fakegrad_patch_startup as hook\n"
        "site.addpackage(sysconfig.get_paths()['purelib'], 'fakegrad_patch.pth', set())\n"
        "print('still running')"
    )
    result = venv.run(code, env={"FAKEGRAD_PATCH": "maybe"})
    assert result.returncode == 0
    assert result.stderr.splitlines() == [HOOK.invalid_message("maybe")]
    loaded = json.loads(result.stdout.splitlines()[0])["loaded"]
    assert loaded == ["_fakegrad_patch_startup"]
    assert result.stdout.splitlines()[-1] == "still running"


def test_import_failure_at_start_up_prints_one_line_and_continues(
    venv: Venv, tmp_path: Path
) -> None:
    broken = tmp_path / "wrapt"
    broken.mkdir()
    (broken / "__init__.py").write_text("raise ImportError('simulated broken wrapt')\n")
    # The package (and wrapt) are imported when torch's import begins.
    result = venv.run(
        "import torch\nprint('program ran')",
        env={"FAKEGRAD_PATCH": "1", "PYTHONPATH": str(tmp_path)},
    )
    assert result.returncode == 0
    assert result.stdout.strip() == "program ran"
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("fakegrad_patch: not activated (pth): ImportError")
    assert "simulated broken wrapt" in lines[0]


def test_pep829_start_entry_point(venv: Venv) -> None:
    """What Python 3.15's site does with fakegrad_patch.start: resolve and call, no arguments.
    Outside site.main() the hook activates at once."""
    code = f"import pkgutil, sys\npkgutil.resolve_name({HOOK.START_ENTRY!r})()\n" + PROBE
    off = venv.run(code)
    assert json.loads(off.stdout)["loaded"] == ["_fakegrad_patch_startup"]
    on = venv.run(code, env={"FAKEGRAD_PATCH": "1"})
    state = json.loads(on.stdout)
    assert state["loaded"] == ["_fakegrad_patch_startup"]
    assert state["state"]["waiting_for_torch"] is True
    on = venv.run(code + "import torch\n" + PROBE, env={"FAKEGRAD_PATCH": "1"})
    state = json.loads(on.stdout.splitlines()[-1])
    assert "fakegrad_patch" in state["loaded"]
    assert state["state"]["activated_by"] == "pth"
    assert callable(pkgutil.resolve_name("fakegrad_patch._activation.startup:hook_module"))


def test_editable_install_activates_too() -> None:
    venv = editable_venv()
    for name in ("fakegrad_patch.pth", "fakegrad_patch.start", "_fakegrad_patch_startup.py"):
        assert (venv.site_packages / name).is_file(), name
    code = FAKE_STEP + textwrap.dedent(
        """
        import fakegrad_patch
        print(fakegrad_patch.is_installed(), fake_step(), fakegrad_patch.__file__)
        """
    )
    result = venv.run(code, env={"FAKEGRAD_PATCH": "1"})
    assert result.returncode == 0, result.stderr
    installed, outcome, path = result.stdout.split()
    assert (installed, outcome) == ("True", "real")
    assert Path(path).is_relative_to(ROOT)
    assert probe(venv)["loaded"] == []


# -- import fakegrad_patch, install / uninstall orders ---------------------------------------------


def test_import_does_not_import_torch(venv: Venv) -> None:
    result = venv.run(
        "import sys, fakegrad_patch\n"
        "print('torch' in sys.modules, fakegrad_patch.status()['waiting_for_torch'])"
    )
    assert result.stdout.split() == ["False", "True"], result.stderr


ORDERS = {
    # name: (script body, expected output)
    "import-before-torch": (
        "import fakegrad_patch\n"
        "from torch._subclasses.fake_tensor import FakeTensorConverter as C\n"
        "ORIGINAL = C.from_real_tensor.__wrapped__\n" + WRAP_STATE + FAKE_STEP + "\n"
        "out = [wrap_state(), fake_step()]\n"
        "fakegrad_patch.uninstall(); out += [wrap_state(), fake_step()]\n"
        "fakegrad_patch.install(); fakegrad_patch.install(); out += [wrap_state(), fake_step()]\n"
        "print(*out)",
        "wrapped-once real original fake wrapped-once real",
    ),
    "import-after-torch": (
        "from torch._subclasses.fake_tensor import FakeTensorConverter as C\n"
        "ORIGINAL = C.__dict__['from_real_tensor']\n"
        "import fakegrad_patch\n" + WRAP_STATE + FAKE_STEP + "\n"
        "out = [wrap_state(), fake_step()]\n"
        "fakegrad_patch.uninstall(); fakegrad_patch.uninstall(); out += [wrap_state()]\n"
        "fakegrad_patch.install(); out += [wrap_state(), fake_step()]\n"
        "fakegrad_patch.uninstall()\n"
        "with fakegrad_patch.patched():\n"
        "    with fakegrad_patch.patched():\n"
        "        out += [wrap_state(), fake_step()]\n"
        "    out += [wrap_state()]\n"
        "out += [wrap_state(), fake_step()]\n"
        "print(*out)",
        "wrapped-once real original wrapped-once real wrapped-once real wrapped-once original fake",
    ),
    "uninstall-before-torch": (
        "import fakegrad_patch\n"
        "fakegrad_patch.uninstall()\n"
        "from torch._subclasses.fake_tensor import FakeTensorConverter as C\n"
        "ORIGINAL = C.__dict__['from_real_tensor']\n" + WRAP_STATE + FAKE_STEP + "\n"
        "out = [fakegrad_patch.is_installed(), wrap_state(), fake_step()]\n"
        "fakegrad_patch.install(); out += [wrap_state(), fake_step()]\n"
        "print(*out)",
        "False original fake wrapped-once real",
    ),
}


@pytest.mark.parametrize("order", list(ORDERS))
def test_install_uninstall_orders(venv: Venv, order: str) -> None:
    code, expected = ORDERS[order]
    result = venv.run(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == expected


def test_pytest_p_fakegrad_patch(tmp_path: Path) -> None:
    (tmp_path / "test_inside.py").write_text(
        "import torch\nimport fakegrad_patch\n\n"
        "def test_installed():\n    assert fakegrad_patch.is_installed()\n"
    )
    (tmp_path / "conftest.py").write_text(
        "import sys\n\ndef pytest_configure(config):\n"
        "    print('PRELOADED', 'fakegrad_patch' in sys.modules)\n"
    )
    base = [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider"]
    env = {"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", "PYTHONPATH": str(ROOT)}
    with_p = run([*base, "-p", "fakegrad_patch", "test_inside.py"], env=env, cwd=tmp_path)
    assert with_p.returncode == 0, with_p.stdout + with_p.stderr
    assert "PRELOADED True" in with_p.stdout
    # Control: without -p the package is not loaded (so -p is what loaded it above).
    (tmp_path / "test_plain.py").write_text("def test_nothing():\n    pass\n")
    without = run([*base, "test_plain.py"], env=env, cwd=tmp_path)
    assert "PRELOADED False" in without.stdout


# -- version gate ----------------------------------------------------------------------------------

MUTATIONS = {
    "changed-signature": (
        "from torch._subclasses.fake_tensor import FakeTensorConverter\n"
        "_orig = FakeTensorConverter.from_real_tensor\n"
        "def from_real_tensor(self, mode, tensor, *args, **kwargs):\n"
        "    return _orig(self, mode, tensor, *args, **kwargs)\n"
        "FakeTensorConverter.from_real_tensor = from_real_tensor\n",
        "FakeTensorConverter.from_real_tensor",
    ),
    "missing-attribute": (
        "import torch\ndel torch._C._ForceDispatchKeyGuard\n",
        "_ForceDispatchKeyGuard",
    ),
}


@pytest.mark.parametrize("mutation", list(MUTATIONS))
def test_unsupported_torch_is_not_patched(venv: Venv, mutation: str) -> None:
    mutate, target = MUTATIONS[mutation]
    code = (
        "import json, torch\n" + mutate + FAKE_STEP + "import fakegrad_patch\n"
        "fakegrad_patch.install()\n"
        "s = fakegrad_patch.status()\n"
        "print(fakegrad_patch.is_installed(), fake_step(), fake_step(),"
        " bool(s['skipped_reason']))\n"
        "from fakegrad_patch._tools import doctor as _doctor\n"
        "report = _doctor.collect()\n"
        "print(json.dumps(report['problems']))\n"
    )
    result = venv.run(code)
    assert result.returncode == 0, result.stderr
    first, problems = result.stdout.splitlines()
    assert first.split() == ["False", "fake", "fake", "True"]
    warnings = [line for line in result.stderr.splitlines() if "FakeGradPatchWarning" in line]
    assert len(warnings) == 1, result.stderr
    import torch

    assert target in warnings[0] and f"torch {torch.__version__}" in warnings[0]
    # ... and doctor says so (a problem means a non-zero exit status).
    assert any(target in p for p in json.loads(problems)), problems
    assert any("wanted but not applied" in p for p in json.loads(problems)), problems


# -- doctor ----------------------------------------------------------------------------------------


def test_doctor_reports_an_activated_environment(venv: Venv) -> None:
    result = run(
        [venv.python, "-m", "fakegrad_patch", "doctor", "--json"], env={"FAKEGRAD_PATCH": "1"}
    )
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout)
    import torch
    import wrapt

    assert (
        report["versions"]["torch"] == torch.__version__.split("+")[0]
        or report["versions"]["torch"] == torch.__version__
    )
    assert report["versions"]["wrapt"] == wrapt.__version__
    (row,) = report["startup_hook"]["installed"]
    assert Path(row["dir"]) == venv.site_packages.resolve()
    assert row["pth"] and row["start"] and row["module"] and row["pth_current"]
    assert report["startup_hook"]["activated_by"] == "pth"
    assert report["environment"]["FAKEGRAD_PATCH"]["parsed"] == "on"
    assert all(t["found"] for t in report["checks"]["targets"] if not t["optional"])
    applied = fakegrad_patch._core.install.current()
    assert applied is not None
    assert report["checks"]["defects"] == applied.probes.detected()
    assert report["checks"]["status"]["installed"] is True
    assert report["problems"] == [] and report["ok"] is True


def test_doctor_fails_on_invalid_settings(venv: Venv) -> None:
    env = {"FAKEGRAD_PATCH": "sometimes", "FAKEGRAD_ON_MISSING": "explode"}
    result = run([venv.python, "-m", "fakegrad_patch", "doctor"], env=env)
    assert result.returncode == 1
    problems = result.stdout.split("problems:", 1)[1]
    assert "FAKEGRAD_PATCH" in problems and "FAKEGRAD_ON_MISSING" in problems
    assert "patch in this process: active" in result.stdout


def test_doctor_fails_when_hook_cannot_run(bare: Venv) -> None:
    """FAKEGRAD_PATCH=1 in an environment without the hook (package only on PYTHONPATH)."""
    result = run(
        [bare.python, "-m", "fakegrad_patch", "doctor", "--json"],
        env={"FAKEGRAD_PATCH": "1", "PYTHONPATH": str(ROOT)},
    )
    assert result.returncode == 1
    problems = json.loads(result.stdout)["problems"]
    assert any("no start-up hook is installed" in p for p in problems), problems


# -- the sitecustomize route -----------------------------------------------------------------------


def test_sitecustomize_command_prints_and_appends_idempotently(venv: Venv, tmp_path: Path) -> None:
    printed = run([venv.python, "-m", "fakegrad_patch", "sitecustomize"])
    assert printed.returncode == 0
    assert printed.stdout.strip() == HOOK.sitecustomize_line()
    target = tmp_path / "sitecustomize.py"
    target.write_text("import os\nUSER_LINE = 1\n# fakegrad_patch old version  " + "\n")
    cmd = [venv.python, "-m", "fakegrad_patch", "sitecustomize", "--append", str(target)]
    first, second = run(cmd), run(cmd)
    assert first.stdout.startswith("added") and second.stdout.startswith("present")
    lines = target.read_text().splitlines()
    assert lines[:2] == ["import os", "USER_LINE = 1"]
    assert lines.count(HOOK.sitecustomize_line()) == 1
    # An older version of our line (same marker) is replaced in place, not duplicated.
    target.write_text("A = 1\nimport os  " + HOOK.SITECUSTOMIZE_MARKER + "\nB = 2\n")
    assert run(cmd).stdout.startswith("updated")
    assert target.read_text().splitlines() == ["A = 1", HOOK.sitecustomize_line(), "B = 2"]


@pytest.mark.parametrize("value", [None, "0", "1", "bogus"])
def test_sitecustomize_route_through_pythonpath(
    bare: Venv, tmp_path: Path, value: str | None
) -> None:
    """Package reached through PYTHONPATH (no .pth processed): the user's sitecustomize.py with
    our line gives the same behaviour as the .pth hook."""
    (tmp_path / "sitecustomize.py").write_text(
        "USER_CODE_RAN = True\n" + HOOK.sitecustomize_line() + "\nAFTER_OUR_LINE = True\n"
    )
    env = {"PYTHONPATH": f"{tmp_path}:{ROOT}"}
    if value is not None:
        env["FAKEGRAD_PATCH"] = value
    code = PROBE + "import sitecustomize as s\nprint(s.USER_CODE_RAN, s.AFTER_OUR_LINE)\n"
    if value == "1":
        code += "import torch, fakegrad_patch\nprint(fakegrad_patch.is_installed())\n"
    result = bare.run(code, env=env)
    assert result.returncode == 0, result.stderr
    state = json.loads(result.stdout.splitlines()[0])
    assert result.stdout.splitlines()[1] == "True True"
    if value == "1":
        assert "fakegrad_patch" in state["loaded"] and "torch" not in state["loaded"]
        assert state["state"]["activated_by"] == "sitecustomize"
        assert result.stderr == ""
        assert result.stdout.splitlines()[2] == "True"
    else:
        assert state["loaded"] == []
        if value == "bogus":
            assert result.stderr.splitlines() == [
                "fakegrad_patch: FAKEGRAD_PATCH='bogus' not understood; not activated"
            ]
        else:
            assert result.stderr == ""


# -- cost ------------------------------------------------------------------------------------------


def test_start_up_overhead_when_unset(venv: Venv, bare: Venv) -> None:
    """docs/activation.md quotes this measurement (goal: under 1 ms). The bound asserted here is
    loose (CPU time, not wall time: shared cores make wall timings noisy); the module-set test
    above is the exact check that nothing is imported."""
    result = startup_overhead(venv, bare, runs=40)
    print(f"start-up overhead with FAKEGRAD_PATCH unset: {result}")
    assert result["cpu_overhead_ms"] < 3.0, result


def test_this_process_is_patched_by_import() -> None:
    """Sanity for the in-process suite: conftest imported the package, which installed it."""
    assert fakegrad_patch.is_installed()
