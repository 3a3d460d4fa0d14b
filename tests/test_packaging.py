"""The wheel and the sdist: what they contain, their metadata, and that the sdist installs.

Builds both once per session with ``python -m build`` (needs the ``build`` package and network or
a local index for hatchling: the tox env ``dist`` provides both; elsewhere the module skips).
"""

from __future__ import annotations

import email.parser
import os
import pathlib
import subprocess
import sys
import tarfile
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
pytest.importorskip("build", reason="needs the `build` package (tox -e dist)")
pytestmark = pytest.mark.slow

#: The start-up hook files and the pytest plugin live at the wheel root (site-packages root).
ROOT_FILES = {
    "fakegrad_patch.pth",
    "fakegrad_patch.start",
    "_fakegrad_patch_startup.py",
    "fakegrad_patch_pytest.py",
}


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> dict[str, pathlib.Path]:
    out = tmp_path_factory.mktemp("dist")
    subprocess.run(
        [sys.executable, "-m", "build", "--sdist", "--wheel", "--outdir", str(out), str(ROOT)],
        check=True,
        capture_output=True,
        timeout=600,
    )
    (wheel,) = out.glob("*.whl")
    (sdist,) = out.glob("*.tar.gz")
    return {"wheel": wheel, "sdist": sdist}


def _is_junk(name: str) -> bool:
    parts = pathlib.PurePosixPath(name).parts
    return (
        any(
            p in {"__pycache__", ".pytest_cache", ".mypy_cache", ".ruff_cache", ".tox"}
            for p in parts
        )
        or name.endswith((".pyc", ".pyo"))
        or any(p.startswith(".venv") for p in parts)
    )


def test_wheel_has_hooks_at_root_the_package_and_py_typed_and_nothing_else(
    dist: dict[str, pathlib.Path],
) -> None:
    names = zipfile.ZipFile(dist["wheel"]).namelist()
    top = {n.split("/", 1)[0] for n in names}
    root_files = {n for n in names if "/" not in n}
    assert root_files == ROOT_FILES
    dist_info = {t for t in top if t.endswith(".dist-info")}
    assert top == {"fakegrad_patch"} | ROOT_FILES | dist_info
    assert "fakegrad_patch/py.typed" in names
    assert "fakegrad_patch/__init__.py" in names
    assert not [n for n in names if n.startswith("tests/") or _is_junk(n)]


def test_wheel_metadata_renders_and_declares_the_tested_ranges(
    dist: dict[str, pathlib.Path],
) -> None:
    with zipfile.ZipFile(dist["wheel"]) as whl:
        (meta_name,) = [n for n in whl.namelist() if n.endswith(".dist-info/METADATA")]
        entry_points = whl.read(meta_name.replace("METADATA", "entry_points.txt")).decode()
        meta = email.parser.Parser().parsestr(whl.read(meta_name).decode())
    assert meta["Name"] == "fakegrad-patch"
    assert meta["Requires-Python"] == ">=3.10"
    assert "torch>=2.4.0" in meta.get_all("Requires-Dist")
    assert meta["Description-Content-Type"] == "text/markdown"
    assert "## Two commands" in meta.get_payload()  # the README is the long description
    assert "Typing :: Typed" in meta.get_all("Classifier")
    assert "fakegrad = fakegrad_patch_pytest" in entry_points
    assert "fakegrad-patch = fakegrad_patch.__main__:main" in entry_points
    twine = subprocess.run(
        [
            sys.executable,
            "-m",
            "twine",
            "check",
            "--strict",
            str(dist["wheel"]),
            str(dist["sdist"]),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    if "No module named twine" in twine.stderr:
        pytest.skip("twine not installed")
    assert twine.returncode == 0, twine.stdout + twine.stderr


def test_sdist_has_sources_tests_docs_and_no_caches(dist: dict[str, pathlib.Path]) -> None:
    with tarfile.open(dist["sdist"]) as tar:
        names = [n.split("/", 1)[1] for n in tar.getnames() if "/" in n]
    for needed in (
        "pyproject.toml",
        "README.md",
        "LICENSE",
        "fakegrad_patch/__init__.py",
        "fakegrad_patch/py.typed",
        "fakegrad_patch/_activation/hooks/fakegrad_patch.pth",
        "tests/test_api.py",
        "docs/compatibility.md",
    ):
        assert needed in names, needed
    assert not [n for n in names if _is_junk(n)]


def test_sdist_installs_into_a_fresh_venv_with_the_hooks_at_site_packages_root(
    dist: dict[str, pathlib.Path], tmp_path: pathlib.Path
) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FAKEGRAD_", "PYTHON"))}
    # --no-deps: torch is not needed to install or to import the package (it patches lazily).
    subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--no-deps", str(dist["sdist"])],
        check=True,
        timeout=600,
        env=env,
        capture_output=True,
    )
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
        env=env,
    ).stdout.strip()
    site = pathlib.Path(purelib)
    for name in ROOT_FILES:
        assert (site / name).is_file(), name
    assert (site / "fakegrad_patch" / "py.typed").is_file()
