"""``python -m fakegrad_patch doctor [--json]``: is fakegrad_patch working in this environment?

Reports versions, the start-up hook (installed where, ran in this process or not), the
environment as parsed, every private torch target (found or why not), the upstream defects the
probes detect on this torch build, and the patch status in this process. Exit status 1 when
something is wrong (a required target missing, the patch wanted but not applied, an invalid
setting, ``FAKEGRAD_PATCH`` on without a start-up hook to honour it), else 0. Paste its output
into bug reports.

Running it imports fakegrad_patch (which installs the patch) and torch: both are what we check.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import site
import sys
import sysconfig
from typing import Any

from . import _config, _startup
from ._sitecustomize import find_sitecustomize


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
        "error": hook.state["error"] if ran else None,
    }


def environment() -> dict[str, dict[str, Any]]:
    """Each variable: the raw value and what fakegrad_patch makes of it (``error`` if invalid)."""
    hook = _startup.hook_module()
    env: dict[str, dict[str, Any]] = {}
    raw = os.environ.get(hook.ENV)
    flag = hook.parse(raw)
    env[hook.ENV] = {
        "raw": raw,
        "parsed": {True: "on", False: "off", None: None}[flag],
        "error": hook.invalid_message(raw or "") if flag is None else None,
    }
    raw = os.environ.get(_config.ENV_ON_MISSING)
    entry: dict[str, Any] = {"raw": raw, "parsed": _config.DEFAULT_ON_MISSING, "error": None}
    if raw and raw.strip():
        try:
            entry["parsed"] = _config.validate_on_missing(raw)
        except ValueError as exc:
            entry["error"] = str(exc)
    env[_config.ENV_ON_MISSING] = entry
    raw = os.environ.get("FAKEGRAD_TRACE")
    env["FAKEGRAD_TRACE"] = {
        "raw": raw,
        "parsed": ("stderr" if raw.strip() == "-" else os.path.abspath(raw.strip()))
        if raw and raw.strip()
        else None,
        "error": None,
    }
    raw = os.environ.get("FAKEGRAD_TRACE_LEVEL")
    entry = {"raw": raw, "parsed": None, "error": None}
    if raw and raw.strip():
        from . import trace

        parse_level = getattr(trace, "parse_level", None)
        if parse_level is not None:
            try:
                entry["parsed"] = parse_level(raw)
            except ValueError as exc:
                entry["error"] = str(exc)
        else:  # pragma: no cover - older tracer
            entry["parsed"] = raw.strip().lower()
    env["FAKEGRAD_TRACE_LEVEL"] = entry
    return env


def torch_checks() -> dict[str, Any]:
    """Import torch, then report targets, defects and the patch status in this process."""
    import fakegrad_patch

    result: dict[str, Any] = {"torch": None, "torch_error": None, "targets": [], "defects": None}
    try:
        import torch
    except Exception as exc:
        result["torch_error"] = f"{type(exc).__name__}: {exc}"
        result["status"] = fakegrad_patch.status()
        return result
    result["torch"] = torch.__version__
    from . import _patch, _targets

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
        applied = _patch.current()
        if applied is not None:
            result["defects"] = applied.probes.detected()
        else:
            from . import _probes

            result["defects"] = _probes.Probes(_targets.resolve_all()).detected()
    except Exception as exc:
        result["defects_error"] = f"{type(exc).__name__}: {exc}"
    result["status"] = fakegrad_patch.status()
    result["checked_on"] = list(_targets.CHECKED_ON)
    return result


def problems(report: dict[str, Any]) -> list[str]:
    """Everything that makes ``doctor`` exit non-zero, one sentence each."""
    found: list[str] = []
    checks = report["checks"]
    if checks["torch_error"]:
        found.append(f"torch cannot be imported: {checks['torch_error']}")
    for row in checks["targets"]:
        if not row["found"] and not row["optional"]:
            found.append(f"required torch target missing: {row['target']}: {row['reason']}")
    status = checks["status"]
    if status["wanted"] and not status["installed"] and checks["torch"]:
        found.append(
            "the patch is wanted but not applied: " + (status["skipped_reason"] or "unknown reason")
        )
    for name, entry in report["environment"].items():
        if entry["error"]:
            found.append(f"{name}: {entry['error']}")
    env = report["environment"][_startup.hook_module().ENV]
    hook = report["startup_hook"]
    if env["parsed"] == "on" and not hook["ran_in_this_process"]:
        if not hook["installed"] and not hook["sitecustomize_has_line"]:
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


def collect() -> dict[str, Any]:
    import fakegrad_patch

    report: dict[str, Any] = {
        "python": sys.version.split()[0],
        "executable": sys.executable,
        "versions": {
            "fakegrad_patch": fakegrad_patch.__version__,
            "torch": _version("torch"),
            "wrapt": _version("wrapt"),
            "structlog": _version("structlog"),
        },
        "startup_hook": startup_hook(),
        "environment": environment(),
        "checks": torch_checks(),
    }
    report["problems"] = problems(report)
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
        ran = "yes (nothing to activate)"
    out.append(f"start-up hook ran in this process: {ran}")
    out.append("environment:")
    for name, entry in report["environment"].items():
        shown = "unset" if entry["raw"] is None else repr(entry["raw"])
        verdict = f"invalid: {entry['error']}" if entry["error"] else f"-> {entry['parsed']}"
        out.append(f"  {name}={shown} {verdict}")
    checks = report["checks"]
    if checks["torch"]:
        out.append(
            f"torch {checks['torch']} (targets checked on {', '.join(checks['checked_on'])})"
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
        elif checks.get("defects_error"):
            out.append(f"upstream defects: probes could not run: {checks['defects_error']}")
    else:
        out.append(f"torch: not importable ({checks['torch_error']})")
    s = checks["status"]
    active = "active" if s["installed"] else "NOT active"
    extra = f" ({s['skipped_reason']})" if s["skipped_reason"] else ""
    out.append(f"patch in this process: {active}{extra}")
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
