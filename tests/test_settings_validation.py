"""Every setting, through every entry point, is validated with one message naming the setting, the
value given and the allowed values (issue 19, item 4); ``Settings.on_missing_explicit``.

Driven by ``fakegrad_patch._config.SETTINGS``: a setting added to the table is tested here
automatically, and the tests below fail until it has example values (:data:`CASES`) and each of
its entry points has a driver (:data:`PYTHON_DRIVERS`, :data:`CLI_DRIVERS`).
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import sysconfig
import textwrap
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

import fakegrad_patch
from fakegrad_patch import _config, trace
from fakegrad_patch._activation import startup as _startup
from fakegrad_patch._config import SETTINGS, Setting, Settings, shown
from fakegrad_patch._tools import doctor as _doctor
from fakegrad_patch._tools import verify_cli as _verify_cli

ROOT = Path(__file__).resolve().parents[1]
HOOK = _startup.hook_module()


@dataclass(frozen=True)
class Cases:
    """Example values of one setting. ``valid``/``invalid``: strings, good for every entry point
    (environment, command line, Python, ini); ``invalid_py``: Python-only bad values."""

    valid: tuple[str, ...]
    invalid: tuple[str, ...]
    invalid_py: tuple[Any, ...] = ()
    valid_py: tuple[Any, ...] = field(default=())
    #: rejected by the Python entry points though the parser takes them (numbers as strings are
    #: for command lines)
    invalid_api: tuple[Any, ...] = ()


CASES: dict[str, Cases] = {
    "patch": Cases(("1", " ON ", "off", "0"), ("maybe", "2", "enabled")),
    "on_missing": Cases(("zeros", " ERROR ", "keep"), ("bogus", "ignore"), (3, True, b"drop")),
    "buffers": Cases(
        ("write_back", " UPSTREAM ", "write-back"), ("writeback", "copy"), (1, True, b"upstream")
    ),
    "propagation": Cases(("fast", "repair", " UPSTREAM "), ("repaired", "off"), (1, True, b"fast")),
    # Every string an environment can hold is a valid path (sink problems are doctor's business).
    "path": Cases(("-", " - "), (), ("a\0b", 3, b"run.jsonl"), ("-", None)),
    "level": Cases(("debug", "INFO", "15"), ("loud", "-1", "1.5"), (True, -1, 1.5)),
    "max_bytes": Cases(("0", "150", "1_000"), ("abc", "1e99", "-1", "0x10"), (-1, True, 1.5)),
    "buffer_size": Cases(("0", "10"), ("lots", "-3"), (-1, True, 2.0)),
    "json": Cases(("stdlib", "auto", "STDLIB"), ("nope", "orjson", "1")),
    "steps": Cases(("1", "2"), ("0", "-1", "x", "1.5"), (0, True, 1.5), (1, 2), ("2",)),
    "zero_grad": Cases(("none", "zeros", "never"), ("bad", "None"), (None, 0)),
    "atol": Cases(
        ("0", "1e-3"),
        ("-1", "nan", "inf", "x"),
        (-1.0, math.nan, math.inf, True, {torch.float32: -1.0}),
        (0.0, 1e-3, {torch.float32: 1e-3}),
        ("0.1", {"float32": 0.1}),
    ),
    "rtol": Cases(
        ("0", "1e-3"),
        ("-1", "nan", "inf", "x"),
        (-1.0, math.nan, math.inf, True, {torch.float32: math.nan}),
        (0.0, 1e-3, {torch.float64: 0.0}),
        ("0.1",),
    ),
    "check_buffers": Cases((), ("yes", "Strict"), (1, None), (True, False, "strict")),
    "fakegrad_patch": Cases(("true", "0", "yes"), ("maybe", "2")),
    "fakegrad_strict": Cases(("false", "on"), ("sometimes",)),
}

ENV_ROWS = [row for row in SETTINGS if row.env is not None]
INVALID_ENV = [
    pytest.param(row, raw, id=f"{row.env}={raw}")
    for row in ENV_ROWS
    for raw in CASES[row.name].invalid
]


def _python_values(row: Setting, which: str) -> list[Any]:
    cases = CASES[row.name]
    if which == "valid":
        return [*(cases.valid_py or cases.valid)]
    return [*cases.invalid, *cases.invalid_py, *cases.invalid_api]


def _clean_env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FAKEGRAD_")}
    env["PYTHONWARNINGS"] = "ignore:Failed to initialize NumPy:UserWarning"
    env.update(extra)
    return env


def _python(
    code: str, env: dict[str, str], *options: str, timeout: int = 180
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *options, "-c", textwrap.dedent(code)],
        env=_clean_env(env),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        cwd=ROOT,
    )


def _no_site_env(extra: dict[str, str]) -> dict[str, str]:
    """For ``python -S``: no site-packages processing (no start-up hook), the package and its
    dependencies reachable through PYTHONPATH."""
    paths = sysconfig.get_paths()
    return {"PYTHONPATH": os.pathsep.join([str(ROOT), paths["purelib"], paths["platlib"]]), **extra}


def _assert_names(message: str, name: str, value: object, allowed: str) -> None:
    assert name in message, message
    assert shown(value) in message, message
    assert allowed in message, message


# -- the table is complete ---------------------------------------------------------------------


def test_every_setting_has_example_values() -> None:
    assert set(CASES) == {row.name for row in SETTINGS}
    for row in SETTINGS:
        cases = CASES[row.name]
        has_invalid = cases.invalid or cases.invalid_py
        assert has_invalid, f"{row.name}: give invalid examples"
        if row.env is not None and row.name != "path":
            assert cases.invalid, f"{row.name}: give invalid environment strings"
        if row.cli or row.ini:
            assert cases.invalid and cases.valid, f"{row.name}: give command-line/ini strings"


def test_the_table_covers_every_variable_the_docs_mention() -> None:
    documented = set(
        re.findall(r"\bFAKEGRAD_[A-Z_]+\b", (ROOT / "docs/configuration.md").read_text())
    )
    in_table = {row.env for row in ENV_ROWS}
    assert documented <= in_table, sorted(documented - in_table)
    assert in_table <= documented, sorted(in_table - documented)  # and every row is documented
    troubleshooting = (ROOT / "docs/troubleshooting.md").read_text()
    mentioned = set(re.findall(r"\bFAKEGRAD_[A-Z_]+\b", troubleshooting)) - {
        "FAKEGRAD_TEST_UNPATCHED"
    }
    assert mentioned <= in_table, sorted(mentioned - in_table)


def test_every_entry_point_has_a_driver() -> None:
    for row in SETTINGS:
        for entry in row.python:
            assert entry in PYTHON_DRIVERS, f"{row.name}: no test driver for {entry}"
        for entry in row.cli:
            assert entry in CLI_DRIVERS, f"{row.name}: no test driver for {entry}"


def test_copies_outside_the_package_agree_with_the_table() -> None:
    """The start-up hook and the pytest plugin may not import the package: their copies of the
    table are pinned to it, over every example value."""
    assert HOOK.ENV == "FAKEGRAD_PATCH"
    assert (HOOK.ON_VALUES, HOOK.OFF_VALUES) == (_config.SWITCH_ON, _config.SWITCH_OFF)
    assert HOOK.ENV_ON_MISSING == _config.ENV_ON_MISSING
    assert HOOK.ON_MISSING_VALUES == _config.ON_MISSING_VALUES
    checked = {row.env for row in ENV_ROWS} - {"FAKEGRAD_PATCH", "FAKEGRAD_TRACE"}
    assert set(HOOK.ENV_CHECKS) == checked
    for row in ENV_ROWS:
        for raw in (*CASES[row.name].valid, *CASES[row.name].invalid):
            if row.env == "FAKEGRAD_PATCH":
                assert (HOOK.parse(raw) is None) == _rejects(row, raw), raw
                assert row.allowed in HOOK.invalid_message(raw)
            else:
                assert HOOK.setting_invalid(row.env, raw) == _rejects(row, raw), (row.env, raw)
    import fakegrad_patch_pytest

    for row in SETTINGS:
        if row.ini:
            assert row.allowed == fakegrad_patch_pytest.INI_ALLOWED
    # one table of level names: the trace's levels are the settings' (not a copy)
    from fakegrad_patch.trace import _env

    assert _env.LEVELS is _config.TRACE_LEVELS
    levels = {
        "debug": trace.DEBUG,
        "info": trace.INFO,
        "warning": trace.WARNING,
        "error": trace.ERROR,
    }
    assert _config.TRACE_LEVELS == levels == {"debug": 10, "info": 20, "warning": 30, "error": 40}


def _rejects(row: Setting, value: object) -> bool:
    try:
        row.parse(value)
    except ValueError:
        return True
    return False


@pytest.mark.parametrize("row", SETTINGS, ids=lambda r: r.name)
def test_parsers_accept_valid_and_reject_invalid_values_by_name(row: Setting) -> None:
    for value in (*CASES[row.name].valid, *CASES[row.name].valid_py):
        _config.parse(row.name, value)
    for value in (*CASES[row.name].invalid, *CASES[row.name].invalid_py):
        with pytest.raises(ValueError) as info:
            _config.parse(row.name, value)
        assert str(info.value) == f"invalid {row.name} {shown(value)}: expected {row.allowed}"


# -- Python entry points -------------------------------------------------------------------------


@pytest.fixture
def pristine() -> Iterator[None]:
    """Settings, trace configuration and patch state restored exactly after the test."""
    settings = _config.current()
    config = trace.current_config()
    installed = fakegrad_patch.status()["wanted"]
    try:
        yield
    finally:
        _config.restore(settings)
        trace.restore(config)
        (fakegrad_patch.install if installed else fakegrad_patch.uninstall)()


def _state() -> tuple[Any, ...]:
    return (_config.current(), trace.current_config(), fakegrad_patch.status()["wanted"])


def _configure(name: str, value: Any) -> None:
    fakegrad_patch.configure(**{name: value})


def _patched(name: str, value: Any) -> None:
    with fakegrad_patch.patched(**{name: value}):
        pass


def _materialize(name: str, value: Any) -> None:
    fakegrad_patch.materialize(torch.ones(2), **{name: value})


def _configure_trace(name: str, value: Any) -> None:
    trace.configure_trace(**{name: value})


def _set_level(name: str, value: Any) -> None:
    trace.set_level(value)


def _capture(name: str, value: Any) -> None:
    with trace.capture(value):
        pass


def _verify(name: str, value: Any) -> None:
    torch.manual_seed(0)
    report = fakegrad_patch.verify(torch.nn.Linear(3, 2), torch.randn(4, 3), **{name: value})
    assert report.ok, report.format()


PYTHON_DRIVERS: dict[str, Callable[[str, Any], None]] = {
    "fakegrad_patch.configure": _configure,
    "fakegrad_patch.patched": _patched,
    "fakegrad_patch.materialize": _materialize,
    "trace.configure_trace": _configure_trace,
    "trace.set_level": _set_level,
    "trace.capture": _capture,
    "fakegrad_patch.verify": _verify,
}

PYTHON_INVALID = [
    pytest.param(row, entry, value, id=f"{entry}-{row.name}={value!r}")
    for row in SETTINGS
    for entry in row.python
    for value in _python_values(row, "invalid")
]
PYTHON_VALID = [
    pytest.param(row, entry, value, id=f"{entry}-{row.name}={value!r}")
    for row in SETTINGS
    for entry in row.python
    for value in _python_values(row, "valid")
    # verify takes tolerances and steps as numbers, not strings (strings are for the CLI)
    if not (
        entry == "fakegrad_patch.verify"
        and isinstance(value, str)
        and row.name not in ("zero_grad", "buffers")
    )
]


@pytest.mark.parametrize(("row", "entry", "value"), PYTHON_INVALID)
def test_python_entry_points_reject_invalid_values(
    pristine: None, row: Setting, entry: str, value: Any
) -> None:
    before = _state()
    with pytest.raises(ValueError) as info:
        PYTHON_DRIVERS[entry](row.name, value)
    _assert_names(str(info.value), row.name, value, row.allowed)
    assert _state() == before  # nothing changed


@pytest.mark.parametrize(("row", "entry", "value"), PYTHON_VALID)
def test_python_entry_points_accept_valid_values(
    pristine: None, propagate: None, row: Setting, entry: str, value: Any
) -> None:
    PYTHON_DRIVERS[entry](row.name, value)


# -- command line --------------------------------------------------------------------------------

FACTORY = """
import torch

