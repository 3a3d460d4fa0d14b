"""PyTorch's own ``test/test_fake_tensor.py`` as a gate: with the patch installed, no upstream
test that passes without it may fail, except the deliberate changes in ``DELIBERATE``.

The file is the one at the build's release tag (tests/upstream/sources.json: tag and commit per
build, chosen by ``torch.__version__``; a file selection, not a behaviour switch). It is not
committed here (tests/upstream/README.md says why and how to supply it): the runner looks for
``<dir>/test_fake_tensor.py`` under ``FAKEGRAD_UPSTREAM_TESTS``, then under tests/upstream/;
``FAKEGRAD_UPSTREAM_TEST_FILE`` names one file to run on whatever build this is. Without a file
the gate is skipped, saying so.

Each run starts two pytest sessions in child interpreters on a copy of the file, with the same
deselections: the baseline (the patch not imported: no ``FAKEGRAD_*`` variable, ``-p
no:fakegrad``) and the patched one (``-p fakegrad_patch``: the patch installed, default settings,
for the whole session). Both run the plain classes and the propagating ones
(``make_propagate_real_tensors_cls``). A probe plugin records in each child whether the patch was
imported and, patched, that it was installed and took part (ops on its fast path or rebuilt), so
the comparison cannot pass with a patch that never ran. The outcomes come from ``--junitxml``.

The baseline runs live (8-10 s a session on torch 2.13.0 on a 2-core machine, 2026-12): a
stored baseline would save little and could drift from the build that CI installs.

``python tests/test_upstream_fake_tensor.py [FILE]`` prints the comparison (counts, regressions,
other changes, timings) without pytest around it.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from typing import Any

import pytest
import torch

import fakegrad_patch

HERE = pathlib.Path(__file__).resolve().parent
UPSTREAM = HERE / "upstream"
SOURCES = json.loads((UPSTREAM / "sources.json").read_text())
FILE_NAME = "test_fake_tensor.py"

#: Upstream tests whose outcome the patch changes on purpose, by id (``Class::test``): why, and
#: our own test of the behaviour. In a propagating mode the patch answers what FakeTensorMode
#: refuses, from the real kernel's outputs: data-dependent ops (issue 39: ``nonzero``, ``.item()``
#: on a tensor's values) and ops without a fake kernel; upstream's tests assert the refusal.
DELIBERATE: dict[str, tuple[str, str]] = {
    "PropagateRealTensorsFakeTensorTest::test_data_dependent_operator_propagate_real_tensors": (
        "nonzero's output shape depends on the values: upstream raises "
        "DynamicOutputShapeException, the patch takes the real kernel's output (shape and "
        "values) in a propagating mode without a ShapeEnv",
        "tests/test_propagation.py::test_nonzero_shape_and_values_come_from_the_real_kernel",
    ),
    "PropagateRealTensorsFakeTensorConstHandling::"
    "test_fake_tensor_in_intlist_repro_propagate_real_tensors": (
        "a tensor's values used as sizes (list(t) reads each element with .item()): upstream "
        "raises DataDependentOutputException, the patch answers from the propagated values",
        "tests/test_propagation.py::test_a_data_dependent_op_gives_eager_values_and_gradients",
    ),
    "PropagateRealTensorsFakeTensorTest::test_custom_op_fallback_propagate_real_tensors": (
        "a custom op with a CPU kernel and no fake or meta kernel: upstream raises "
        "UnsupportedOperatorException, the patch makes the outputs from the real kernel's",
        "tests/test_propagation.py::test_an_op_without_a_fake_kernel_gets_the_real_kernels_outputs",
    ),
}

#: Upstream tests left out of both sessions, by id: why. Tests that need CUDA or another
#: device skip themselves; a test that fails without the patch counts for nothing.
DESELECT: dict[str, str] = {}

#: Written into the children's folder and loaded with ``-p``: what the session had.
PROBE = """\
import json, os, sys

def pytest_sessionfinish(session):
    out = {"fakegrad_imported": "fakegrad_patch" in sys.modules}
    import torch
    out["torch"] = torch.__version__
    out["git_version"] = getattr(torch.version, "git_version", None)
    if out["fakegrad_imported"]:
        import fakegrad_patch
        out["fakegrad_file"] = fakegrad_patch.__file__
        out["status"] = fakegrad_patch.status()
    with open(os.environ["FAKEGRAD_UPSTREAM_PROBE"], "w") as f:
        json.dump(out, f, default=str)
