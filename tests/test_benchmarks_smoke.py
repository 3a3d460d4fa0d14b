"""The benchmark suite runs on this torch (issue 17: "the benchmarks run in CI on every torch env").

One fresh pytest process runs ``benchmarks/`` in smoke mode (``--bench-smoke``: 1 block, 1 round,
no warm-up, the smallest sizes; benchmarks/conftest.py), then ``benchmarks/ratios.py`` renders
its JSON. Nothing about timing is asserted. What is: the run passes (every case's own checks
hold: each variant is what it claims, grads real or fake as expected), every case that uses only
the public API ran on CPU rather than skipped, the compile cases ran or were skipped for a reason
this build gives (no dynamo, no C++ compiler), and the ratio table has a row for every case that
ran.

Also the harness's handling of ``--benchmark-json`` as each pytest-benchmark release parses it
(issue 38): an open file (``argparse.FileType('wb')``: 4.x up to 5.2) or a path (5.3 on).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import torch

from fakegrad_patch._core.accumulate import profiling

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"

#: test function -> case; these use only the public API (the set floor also reads the fake
#: gradient's ``real_tensor``, which every build with real-value propagation has) and must run on
#: every build
MUST_RUN = {
    "test_p2_fake_forward": "P2",
    "test_p11_arming_per_leaf": "P11",
    "test_p11_node_hook_floor": "P11",
    "test_p12_set_path_hook_time": "P12",
    "test_p12_set_floor": "P12",
    "test_p13_trace_end_to_end": "P13",
    "test_p14_scaling": "P14",
    "test_p15_write_back": "P15",
}
#: may skip, but only for these reasons (benchmarks/test_compile.py ``unsupported``)
COMPILE = {"test_p9_compile_first_step": "P9", "test_p10_compiled_steady_steps": "P10"}
COMPILE_SKIP_REASONS = ("torch.compile is not supported", "needs a C++ compiler", "needs Triton")


@pytest.mark.slow
def test_benchmarks_run_in_smoke_mode(tmp_path: Path) -> None:
    if not (BENCH / "conftest.py").exists():
        pytest.skip("no benchmarks/ next to tests/ (installed without the source tree)")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FAKEGRAD_", "PYTEST_"))}
    junit, out = tmp_path / "junit.xml", tmp_path / "smoke.json"
    cmd = [
        *(sys.executable, "-m", "pytest", "benchmarks", "-p", "no:cacheprovider", "-q"),
        *("--bench-smoke", f"--benchmark-json={out}", f"--junitxml={junit}"),
    ]
    run = subprocess.run(
        cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900, check=False
    )
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]

    outcomes: dict[str, list[tuple[str, str]]] = defaultdict(list)  # function -> (id, outcome)
    for case in ET.parse(junit).iter("testcase"):
        name = case.get("name", "")
        function = name.split("[", 1)[0]
        skipped = case.find("skipped")
        outcome = "passed" if skipped is None else "skipped: " + skipped.get("message", "")
        outcomes[function].append((name, outcome))

    for function in MUST_RUN:
        cpu = [o for name, o in outcomes[function] if "[cpu" in name]
        assert cpu and all(o == "passed" for o in cpu), (function, cpu)
    for function in COMPILE:
        cpu = [o for name, o in outcomes[function] if "[cpu" in name]
        assert cpu, function
        for o in cpu:
            assert o == "passed" or any(r in o for r in COMPILE_SKIP_REASONS), (function, o)

    doc = json.loads(out.read_text())
    ran = {b["extra_info"]["case"] for b in doc["benchmarks"]}
    assert set(MUST_RUN.values()) <= ran, ran
    table = subprocess.run(
        [sys.executable, str(BENCH / "ratios.py"), str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    rows = {line.split("|")[1].strip() for line in table.splitlines() if line.startswith("| P")}
    assert ran <= rows, (ran - rows, table)
    # item 1's measurements, not only its timings: arming read from the patch's profiler
    # ranges, torch's floor timed inside its step, the cache control's hook time
    lines = [line for line in table.splitlines() if line.startswith("| P1")]
    if profiling.available():  # the build has the ranges' touch points
        # and read against the same run's floor row (a multiple that does not depend on the
        # machine's speed, as the absolute goal does)
        assert any(
            "fwd+bwd 100 leaves" in x and "(its profiler ranges) = " in x and "x torch's floor" in x
            for x in lines
        ), table
    assert any("floor" in x and "register_prehook/remove" in x for x in lines), table
    assert any("(control)" in x and "µs/leaf in the hook" in x for x in lines), table
    # the set path read against its floor, the least a set path costs in the same step
    assert any("set floor, torch alone" in x and "the least a set path" in x for x in lines), table
    assert any("64 leaves x 1KiB" in x and "x the set floor;" in x for x in lines), table
    # P19 / P20 read against the fake floor (the least a FakeTensor-making mode does per op),
    # where the floor runs on this build; else its rows are skipped, and the table says why
    floor_skips = [s for s in doc["fakegrad_patch"]["skipped"] if "fake floor" in s["reason"]]
    for case, other in (("P19", "eager"), ("P20", "pass-through")):
        per_op = [line for line in table.splitlines() if line.startswith(f"| {case} | cpu")]
        if any(s["case"] == case for s in floor_skips):
            continue
        assert any(f"fake floor / {other}" in x for x in per_op), table
        assert any(f"patched / {other}" in x and "patched / fake floor" in x for x in per_op), table
        if case == "P19":  # item 5's floor: the least a FakeTensor-making mode against two-pass
            assert any("fake floor / two-pass" in x for x in per_op), table


class _Config:
    """What ``benchmarks/conftest.py``'s ``pytest_configure`` reads of pytest's config."""

    def __init__(self, benchmark_json: Any) -> None:
        self.options = {
            "--bench-scale": 1.0,
            "--bench-smoke": False,
            "--bench-round-budget": 150.0,
            "--bench-threads": torch.get_num_threads(),  # unchanged
            "benchmark_json": benchmark_json,
        }

    def getoption(self, name: str, default: Any = None) -> Any:
        return self.options.get(name, default)

    def addinivalue_line(self, name: str, line: str) -> None:
        pass


@pytest.mark.parametrize("form", ["open file (4.x to 5.2)", "Path (5.3 on)", "str", "absent"])
def test_the_harness_takes_benchmark_json_as_every_pytest_benchmark_parses_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, form: str
) -> None:
    """pytest-benchmark up to 5.2 opens ``--benchmark-json`` itself (``argparse.FileType('wb')``)
    and hands the plugins an open file; 5.3 on, a ``Path``. The harness's ``pytest_configure``
    takes each (an open file raised TypeError there before issue 38, so a GPU run wrote no
    benchmark row), and makes the folder a path names."""
    monkeypatch.syspath_prepend(str(ROOT))
    conftest = importlib.import_module("benchmarks.conftest")
    support = importlib.import_module("benchmarks._support")
    for name in ("SCALE", "SMOKE", "ROUND_BUDGET_S"):  # pytest_configure sets them
        monkeypatch.setattr(support, name, getattr(support, name))
    target = tmp_path / "not yet" / "bench.json"
    option: Any = None
    if form.startswith("open file"):
        target.parent.mkdir()
        option = argparse.FileType("wb")(str(target))  # exactly what 4.x ... 5.2 pass on
    elif form.startswith("Path"):
        option = target
    elif form == "str":
        option = str(target)
    try:
        conftest.pytest_configure(_Config(option))
    finally:
        torch.set_flush_denormal(False)  # pytest_configure turns it on for the benchmarks
        if hasattr(option, "close"):
            option.close()
    assert conftest.json_path(option) == (None if form == "absent" else target)
    assert target.parent.is_dir() is (form != "absent")
