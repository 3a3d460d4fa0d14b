"""``python -m fakegrad_patch doctor [--json]``: is fakegrad_patch working in this environment?

Reports versions, the start-up hook (installed where, ran in this process or not), the
environment as parsed, every private torch target (found or why not), the upstream defects the
probes detect on this torch build, and the patch status in this process. Exit status 1 when
something is wrong (a required target missing, the patch wanted but not applied, an invalid
setting, a trace file that cannot be written, wrapt missing, a torch older than the tested range,
``FAKEGRAD_PATCH`` on without a start-up hook to honour it), else 0. Notices (exit 0) say what is
unusual but not known to break: a torch newer than the tested range, a package run from a source
tree (no distribution installed). Paste its output into bug reports.

Running it imports fakegrad_patch (which installs the patch) and torch: both are what we check.
It works without wrapt (and reports it).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import re
import site
import sys
import sysconfig
from typing import Any

from .. import _config
from .._activation import startup as _startup
from .._activation.sitecustomize import find_sitecustomize
from .._core.touchpoints import targets as _targets

#: The distribution name on PyPI (``import fakegrad_patch`` is its import name).
DISTRIBUTION = "fakegrad-patch"
#: Used when ``_targets`` does not define ``TESTED_TORCH`` (oldest, newest release, inclusive).
DEFAULT_TESTED_TORCH = ("2.13.0", "2.14.1")
#: How many characters of a raw environment value the report shows.
ECHO_LIMIT = 60


def _shown(raw: str) -> str:
    if len(raw) <= ECHO_LIMIT:
        return ascii(raw)
    return f"{raw[:ECHO_LIMIT]!a}... ({len(raw)} characters)"


def release(version: str) -> tuple[int, ...]:
    """The release part of a torch version, without pre/dev/post/local parts:
    ``"2.15.0a0+git1234"`` -> ``(2, 15, 0)``, ``"2.14.1+cu130"`` -> ``(2, 14, 1)``; padded to
    three numbers. ``()`` when ``version`` does not start with a number."""
    match = re.match(r"\s*v?(\d+(?:\.\d+)*)", version)
    if match is None:
        return ()
    parts = tuple(int(p) for p in match.group(1).split("."))
    return parts + (0,) * (3 - len(parts))


def tested_torch() -> tuple[str, str]:
    """(oldest, newest) torch release the suite was run on, inclusive."""
    tested = getattr(_targets, "TESTED_TORCH", DEFAULT_TESTED_TORCH)
    return str(tested[0]), str(tested[-1])


def torch_range(version: str, tested: tuple[str, str] | None = None) -> str | None:
    """ "older" / "newer" when ``version``'s release is outside the tested range, else None."""
    oldest, newest = tested or tested_torch()
    mine = release(version)
    if not mine:
        return None
    if mine < release(oldest):
        return "older"
    if mine > release(newest):
        return "newer"
    return None


def installation() -> dict[str, Any]:
    """Is the imported package an installed distribution? ``installed`` False means it is run
    from a source tree (PYTHONPATH, the current directory): no start-up hook file can exist for
    it, and pip does not know it. ``same`` is False when a distribution is installed but the
    package imported here is another copy (a checkout shadowing the install)."""
    import fakegrad_patch

    here = os.path.dirname(os.path.realpath(fakegrad_patch.__file__))
    out: dict[str, Any] = {"installed": False, "version": None, "package_dir": here, "same": None}
    try:
        dist = importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return out
    out["installed"] = True
    out["version"] = dist.version
    with contextlib.suppress(Exception):
        direct = json.loads(dist.read_text("direct_url.json") or "null") or {}
        url = str(direct.get("url", ""))
        if direct.get("dir_info", {}).get("editable") and url.startswith("file://"):
            source = os.path.realpath(url[len("file://") :])
            out["same"] = os.path.commonpath([here, source]) == source
        else:
            located = os.path.realpath(str(dist.locate_file("fakegrad_patch/__init__.py")))
            out["same"] = os.path.dirname(located) == here
    return out


