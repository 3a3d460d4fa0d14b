"""Shared fixtures: devices, propagation, a clean patch state per test."""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator

import pytest
import torch
import torch._functorch.config as functorch_config

import fakegrad_patch
from fakegrad_patch import _config, trace

#: Set by tests/test_can_fail.py: run the suite against upstream torch to prove it fails there.
UNPATCHED = os.environ.get("FAKEGRAD_TEST_UNPATCHED") == "1"

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


#: Test files whose subject does not change with the torch build: the start-up hook and its
#: activation paths, settings parsing, the pytest plugin, doctor's checks, the trace reader and
#: sink, the verify CLI's plumbing, packaging, the README and the package layout. They depend on
#: the interpreter and on wrapt/structlog instead. ``FAKEGRAD_TEST_SCOPE=build`` deselects them
#: (torch213 and torch214 on 3.11, the quick tier); they run in oldest (3.10, the oldest
#: Python), lowest (3.12, the lowest wrapt/structlog) and newest (3.13, the newest Python).
#: Unset, or ``all``: every file runs.
BUILD_INDEPENDENT = frozenset(
    {
        "test_activation.py",
        "test_startup_hook.py",
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
#: registries' cost at 6,000 tensors (scale) and the benchmark smoke run (benchmarks run on the
#: local builds). ``FAKEGRAD_TEST_SCOPE=deps`` deselects them: the ``lowest`` env, whose torch
#: (2.15.0) is newest's, only changes wrapt and structlog, which these files do not exercise
#: beyond what every other file does; newest runs them on that build.
BUILD_BOUND = frozenset(
    {
        "test_pt2_coexistence.py",
        "test_can_fail.py",
        "test_scale.py",
        "test_benchmarks_smoke.py",
    }
)
SCOPES = {"all": frozenset(), "build": BUILD_INDEPENDENT, "deps": BUILD_BOUND}
HERE = os.path.dirname(os.path.abspath(__file__))


def _scope() -> str:
    scope = os.environ.get("FAKEGRAD_TEST_SCOPE", "").strip() or "all"
    if scope not in SCOPES:
        raise pytest.UsageError(f"FAKEGRAD_TEST_SCOPE={scope!r}: expected one of {tuple(SCOPES)}")
    return scope


def elsewhere(value: str | None = None) -> frozenset[str]:
    """``FAKEGRAD_TEST_ELSEWHERE``: more test files a tox env leaves to another env of the CI
    command (tests/test_readme.py checks that every file still runs in one). A name that is not
    a test file here is an error, never silently nothing."""
    raw = os.environ.get("FAKEGRAD_TEST_ELSEWHERE", "") if value is None else value
    names = frozenset(raw.replace(",", " ").split())
    unknown = sorted(n for n in names if not os.path.isfile(os.path.join(HERE, n)))
    if unknown:
        raise pytest.UsageError(f"FAKEGRAD_TEST_ELSEWHERE: no such test file: {unknown}")
    return names


def left_out(scope: str, also: frozenset[str]) -> frozenset[str]:
    """The test files an env with this scope and ``FAKEGRAD_TEST_ELSEWHERE`` deselects."""
    return SCOPES[scope] | also


def pytest_report_header(config: pytest.Config) -> str:
    scope, also = _scope(), elsewhere()
    lines = []
    if scope == "build":
        lines.append(
            "FAKEGRAD_TEST_SCOPE=build: the build-independent files are deselected here "
            "(they run in the oldest, lowest and newest envs)"
        )
    elif scope == "deps":
        lines.append(
            "FAKEGRAD_TEST_SCOPE=deps: the build-bound files are deselected here "
            f"({', '.join(sorted(BUILD_BOUND))}: they run in the envs of each torch build)"
        )
    else:
        lines.append("FAKEGRAD_TEST_SCOPE=all: every test file")
    if also:
        lines.append(
            f"FAKEGRAD_TEST_ELSEWHERE: {', '.join(sorted(also))} deselected here "
            "(another env of the CI command runs them)"
        )
    return "\n".join(lines)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    dropped_files = left_out(_scope(), elsewhere())
    if dropped_files:
        kept, dropped = [], []
        for item in items:
            (dropped if item.path.name in dropped_files else kept).append(item)
        if dropped:
            config.hook.pytest_deselected(items=dropped)
            items[:] = kept
    skip = pytest.mark.skip(reason="CUDA not available")
    if not torch.cuda.is_available():
        for item in items:
            if "cuda" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> torch.device:
    return torch.device(request.param)


@pytest.fixture(autouse=True)
def patch_state() -> Iterator[None]:
    """Every test starts with the patch installed (or, for the can-fail proof, uninstalled),
    the default settings (``on_missing`` not set explicitly), and leaves the settings and the
    trace level as it found them."""
    if UNPATCHED:
        fakegrad_patch.uninstall()
    else:
        fakegrad_patch.install()
    previous = _config.current()
    _config.restore(fakegrad_patch.Settings())  # the defaults, nothing explicit
    fakegrad_patch._settings_changed()
    level = trace.set_level(trace.WARNING)
    propagating = functorch_config.fake_tensor_propagate_real_tensors
    try:
        yield
    finally:
        _config.restore(previous)
        fakegrad_patch._settings_changed()
        trace.set_level(level)
        # Tests that patch the config inside several threads at once (each thread its own
        # ``config.patch``) leak the value where the build's config is process-wide (2.4: the
        # threads' restores interleave); the next test must start as this one did.
        if functorch_config.fake_tensor_propagate_real_tensors != propagating:
            functorch_config.fake_tensor_propagate_real_tensors = propagating


@pytest.fixture
def propagate() -> Iterator[None]:
    """Real-value propagation on for modes created in this test (this thread)."""
    with functorch_config.patch(fake_tensor_propagate_real_tensors=True):
        yield


@pytest.fixture
def no_propagate() -> Iterator[None]:
    with functorch_config.patch(fake_tensor_propagate_real_tensors=False):
        yield


@pytest.fixture
def quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fakegrad_patch.FakeGradPatchWarning)
        yield
