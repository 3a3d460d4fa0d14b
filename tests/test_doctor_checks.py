"""``python -m fakegrad_patch doctor`` must not say "no problems found" when (issues 11, 12):

* ``FAKEGRAD_TRACE`` names a file that cannot be written (the trace sink is checked);
* wrapt is missing (and the package, the trace reader and doctor keep working without it);
* torch is outside the tested range (older: a problem; newer: a notice);
* fakegrad-patch is not installed at all (a source tree on PYTHONPATH: a notice, a problem only
  when ``FAKEGRAD_PATCH`` is on, as no start-up hook can honour it).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from fakegrad_patch import trace
from fakegrad_patch._core.touchpoints import targets as _targets
from fakegrad_patch._tools import doctor as _doctor

ROOT = Path(__file__).resolve().parents[1]

#: A sitecustomize.py that makes wrapt unimportable, as in an environment without it.
BLOCK_WRAPT = textwrap.dedent(
    """
    import sys

    class _NoWrapt:
        def find_spec(self, name, path=None, target=None):
            if name == "wrapt" or name.startswith("wrapt."):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, _NoWrapt())
    """
)


def run(
    args: list[str], env: dict[str, str] | None = None, **kw: Any
) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("FAKEGRAD_")}
    base["PYTHONPATH"] = str(ROOT)
    base["PYTHONWARNINGS"] = "ignore:Failed to initialize NumPy:UserWarning"
    base.update(env or {})
    return subprocess.run(
        [sys.executable, *args], env=base, capture_output=True, text=True, timeout=300, **kw
    )


# -- FAKEGRAD_TRACE sink ------------------------------------------------------------------------


def _bad_paths(tmp_path: Path) -> dict[str, str]:
    a_file = tmp_path / "file.txt"
    a_file.write_text("")
    return {
        "missing-directory": str(tmp_path / "nope" / "run.jsonl"),
        "is-a-directory": str(tmp_path),
        "under-a-file": str(a_file / "run.jsonl"),
    }


@pytest.mark.parametrize("case", ["missing-directory", "is-a-directory", "under-a-file"])
def test_fallback_sink_check_reports_bad_paths(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, case: str
) -> None:
    monkeypatch.delattr(trace, "sink_problem", raising=False)
    monkeypatch.setenv("FAKEGRAD_TRACE", _bad_paths(tmp_path)[case])
    entry = _doctor.environment()["FAKEGRAD_TRACE"]
    assert entry["error"], entry
    assert not (tmp_path / "nope").exists()


@pytest.mark.parametrize("value", ["-", "run.jsonl", "existing.jsonl"])
def test_fallback_sink_check_accepts_good_paths(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, value: str
) -> None:
    monkeypatch.delattr(trace, "sink_problem", raising=False)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "existing.jsonl").write_text("")
    monkeypatch.setenv("FAKEGRAD_TRACE", value)
    assert _doctor.environment()["FAKEGRAD_TRACE"]["error"] is None
    assert not (tmp_path / "run.jsonl").exists()  # checking creates nothing


def test_tracer_sink_check_is_used_when_present(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    seen: list[object] = []

    def sink_problem(path: str | None = None) -> str | None:
        seen.append(path)
        return "simulated: not writable"

    monkeypatch.setattr(trace, "sink_problem", sink_problem, raising=False)
    monkeypatch.setenv("FAKEGRAD_TRACE", " run.jsonl ")
    entry = _doctor.environment()["FAKEGRAD_TRACE"]
    assert entry["error"] == "simulated: not writable" and seen == ["run.jsonl"]

    def broken(path: str | None = None) -> str | None:
        raise RuntimeError("boom")

    monkeypatch.setattr(trace, "sink_problem", broken, raising=False)
    assert "boom" in _doctor.environment()["FAKEGRAD_TRACE"]["error"]
    monkeypatch.setattr(trace, "sink_problem", lambda path=None: None, raising=False)
    assert _doctor.environment()["FAKEGRAD_TRACE"]["error"] is None


def test_doctor_exits_1_for_an_unwritable_trace_file(tmp_path: Path) -> None:
    bad = tmp_path / "missing" / "run.jsonl"
    result = run(["-m", "fakegrad_patch", "doctor", "--json"], {"FAKEGRAD_TRACE": str(bad)})
    assert result.returncode == 1, result.stdout + result.stderr
    problems = json.loads(result.stdout)["problems"]
    assert any(p.startswith("FAKEGRAD_TRACE") for p in problems), problems


# -- wrapt missing ------------------------------------------------------------------------------


@pytest.fixture
def no_wrapt(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "sitecustomize.py").write_text(BLOCK_WRAPT)
    return {"PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"}


def test_package_imports_and_patches_nothing_without_wrapt(no_wrapt: dict[str, str]) -> None:
    code = textwrap.dedent(
        """
        import json, warnings
        from torch._subclasses.fake_tensor import FakeTensorConverter as C
        original = C.__dict__["from_real_tensor"]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import fakegrad_patch
            fakegrad_patch.install(); fakegrad_patch.install()
            with fakegrad_patch.patched():
                pass
        print(json.dumps({
            "warnings": [f"{w.category.__name__}: {w.message}" for w in caught],
            "installed": fakegrad_patch.is_installed(),
            "status": fakegrad_patch.status(),
            "untouched": C.__dict__["from_real_tensor"] is original,
            "events": [e["event"] for e in fakegrad_patch.trace.events()],
        }))
        """
    )
    result = run(["-c", code], no_wrapt)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout.splitlines()[-1])
    assert len(out["warnings"]) == 1, out["warnings"]
    assert out["warnings"][0].startswith("FakeGradPatchWarning")
    assert "wrapt is not installed; not patching" in out["warnings"][0]
    assert out["installed"] is False and out["untouched"] is True
    assert out["status"]["skipped_reason"] and "wrapt" in out["status"]["skipped_reason"]
    assert out["events"] == ["patch_skipped"]


def test_trace_reader_works_without_wrapt(no_wrapt: dict[str, str], tmp_path: Path) -> None:
    events = tmp_path / "run.jsonl"
    events.write_text("")
    result = run(["-m", "fakegrad_patch", "trace", str(events)], no_wrapt)
    assert result.returncode == 0, result.stderr
    assert "ModuleNotFoundError" not in result.stderr


def test_doctor_reports_missing_wrapt(no_wrapt: dict[str, str]) -> None:
    result = run(["-m", "fakegrad_patch", "doctor", "--json"], no_wrapt)
    assert result.returncode == 1, result.stdout + result.stderr
    report = json.loads(result.stdout)
    assert any("wrapt" in p for p in report["problems"]), report["problems"]
    assert report["checks"]["targets"], "targets are still checked without wrapt"
    text = run(["-m", "fakegrad_patch", "doctor"], no_wrapt)
    assert text.returncode == 1 and "wrapt" in text.stdout.split("problems:", 1)[1]


# -- tested torch range -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("version", "expected"),
    [
        ("2.13.0", None),
        ("2.13.0+cpu", None),
        ("2.14.1+cu130", None),
        ("2.13.0rc1", None),  # pre-release parts are stripped: its release is 2.13.0
        ("2.14", None),
        ("2.6.0", "older"),
        ("2.12.9+cpu", "older"),
        ("2.14.2", "newer"),
        ("2.15.0a0+git1234", "newer"),
        ("3.0.0.dev20270101", "newer"),
        ("not-a-version", None),
    ],
)
def test_torch_range(version: str, expected: str | None) -> None:
    assert _doctor.torch_range(version, ("2.13.0", "2.14.1")) == expected


def test_tested_range_comes_from_targets(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_targets, "TESTED_TORCH", ("2.0.0", "2.15.0"), raising=False)
    assert _doctor.tested_torch() == ("2.0.0", "2.15.0")
    monkeypatch.delattr(_targets, "TESTED_TORCH", raising=False)
    assert _doctor.tested_torch() == _doctor.DEFAULT_TESTED_TORCH


@pytest.mark.parametrize(
    ("tested", "where"), [(("1.0.0", "2.0.0"), "notices"), (("3.0.0", "3.1.0"), "problems")]
)
def test_doctor_reports_torch_outside_tested_range(
    monkeypatch: pytest.MonkeyPatch, tested: tuple[str, str], where: str
) -> None:
    monkeypatch.setattr(_targets, "TESTED_TORCH", tested, raising=False)
    report = _doctor.collect()
    import torch

    found = [m for m in report[where] if f"torch {torch.__version__}" in m and tested[0] in m]
    assert found, report
    rendered = _doctor.render(report)
    assert "the tested range" in rendered and tested[1] in rendered
    if where == "notices":
        assert "no problems found" in rendered
    else:
        assert report["ok"] is False


def test_doctor_in_range_says_nothing_about_it(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr(
        _targets, "TESTED_TORCH", (torch.__version__, torch.__version__), raising=False
    )
    report = _doctor.collect()
    assert not [m for m in report["problems"] + report["notices"] if "tested" in m]


# -- not installed ------------------------------------------------------------------------------


def _not_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.metadata.distribution

    def distribution(name: str) -> importlib.metadata.Distribution:
        if name == _doctor.DISTRIBUTION:
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(importlib.metadata, "distribution", distribution)


def test_not_installed_is_a_notice(monkeypatch: pytest.MonkeyPatch) -> None:
    _not_installed(monkeypatch)
    monkeypatch.delenv("FAKEGRAD_PATCH", raising=False)
    report = _doctor.collect()
    assert report["installation"]["installed"] is False
    assert any("not installed" in n for n in report["notices"]), report["notices"]
    assert not any("not installed" in p for p in report["problems"])
    assert "fakegrad-patch: not installed" in _doctor.render(report)


def test_not_installed_with_the_variable_on_is_a_problem(monkeypatch: pytest.MonkeyPatch) -> None:
    _not_installed(monkeypatch)
    monkeypatch.setenv("FAKEGRAD_PATCH", "1")
    report = _doctor.collect()
    assert any("not installed" in p for p in report["problems"]), report["problems"]
    assert report["ok"] is False


# -- what the patch does not change, and standing aside (issues 10 and 12) ------------------------


def test_doctor_lists_the_known_limits() -> None:
    report = _doctor.collect()
    rendered = _doctor.render(report)
    assert "known limits" in rendered and "spectral_norm" in rendered
    assert report["checks"]["known_limits"]


def test_doctor_lists_the_buffers_option_and_whether_write_back_is_available() -> None:
    import fakegrad_patch

    rendered = _doctor.render(_doctor.collect())
    assert "buffers=upstream (one of upstream, write_back; write_back available" in rendered
    assert "FAKEGRAD_BUFFERS=unset -> upstream" in rendered
    assert "CPU autocast" in rendered
    fakegrad_patch.configure(buffers="write_back")  # conftest restores the settings
    report = _doctor.collect()
    assert report["checks"]["options"]["buffers"] == "write_back"
    assert report["checks"]["options"]["write_back_available"] is True
    assert report["checks"]["status"]["write_back"] is True
    assert "buffers=write_back" in _doctor.render(report)


def test_doctor_says_when_upstream_is_fixed(monkeypatch: pytest.MonkeyPatch) -> None:
    from fakegrad_patch._core.touchpoints import probes as _probes

    monkeypatch.setitem(_probes._results, _probes.D1.key, False)
    rendered = _doctor.render(_doctor.collect())
    assert "D1 absent" in rendered and "arms nothing" in rendered
