"""The benchmark suite runs on this torch (issue 17: "the benchmarks run in CI on every torch env").

One fresh pytest process runs ``benchmarks/`` in smoke mode (``--bench-smoke``: 1 block, 1 round,
no warm-up, the smallest sizes; benchmarks/conftest.py), then ``benchmarks/ratios.py`` renders
its JSON. Nothing about timing is asserted. What is: the run passes (every case's own checks
hold: each variant is what it claims, grads real or fake as expected), every case that uses only
the public API ran on CPU rather than skipped, the compile cases ran or were skipped for a reason
this build gives (no dynamo, no C++ compiler), and the ratio table has a row for every case that
ran.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

import pytest

from fakegrad_patch._core import profiling

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