def case():
    torch.manual_seed(0)
    return torch.nn.Linear(3, 2), torch.randn(4, 3)
"""


CLI_DRIVERS: dict[str, str] = {"verify --steps": "--steps", "verify --zero-grad": "--zero-grad"}
CLI_DRIVERS |= {"verify --atol": "--atol", "verify --rtol": "--rtol"}
CLI_DRIVERS |= {"verify --buffers": "--buffers"}

CLI_CASES = [
    pytest.param(row, entry, value, id=f"{entry}={value}")
    for row in SETTINGS
    for entry in row.cli
    for value in CASES[row.name].invalid
]


@pytest.mark.parametrize(("row", "entry", "value"), CLI_CASES)
def test_cli_rejects_invalid_values_with_an_argparse_error(
    capsys: pytest.CaptureFixture[str], row: Setting, entry: str, value: str
) -> None:
    option = CLI_DRIVERS[entry]
    with pytest.raises(SystemExit) as info:
        _verify_cli.main(["nowhere:factory", f"{option}={value}"])
    assert info.value.code == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert f"argument {option}:" in err, err
    assert shown(value) in err or repr(value) in err, err
    allowed = row.cli_allowed or row.allowed
    if option == "--zero-grad":  # argparse's own choices message lists them
        assert all(repr(v) in err for v in ("none", "zeros", "never")), err
    else:
        assert allowed in err, err


@pytest.mark.parametrize(
    ("row", "entry", "value"),
    [
        pytest.param(row, entry, value, id=f"{entry}={value}")
        for row in SETTINGS
        for entry in row.cli
        for value in CASES[row.name].valid
    ],
)
def test_cli_accepts_valid_values(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    propagate: None,
    row: Setting,
    entry: str,
    value: str,
) -> None:
    (tmp_path / "case.py").write_text(FACTORY)
    code = _verify_cli.main([f"{tmp_path / 'case.py'}:case", f"{CLI_DRIVERS[entry]}={value}"])
    out, err = capsys.readouterr()
    assert code == 0, out + err


def test_identical_losses_are_never_a_mismatch_for_any_accepted_tolerance(propagate: None) -> None:
    """The bug the tolerance checks close: ``--atol -1`` made identical results a MISMATCH.
    Every tolerance the table accepts keeps equal values equal."""
    for atol in (0.0, 1e-12, 1.0):
        for rtol in (0.0, 1e-12):
            torch.manual_seed(0)
            report = fakegrad_patch.verify(
                torch.nn.Linear(3, 2), torch.randn(4, 3), atol=atol, rtol=rtol
            )
            assert report.ok, report.format()


# -- environment: at import (install), with and without the start-up hook -----------------------

IMPORT = """
import warnings
warnings.simplefilter("always")
import fakegrad_patch
print("OUT")
"""


def _warning_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "fakegrad_patch:" in line]


@pytest.mark.parametrize("no_site", [False, True], ids=["site", "no-start-up-hook"])
@pytest.mark.parametrize(("row", "raw"), INVALID_ENV)
def test_an_invalid_environment_value_warns_once_at_import(
    row: Setting, raw: str, no_site: bool
) -> None:
    assert row.env is not None
    env = {row.env: raw}
    result = _python(IMPORT, _no_site_env(env), "-S") if no_site else _python(IMPORT, env)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "OUT\n"  # never on stdout
    lines = _warning_lines(result.stderr)
    assert len(lines) == 1, result.stderr
    _assert_names(lines[0], row.env, raw, row.allowed)
    if row.env != "FAKEGRAD_PATCH" or no_site:
        assert result.stderr.count("FakeGradPatchWarning") == 1, result.stderr


PROPAGATING_STEP = """
import json, warnings
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as caught:
    import fakegrad_patch
    import torch
    import torch._functorch.config as fc
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    model = torch.nn.Linear(3, 2)
    x = torch.randn(4, 3)
    with fc.patch(fake_tensor_propagate_real_tensors=True):
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        fake_x = mode.from_tensor(x)
        with mode:
            model(fake_x).sum().backward()
            model(fake_x).sum().backward()
