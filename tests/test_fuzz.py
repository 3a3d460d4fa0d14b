"""Random programs, eager vs one patched propagating pass (tests/fuzz_programs.py), as a gate.

A fixed window of seeds per build (the same programs on every run of a build, so CI is
deterministic; each build of the CI command its own window, ``WINDOWS``),
each program eagerly and inside ``FakeTensorMode(allow_non_fake_inputs=True)`` with
propagation and the patch, under ``propagation="fast"`` and ``"repair"``, in two child
interpreters (about 40 s on a 2-core machine). Asserted: no program kills its interpreter
(``crash``) and none differs from eager without a word (``silent``); every error the patched
pass raises where eager does not names the op (Python 3.11+: the patch's note).

``FAKEGRAD_FUZZ_BUDGET_S=600`` runs more programs (the seeds after the gate's, for that many
seconds; ``FAKEGRAD_FUZZ_SETTINGS=fast,repair,fast-wb,repair-wb`` for the write-back twins).
Every failure reproduces alone: ``python tests/fuzz_programs.py --seed N --setting S --show``
prints the program as plain Python, ``--seed N --setting S`` runs it and prints what differed.
The categories go to a JSON beside the run (``FAKEGRAD_SWEEP_DIR``, as the operator sweep's).
Two quick tests check the harness itself: a program run eagerly twice compares exact (nothing in
it but its seed decides a value), and a record with one thing changed compares silent.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import pathlib
import sys
from typing import Any

import fuzz_programs
import pytest
import torch

SETTINGS = ["fast", "repair"]
#: Programs per build in the gate: ~40 s on this project's 2-core machine (two interpreters).
WINDOW = 125
#: Which window of seeds each build of the CI command runs (tox.ini: oldest, torch213, torch214,
#: newest): four builds, four windows, so the command runs seeds 0-499 once each, every seed on
#: one build (before: seeds 0-249 on every build, ~80 s each; tests/test_readme.py checks that
#: the CI builds cover every window). A program depends on the build less than on its seed; a
#: build outside the table takes the window of its minor version modulo 4. A test-data choice by
#: version, like tests/upstream/sources.json: it decides which programs run, never what passes.
WINDOWS = {(2, 4): 0, (2, 13): 1, (2, 14): 2, (2, 15): 3}


def gate_seeds(version: str) -> list[int]:
    """The gate's seeds on the build ``version`` (``torch.__version__``)."""
    major, minor = (int(part) for part in version.split("+")[0].split(".")[:2])
    window = WINDOWS.get((major, minor), minor % len(WINDOWS))
    return list(range(window * WINDOW, (window + 1) * WINDOW))


GATE_SEEDS = gate_seeds(torch.__version__)
#: where FAKEGRAD_FUZZ_BUDGET_S's programs start: after every window of the gate
BUDGET_START = len(WINDOWS) * WINDOW


def _report(rows: list[dict[str, Any]], settings: list[str], name: str, tmp: pathlib.Path) -> None:
    out_dir = pathlib.Path(os.environ.get("FAKEGRAD_SWEEP_DIR") or tmp)
    out_dir.mkdir(parents=True, exist_ok=True)
    result = {
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "settings": settings,
        "counts": fuzz_programs.summarize(rows, settings),
        "classes": fuzz_programs.classes(rows),
        "findings": fuzz_programs.findings(rows),
    }
    (out_dir / f"{name}-torch{torch.__version__.split('+')[0]}.json").write_text(
        json.dumps(result, indent=1)
    )


def _lines(rows: list[dict[str, Any]]) -> str:
    return "\n".join(
        f"{r['outcome']} seed {r['seed']} {r['setting']} step {r.get('step')} {r.get('op', '')}: "
        f"{str(r.get('why', ''))[:200]}{' (' + r['alone'] + ')' if 'alone' in r else ''}\n"
        f"    python tests/fuzz_programs.py --seed {r['seed']} --setting "
        f"{r['setting'] if r['setting'] != '*' else 'fast'} --show"
        for r in rows
    )


def _workers() -> int:
    return max(1, min(2, os.cpu_count() or 1))