"""

#: What a session may not inherit: the patch's settings and start-up hook (the baseline must not
#: import it; the patched session runs the defaults), pytest's own options (an outer xdist
#: worker's), PyTorch's test switches (the file's behaviour).
_DROPPED_ENV = ("FAKEGRAD_", "PYTEST_", "PYTORCH_")


def build_key(version: str | None = None) -> str:
    """``major.minor.patch`` of a torch version (``2.13.0+cpu`` -> ``2.13.0``)."""
    return (version or torch.__version__).split("+")[0]


def source() -> dict[str, Any] | None:
    """This build's entry in sources.json, or None for a build the gate does not cover."""
    return SOURCES["builds"].get(build_key())


def upstream_file() -> tuple[pathlib.Path | None, str]:
    """The upstream file this build runs, and a sentence saying where it was looked for."""
    explicit = os.environ.get("FAKEGRAD_UPSTREAM_TEST_FILE")
    if explicit:
        path = pathlib.Path(explicit)
        if not path.is_file():
            raise pytest.UsageError(f"FAKEGRAD_UPSTREAM_TEST_FILE={explicit}: no such file")
        return path, f"FAKEGRAD_UPSTREAM_TEST_FILE={explicit}"
    entry = source()
    if entry is None:
        return None, (
            f"torch {torch.__version__}: the gate covers torch "
            f"{', '.join(SOURCES['builds'])} (tests/upstream/sources.json)"
        )
    given = (os.environ.get("FAKEGRAD_UPSTREAM_TESTS") or "").split(os.pathsep)
    roots = [pathlib.Path(p) for p in given if p] + [UPSTREAM]
    for root in roots:
        path = root / entry["dir"] / FILE_NAME
        if path.is_file():
            return path, str(path)
    looked = ", ".join(str(r / entry["dir"] / FILE_NAME) for r in roots)
    return None, (
        f"PyTorch's {SOURCES['file']} at {entry['tag']} (commit {entry['commit']}) is not "
        f"here: looked for {looked} (tests/upstream/README.md)"
    )


