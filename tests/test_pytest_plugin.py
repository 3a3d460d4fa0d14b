"""Issue 5: the pytest plugin (entry point ``fakegrad``): the ``fakegrad_events`` fixture,
``--fakegrad-patch`` and ``--fakegrad-strict`` (and their ini keys), inert when unused."""

from __future__ import annotations

import textwrap
import warnings

import pytest

pytest_plugins = ["pytester"]

#: Inner test module helpers: a tiny model and a fake backward with or without propagation.
HELPERS = textwrap.dedent(
    """
    import torch
    import torch._functorch.config as fc
    from torch._subclasses.fake_tensor import FakeTensorMode
    import fakegrad_patch

    def fake_backward(propagate):
        torch.manual_seed(0)
        m = torch.nn.Linear(3, 2)
        fakegrad_patch.name_parameters(m, prefix="lin")
        with fc.patch(fake_tensor_propagate_real_tensors=propagate):
            with FakeTensorMode(allow_non_fake_inputs=True):
                m(torch.randn(4, 3)).sum().backward()
        return m
    """
)


@pytest.fixture(scope="module")
def warm_torch() -> None:
    """Import, in this process, every torch module the inner tests import: in-process pytester
    runs drop modules first imported during the run, and torch cannot import some of them twice
    (operator libraries register once per process)."""
    namespace: dict[str, object] = {}
    exec(HELPERS, namespace)
    fake_backward = namespace["fake_backward"]
    assert callable(fake_backward)
    import fakegrad_patch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fake_backward(True)
        fake_backward(False)
        with fakegrad_patch.patched(on_missing="keep"):
            fake_backward(False)


@pytest.fixture
def inner(pytester: pytest.Pytester, warm_torch: None) -> pytest.Pytester:
    pytester.makepyfile(fgp_helpers=HELPERS)
    pytester.makeini("[pytest]\nfilterwarnings = ignore::UserWarning\n")
    return pytester


def test_fixture_captures_one_test_at_debug_and_restores(inner: pytest.Pytester) -> None:
    inner.makepyfile(
        test_inner="""
        from fakegrad_patch import trace
        from fgp_helpers import fake_backward

        def test_events(fakegrad_events):
            assert trace.enabled(trace.DEBUG)
            fake_backward(propagate=True)
            kinds = [e["event"] for e in fakegrad_events]
            assert kinds.count("leaf_armed") == 2
            assert kinds.count("fake_grad_set") == 2
            names = {e["name"] for e in fakegrad_events if e["event"] == "fake_grad_set"}
            assert names == {"lin.weight", "lin.bias"}

        def test_after():
            assert not trace.enabled(trace.DEBUG)

        def test_isolated(fakegrad_events):
            assert fakegrad_events == []
        """
    )
    inner.runpytest().assert_outcomes(passed=3)


def test_plugin_is_inert_and_torch_free_without_options(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_inner="""
        import sys

        def test_nothing_heavy_loaded(pytestconfig):
            assert pytestconfig.pluginmanager.has_plugin("fakegrad")
            assert "torch" not in sys.modules
            assert "structlog" not in sys.modules
            assert "fakegrad_patch" not in sys.modules  # importing it would install the patch
        """
    )
    result = pytester.runpytest_subprocess()
    result.assert_outcomes(passed=1)
    assert "fakegrad_patch: patch installed" not in result.stdout.str()


def test_plugin_can_be_disabled(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_inner="""
        def test_disabled(pytestconfig):
            assert not pytestconfig.pluginmanager.has_plugin("fakegrad")
        """
    )
    pytester.runpytest_subprocess("-p", "no:fakegrad").assert_outcomes(passed=1)


# The inner conftest uninstalls what ``import fakegrad_patch`` installed, so the session option
# is what decides (conftest files load before pytest_configure).
UNINSTALLING_CONFTEST = """
import fakegrad_patch
fakegrad_patch.uninstall()
"""
CHECK_INSTALLED = """
import torch  # noqa: F401  (the patch applies once torch is imported)
import fakegrad_patch

def test_state():
    assert fakegrad_patch.is_installed() is {expected}
"""


@pytest.mark.parametrize(
    ("args", "ini", "expected"),
    [
        ((), "", False),
        (("--fakegrad-patch",), "", True),
        ((), "fakegrad_patch = true", True),
        (("--fakegrad-strict",), "", True),
    ],
)
def test_patch_option_installs_for_the_session(
    pytester: pytest.Pytester, args: tuple[str, ...], ini: str, expected: bool
) -> None:
    pytester.makeconftest(UNINSTALLING_CONFTEST)
    pytester.makeini(f"[pytest]\n{ini}\n")
    pytester.makepyfile(test_inner=CHECK_INSTALLED.format(expected=expected))
    result = pytester.runpytest_subprocess(*args)
    result.assert_outcomes(passed=1)
    header = "fakegrad_patch: patch installed for the session"
    assert (header in result.stdout.str()) is expected


STRICT_TESTS = """
import pytest
import fakegrad_patch
from fgp_helpers import fake_backward

def test_propagated_is_fine():
    fake_backward(propagate=True)

def test_dropped_fails():
    fake_backward(propagate=False)

def test_kept_fails():
    with fakegrad_patch.patched(on_missing="keep"):
        fake_backward(propagate=False)

@pytest.mark.fakegrad_allow
def test_allowed_drop():
    fake_backward(propagate=False)

def test_no_torch_at_all():
    assert 1 + 1 == 2

@pytest.fixture
def drops_in_setup():
    fake_backward(propagate=False)

def test_setup_problem_is_an_error(drops_in_setup):
    pass
"""


@pytest.mark.parametrize("how", ["option", "ini"])
def test_strict_fails_the_offending_tests(inner: pytest.Pytester, how: str) -> None:
    inner.makepyfile(test_inner=STRICT_TESTS)
    if how == "ini":
        inner.makeini("[pytest]\nfilterwarnings = ignore::UserWarning\nfakegrad_strict = true\n")
        result = inner.runpytest()
    else:
        result = inner.runpytest("--fakegrad-strict")
    result.assert_outcomes(passed=3, failed=2, errors=1)
    result.stdout.fnmatch_lines(
        [
            "*fakegrad_patch strict: 2 fake gradient problem(s) during*test_dropped_fails*",
            "*fake_grad_drop: leaf 'lin.*' [[]*[]] float32 cpu (backward *)*",
        ]
    )
    out = result.stdout.str()
    assert "fake_grad_keep: leaf 'lin." in out
    for name in ("test_dropped_fails", "test_kept_fails"):
        assert f"FAILED test_inner.py::{name}" in out
    assert "ERROR test_inner.py::test_setup_problem_is_an_error" in out


def test_without_strict_drops_do_not_fail(inner: pytest.Pytester) -> None:
    inner.makepyfile(test_inner=STRICT_TESTS)
    inner.runpytest().assert_outcomes(passed=6)
