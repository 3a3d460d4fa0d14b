"""Which test files a tox env runs (issue 26): the data behind ``FAKEGRAD_TEST_SCOPE`` and
``FAKEGRAD_TEST_ELSEWHERE``, shared by tests/conftest.py and tests/test_readme.py.

A plain module, not conftest: with pytest's default import mode, ``import conftest`` from a
test finds whichever conftest.py was imported first under that name (tests/ecosystem/ has
its own), so the data lives where one import name means one file.
"""

from __future__ import annotations

import os

#: Test files whose subject does not change with the torch build: the start-up hook and its
#: activation paths, settings parsing, the pytest plugin, doctor's checks, the trace reader and
#: sink, the verify CLI's plumbing, packaging, the README and the package layout. They depend on
#: the interpreter and on wrapt/structlog instead. ``FAKEGRAD_TEST_SCOPE=build`` deselects them
#: (oldest on 3.10, torch213 and torch214 on 3.11, the quick tier); they run in lowest (3.12,
#: the lowest wrapt/structlog) and newest (3.13, the newest Python).
#: Unset, or ``all``: every file runs.
BUILD_INDEPENDENT = frozenset(
    {
        "test_activation.py",
        "test_startup_hook.py",
        "test_import_order.py",
        "test_sitecustomize_append.py",
        "test_settings_validation.py",
        "test_pytest_plugin.py",
        "test_doctor_checks.py",
        "test_trace_reader.py",
        "test_trace_reader_robust.py",
        "test_trace_sink.py",
        "test_trace_pipeline.py",
        "test_verify_cli.py",
        "test_packaging.py",
        "test_readme.py",
        "test_layout.py",
    }
)
#: Files whose subject is the torch build alone: PyTorch's own tracers next to the patch (PT2
#: coexistence, inductor compiles), upstream's defects with the patch removed (can_fail), the
#: registries' cost at 6,000 tensors (scale), the benchmark smoke run (benchmarks run on the
#: local builds), the CUDA command's dry run (it collects this build's CUDA tests and
#: benchmark rows; GPU runs use a local build too), PyTorch's own test_fake_tensor.py at the
#: build's tag with and without the patch, the operator sweep and the random-program fuzzer
#: (eager vs patched on this build). ``FAKEGRAD_TEST_SCOPE=deps`` deselects them:
#: the ``lowest`` env, whose torch
#: (2.15.0) is newest's, only changes wrapt and structlog, which these files do not exercise
#: beyond what every other file does; newest runs them on that build.
BUILD_BOUND = frozenset(
    {
        "test_pt2_coexistence.py",
        "test_pt2_inductor.py",
        "test_can_fail.py",
        "test_scale.py",
        "test_benchmarks_smoke.py",
        "test_cuda_check.py",
        "test_opinfo_sweep.py",
        "test_upstream_fake_tensor.py",
        "test_fuzz.py",
    }
)
#: Files whose subject is the patch's tensor logic on the build (conversions, propagation, views,
#: lending, direct reads, write-through of gradients, a family of programs): they reach wrapt and
#: structlog only through the calls that every file makes (test_correctness, test_api,
#: test_multi_mode and the trace files keep those in ``lowest``). ``FAKEGRAD_TEST_SCOPE=deps``
#: deselects them too: ``lowest`` shares newest's build, and newest runs them on it (CI time,
#: docs/compatibility.md).
TENSOR_LOGIC = frozenset(
    {
        "test_propagation.py",
        "test_programs.py",
        "test_distributed.py",
        "test_autocast_norm.py",
        "test_verify.py",
        "test_lending.py",
        "test_grad_layout_contract.py",
        "test_fake_leaves.py",
        "test_recurrent.py",
        "test_interplay.py",
        "test_norm_attention.py",
        "test_lean_conversion.py",
        "test_inplace_updates.py",
        "test_fast_batchnorm.py",
        "test_profiler_ranges.py",
        "test_materialize.py",
        "test_mode_entry.py",
        "test_direct_reads.py",
        "test_fake_maker.py",
    }
)
SCOPES = {"all": frozenset(), "build": BUILD_INDEPENDENT, "deps": BUILD_BOUND | TENSOR_LOGIC}
HERE = os.path.dirname(os.path.abspath(__file__))


class ScopeError(ValueError):
    """A scope or file list that names nothing here; conftest turns it into a usage error."""


def scope() -> str:
    """``FAKEGRAD_TEST_SCOPE``: ``all`` (unset), ``build`` or ``deps``."""
    value = os.environ.get("FAKEGRAD_TEST_SCOPE", "").strip() or "all"
    if value not in SCOPES:
        raise ScopeError(f"FAKEGRAD_TEST_SCOPE={value!r}: expected one of {tuple(SCOPES)}")
    return value


def elsewhere(value: str | None = None) -> frozenset[str]:
    """``FAKEGRAD_TEST_ELSEWHERE``: more test files a tox env leaves to another env of the CI
    command (tests/test_readme.py checks that every file still runs in one). A name that is not
    a test file here is an error, never silently nothing."""
    raw = os.environ.get("FAKEGRAD_TEST_ELSEWHERE", "") if value is None else value
    names = frozenset(raw.replace(",", " ").split())
    unknown = sorted(n for n in names if not os.path.isfile(os.path.join(HERE, n)))
    if unknown:
        raise ScopeError(f"FAKEGRAD_TEST_ELSEWHERE: no such test file: {unknown}")
    return names


def left_out(name: str, also: frozenset[str]) -> frozenset[str]:
    """The test files an env with this scope and ``FAKEGRAD_TEST_ELSEWHERE`` deselects."""
    return SCOPES[name] | also
