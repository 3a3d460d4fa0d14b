"""``tests/cuda_check.py``, the one command for everything CUDA (issue 38), checked without a
GPU: its dry run (``--allow-no-gpu``) collects every family a GPU run covers and skips each case
cleanly; its plugin records each outcome, XFAIL and XPASS included; its table names what failed.
(On a machine with a GPU the command itself is the check: docs/cuda.md.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "cuda_check.py"

pytestmark = pytest.mark.slow  # fresh interpreters


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("FAKEGRAD_", "PYTEST_"))}


def _cuda_check() -> Any:
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import cuda_check
    finally:
        sys.path.remove(str(SCRIPT.parent))
    return cuda_check


#: test function -> families a GPU run must cover (issue 38's list)
FAMILIES = {
    ("tests/test_verify.py", "test_zoo_model_trains_like_eager"),
    ("tests/test_verify.py", "test_zoo_model_trains_like_eager_buffers_included_with_write_back"),
    ("tests/test_recurrent.py", "test_cell_unrolled_in_a_loop_trains_like_eager"),
    ("tests/test_recurrent.py", "test_recurrent_module_trains_like_eager"),
    ("tests/test_recurrent.py", "test_packed_sequence_trains_like_eager"),
    (
        "tests/test_norm_attention.py",
        "test_batch_norm_backward_with_each_output_mask_trains_like_eager",
    ),
    ("tests/test_norm_attention.py", "test_attention_on_each_sdpa_backend_trains_like_eager"),
    ("tests/test_norm_attention.py", "test_float32_transformer_encoder_layer_trains_like_eager"),
    (
        "tests/test_write_back.py",
        "test_batch_norm_statistics_with_and_without_cudnn_train_like_eager",
    ),
    (
        "tests/test_distributed.py",
        "test_nccl_on_one_gpu_fake_forward_and_backward_give_eager_ddp_grads",
    ),
}


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: run the command itself")
def test_dry_run_covers_every_cuda_family_and_skips_each_case(tmp_path: Path) -> None:
    out = tmp_path / "results"
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--allow-no-gpu", "--workers", "0", "--out", str(out)],
        cwd=tmp_path,  # runs from anywhere
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert {p.name for p in out.iterdir()} == {
        "results.md",
        "results.json",
        "tests.junit.xml",
        "bench.junit.xml",
        "run.log",  # and bench.json where a benchmark ran
    }
    result = json.loads((out / "results.json").read_text())
    assert result["verdict"].startswith("DRY RUN"), result["verdict"]
    tests = result["tests"]
    assert tests and {t["outcome"] for t in tests.values()} == {"skipped"}, result["verdict"]
    families = {(row["file"], row["test"]) for row in result["families"]}
    assert families >= FAMILIES, FAMILIES - families
    # every CUDA test of the suite, not only issue 38's: the device-parametrized ones too
    assert ("tests/test_materialize.py", "test_mlp_parameters_equal_eager") in families
    # each benchmark case the command runs has CUDA variants, skipped with the harness's reason
    cuda_check = _cuda_check()
    for case, functions in cuda_check.BENCH_CASES.items():
        for function in functions:
            path, name = function.split("::")
            ids = [n for n in tests if n.startswith(f"benchmarks/{path}::{name}[")]
            assert ids, (case, function)
            assert all("[cuda" in n or "-cuda" in n for n in ids), ids
            assert all("no CUDA device" in tests[n]["message"] for n in ids), ids
    table = (out / "results.md").read_text()
    assert "| verdict | **DRY RUN" in table and "| torch | " in table
    assert "tests/test_recurrent.py | test_recurrent_module_trains_like_eager |" in table


def test_every_function_of_a_benchmark_case_is_in_the_command() -> None:
    """A case split over several functions (P19's four models and the zoo) runs whole on CUDA:
    every benchmark function named after a case the command runs (``test_p19_...``) is listed."""
    import re

    cases = _cuda_check().BENCH_CASES
    listed = {f for functions in cases.values() for f in functions}
    found = set()
    for path in sorted((ROOT / "benchmarks").glob("test_*.py")):
        for name in re.findall(r"^def (test_p(\d+)_\w+)\(", path.read_text(), re.MULTILINE):
            if f"P{name[1]}" in cases:
                found.add(f"{path.name}::{name[0]}")
    assert found and found <= listed, found - listed


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here")
def test_without_a_gpu_it_refuses_unless_asked(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(tmp_path)],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert run.returncode == 2, run.stdout + run.stderr
    assert "--allow-no-gpu" in run.stderr


SAMPLE = """
import pytest

def test_passes():
    pass

def test_fails():
    assert 1 == 2, "one is not two"

@pytest.mark.xfail(reason="a known cause", strict=False)
def test_known_failure():
    raise RuntimeError("still broken")

@pytest.mark.xfail(reason="a fixed cause", strict=False)
def test_fixed_since():
    pass

def test_marked_while_running(request):
    request.applymarker(pytest.mark.xfail(reason="marked at run time", strict=False))
    raise RuntimeError("broken")

@pytest.mark.parametrize("n", [1, 2])
def test_skipped(n):
    pytest.skip("no GPU here")

@pytest.fixture
def broken():
    raise OSError("setup broke")

def test_setup_error(broken):
    pass
"""


def test_the_plugin_records_each_outcome_and_the_table_names_them(tmp_path: Path) -> None:
    (tmp_path / "test_sample.py").write_text(textwrap.dedent(SAMPLE))
    record = tmp_path / "record.jsonl"
    env = {
        **_env(),
        "PYTHONPATH": os.pathsep.join([str(SCRIPT.parent), os.environ.get("PYTHONPATH", "")]),
        "FAKEGRAD_CUDA_CHECK_RECORD": str(record),
    }
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "cuda_check", "-p", "no:cacheprovider", "-q"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert run.returncode == 1, run.stdout + run.stderr  # one test failed
    cuda_check = _cuda_check()
    tests = cuda_check.read_records(record)
    outcomes = {nodeid.split("::")[1]: t["outcome"] for nodeid, t in tests.items()}
    assert outcomes == {
        "test_passes": "passed",
        "test_fails": "failed",
        "test_known_failure": "xfailed",
        "test_fixed_since": "xpassed",
        "test_marked_while_running": "xfailed",
        "test_skipped[1]": "skipped",
        "test_skipped[2]": "skipped",
        "test_setup_error": "error",
    }
    messages = {nodeid.split("::")[1]: t["message"] for nodeid, t in tests.items()}
    assert "one is not two" in messages["test_fails"]
    assert messages["test_known_failure"] == "a known cause"
    assert messages["test_skipped[1]"] == "no GPU here"
    assert "setup broke" in messages["test_setup_error"]

    info = {
        "date": "d",
        "python": "3",
        "cpus": 4,
        "torch": "t",
        "torch_cuda": "13.0",
        "cuda_available": True,
        "gpus": [{"name": "GPU", "capability": "9.0", "memory_gib": 1.0}],
        "driver": "1",
        "cudnn": 1,
        "nccl": "2",
        "fakegrad_patch": "v",
        "fakegrad_patch_path": "p",
        "commit": None,
        "packages": {},
    }
    phases = [{"name": "tests", "exit": 1, "timed_out": False, "seconds": 1.0}]
    totals = cuda_check.Counter(t["outcome"] for t in tests.values())
    verdict = cuda_check.verdict(info, phases, totals)
    assert verdict.startswith("FAIL: 1 passed, 1 failed, 1 error, 2 xfailed, 1 xpassed, 2 skipped")
    table = cuda_check.render(
        {
            "verdict": verdict,
            "command": "c",
            "machine": info,
            "phases": phases,
            "families": cuda_check.summarize(tests),
            "tests": tests,
            "bench_table": "b",
        }
    )
    assert "| test_sample.py | test_skipped |  |  |  |  |  | 2 |" in table
    assert "* **FAILED** (1): " in table and "one is not two" in table
    assert "* **XPASSED** (1), passes now" in table
    assert "* **XFAILED** (1), a known cause outside these tests" in table
    assert "`test_sample.py::test_fixed_since`" in table