def digest(path: pathlib.Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _outcomes(junit: pathlib.Path) -> tuple[dict[str, str], list[str]]:
    """Per test id (``Class::test``): passed, failed, error, skipped or xfailed; and the
    messages of collection errors (a file that does not import on this build)."""
    outcomes: dict[str, str] = {}
    collection: list[str] = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        cls = (case.get("classname") or "").rsplit(".", 1)[-1]
        name = case.get("name") or ""
        children = {child.tag: child for child in case}
        if "error" in children and not cls:
            collection.append(_first_lines(children["error"]) or name)
            continue
        if "failure" in children:
            outcome = "failed"
        elif "error" in children:
            outcome = "error"
        elif "skipped" in children:
            kind = children["skipped"].get("type") or ""
            outcome = "xfailed" if kind.endswith("xfail") else "skipped"
        else:
            outcome = "passed"
        outcomes[f"{cls}::{name}"] = outcome
    return outcomes, collection


def _first_lines(element: ET.Element, count: int = 3) -> str:
    """The first lines of a failure's or error's report: its ``E`` lines (junit's message
    attribute is cut at one line), or its text."""
    text = element.text or element.get("message") or ""
    lines = [line[1:].strip() for line in text.splitlines() if line.startswith("E ")]
    lines = [line for line in lines if line] or text.strip().splitlines()
    return "\n".join(lines[:count])


def _messages(junit: pathlib.Path) -> dict[str, str]:
    """The first lines of each failing test's report, by id."""
    out: dict[str, str] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        cls = (case.get("classname") or "").rsplit(".", 1)[-1]
        for child in case:
            if child.tag in ("failure", "error"):
                out[f"{cls}::{case.get('name')}"] = _first_lines(child)
    return out


def run_session(path: pathlib.Path, workdir: pathlib.Path, *, patched: bool) -> dict[str, Any]:
    """One pytest session in a child interpreter on a copy of ``path``: outcomes, collection
    errors, failure messages, the probe's record and the wall time."""
    name = "patched" if patched else "baseline"
    work = workdir / name
    work.mkdir(parents=True)
    shutil.copy(path, work / FILE_NAME)
    (work / "pytest.ini").write_text("[pytest]\n")  # none of this repository's options
    (work / "_fakegrad_upstream_probe.py").write_text(PROBE)
    junit, probe = work / "junit.xml", work / "probe.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(_DROPPED_ENV)}
    # the same fakegrad_patch as this process's, whether installed or on PYTHONPATH
    package_root = str(pathlib.Path(fakegrad_patch.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(work), package_root, *filter(None, [os.environ.get("PYTHONPATH")])]
    )
    env["FAKEGRAD_UPSTREAM_PROBE"] = str(probe)
    env["PYTORCH_PRINT_REPRO_ON_FAILURE"] = "0"
    env.setdefault("OMP_NUM_THREADS", "1")
    command = [
        sys.executable,
        "-m",
        "pytest",
        FILE_NAME,
        "-q",
        "-p",
        "no:cacheprovider",
        "-p",
        "_fakegrad_upstream_probe",
        "-p",
        "fakegrad_patch" if patched else "no:fakegrad",
        f"--junitxml={junit}",
        *(f"--deselect={FILE_NAME}::{test}" for test in DESELECT),
    ]
    start = time.perf_counter()
    proc = subprocess.run(
        command, cwd=work, env=env, capture_output=True, text=True, timeout=600, check=False
    )
    seconds = time.perf_counter() - start
    if not junit.is_file() or not probe.is_file():
        raise AssertionError(
            f"the {name} session wrote no results (exit {proc.returncode}):\n"
            f"{(proc.stdout + proc.stderr)[-3000:]}"
        )
    outcomes, collection = _outcomes(junit)
    return {
        "outcomes": outcomes,
        "collection_errors": collection,
        "messages": _messages(junit),
        "probe": json.loads(probe.read_text()),
        "seconds": round(seconds, 1),
        "exit": proc.returncode,
    }


def counts(outcomes: dict[str, str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for outcome in outcomes.values():
        out[outcome] = out.get(outcome, 0) + 1
    return dict(sorted(out.items()))


def compare(baseline: dict[str, str], patched: dict[str, str]) -> dict[str, Any]:
    """Regressions (passed without the patch, not with it, not deliberate), deliberate changes
    seen, stale deliberate entries (the test passes with the patch too) and every other change."""
    regressions, deliberate, changed = [], [], []
    for test, before in sorted(baseline.items()):
        after = patched.get(test, "missing")
        if before == after:
            continue
        if before == "passed":
            (deliberate if test in DELIBERATE else regressions).append(test)
        else:
            changed.append(f"{test}: {before} -> {after}")
    changed += [f"{t}: missing -> {patched[t]}" for t in sorted(set(patched) - set(baseline))]
    stale = [t for t in DELIBERATE if baseline.get(t) == "passed" and patched.get(t) == "passed"]
    return {
        "regressions": regressions,
        "deliberate": deliberate,
        "stale": stale,
        "changed": changed,
    }


def run_gate(path: pathlib.Path, workdir: pathlib.Path) -> dict[str, Any]:
    baseline = run_session(path, workdir, patched=False)
    patched = run_session(path, workdir, patched=True)
    return {
        "torch": torch.__version__,
        "git_version": getattr(torch.version, "git_version", None),
        "python": sys.version.split()[0],
        "file": str(path),
        "sha256": digest(path),
        "source": source(),
        "deselected": DESELECT,
        "baseline": baseline,
        "patched": patched,
        "comparison": compare(baseline["outcomes"], patched["outcomes"]),
    }


def _summary(result: dict[str, Any]) -> str:
    lines = [
        f"torch {result['torch']} ({result['git_version']}), {result['file']} "
        f"sha256 {result['sha256'][:16]}",
    ]
    for name in ("baseline", "patched"):
        session = result[name]
        lines.append(f"{name}: {counts(session['outcomes'])} in {session['seconds']} s")
        lines.extend(f"  collection error: {e}" for e in session["collection_errors"])
    comparison = result["comparison"]
    messages = result["patched"]["messages"]
    for key in ("regressions", "deliberate", "stale", "changed"):
        lines.append(f"{key}: {len(comparison[key])}")
        for item in comparison[key]:
            lines.append(f"  {item}")
            if key == "regressions" and item in messages:
                lines.extend(f"      {line}" for line in messages[item].splitlines())
    return "\n".join(lines)


# -- the gate -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gate(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    path, where = upstream_file()
    if path is None:
        pytest.skip(f"upstream test file not available: {where}")
    entry = source()
    explicit = "FAKEGRAD_UPSTREAM_TEST_FILE" in os.environ
    pinned = entry.get("sha256") if entry and not explicit else None
    if pinned and digest(path) != pinned:
        raise AssertionError(
            f"{path}: sha256 {digest(path)} is not the pinned {pinned} "
            f"({entry['tag'] if entry else ''}): the wrong file for torch {torch.__version__}"
        )
    result = run_gate(path, tmp_path_factory.mktemp("upstream"))
    out_dir = pathlib.Path(
        os.environ.get("FAKEGRAD_SWEEP_DIR") or tmp_path_factory.mktemp("upstream-out")
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"upstream-fake-tensor-torch{build_key()}.json").write_text(
        json.dumps(result, indent=1, default=str)
    )
    print(_summary(result))
    return result


@pytest.mark.slow
def test_both_sessions_ran_the_file_the_baseline_without_the_patch(gate: dict[str, Any]) -> None:
    for name in ("baseline", "patched"):
        session = gate[name]
        assert not session["collection_errors"], (
            f"the upstream file does not import on torch {torch.__version__} ({name}): "
            f"{session['collection_errors']}"
        )
        assert counts(session["outcomes"]).get("passed", 0) > 0, (name, session["outcomes"])
    assert not gate["baseline"]["probe"]["fakegrad_imported"], "the baseline imported the patch"
    status = gate["patched"]["probe"]["status"]
    assert status["installed"], status
    # the propagating classes went through the patch's dispatch wrapper
    assert status["propagation"]["fast_ops"] + status["propagation"]["rebuilt"] > 0, status
    assert set(gate["baseline"]["outcomes"]) == set(gate["patched"]["outcomes"])


@pytest.mark.slow
def test_no_upstream_test_that_passes_without_the_patch_fails_with_it(gate: dict[str, Any]) -> None:
    regressions = gate["comparison"]["regressions"]
    messages = gate["patched"]["messages"]
    shown = [f"{t}\n    " + messages.get(t, "").replace("\n", "\n    ") for t in regressions]
    assert not regressions, (
        f"{len(regressions)} upstream tests regress with the patch:\n" + "\n".join(shown)
    )


@pytest.mark.slow
def test_every_deliberate_change_still_differs(gate: dict[str, Any]) -> None:
    """A deliberate entry whose test passes with the patch too is stale: the list stays short."""
    assert not gate["comparison"]["stale"], gate["comparison"]["stale"]


# -- without the upstream file ---------------------------------------------------------------------


def test_each_deliberate_change_names_an_upstream_propagating_test_and_a_test_of_ours() -> None:
    assert len(DELIBERATE) <= 5, "a short list"
    for test, (why, ours) in DELIBERATE.items():
        cls, _, name = test.partition("::")
        assert cls.startswith("PropagateRealTensors") and name.startswith("test_"), test
        assert len(why) > 40, test
        file, _, function = ours.partition("::")
        tree = ast.parse((HERE.parent / file).read_text())
        defined = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
        assert function in defined, f"{test}: our test {ours} does not exist"


def test_the_pinned_commit_is_the_one_this_build_was_made_from() -> None:
    """sources.json's commit for this build is the wheel's (``torch.version.git_version``):
    the tag's file is the one to run."""
    entry = source()
    if entry is None:
        pytest.skip(f"torch {torch.__version__}: not a build the gate covers")
    if entry["commit"] is None:
        pytest.skip(f"torch {build_key()}: its commit is not recorded in sources.json yet")
    assert getattr(torch.version, "git_version", None) == entry["commit"], entry


def test_outcomes_are_read_from_junit(tmp_path: pathlib.Path) -> None:
    junit = tmp_path / "junit.xml"
    junit.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="test_fake_tensor.A" name="test_ok"/>'
        '<testcase classname="test_fake_tensor.A" name="test_bad"><failure message="boom"/>'
        "</testcase>"
        '<testcase classname="test_fake_tensor.A" name="test_err"><error message="e"/></testcase>'
        '<testcase classname="test_fake_tensor.A" name="test_skip">'
        '<skipped type="pytest.skip" message="cuda"/></testcase>'
        '<testcase classname="test_fake_tensor.A" name="test_xf">'
        '<skipped type="pytest.xfail" message=""/></testcase>'
        '<testcase classname="" name="test_fake_tensor"><error message="collection failure">'
        "E   ModuleNotFoundError: No module named 'x'</error>"
        "</testcase></testsuite></testsuites>"
    )
    outcomes, collection = _outcomes(junit)
    assert outcomes == {
        "A::test_ok": "passed",
        "A::test_bad": "failed",
        "A::test_err": "error",
        "A::test_skip": "skipped",
        "A::test_xf": "xfailed",
    }
    assert collection == ["ModuleNotFoundError: No module named 'x'"]


def test_compare_finds_regressions_and_leaves_deliberate_changes_out() -> None:
    deliberate = next(iter(DELIBERATE))
    baseline = {"A::p": "passed", "A::f": "failed", "A::r": "passed", deliberate: "passed"}
    patched = {"A::p": "passed", "A::f": "passed", "A::r": "error", deliberate: "failed"}
    result = compare(baseline, patched)
    assert result["regressions"] == ["A::r"]
    assert result["deliberate"] == [deliberate]
    assert result["changed"] == ["A::f: failed -> passed"]
    assert compare({deliberate: "passed"}, {deliberate: "passed"})["stale"] == [deliberate]


if __name__ == "__main__":
    explicit = sys.argv[1:]
    if explicit:
        os.environ["FAKEGRAD_UPSTREAM_TEST_FILE"] = explicit[0]
    found, where = upstream_file()
    if found is None:
        sys.exit(f"no upstream file: {where}")
    with tempfile.TemporaryDirectory() as tmp:
        print(_summary(run_gate(found, pathlib.Path(tmp))))