def _minimal_sink_problem(raw: str) -> str | None:
    """What is wrong with ``FAKEGRAD_TRACE=raw`` as a file sink, checked without creating it
    (used when the tracer has no ``sink_problem``)."""
    if raw == "-":
        return None
    path = os.path.abspath(os.path.expanduser(raw))
    if os.path.isdir(path):
        return f"{path} is a directory"
    parent = os.path.dirname(path)
    if not os.path.exists(parent):
        return f"directory {parent} does not exist"
    if not os.path.isdir(parent):
        return f"{parent} is not a directory"
    if os.path.exists(path):
        if not os.access(path, os.W_OK):
            return f"{path} is not writable"
    elif not os.access(parent, os.W_OK | os.X_OK):
        return f"directory {parent} is not writable"
    return None


def sink_problem(raw: str) -> str | None:
    """Why events could not be written to ``FAKEGRAD_TRACE=raw`` (None: fine). Asks the tracer
    (``trace.sink_problem``) when it has that check, else a minimal check of our own."""
    from .. import trace

    check = getattr(trace, "sink_problem", None)
    if check is None:
        return _minimal_sink_problem(raw)
    try:
        problem = check(raw)
    except Exception as exc:  # the check itself failing is a finding, not a crash
        return f"cannot check the trace sink: {type(exc).__name__}: {exc}"
    return None if problem is None else str(problem)


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _site_dirs() -> list[str]:
    dirs: list[str] = []
    candidates: list[str] = []
    with contextlib.suppress(AttributeError):  # old virtualenv's site.py has none
        candidates += site.getsitepackages()
    if site.ENABLE_USER_SITE:
        candidates.append(site.getusersitepackages())
    paths = sysconfig.get_paths()
    candidates += [paths["purelib"], paths["platlib"]]
    for d in candidates:
        real = os.path.realpath(d)
        if real not in dirs and os.path.isdir(real):
            dirs.append(real)
    return dirs


def startup_hook() -> dict[str, Any]:
    """Where the hook files are installed, whether they are current, and what ran here."""
    hook = _startup.hook_module()
    ran = _startup.hook_ran()
    installed = []
    for d in _site_dirs():
        pth = os.path.join(d, hook.PTH_NAME)
        start = os.path.join(d, hook.START_NAME)
        module = os.path.join(d, hook.TOPLEVEL_MODULE + ".py")
        if not any(os.path.exists(p) for p in (pth, start, module)):
            continue
        try:
            with open(pth, encoding="utf-8") as f:
                pth_current = hook.PTH_LINE in f.read().splitlines()
        except OSError:
            pth_current = False
        installed.append(
            {
                "dir": d,
                "pth": os.path.exists(pth),
                "start": os.path.exists(start),
                "module": os.path.exists(module),
                "pth_current": pth_current,
            }
        )
    custom = find_sitecustomize()
    custom_line = False
    if custom is not None:
        try:
            with open(custom, encoding="utf-8") as f:
                custom_line = hook.SITECUSTOMIZE_MARKER in f.read()
        except OSError:
            pass
    return {
        "installed": installed,
        "sitecustomize": custom,
        "sitecustomize_has_line": custom_line,
        "ran_in_this_process": ran,
        "activated_by": hook.state["activated_by"] if ran else None,
        "waiting_for_torch": bool(hook.state.get("waiting_for_torch")) if ran else False,
        "error": hook.state["error"] if ran else None,
        "warning": hook.state.get("warning") if ran else None,
    }


def environment() -> dict[str, dict[str, Any]]:
    """Each environment setting of the table (``fakegrad_patch._config.SETTINGS``): the raw value
    and what fakegrad_patch makes of it (``error`` if invalid: the value and the allowed ones)."""
    hook = _startup.hook_module()
    env: dict[str, dict[str, Any]] = {}
    for row in _config.SETTINGS:
        if row.env is None:
            continue
        raw = os.environ.get(row.env)
        if row.env == hook.ENV:
            flag = hook.parse(raw)
            env[row.env] = {
                "raw": raw,
                "parsed": {True: "on", False: "off", None: None}[flag],
                "error": hook.invalid_message(raw or "") if flag is None else None,
            }
            continue
        entry: dict[str, Any] = {"raw": raw, "parsed": None, "error": None}
        if raw is not None and raw.strip():
            try:
                entry["parsed"] = row.parse(raw)
            except ValueError:
                entry["error"] = _config.env_problem(row, raw)
        if row.env == "FAKEGRAD_TRACE" and entry["parsed"] is not None:
            text = entry["parsed"]
            entry["parsed"] = "stderr" if text == "-" else os.path.abspath(text)
            entry["error"] = sink_problem(text)
        elif row.env == _config.ENV_ON_MISSING:
            entry["parsed"] = entry["parsed"] or _config.DEFAULT_ON_MISSING
        elif row.env == _config.ENV_BUFFERS:
            entry["parsed"] = entry["parsed"] or _config.DEFAULT_BUFFERS
        env[row.env] = entry
    return env