print(json.dumps({
    "grad": "fake" if isinstance(model.weight.grad, FakeTensor) else "real",
    "warnings": [str(w.message) for w in caught
                 if type(w.message).__name__ == "FakeGradPatchWarning"],
}))
"""


@pytest.mark.parametrize(
    "row",
    [row for row in ENV_ROWS if row.env != "FAKEGRAD_PATCH" and CASES[row.name].invalid],
    ids=lambda r: r.env,
)
def test_an_invalid_environment_value_warns_once_in_a_propagating_run(row: Setting) -> None:
    """The run itself never needs the setting (nothing goes missing): the value is still
    reported, once, and the gradients are real."""
    assert row.env is not None
    raw = CASES[row.name].invalid[0]
    result = _python(PROPAGATING_STEP, {row.env: raw})
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout.splitlines()[-1])
    assert out["grad"] == "real"
    assert len(out["warnings"]) == 1, out["warnings"]
    _assert_names(out["warnings"][0], row.env, raw, row.allowed)


W_ERROR = """
import json
try:
    import fakegrad_patch
except Warning as exc:
    first = [type(exc).__name__, str(exc)]
else:
    first = None
import fakegrad_patch
print(json.dumps([first, fakegrad_patch.settings().on_missing]))
"""


@pytest.mark.parametrize(
    ("row", "raw"), [p for p in INVALID_ENV if p.values[0].env != "FAKEGRAD_PATCH"]
)
def test_warnings_as_errors_raise_from_the_import_naming_the_setting(
    row: Setting, raw: str
) -> None:
    """``-W error``: the import raises the warning (nothing installed); a second import works,
    with the default. Nothing on stdout but the program's own line."""
    assert row.env is not None
    result = _python(W_ERROR, {row.env: raw}, "-W", "error")
    assert result.returncode == 0, result.stderr
    first, policy = json.loads(result.stdout)
    assert first is not None and first[0] == "FakeGradPatchWarning"
    _assert_names(first[1], row.env, raw, row.allowed)
    assert policy == "drop"


