"""Shared fixtures: devices, propagation, a clean patch state per test."""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator

import _scopes
import pytest
import torch
import torch._functorch.config as functorch_config
from _helpers import DEVICES  # defined there, so test files can import it too

import fakegrad_patch
from fakegrad_patch import _config, trace

#: Set by tests/test_can_fail.py: run the suite against upstream torch to prove it fails there.
UNPATCHED = os.environ.get("FAKEGRAD_TEST_UNPATCHED") == "1"
#: Set by tests/test_can_fail.py: the patch installed with its propagation repairs off (issue 39),
#: to prove the repairs' tests fail without them.
DEFAULTS = fakegrad_patch.Settings(
    propagation=os.environ.get("FAKEGRAD_TEST_PROPAGATION", "fast")  # type: ignore[arg-type]
)


def _scope() -> str:
    try:
        return _scopes.scope()
    except _scopes.ScopeError as exc:
        raise pytest.UsageError(str(exc)) from None


def elsewhere() -> frozenset[str]:
    try:
        return _scopes.elsewhere()
    except _scopes.ScopeError as exc:
        raise pytest.UsageError(str(exc)) from None


def pytest_report_header(config: pytest.Config) -> str:
    scope, also = _scope(), elsewhere()
    lines = []
    if scope == "build":
        lines.append(
            "FAKEGRAD_TEST_SCOPE=build: the build-independent files are deselected here "
            "(they run in the lowest and newest envs)"
        )
    elif scope == "deps":
        lines.append(
            "FAKEGRAD_TEST_SCOPE=deps: the build-bound files are deselected here "
            f"({', '.join(sorted(_scopes.BUILD_BOUND))}: they run in the envs of each torch "
            "build), and the files of the patch's tensor logic (newest runs them on this build)"
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
    dropped_files = _scopes.left_out(_scope(), elsewhere())
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
    _config.restore(DEFAULTS)  # the defaults, nothing explicit
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
def restore_trace() -> Iterator[None]:
    """Tests that change the trace configuration put it back."""
    previous = trace.current_config()
    try:
        yield
    finally:
        trace.restore(previous)


@pytest.fixture
def no_propagate() -> Iterator[None]:
    with functorch_config.patch(fake_tensor_propagate_real_tensors=False):
        yield


@pytest.fixture
def quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fakegrad_patch.FakeGradPatchWarning)
        yield