def _wrapt_error() -> str | None:
    try:
        import wrapt  # noqa: F401
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def torch_checks() -> dict[str, Any]:
    """Import torch, then report targets, defects and the patch status in this process."""
    import fakegrad_patch

    result: dict[str, Any] = {
        "torch": None,
        "torch_error": None,
        "targets": [],
        "defects": None,
        "wrapt_error": _wrapt_error(),
        "tested": list(tested_torch()),
        "torch_range": None,
    }
    try:
        import torch
    except Exception as exc:
        result["torch_error"] = f"{type(exc).__name__}: {exc}"
        result["status"] = fakegrad_patch.status()
        return result
    result["torch"] = torch.__version__
    result["torch_range"] = torch_range(torch.__version__)

    for target, reason in _targets.report():
        result["targets"].append(
            {
                "target": target.dotted,
                "why": target.why,
                "found": reason is None,
                "reason": reason,
                "optional": target in _targets.OPTIONAL_TARGETS,
            }
        )
    try:
        applied = None
        if result["wrapt_error"] is None:
            from .._core import install as _patch

            applied = _patch.current()
        if applied is not None:
            result["defects"] = applied.probes.detected()
        else:
            from .._core.touchpoints import probes as _probes

            result["defects"] = _probes.Probes(_targets.resolve_all()).detected()
    except Exception as exc:
        result["defects_error"] = f"{type(exc).__name__}: {exc}"
    result["status"] = fakegrad_patch.status()
    settings = _config.current()
    result["options"] = {
        "on_missing": settings.on_missing,
        "on_missing_explicit": settings.on_missing_explicit,
        "buffers": settings.buffers,
        "buffers_values": list(_config.BUFFERS_VALUES),
        "write_back_available": _targets.resolve_optional(_targets.FAKE_MODE_DISPATCH) is not None,
    }
    result["checked_on"] = list(_targets.CHECKED_ON)
    result["known_limits"] = list(KNOWN_LIMITS)
    return result


#: Upstream behaviours the patch does not change (docs/compatibility.md, "Known limits").
KNOWN_LIMITS = (
    "by default (buffers='upstream') real tensors updated in place inside the mode stay "
    "unchanged (upstream: fake computations never mutate real inputs): BatchNorm "
    "running_mean/running_var, spectral_norm's _u/_v, .grads zeroed or clipped, optimizer "
    "steps; each such update is reported (update_lost event, one warning); "
    "buffers='write_back' (configure, FAKEGRAD_BUFFERS) makes them reach the real tensors, "
    "except a GradScaler scale created inside the mode; see docs/configuration.md",
    "CPU autocast with BatchNorm/LayerNorm/GroupNorm raises upstream's MetadataMismatchError "
    "under real-value propagation (fake kernel statistics in the input dtype, CPU kernel in "
    "float32); traced as propagation_mismatch; workaround: the norm in float32; see "
    "docs/troubleshooting.md",
)