def test_every_invalid_environment_value_is_reported_at_once() -> None:
    env = {
        row.env: CASES[row.name].invalid[0]
        for row in ENV_ROWS
        if row.env and CASES[row.name].invalid
    }
    result = _python(IMPORT, _no_site_env(env), "-S")
    assert result.returncode == 0 and result.stdout == "OUT\n", result.stderr
    lines = _warning_lines(result.stderr)
    assert len(lines) == len(env), result.stderr
    for name, raw in env.items():
        assert any(name in line and shown(raw) in line for line in lines), (name, lines)


# -- doctor --------------------------------------------------------------------------------------


@pytest.mark.parametrize(("row", "raw"), INVALID_ENV)
def test_doctor_reports_each_invalid_environment_value(
    monkeypatch: pytest.MonkeyPatch, row: Setting, raw: str
) -> None:
    assert row.env is not None
    monkeypatch.setenv(row.env, raw)
    entry = _doctor.environment()[row.env]
    assert entry["raw"] == raw and entry["error"], entry
    _assert_names(f"{row.env}: {entry['error']}", row.env, raw, row.allowed)


@pytest.mark.parametrize("row", ENV_ROWS, ids=lambda r: r.env)
def test_doctor_lists_every_environment_setting(
    monkeypatch: pytest.MonkeyPatch, row: Setting
) -> None:
    assert row.env is not None
    monkeypatch.delenv(row.env, raising=False)
    entry = _doctor.environment()[row.env]
    assert entry == {"raw": None, "parsed": entry["parsed"], "error": None}


