"""pytest integration for fakegrad_patch (entry point ``pytest11``: ``fakegrad``).

* fixture ``fakegrad_events``: the trace events of one test, as a list of dicts (debug level
  while the test runs, whatever the trace level is outside it);
* ``--fakegrad-patch`` (ini ``fakegrad_patch = true``): install the patch for the session;
* ``--fakegrad-strict`` (ini ``fakegrad_strict = true``): install the patch and fail every test
  during which a fake gradient was dropped (``fake_grad_drop``), raised (``fake_grad_error``),
  left on a real leaf (``fake_grad_keep``) or lost to an internal error. A problem during setup or
  teardown makes that phase an error. Mark a test ``@pytest.mark.fakegrad_allow`` to exempt it
  (tests that exercise those policies on purpose). If the patch could not be applied to this
  torch at all, the session fails.
* fixture ``fakegrad_verify``: ``fakegrad_verify(model, inputs, loss_fn=None, **options)`` runs
  ``fakegrad_patch.verify`` and fails the test with the report when the patched run differs from
  eager; returns the report.

Without those options, and unless a test asks for the fixture, the plugin does nothing: this
module imports neither fakegrad_patch (whose import installs the patch) nor torch nor structlog,
and the hooks below return at once. It ships as the top-level module ``fakegrad_patch_pytest``
(pyproject force-include) for that reason. Disable it entirely with ``-p no:fakegrad``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Generator, Iterator
from typing import Any

import pytest

#: Events that make a test fail under --fakegrad-strict.
STRICT_EVENTS = frozenset({"fake_grad_drop", "fake_grad_error", "fake_grad_keep", "internal_error"})

_STATE = pytest.StashKey[dict[str, Any]]()

#: The allowed values of the plugin's boolean ini options, as ``fakegrad_patch._config.SETTINGS``
#: words them (this module may not import the package; tests/test_settings_validation.py pins the
#: two to each other).
INI_ALLOWED = "a pytest boolean: y/yes/t/true/on/1 or n/no/f/false/off/0"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("fakegrad", "fakegrad_patch (real gradients under FakeTensorMode)")
    group.addoption(
        "--fakegrad-patch",
        action="store_true",
        default=None,
        help="install the fakegrad_patch patch for the whole session (ini: fakegrad_patch)",
    )
    group.addoption(
        "--fakegrad-strict",
        action="store_true",
        default=None,
        help="install the patch and fail tests that drop a gradient or leave a fake gradient "
        "on a real leaf (ini: fakegrad_strict)",
    )
    parser.addini("fakegrad_patch", "install the fakegrad_patch patch for the session", "bool")
    parser.addini(
        "fakegrad_strict",
        "fail tests that drop a gradient or leave a fake gradient on a real leaf",
        "bool",
    )


def _flag(config: pytest.Config, name: str) -> bool:
    option = config.getoption(name)
    if option is not None:
        return bool(option)
    try:
        return bool(config.getini(name))
    except (ValueError, pytest.UsageError) as exc:  # pytest 9: UsageError("invalid truth value")
        # pytest words it "invalid truth value 'raw'" (config.inicfg, the raw text, is deprecated)
        text = str(exc)
        shown = text.split("invalid truth value ", 1)[-1].strip() if "truth value" in text else text
        raise pytest.UsageError(
            f"fakegrad_patch: ini option {name}: invalid value {shown}: expected {INI_ALLOWED}"
        ) from None


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "fakegrad_allow: exempt this test from --fakegrad-strict (it drops or keeps fake "
        "gradients on purpose)",
    )
    strict = _flag(config, "fakegrad_strict")
    patch = strict or _flag(config, "fakegrad_patch")
    state: dict[str, Any] = {"strict": strict, "patch": patch, "installed_by_us": False}
    config.stash[_STATE] = state
    if patch:
        import fakegrad_patch

        state["installed_by_us"] = not fakegrad_patch.status()["wanted"]
        fakegrad_patch.install()
        if strict and not fakegrad_patch.settings().on_missing_explicit:
            # Strict asks for the policy everywhere: also in modes that do not propagate real
            # values, where the patch otherwise leaves upstream's FakeTensor gradients alone.
            state["settings"] = fakegrad_patch.configure(
                on_missing=fakegrad_patch.settings().on_missing
            )


def pytest_unconfigure(config: pytest.Config) -> None:
    state = config.stash.get(_STATE, None)
    if state and "settings" in state:
        from fakegrad_patch import _config

        _config.restore(state["settings"])
    if state and state["installed_by_us"]:
        import fakegrad_patch

        fakegrad_patch.uninstall()


def pytest_report_header(config: pytest.Config) -> str | None:
    state = config.stash.get(_STATE, None)
    if not state or not state["patch"]:
        return None
    return "fakegrad_patch: patch installed for the session" + (
        ", strict (tests fail on dropped or fake gradients)" if state["strict"] else ""
    )


def _describe(event: dict[str, Any]) -> str:
    if event["event"] == "internal_error":
        return f"internal_error in {event.get('where')}: {event.get('error')}"
    leaf = f"{event.get('shape')} {event.get('dtype')} {event.get('device')}"
    if event.get("name"):
        leaf = f"{event['name']!r} {leaf}"
    return f"{event['event']}: leaf {leaf} (backward {event.get('backward_id')})"


def _strict_guard(item: pytest.Item) -> Generator[None, Any, Any]:
    """Run one test phase inside a capture and fail it on problem events."""
    state = item.config.stash.get(_STATE, None)
    if not state or not state["strict"] or item.get_closest_marker("fakegrad_allow"):
        return (yield)
    from fakegrad_patch import trace

    with trace.capture(trace.INFO) as captured:
        result = yield  # an exception from the test itself propagates unchanged
    problems = [e for e in captured if e["event"] in STRICT_EVENTS]
    if problems:
        lines = "\n".join(f"  {_describe(e)}" for e in problems[:20])
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        pytest.fail(
            f"fakegrad_patch strict: {len(problems)} fake gradient problem(s) during "
            f"{item.nodeid}:\n{lines}{more}\n(mark the test @pytest.mark.fakegrad_allow if "
            "this is intended)",
            pytrace=False,
        )
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator[None, Any, Any]:
    return (yield from _strict_guard(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, Any, Any]:
    return (yield from _strict_guard(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Generator[None, Any, Any]:
    return (yield from _strict_guard(item))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    state = session.config.stash.get(_STATE, None)
    if not state or not state["strict"]:
        return
    import fakegrad_patch

    reason = fakegrad_patch.status()["skipped_reason"]
    if reason:
        state["skipped"] = reason
        if session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    state = config.stash.get(_STATE, None)
    if state and state.get("skipped"):
        terminalreporter.write_line(
            f"fakegrad_patch strict: the patch could not be applied ({state['skipped']}); "
            "fake gradients were not checked. Failing the session.",
            red=True,
        )


@pytest.fixture
def fakegrad_events() -> Iterator[list[dict[str, Any]]]:
    """The fakegrad_patch trace events of this test (every level, debug included), oldest first.

    Each item is the event's dict as documented in docs/trace-schema.md. The trace's own level,
    sink and memory buffer are unchanged and restored state is exact after the test.
    """
    from fakegrad_patch import trace

    with trace.capture(trace.DEBUG) as captured:
        yield captured


@pytest.fixture
def fakegrad_verify() -> Iterator[Callable[..., Any]]:
    """``fakegrad_verify(model, example_inputs, loss_fn=None, **options) -> report``.

    Runs ``fakegrad_patch.verify`` (same arguments) and fails the test with the formatted report
    (problems first) when the patched run differs from eager in any way. The patch state is as
    before the test afterwards (importing fakegrad_patch installs the patch; if this fixture
    caused that import, it uninstalls at teardown).
    """
    imported_before = "fakegrad_patch" in sys.modules
    import fakegrad_patch

    wanted_before = imported_before and fakegrad_patch.status()["wanted"]

    def check(model: Any, example_inputs: Any, loss_fn: Any = None, **options: Any) -> Any:
        __tracebackhide__ = True
        report = fakegrad_patch.verify(model, example_inputs, loss_fn, **options)
        if not report.ok:
            pytest.fail(
                "fakegrad_patch.verify: the patched run differs from eager\n" + report.format(),
                pytrace=False,
            )
        return report

    yield check
    if not wanted_before:
        fakegrad_patch.uninstall()