def problems(report: dict[str, Any]) -> list[str]:
    """Everything that makes ``doctor`` exit non-zero, one sentence each."""
    found: list[str] = []
    checks = report["checks"]
    if checks["wrapt_error"]:
        found.append(
            f"wrapt cannot be imported ({checks['wrapt_error']}): fakegrad_patch cannot patch "
            "anything (pip install wrapt)"
        )
    if checks["torch_error"]:
        found.append(f"torch cannot be imported: {checks['torch_error']}")
    if checks["torch_range"] == "older":
        oldest, newest = checks["tested"]
        found.append(
            f"torch {checks['torch']} is older than the oldest tested release ({oldest}; tested "
            f"{oldest} to {newest}): not supported"
        )
    for row in checks["targets"]:
        if not row["found"] and not row["optional"]:
            found.append(f"required torch target missing: {row['target']}: {row['reason']}")
    status = checks["status"]
    if (
        status["wanted"]
        and not status["installed"]
        and checks["torch"]
        and not checks["wrapt_error"]
    ):
        found.append(
            "the patch is wanted but not applied: " + (status["skipped_reason"] or "unknown reason")
        )
    for name, entry in report["environment"].items():
        if entry["error"]:
            found.append(f"{name}: {entry['error']}")
    env = report["environment"][_startup.hook_module().ENV]
    hook = report["startup_hook"]
    if env["parsed"] == "on" and not hook["ran_in_this_process"]:
        if not report["installation"]["installed"] and not hook["sitecustomize_has_line"]:
            found.append(
                "FAKEGRAD_PATCH is on but fakegrad-patch is not installed (the package is run "
                f"from {report['installation']['package_dir']}): no start-up hook can honour it "
                "(pip install it, or see `python -m fakegrad_patch sitecustomize`)"
            )
        elif not hook["installed"] and not hook["sitecustomize_has_line"]:
            found.append(
                "FAKEGRAD_PATCH is on but no start-up hook is installed in this environment "
                "(reinstall with pip, or see `python -m fakegrad_patch sitecustomize`)"
            )
        else:
            found.append(
                "FAKEGRAD_PATCH is on but the start-up hook did not run in this process "
                "(python -S? a different interpreter? see docs/activation.md)"
            )
    if hook["error"]:
        found.append(hook["error"])
    return found


def notices(report: dict[str, Any]) -> list[str]:
    """What is unusual but not known to break (exit status stays 0), one sentence each."""
    found: list[str] = []
    checks = report["checks"]
    if checks["torch_range"] == "newer":
        oldest, newest = checks["tested"]
        found.append(
            f"torch {checks['torch']} is newer than the newest tested release ({newest}; tested "
            f"{oldest} to {newest}): the targets above were checked, the behaviour was not"
        )
    where = report["installation"]
    if not where["installed"]:
        found.append(
            f"fakegrad-patch is not installed: this package is run from {where['package_dir']} "
            "(PYTHONPATH or the current directory), so no start-up hook file exists for it"
        )
    elif where["same"] is False:
        found.append(
            f"the fakegrad_patch imported here ({where['package_dir']}) is not the installed "
            f"fakegrad-patch {where['version']}: the start-up hook activates the imported one"
        )
    return found


def collect() -> dict[str, Any]:
    import fakegrad_patch

    # torch first: importing it is what fires the start-up hook's lazy activation, and the
    # hook's state is reported after that.
    checks = torch_checks()
    report: dict[str, Any] = {
        "python": sys.version.split()[0],
        "executable": sys.executable,
        "versions": {
            "fakegrad_patch": fakegrad_patch.__version__,
            "torch": _version("torch"),
            "wrapt": _version("wrapt"),
            "structlog": _version("structlog"),
        },
        "installation": installation(),
        "startup_hook": startup_hook(),
        "environment": environment(),
        "checks": checks,
    }
    report["problems"] = problems(report)
    report["notices"] = notices(report)
    report["ok"] = not report["problems"]
    return report