def test_doctor_exits_1_listing_every_invalid_setting(tmp_path: Path) -> None:
    env = {
        row.env: CASES[row.name].invalid[0]
        for row in ENV_ROWS
        if row.env and CASES[row.name].invalid
    }
    result = subprocess.run(
        [sys.executable, "-m", "fakegrad_patch", "doctor", "--json"],
        env=_clean_env({"PYTHONPATH": str(ROOT), **env}),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=tmp_path,
    )
    assert result.returncode == 1, result.stdout + result.stderr
    problems = json.loads(result.stdout)["problems"]
    for name, raw in env.items():
        row = _config.env_setting(name)
        matching = [p for p in problems if p.startswith(name) and shown(raw) in p]
        assert len(matching) == 1, (name, problems)
        assert row.allowed in matching[0], matching[0]


# -- pytest ini ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("row", "raw"),
    [
        pytest.param(row, raw, id=f"{ini}={raw}")
        for row in SETTINGS
        for ini in row.ini
        for raw in CASES[row.name].invalid
    ],
)
def test_pytest_ini_rejects_invalid_values(tmp_path: Path, row: Setting, raw: str) -> None:
    ini = row.ini[0]
    (tmp_path / "pytest.ini").write_text(f"[pytest]\n{ini} = {raw}\n")
    (tmp_path / "test_one.py").write_text("def test_one():\n    pass\n")
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
        env=_clean_env({}),
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
        cwd=tmp_path,
    )
    output = result.stdout + result.stderr
    assert result.returncode == pytest.ExitCode.USAGE_ERROR, output
    assert "Traceback" not in output, output
    _assert_names(output, ini, raw, row.allowed)