@pytest.fixture(scope="module")
def gate(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    work = tmp_path_factory.mktemp("fuzz")
    rows = fuzz_programs.run_isolated(GATE_SEEDS, SETTINGS, workers=_workers(), workdir=str(work))
    _report(rows, SETTINGS, "fuzz-gate", work)
    return rows


@pytest.mark.slow
def test_no_random_program_crashes_or_differs_silently(gate: list[dict[str, Any]]) -> None:
    bad = [r for r in gate if r["outcome"] in ("crash", "silent")]
    assert not bad, f"{len(bad)} of {len(gate)} programs:\n" + _lines(bad)
    assert sum(r["outcome"] == "exact" for r in gate) > 0


@pytest.mark.slow
def test_every_loud_error_names_the_op(gate: list[dict[str, Any]]) -> None:
    if sys.version_info < (3, 11):
        pytest.skip("the note naming the op needs Python 3.11 (exception notes)")
    unnamed = [r for r in gate if r["outcome"] == "loud" and not r.get("names_op")]
    assert not unnamed, _lines(unnamed)


@pytest.mark.slow
def test_more_programs_within_a_budget(tmp_path: pathlib.Path) -> None:
    budget = os.environ.get("FAKEGRAD_FUZZ_BUDGET_S", "")
    if not budget:
        pytest.skip("FAKEGRAD_FUZZ_BUDGET_S not set (the gate's fixed seeds run above)")
    settings = os.environ.get("FAKEGRAD_FUZZ_SETTINGS", ",".join(SETTINGS)).split(",")
    rows = fuzz_programs.run_isolated(
        None,
        settings,
        workers=_workers(),
        budget_s=float(budget),
        seed_start=BUDGET_START,
        workdir=str(tmp_path),
    )
    _report(rows, settings, "fuzz-budget", tmp_path)
    bad = [r for r in rows if r["outcome"] in ("crash", "silent")]
    assert not bad, f"{len(bad)} of {len(rows)} programs:\n" + _lines(bad)


def test_eager_twice_is_exact() -> None:
    """The harness itself: a program's eager run is a function of its seed (no uninitialised
    memory read, no other state), so any difference a patched run shows is the patch's."""
    outcomes = {seed: fuzz_programs.self_check(seed).outcome for seed in range(30)}
    # "error": the program ends at a step eager raises at, kept on purpose (both runs raise)
    assert set(outcomes.values()) <= {"exact", "error"}, outcomes
    assert list(outcomes.values()).count("exact") >= 20


def test_the_comparison_sees_each_kind_of_difference() -> None:
    """A copy of an eager record with one thing changed is ``silent``, naming it."""
    seed = next(s for s in range(50) if fuzz_programs.self_check(s).outcome == "exact")
    prog = fuzz_programs.generate(seed)
    want = fuzz_programs.run_eager(prog)
    name, snap = next(
        (n, v)
        for n, v in want.steps[0].items()
        if isinstance(v, fuzz_programs.TSnap) and v.values is not None and v.values.numel() > 1
    )
    changes = {
        "values differ": {"values": snap.values + 1},
        "stride": {"stride": tuple(x + 1 for x in snap.stride)},
        "is_conj": {"conj": not snap.conj},
        "no real values": {"values": None},
        "requires_grad": {"requires_grad": not snap.requires_grad},
    }
    for what, change in changes.items():
        got = copy.deepcopy(want)
        got.steps[0][name] = dataclasses.replace(snap, **change)
        res = fuzz_programs.classify(prog, got, want, [])
        assert res.outcome == "silent" and what in res.why, (what, res)
        assert fuzz_programs.classify(prog, got, want, ["a warning"]).outcome == "reported"
    got = copy.deepcopy(want)
    got.rng[0] = "another state"
    assert "RNG" in fuzz_programs.classify(prog, got, want, []).why
    got = copy.deepcopy(want)
    got.error = (0, RuntimeError("aten.mm: no"))
    res = fuzz_programs.classify(prog, got, want, [])
    assert res.outcome == "loud" and res.names_op and res.step == 0
