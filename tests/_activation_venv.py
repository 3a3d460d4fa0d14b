"""Throw-away virtual environments with fakegrad_patch really installed, for the activation tests.

Start-up hooks only exist in an installed distribution, so these tests need a venv where the
wheel (or an editable install) was installed by pip. Installing torch into each venv would take
minutes, so each venv sees the *running* interpreter's packages (torch, wrapt, structlog,
pytest) through a ``zz_fakegrad_test_base.pth`` path file. Its name sorts after
``fakegrad_patch.pth`` on purpose: when our hook runs, wrapt and torch are not importable yet,
which proves the hook waits for the end of ``site`` before importing anything.

Environments are cached under the temp directory, keyed by the interpreter and a hash of the
package sources, so a second test session reuses them (a lock serialises concurrent sessions).

``python tests/_activation_venv.py [RUNS]`` prints the start-up overhead quoted in
docs/activation.md.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import resource
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "fakegrad_patch"
HOOKS = PACKAGE / "_activation" / "hooks"
CACHE = Path(tempfile.gettempdir()) / "fakegrad_patch_activation"
BASE_PTH = "zz_fakegrad_test_base.pth"
#: Variables that would change what a child interpreter does at start-up.
SCRUBBED = ("PYTHONPATH", "PYTHONSTARTUP", "PYTHONHOME", "PYTHONSAFEPATH", "PYTHONNOUSERSITE")


@dataclass(frozen=True)
class Venv:
    path: Path

    @property
    def python(self) -> str:
        return str(self.path / "bin" / "python")

    @property
    def site_packages(self) -> Path:
        version = f"python{sys.version_info.major}.{sys.version_info.minor}"
        return self.path / "lib" / version / "site-packages"

    def run(
        self,
        code: str,
        env: Mapping[str, str] | None = None,
        options: tuple[str, ...] = (),
        cwd: str | os.PathLike[str] | None = None,
        timeout: float = 120,
    ) -> subprocess.CompletedProcess[str]:
        """Run ``code`` in a fresh interpreter of this venv, FAKEGRAD_* unset unless given."""
        return run([self.python, *options, "-c", code], env=env, cwd=cwd, timeout=timeout)


def clean_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("FAKEGRAD_") and k not in SCRUBBED and k != "PYTEST_ADDOPTS"
    }
    # torch warns on stderr at import when numpy is absent (tox envs have no numpy); the tests
    # assert that *our* start-up path prints nothing, so that one upstream message is silenced.
    env["PYTHONWARNINGS"] = "ignore:Failed to initialize NumPy:UserWarning"
    env.update(extra or {})
    return env


def run(
    argv: list[str],
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    timeout: float = 120,
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv,
        env=clean_env(env),
        cwd=cwd or tempfile.gettempdir(),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def _source_key(paths: list[Path]) -> str:
    digest = hashlib.sha256()
    digest.update(Path(__file__).read_bytes())  # how the venvs are built is part of the key
    digest.update(os.path.realpath(sys.executable).encode())
    digest.update(sys.prefix.encode())
    # the checkout too: an editable venv points at it (two clones, same interpreter path)
    digest.update(str(ROOT.resolve()).encode())
    for path in sorted(paths):
        if path.is_file() and "__pycache__" not in path.parts:
            digest.update(str(path.relative_to(ROOT)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


@contextlib.contextmanager
def _locked() -> Iterator[None]:
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _check(result: subprocess.CompletedProcess[str], what: str) -> None:
    if result.returncode != 0:
        raise RuntimeError(
            f"{what} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}"
        )


def _base_paths() -> list[str]:
    """The running interpreter's package directories (where torch and wrapt are)."""
    paths = sysconfig.get_paths()
    dirs = [paths["purelib"], paths["platlib"]]
    return list(dict.fromkeys(os.path.realpath(d) for d in dirs))


def _new_venv(dest: Path) -> Venv:
    result = run([sys.executable, "-m", "venv", "--without-pip", str(dest)])
    _check(result, "python -m venv")
    venv = Venv(dest)
    (venv.site_packages / BASE_PTH).write_text("\n".join(_base_paths()) + "\n")
    return venv


def _pip(venv: Venv, *args: str) -> None:
    result = run([sys.executable, "-m", "pip", "--python", venv.python, *args], timeout=600)
    _check(result, "pip " + " ".join(args))