# -- issue 17: on_missing_explicit ---------------------------------------------------------------


@pytest.fixture
def default_settings() -> Iterator[None]:
    previous = _config.current()
    _config.restore(Settings())
    try:
        yield
    finally:
        _config.restore(previous)


def test_default_settings_are_not_explicit() -> None:
    assert Settings() == Settings(on_missing="drop", on_missing_explicit=False)


@pytest.mark.parametrize("policy", _config.ON_MISSING_VALUES)
def test_configure_and_patched_make_on_missing_explicit_and_restore_exactly(
    default_settings: None, policy: str
) -> None:
    before = fakegrad_patch.settings()
    assert before.on_missing_explicit is False
    with fakegrad_patch.patched(on_missing=policy):  # type: ignore[arg-type]
        assert fakegrad_patch.settings() == Settings(policy, True)  # type: ignore[arg-type]
        with fakegrad_patch.patched():  # no value: explicitness unchanged
            assert fakegrad_patch.settings() == Settings(policy, True)  # type: ignore[arg-type]
    assert fakegrad_patch.settings() == before
    with fakegrad_patch.patched():
        assert fakegrad_patch.settings() == before
    previous = fakegrad_patch.configure(on_missing=policy)  # type: ignore[arg-type]
    assert previous == before
    assert fakegrad_patch.settings() == Settings(policy, True)  # type: ignore[arg-type]
    # the default value given explicitly is explicit too
    again = fakegrad_patch.configure(on_missing="drop")
    assert fakegrad_patch.settings() == Settings("drop", True)
    _config.restore(again)
    assert fakegrad_patch.settings() == Settings(policy, True)  # type: ignore[arg-type]
    _config.restore(previous)
    assert fakegrad_patch.settings() == before
    with pytest.raises(ValueError):
        fakegrad_patch.configure(on_missing="bogus")  # type: ignore[arg-type]
    assert fakegrad_patch.settings() == before


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (None, Settings("drop", False)),
        ("", Settings("drop", False)),
        ("drop", Settings("drop", True)),
        (" Zeros ", Settings("zeros", True)),
        ("error", Settings("error", True)),
        ("keep", Settings("keep", True)),
        ("bogus", Settings("drop", False)),
    ],
)
def test_the_environment_makes_on_missing_explicit_only_when_valid(
    raw: str | None, expected: Settings
) -> None:
    environ = {} if raw is None else {"FAKEGRAD_ON_MISSING": raw}
    with pytest.warns(fakegrad_patch.FakeGradPatchWarning) if raw == "bogus" else nullcontext():
        assert _config.settings_from_env(environ) == expected
    env = _clean_env({} if raw is None else {"FAKEGRAD_ON_MISSING": raw})
    code = (
        "import json, fakegrad_patch as f; s = f.settings(); "
        "print(json.dumps([s.on_missing, s.on_missing_explicit]))"
    )
    result = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == [expected.on_missing, expected.on_missing_explicit]