def render(report: dict[str, Any]) -> str:
    """The human-readable form."""
    out: list[str] = []
    v = report["versions"]
    out.append(f"python {report['python']} ({report['executable']})")
    out.append(
        "versions: "
        + ", ".join(f"{name} {version or 'not installed'}" for name, version in v.items())
    )
    where = report["installation"]
    if where["installed"]:
        out.append(
            f"fakegrad-patch {where['version']} installed; package at {where['package_dir']}"
        )
    else:
        out.append(f"fakegrad-patch: not installed (package run from {where['package_dir']})")
    hook = report["startup_hook"]
    if hook["installed"]:
        for row in hook["installed"]:
            parts = [name for name in ("pth", "start", "module") if row[name]]
            stale = "" if row["pth_current"] or not row["pth"] else " (.pth line out of date)"
            out.append(f"start-up hook: installed in {row['dir']} ({', '.join(parts)}){stale}")
    else:
        out.append("start-up hook: not installed in this environment's site-packages")
    if hook["sitecustomize"]:
        has = "with" if hook["sitecustomize_has_line"] else "without"
        out.append(f"sitecustomize: {hook['sitecustomize']} ({has} the fakegrad_patch line)")
    ran = f"yes (activated by {hook['activated_by']})" if hook["activated_by"] else "no"
    if hook["ran_in_this_process"] and not hook["activated_by"]:
        ran = (
            "yes (waiting for import torch)"
            if hook["waiting_for_torch"]
            else "yes (nothing to activate)"
        )
    out.append(f"start-up hook ran in this process: {ran}")
    out.append("environment:")
    for name, entry in report["environment"].items():
        shown = "unset" if entry["raw"] is None else _shown(entry["raw"])
        verdict = f"invalid: {entry['error']}" if entry["error"] else f"-> {entry['parsed']}"
        out.append(f"  {name}={shown} {verdict}")
    checks = report["checks"]
    if checks["torch"]:
        oldest, newest = checks["tested"]
        where = {"older": "OLDER than", "newer": "newer than"}.get(checks["torch_range"], "in")
        out.append(
            f"torch {checks['torch']} ({where} the tested range {oldest} to {newest}; targets "
            f"checked on {', '.join(checks['checked_on'])})"
        )
        out.append("targets:")
        for row in checks["targets"]:
            mark = "ok     " if row["found"] else ("absent " if row["optional"] else "MISSING")
            reason = "" if row["found"] else f": {row['reason']}"
            out.append(f"  {mark} {row['target']}{reason}")
        if checks["defects"] is not None:
            found = [k for k, present in checks["defects"].items() if present]
            out.append(
                "upstream defects on this build: "
                + (", ".join(found) if found else "none detected")
                + f" (probed: {', '.join(checks['defects'])})"
            )
            if checks["defects"].get("D1_fake_grad_in_real_leaf") is False:
                out.append(
                    "D1 absent: upstream writes real gradients itself; the patch arms nothing"
                )
        elif checks.get("defects_error"):
            out.append(f"upstream defects: probes could not run: {checks['defects_error']}")
        options = checks.get("options")
        if options:
            explicit = "" if options["on_missing_explicit"] else " (default)"
            available = "available" if options["write_back_available"] else "NOT available"
            out.append(
                f"options: on_missing={options['on_missing']}{explicit}; "
                f"buffers={options['buffers']} (one of {', '.join(options['buffers_values'])}; "
                f"write_back {available} on this build)"
            )
        if checks.get("known_limits"):
            out.append("known limits (not changed by the patch):")
            out += [f"  - {limit}" for limit in checks["known_limits"]]
    else:
        out.append(f"torch: not importable ({checks['torch_error']})")
    s = checks["status"]
    active = "active" if s["installed"] else "NOT active"
    extra = f" ({s['skipped_reason']})" if s["skipped_reason"] else ""
    out.append(f"patch in this process: {active}{extra}")
    if s.get("updates_lost"):
        out.append(
            f"in-place updates of real tensors lost in this process: {s['updates_lost']} "
            "(update_lost events; buffers='write_back' or make them outside the mode: "
            "docs/troubleshooting.md)"
        )
    if checks["wrapt_error"]:
        out.append(f"wrapt: not importable ({checks['wrapt_error']})")
    if report["notices"]:
        out.append("notices:")
        out += [f"  - {n}" for n in report["notices"]]
    if report["problems"]:
        out.append("problems:")
        out += [f"  - {p}" for p in report["problems"]]
    else:
        out.append("no problems found")
    return "\n".join(out)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m fakegrad_patch doctor",
        description="Check fakegrad_patch in this environment; exit 1 when something is wrong.",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    report = collect()
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=True, default=str))
    else:
        print(render(report))
    return 0 if report["ok"] else 1
