"""``python -m fakegrad_patch sitecustomize [--append [PATH]]``: the sitecustomize route.

For environments that reach fakegrad_patch through PYTHONPATH, where the ``.pth`` start-up hook
is never processed (``site`` only reads ``.pth`` files in site-packages directories). Prints the
one stdlib-only line to add to your own ``sitecustomize.py``; ``--append`` adds it, idempotently
(an older version of the line, found by its marker comment, is replaced in place), writing
through the path given (symlink, mode and owner kept), atomically, and only once the result
compiles; a read-only file is refused (exit 1).

We never ship a ``sitecustomize.py``: there is only one per interpreter, and shipping ours would
hide the user's (the OpenTelemetry pitfall).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import stat
import sys
import sysconfig
import tempfile

from . import startup as _startup


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


class AppendError(Exception):
    """``--append`` refused to change the file; the message says why (nothing was written)."""


def _edited(text: str, line: str, marker: str) -> tuple[str, str]:
    """``text`` with our line added or updated, and "added" / "updated" / "present".

    Lines are split on ``\n`` only (``str.splitlines`` also splits on form feeds, ``\x1c``,
    ``\x85``, ``\u2028``... which may sit inside string literals), and every other byte of the
    file is kept as it was, line endings included."""
    lines = text.split("\n")
    newline = "\r\n" if "\r\n" in text else "\n"
    for i, existing in enumerate(lines):
        body = existing.removesuffix("\r")
        if body == line:
            return text, "present"
        if body.rstrip().endswith(marker):
            lines[i] = line + existing[len(body) :]
            return "\n".join(lines), "updated"
    if text and not text.endswith("\n"):
        text += newline
    return text + line + newline, "added"


def append(path: str) -> str:
    """Add the line to ``path`` (created if missing). Returns "added", "updated" or "present".

    Writes through ``path``: a symlink stays a symlink (its target is rewritten), the file keeps
    its permission bits (and owner, where allowed). The new contents are written to a temporary
    file next to the target and moved over it (atomic), only after they compiled. Raises
    :class:`AppendError` (nothing written) for a read-only file, or when the result would not
    compile."""
    line = _startup.sitecustomize_line()
    marker = _startup.hook_module().SITECUSTOMIZE_MARKER
    target = os.path.realpath(path)
    try:
        st: os.stat_result | None = os.stat(target)
    except FileNotFoundError:
        st = None
    if st is not None:
        if not stat.S_ISREG(st.st_mode):
            raise AppendError(f"{path} is not a regular file")
        if not st.st_mode & (stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH) or not os.access(
            target, os.W_OK
        ):
            raise AppendError(
                f"{path} is read-only (mode {stat.filemode(st.st_mode)}); not changed. Make it "
                "writable first, or add the line printed by `python -m fakegrad_patch "
                "sitecustomize` yourself"
            )
        try:
            with open(target, encoding="utf-8", newline="") as f:
                text = f.read()
        except UnicodeDecodeError as exc:
            raise AppendError(f"{path} is not UTF-8 ({exc}); not changed") from None
    else:
        text = ""
    new_text, result = _edited(text, line, marker)
    if result == "present":
        return result
    try:
        compile(new_text, target, "exec", dont_inherit=True)
    except (SyntaxError, ValueError) as exc:
        raise AppendError(
            f"{path} would not compile with the line added ({type(exc).__name__}: {exc}); "
            "not changed"
        ) from None
    directory = os.path.dirname(target)
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".sitecustomize.", suffix=".fakegrad_patch", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
            f.write(new_text)
        if st is not None:
            os.chmod(tmp, stat.S_IMODE(st.st_mode))
            with contextlib.suppress(OSError):  # only root can give a file away
                os.chown(tmp, st.st_uid, st.st_gid)
        else:
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
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
    except AppendError as exc:
        print(f"not changed: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"cannot write {path}: {exc}", file=sys.stderr)
        return 1
    print(f"{result}: {path}")
    return 0
