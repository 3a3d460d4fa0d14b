"""P6: interpreter start-up: package installed with FAKEGRAD_PATCH unset vs not installed, and
(second row) FAKEGRAD_PATCH=1 vs unset in the installed venv, for a process that never imports
torch (issue 13: the variable is often exported for a whole shell or job; until torch's import
begins only the stdlib-only start-up module may load, goal <= +2 ms).

Two throwaway venvs (``python -m venv --without-pip``) built from this interpreter, identical
except for the package: both get one ``.pth`` line (named to sort first) that puts this
environment's site-packages on ``sys.path`` (so the packages fakegrad_patch depends on are
importable, as in a real install);
"installed" also gets what a wheel install puts into site-packages: the ``fakegrad_patch``
package (a symlink to this checkout's) and the files hatch force-includes at the root, i.e. the
start-up hook ``fakegrad_patch/_activation/hooks/*`` (``fakegrad_patch.pth`` and the module it
imports, byte-compiled as pip does).
Each round is one ``python -c pass`` in a subprocess; the variants alternate block by block.

Skips, saying why, while the start-up hook does not exist (it is owned by the activation work).
"""

from __future__ import annotations

import os
import py_compile
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

import fakegrad_patch
from benchmarks import _support

PACKAGE_DIR = Path(fakegrad_patch.__file__).resolve().parent
HOOKS_DIR = PACKAGE_DIR / "_activation" / "hooks"


def _hook_files() -> list[Path]:
    return sorted(p for p in HOOKS_DIR.glob("*") if p.is_file() and p.suffix != ".pyc")


def _site_packages(venv: Path) -> Path:
    found = list(venv.glob("lib/python*/site-packages")) + list(venv.glob("Lib/site-packages"))
    assert len(found) == 1, found
    return found[0]


def _python(venv: Path) -> Path:
    return venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


@pytest.fixture(scope="module")
def venvs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    if not any(p.suffix == ".pth" for p in _hook_files()):
        pytest.skip(f"no start-up hook (*.pth) in {HOOKS_DIR} yet: nothing to measure")
    root = tmp_path_factory.mktemp("startup")
    deps = sysconfig.get_paths()["purelib"]
    out: dict[str, Path] = {}
    for name in ("not-installed", "installed"):
        venv = root / name
        subprocess.run(
            [sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120
        )
        site = _site_packages(venv)
        (site / "00-bench-deps.pth").write_text(deps + "\n")
        if name == "installed":
            (site / "fakegrad_patch").symlink_to(PACKAGE_DIR, target_is_directory=True)
            for hook in _hook_files():
                shutil.copy2(hook, site / hook.name)
                if hook.suffix == ".py":
                    # pip byte-compiles what it installs; without this, a PYTHONDONTWRITEBYTECODE
                    # environment would compile the hook module at every start (~2-3 ms).
                    py_compile.compile(str(site / hook.name), doraise=True)
        out[name] = _python(venv)
    return out


def _env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("FAKEGRAD_") and k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")
    }
    env.update(extra)
    return env


def _modules(python: Path, **extra: str) -> set[str]:
    code = "import sys; print('\\n'.join(sys.modules))"
    done = subprocess.run(
        [str(python), "-c", code], env=_env(**extra), capture_output=True, text=True, check=True
    )
    assert done.stderr == "", done.stderr
    return set(done.stdout.split())


@pytest.mark.paired("not-installed", "installed")
def test_p6_interpreter_startup(benchmark, venvs: dict[str, Path], slot: _support.Slot) -> None:
    python = venvs[slot.variant]
    env = _env()
    extra = {}
    if slot.variant == "installed":
        # The hook is live in this venv (it activates when asked) ...
        assert "_fakegrad_patch_startup" in _modules(python, FAKEGRAD_PATCH="1")
        # ... and with the variable unset it loads nothing the bare venv does not.
        extra_modules = sorted(_modules(python) - _modules(venvs["not-installed"]))
        extra = {"extra_modules_at_startup": extra_modules}

    def start() -> None:
        subprocess.run([str(python), "-c", "pass"], env=env, check=True)

    _support.record(
        benchmark,
        slot,
        case="P6",
        device="host",
        detail="python -c pass, FAKEGRAD_PATCH unset",
        goal=None,
        target=start,
        rounds=10,
        extra=extra,
    )


@pytest.mark.paired("unset", "set")
def test_p6_interpreter_startup_variable_set(
    benchmark, venvs: dict[str, Path], slot: _support.Slot
) -> None:
    python = venvs["installed"]
    env = _env(FAKEGRAD_PATCH="1") if slot.variant == "set" else _env()
    extra = {}
    if slot.variant == "set":
        # What the variable costs in modules: only the hook module, nothing of the package, wrapt
        # or torch (they load when torch's import begins).
        extra_modules = sorted(_modules(python, FAKEGRAD_PATCH="1") - _modules(python))
        assert extra_modules == ["_fakegrad_patch_startup"], extra_modules
        extra = {"extra_modules_at_startup": extra_modules}

    def start() -> None:
        subprocess.run([str(python), "-c", "pass"], env=env, check=True)

    _support.record(
        benchmark,
        slot,
        case="P6",
        device="host",
        detail="python -c pass, FAKEGRAD_PATCH=1 vs unset (torch never imported)",
        goal=None,
        target=start,
        rounds=10,
        extra=extra,
    )
