"""Everything CUDA in one command (issue 38): every CUDA-marked test (the model zoo under
``verify`` on CUDA, the recurrent, BatchNorm, attention and write-back families, the NCCL twin of
the DDP/FSDP2 tests among them), then the CUDA rows of the benchmarks P1-P5, P11, P12, P15 and
P18-P20, and a results table (docs/cuda.md). Never run by CI, which has no GPU; CI runs its dry mode
(``--allow-no-gpu``: the same two runs, every CUDA case skipped) in tests/test_cuda_check.py.

Usage (from anywhere; the tree this file is in is tested)::

    python tests/cuda_check.py --out DIR          # DIR defaults to $OUT, else cuda-results/

Needs torch (a CUDA build), wrapt, structlog and pytest importable; fakegrad_patch comes from
this tree (put first on the runs' PYTHONPATH), installed or not. Uses pytest-xdist when it is
there (``--workers``, 4 by default; without it the tests run in one process) and pytest-benchmark
4.x or 5.x (without it, no benchmark rows). Writes 7 files into DIR:

* ``results.md``: the table docs/cuda.md shows: GPU, driver, torch build, date, pass/fail per
  test family, every test that did not pass with its reason, the benchmark ratios;
* ``results.json``: the same as data, every test's outcome;
* ``tests.junit.xml``, ``bench.junit.xml``: pytest's JUnit XML of the two runs;
* ``bench.json``: pytest-benchmark's JSON (benchmarks/ratios.py reads it);
* ``run.log``: both runs' output;
* ``opinfo-sweep-cuda.json``: the operator sweep on CUDA (tests/test_opinfo_sweep.py, issue 39:
  every sample's category).

Exit status: 0 when no selected test failed and both runs finished; 1 otherwise; 2 when it
could not start (no GPU without ``--allow-no-gpu``, a package missing).

This file is also the small pytest plugin the two runs load (``-p cuda_check``): it records
every test's outcome, XFAIL and XPASS included (JUnit XML tells XPASS from a pass in no
release), to the file named by ``FAKEGRAD_CUDA_CHECK_RECORD``, as the tests finish, so a run
cut short by the time budget still reports what it did.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import IO, Any

ROOT = Path(__file__).resolve().parent.parent
RECORD_ENV = "FAKEGRAD_CUDA_CHECK_RECORD"

#: The benchmark cases the command runs on CUDA (their ``device`` parameter, ``cuda`` marked).
BENCH_CASES = {
    "P1": [
        "test_train_step.py::test_p1_real_train_step",
        "test_train_step.py::test_p1_tiny_real_steps",
    ],
    "P2": ["test_fake_passes.py::test_p2_fake_forward"],
    "P3": ["test_fake_passes.py::test_p3_fake_backward_propagated"],
    "P4": ["test_grad_write.py::test_p4_set_path_zero_copy"],
    "P5": ["test_grad_write.py::test_p5_accumulate_vs_add"],
    "P11": [
        "test_per_leaf.py::test_p11_arming_per_leaf",
        "test_per_leaf.py::test_p11_node_hook_floor",
    ],
    "P12": [
        "test_per_leaf.py::test_p12_set_path_hook_time",
        "test_per_leaf.py::test_p12_set_floor",
    ],
    "P15": ["test_write_back.py::test_p15_write_back"],
    "P18": [
        "test_propagating_step.py::test_p18_one_propagating_pass",
        "test_propagating_step.py::test_p18_real_step_after_a_session",
    ],
    "P19": [
        "test_floors.py::test_p19_step_against_eager",
        "test_floors.py::test_p19_zoo_step_against_eager",
    ],
    "P20": ["test_floors.py::test_p20_per_op_against_a_pass_through_mode"],
}
REQUIRED = ("torch", "wrapt", "structlog", "pytest")
OUTCOMES = ("passed", "failed", "error", "xfailed", "xpassed", "skipped")
#: seconds kept for the benchmark run when the tests take the budget's rest; and for the report
BENCH_RESERVE_S, REPORT_RESERVE_S = 150, 10

# -- the plugin side (loaded into the runs with ``-p cuda_check``) --------------------------------

_record: IO[str] | None = None


def pytest_configure(config: Any) -> None:
    global _record
    path = os.environ.get(RECORD_ENV)
    if path and not hasattr(config, "workerinput"):  # the xdist controller, or a plain run
        _record = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed in unconfigure


def pytest_unconfigure(config: Any) -> None:
    global _record
    if _record is not None and not hasattr(config, "workerinput"):
        _record.close()
        _record = None


def _message(report: Any) -> str:
    if hasattr(report, "wasxfail"):
        return str(report.wasxfail).removeprefix("reason: ")
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:  # a skip: (file, line, reason)
        return str(longrepr[2]).removeprefix("Skipped: ")
    crash = getattr(longrepr, "reprcrash", None)
    if crash is not None and getattr(crash, "message", None):
        return str(crash.message)
    lines = [line for line in str(longrepr or "").splitlines() if line.strip()]
    return lines[-1] if lines else ""


def _write(nodeid: str, when: str, outcome: str, report: Any) -> None:
    if _record is None:
        return
    entry = {
        "nodeid": nodeid,
        "when": when,
        "outcome": outcome,
        "message": _message(report)[:500],
        "duration": round(float(getattr(report, "duration", 0.0) or 0.0), 3),
    }
    _record.write(json.dumps(entry) + "\n")
    _record.flush()


def pytest_runtest_logreport(report: Any) -> None:
    xfail = hasattr(report, "wasxfail")
    outcome: str | None = None
    if report.when == "call":
        if report.passed:
            outcome = "xpassed" if xfail else "passed"
        elif report.failed:
            outcome = "failed"  # a strict xfail that passed is a failure too
        else:
            outcome = "xfailed" if xfail else "skipped"
    elif report.failed:
        outcome = "error"
    elif report.skipped and report.when == "setup":
        outcome = "xfailed" if xfail else "skipped"
    if outcome is not None:
        _write(report.nodeid, report.when, outcome, report)


def pytest_collectreport(report: Any) -> None:
    if report.failed:
        _write(report.nodeid or "<collection>", "collect", "error", report)


# -- the command -------------------------------------------------------------------------------


def _version(distribution: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def _run_text(cmd: list[str]) -> str | None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = out.stdout.strip().splitlines()
    return lines[0].strip() if lines else None


def machine() -> dict[str, Any]:
    """What the results depend on: the GPU, its driver, the torch build, the interpreter."""
    import torch

    import fakegrad_patch

    info: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "gpus": [],
        "driver": None,
        "cudnn": None,
        "nccl": None,
        "fakegrad_patch": fakegrad_patch.__version__,
        "fakegrad_patch_path": str(Path(fakegrad_patch.__file__).parent),
        "commit": _run_text(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"]),
        "packages": {
            name: _version(name)
            for name in ("pytest", "pytest-xdist", "pytest-benchmark", "wrapt", "structlog")
        },
    }
    if info["cuda_available"]:
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            info["gpus"].append(
                {
                    "name": props.name,
                    "capability": f"{props.major}.{props.minor}",
                    "memory_gib": round(props.total_memory / 2**30, 1),
                }
            )
        info["cudnn"] = (
            torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
        )
        try:
            info["nccl"] = ".".join(str(v) for v in torch.cuda.nccl.version())
        except Exception:  # no NCCL in this build
            info["nccl"] = None
    if shutil.which("nvidia-smi"):
        info["driver"] = _run_text(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
        )
    return info


def _pump(stream: IO[str], sinks: list[IO[str]]) -> None:
    for line in stream:
        for sink in sinks:
            sink.write(line)
            sink.flush()


def run_pytest(
    name: str, args: list[str], env: dict[str, str], timeout: float, log: IO[str]
) -> dict[str, Any]:
    """One pytest run in its own process group, its output to the log and to stdout, cut at
    ``timeout`` seconds (the whole group killed)."""
    cmd = [sys.executable, "-m", "pytest", *args]
    header = f"\n===== {name}: {' '.join(cmd)} (timeout {timeout:.0f} s)\n"
    log.write(header)
    sys.stdout.write(header)
    start = time.monotonic()
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    assert proc.stdout is not None
    pump = threading.Thread(target=_pump, args=(proc.stdout, [log, sys.stdout]), daemon=True)
    pump.start()
    timed_out = False
    try:
        returncode = proc.wait(timeout=max(1.0, timeout))
    except subprocess.TimeoutExpired:
        timed_out = True
        os.killpg(proc.pid, signal.SIGKILL)
        returncode = proc.wait()
    pump.join(10)
    seconds = round(time.monotonic() - start, 1)
    note = f"===== {name}: exit {returncode}{' (timed out)' if timed_out else ''}, {seconds} s\n"
    log.write(note)
    sys.stdout.write(note)
    return {"name": name, "exit": returncode, "timed_out": timed_out, "seconds": seconds}


def read_records(path: Path) -> dict[str, dict[str, Any]]:
    """nodeid -> its outcome (an error in setup or teardown wins), message, seconds."""
    tests: dict[str, dict[str, Any]] = {}
    if not path.exists():
        return tests
    for line in path.read_text(encoding="utf-8").splitlines():
        entry = json.loads(line)
        test = tests.setdefault(entry["nodeid"], {"outcome": None, "message": "", "duration": 0.0})
        test["duration"] = round(test["duration"] + entry["duration"], 3)
        if test["outcome"] != "error" and (
            entry["outcome"] == "error" or entry["when"] in ("call", "setup", "collect")
        ):
            test["outcome"], test["message"] = entry["outcome"], entry["message"]
    return tests


def family(nodeid: str) -> tuple[str, str]:
    """(file, test function): a test and all its parametrizations are one family."""
    path, _, rest = nodeid.partition("::")
    return path, rest.split("[", 1)[0]


def summarize(tests: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    rows: dict[tuple[str, str], Counter[str]] = defaultdict(Counter)
    for nodeid, test in tests.items():
        rows[family(nodeid)][test["outcome"]] += 1
    return [
        {"file": f, "test": t, **{o: counts[o] for o in OUTCOMES}}
        for (f, t), counts in sorted(rows.items())
    ]


def _bench_doc(path: Path) -> dict[str, Any] | None:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):  # not written (no case ran), or empty (4.x-5.2 open it early)
        return None
    return doc if isinstance(doc, dict) else None


def _ratios() -> Any:
    sys.path.insert(0, str(ROOT))
    from benchmarks import ratios

    return ratios


def verdict(info: dict[str, Any], phases: list[dict[str, Any]], totals: Counter[str]) -> str:
    bad = totals["failed"] + totals["error"]
    broken = [p for p in phases if p.get("timed_out") or p.get("exit") not in (0, None)]
    counts = ", ".join(f"{totals[o]} {o}" for o in OUTCOMES if totals[o])
    if bad or broken:
        why = [
            f"{p['name']} run " + ("timed out" if p.get("timed_out") else f"exit {p['exit']}")
            for p in broken
        ]
        return f"FAIL: {counts or 'nothing recorded'}" + (f" ({'; '.join(why)})" if why else "")
    if not info["cuda_available"]:
        return f"DRY RUN (no GPU: every CUDA case skipped): {counts}"
    return f"PASS: {counts}"


def _md_escape(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render(result: dict[str, Any]) -> str:
    info = result["machine"]
    gpus = info["gpus"]
    gpu = (
        "; ".join(
            f"{g['name']} (compute capability {g['capability']}, {g['memory_gib']} GiB)"
            for g in gpus
        )
        if gpus
        else "none (CUDA not available)"
    )
    pkgs = ", ".join(f"{k} {v or 'absent'}" for k, v in info["packages"].items())
    build = (
        f"{info['torch']} (CUDA {info['torch_cuda'] or '-'}, cuDNN {info['cudnn'] or '-'}, "
        f"NCCL {info['nccl'] or '-'})"
    )
    runs = "; ".join(
        f"{p['name']}: "
        + (f"not run: {p['skipped']}" if p.get("skipped") else f"exit {p['exit']}")
        + (" (timed out)" if p.get("timed_out") else "")
        + (f", {p['seconds']} s" if "seconds" in p else "")
        for p in result["phases"]
    )
    lines = [
        "# CUDA check results",
        "",
        "| | |",
        "|---|---|",
        f"| verdict | **{result['verdict']}** |",
        f"| date | {info['date']} |",
        f"| GPU | {gpu} |",
        f"| driver | {info['driver'] or 'unknown (no nvidia-smi)'} |",
        f"| torch | {build} |",
        f"| Python | {info['python']}, {info['cpus']} CPUs |",
        f"| packages | {pkgs} |",
        f"| fakegrad_patch | {info['fakegrad_patch']} from {info['fakegrad_patch_path']}"
        f" (commit {info['commit'] or 'unknown'}) |",
        f"| command | `{result['command']}` |",
        f"| runs | {runs} |",
        "",
        "## Tests: every CUDA-marked test (then the benchmark cases: their own checks)",
        "",
        "| file | test | " + " | ".join(OUTCOMES) + " |",
        "|---|---|" + "---|" * len(OUTCOMES),
    ]
    totals: Counter[str] = Counter()
    for row in result["families"]:
        totals.update({o: row[o] for o in OUTCOMES})
        cells = [str(row[o]) if row[o] else "" for o in OUTCOMES]
        lines.append(f"| {row['file']} | {row['test']} | " + " | ".join(cells) + " |")
    lines.append("| **total** | | " + " | ".join(f"**{totals[o]}**" for o in OUTCOMES) + " |")
    lines += ["", "### Not passed", ""]
    by_kind: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for nodeid, test in sorted(result["tests"].items()):
        if test["outcome"] != "passed":
            by_kind[test["outcome"]][test["message"]].append(nodeid)
    notes = {
        "xfailed": "a known cause outside these tests (tests/_pending.py)",
        "xpassed": "passes now: its cause is fixed, remove the xfail (tests/_pending.py)",
    }
    if not by_kind:
        lines.append("Every test passed.")
    for kind in ("failed", "error", "xpassed", "xfailed", "skipped"):
        for message, nodeids in sorted(by_kind.get(kind, {}).items()):
            head = f"* **{kind.upper()}** ({len(nodeids)})"
            if kind in notes:
                head += f", {notes[kind]}"
            lines.append(f"{head}: {_md_escape(message) or '(no message)'}")
            if kind != "skipped" or len(nodeids) <= 5:
                lines += [f"  * `{n}`" for n in nodeids]
    lines += ["", "## Benchmarks: the CUDA rows of " + ", ".join(BENCH_CASES), ""]
    lines.append(result["bench_table"])
    return "\n".join(lines) + "\n"


def _missing() -> list[str]:
    return [name for name in REQUIRED if importlib.util.find_spec(name) is None]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, help="results folder (default: $OUT, else cuda-results/)"
    )
    parser.add_argument(
        "--allow-no-gpu",
        action="store_true",
        help="dry run without a GPU: the same runs, every CUDA case skipped (CI checks this)",
    )
    parser.add_argument("--workers", type=int, default=4, help="pytest-xdist workers (0: none)")
    parser.add_argument("--no-bench", action="store_true", help="tests only")
    parser.add_argument("--bench-blocks", type=int, default=2, help="benchmarks/conftest.py's")
    parser.add_argument("--bench-scale", type=float, default=0.5, help="benchmarks/conftest.py's")
    parser.add_argument("--budget", type=float, default=360.0, help="seconds for both runs")
    args = parser.parse_args(argv)
    started = time.monotonic()
    out = (args.out or Path(os.environ.get("OUT") or "cuda-results")).resolve()  # runs: cwd ROOT
    out.mkdir(parents=True, exist_ok=True)
    missing = _missing()
    if missing:
        print(
            f"cuda_check: cannot start: {', '.join(missing)} not importable. Without network: "
            f"`pip download {' '.join(missing)} -d wheels/` on a machine with network, carry "
            "wheels/ over, `pip install --no-index --no-deps --target DIR wheels/*` and put DIR "
            "on PYTHONPATH (docs/cuda.md)",
            file=sys.stderr,
        )
        return 2
    sys.path.insert(0, str(ROOT))  # this tree's fakegrad_patch, for machine()
    info = machine()
    if not info["cuda_available"] and not args.allow_no_gpu:
        print(
            "cuda_check: torch.cuda.is_available() is False (torch "
            f"{info['torch']}); --allow-no-gpu runs the same collection with every CUDA case "
            "skipped",
            file=sys.stderr,
        )
        return 2

    record = Path(tempfile.mkdtemp(prefix="cuda-check-")) / "record.jsonl"
    env = {k: v for k, v in os.environ.items() if not k.startswith("FAKEGRAD_")}
    paths = [
        str(ROOT),
        str(ROOT / "tests"),
        *filter(None, env.get("PYTHONPATH", "").split(os.pathsep)),
    ]
    env.update(
        {
            "PYTHONPATH": os.pathsep.join(paths),
            "PYTHONDONTWRITEBYTECODE": "1",
            "FAKEGRAD_TEST_SCOPE": "all",
            # the CUDA operator sweep's categories (tests/test_opinfo_sweep.py) come back too
            "FAKEGRAD_SWEEP_DIR": str(out),
            RECORD_ENV: str(record),
        }
    )
    common = ["-p", "no:cacheprovider", "-p", "cuda_check", "-q", "-m", "cuda"]
    workers: list[str] = []
    if args.workers > 0 and importlib.util.find_spec("xdist") is not None:
        workers = ["-n", str(args.workers), "--dist", "loadfile"]
    have_bench = importlib.util.find_spec("pytest_benchmark") is not None
    phases: list[dict[str, Any]] = []
    with open(out / "run.log", "w", encoding="utf-8") as log:
        budget = args.budget - (time.monotonic() - started) - REPORT_RESERVE_S
        reserve = BENCH_RESERVE_S if have_bench and not args.no_bench else 0
        tests_args = [
            "tests",
            *common,
            *workers,
            "--durations=15",
            f"--junitxml={out / 'tests.junit.xml'}",
        ]
        phases.append(run_pytest("tests", tests_args, env, max(60.0, budget - reserve), log))
        if args.no_bench:
            phases.append({"name": "benchmarks", "skipped": "--no-bench"})
        elif not have_bench:
            phases.append({"name": "benchmarks", "skipped": "pytest-benchmark is not installed"})
        else:
            bench_json = out / "bench.json"
            bench_json.unlink(missing_ok=True)
            bench_args = [
                *(f"benchmarks/{case}" for cases in BENCH_CASES.values() for case in cases),
                *common,
                "-p",
                "no:xdist",
                f"--junitxml={out / 'bench.junit.xml'}",
                f"--benchmark-json={bench_json}",
                f"--bench-blocks={args.bench_blocks}",
                f"--bench-scale={args.bench_scale}",
            ]
            left = args.budget - (time.monotonic() - started) - REPORT_RESERVE_S
            phases.append(run_pytest("benchmarks", bench_args, env, max(30.0, left), log))

    tests = read_records(record)
    shutil.rmtree(record.parent, ignore_errors=True)
    families = summarize({k: v for k, v in tests.items() if not k.startswith("benchmarks/")})
    totals: Counter[str] = Counter()
    for test in tests.values():
        totals[test["outcome"]] += 1
    doc = _bench_doc(out / "bench.json")
    if doc is None and (out / "bench.json").exists():  # opened by 4.x-5.2, never written
        (out / "bench.json").unlink()
    if doc is None:
        why = next((p["skipped"] for p in phases if p.get("skipped")), None)
        bench_table = f"Not run: {why}." if why else "No benchmark ran (no CUDA row)."
    else:
        bench_table = _ratios().render(doc, "bench.json")
    bench_families = summarize({k: v for k, v in tests.items() if k.startswith("benchmarks/")})
    result = {
        "verdict": verdict(info, phases, totals),
        "command": " ".join(
            ["python", "tests/cuda_check.py", *(argv if argv is not None else sys.argv[1:])]
        ),
        "machine": info,
        "phases": phases,
        "families": families + bench_families,
        "tests": tests,
        "bench_table": bench_table,
        "bench_rows": [] if doc is None else _ratios().rows(doc),
    }
    (out / "results.json").write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    (out / "results.md").write_text(render(result), encoding="utf-8")
    print(f"\ncuda_check: {result['verdict']}\ncuda_check: results in {out}/results.md")
    return 0 if result["verdict"].startswith(("PASS", "DRY RUN")) else 1


if __name__ == "__main__":
    sys.exit(main())
