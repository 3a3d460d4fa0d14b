"""``python -m fakegrad_patch sitecustomize [--append [PATH]]``: the sitecustomize route.

For environments that reach fakegrad_patch through PYTHONPATH, where the ``.pth`` start-up hook
is never processed (``site`` only reads ``.pth`` files in site-packages directories). Prints the
one stdlib-only line to add to your own ``sitecustomize.py``; ``--append`` adds it, idempotently
(an older version of the line, found by its marker comment, is replaced in place).

We never ship a ``sitecustomize.py``: there is only one per interpreter, and shipping ours would
hide the user's (the OpenTelemetry pitfall).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import sysconfig

from . import _startup


def find_sitecustomize() -> str | None:
    """Path of the ``sitecustomize.py`` this interpreter loads, or None when there is none."""
    module = sys.modules.get("sitecustomize")
    origin = getattr(getattr(module, "__spec__", None), "origin", None)
    if origin is None:
        try:
            spec = importlib.util.find_spec("sitecustomize")
        except (ImportError, ValueError):
            spec = None
        origin = getattr(spec, "origin", None)
    if isinstance(origin, str) and origin.endswith(".py") and os.path.isfile(origin):
        return origin
    return None


def _default_target() -> tuple[str | None, str]:
    """Where ``--append`` without PATH writes, or (None, why not)."""
    found = find_sitecustomize()
    if found is None:
        path = os.path.join(sysconfig.get_paths()["purelib"], "sitecustomize.py")
        return path, f"no sitecustomize.py found; creating {path}"
    real_prefix = os.path.realpath(sys.prefix)
    if os.path.commonpath([os.path.realpath(found), real_prefix]) != real_prefix:
        # e.g. Debian's /etc/python3.X/sitecustomize.py: shared by every environment of that
        # interpreter. Changing it needs an explicit PATH.
        return None, (
            f"the sitecustomize.py in use ({found}) is outside this environment ({sys.prefix}); "
            "pass its PATH explicitly to change it"
        )
    return found, f"appending to {found}"


def append(path: str) -> str:
    """Add the line to ``path`` (created if missing). Returns "added", "updated" or "present"."""
    line = _startup.sitecustomize_line()
    marker = _startup.hook_module().SITECUSTOMIZE_MARKER
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        text = ""
    lines = text.splitlines()
    if line in lines:
        return "present"
    for i, existing in enumerate(lines):
        if existing.rstrip().endswith(marker):
            lines[i] = line
            result = "updated"
            break
    else:
        lines.append(line)
        result = "added"
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.fakegrad_patch.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    os.replace(tmp, path)
    return result


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m fakegrad_patch sitecustomize",
        description="Print (or append to sitecustomize.py) the line that activates fakegrad_patch "
        "when FAKEGRAD_PATCH=1, for environments where .pth files are not processed.",
    )
    parser.add_argument(
        "--append",
        nargs="?",
        const="",
        metavar="PATH",
        help="append the line to PATH (default: the sitecustomize.py this interpreter loads, if "
        "it belongs to this environment, else a new one in site-packages); idempotent",
    )
    args = parser.parse_args(argv)
    if args.append is None:
        print(_startup.sitecustomize_line())
        return 0
    path: str | None = args.append or None
    if path is None:
        path, why = _default_target()
        print(why, file=sys.stderr)
        if path is None:
            return 1
    try:
        result = append(path)
    except OSError as exc:
        print(f"cannot write {path}: {exc}", file=sys.stderr)
        return 1
    print(f"{result}: {path}")
    return 0