def _ensure(name: str, build: object, sources: list[Path]) -> Venv:
    """The cached venv ``name`` for the current ``sources``, built by ``build(dest)`` if missing."""
    key_dir = CACHE / f"{name}-{_source_key(sources)}"
    dest = key_dir / name
    with _locked():
        if not (dest / ".complete").exists():
            shutil.rmtree(dest, ignore_errors=True)
            key_dir.mkdir(parents=True, exist_ok=True)
            build(dest)  # type: ignore[operator]
            (dest / ".complete").write_text("ok\n")
        for old in CACHE.iterdir():  # sources changed since: drop stale environments
            if (
                old.is_dir()
                and old.name.startswith(f"{name}-")
                and old != key_dir
                and time.time() - old.stat().st_mtime > 3600
            ):
                shutil.rmtree(old, ignore_errors=True)
    return Venv(dest)


def _build_wheel_venv(dest: Path) -> None:
    wheels = dest.parent / "wheel"
    shutil.rmtree(wheels, ignore_errors=True)
    result = run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(wheels), str(ROOT)],
        timeout=600,
    )
    _check(result, "pip wheel")
    (wheel,) = wheels.glob("fakegrad_patch-*.whl")
    venv = _new_venv(dest)
    # --ignore-installed: the base path file makes the running environment's own fakegrad_patch
    # (installed by tox, or editable) visible, and pip would call the wheel "already satisfied".
    _pip(venv, "install", "--no-deps", "--no-index", "--ignore-installed", "-q", str(wheel))


def _build_editable_venv(dest: Path) -> None:
    venv = _new_venv(dest)
    _pip(venv, "install", "--no-deps", "--ignore-installed", "-q", "-e", str(ROOT))


def _build_bare_venv(dest: Path) -> None:
    _new_venv(dest)


def wheel_venv() -> Venv:
    """A venv with ``pip install <wheel>`` of the current sources."""
    return _ensure("wheel-venv", _build_wheel_venv, [ROOT / "pyproject.toml", *PACKAGE.rglob("*")])


def editable_venv() -> Venv:
    """A venv with ``pip install -e`` of this checkout."""
    # Editable: only the pyproject and the force-included hook files are copied at install time.
    return _ensure(
        "editable-venv", _build_editable_venv, [ROOT / "pyproject.toml", *HOOKS.rglob("*")]
    )


def bare_venv() -> Venv:
    """The same venv without fakegrad_patch (for comparisons)."""
    return _ensure("bare-venv", _build_bare_venv, [])


def startup_overhead(with_pkg: Venv, without: Venv, runs: int = 40) -> dict[str, float]:
    """``python -c pass`` in each venv, interleaved: median wall time and median CPU time (user +
    system, from the child's rusage) in milliseconds. CPU time is the robust number on a busy
    machine: wall time there is mostly waiting for a core."""
    env = clean_env()
    wall: dict[Venv, list[float]] = {with_pkg: [], without: []}
    cpu: dict[Venv, list[float]] = {with_pkg: [], without: []}
    for _ in range(3):  # warm the page cache
        for venv in (with_pkg, without):
            subprocess.run([venv.python, "-c", "pass"], env=env, check=True)
    for _ in range(runs):
        for venv in (with_pkg, without):
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            start = time.perf_counter()
            subprocess.run([venv.python, "-c", "pass"], env=env, check=True)
            wall[venv].append((time.perf_counter() - start) * 1e3)
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            used = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
            cpu[venv].append(used * 1e3)
    med = statistics.median
    return {
        "wall_with_ms": med(wall[with_pkg]),
        "wall_without_ms": med(wall[without]),
        "wall_overhead_ms": med(wall[with_pkg]) - med(wall[without]),
        "cpu_with_ms": med(cpu[with_pkg]),
        "cpu_without_ms": med(cpu[without]),
        "cpu_overhead_ms": med(cpu[with_pkg]) - med(cpu[without]),
    }


if __name__ == "__main__":
    n = int(sys.argv[1]) if sys.argv[1:] else 40
    r = startup_overhead(wheel_venv(), bare_venv(), runs=n)
    print(
        f"python -c pass, median of {n} interleaved runs, FAKEGRAD_PATCH unset: "
        f"wall {r['wall_with_ms']:.2f} ms with fakegrad_patch installed vs "
        f"{r['wall_without_ms']:.2f} ms without ({r['wall_overhead_ms'] * 1e3:+.0f} us); "
        f"CPU {r['cpu_with_ms']:.2f} ms vs {r['cpu_without_ms']:.2f} ms "
        f"({r['cpu_overhead_ms'] * 1e3:+.0f} us)"
    )
