"""Run coexistence programs (programs.py) in this fresh interpreter and write one JSON line each.

    python tests/pt2/runner.py patched|unpatched|env OUT.jsonl PROGRAM [PROGRAM ...]

``patched``: ``import fakegrad_patch`` before torch (the way a user switches it on for a whole
process); ``unpatched``: fakegrad_patch is never imported; ``env``: no import, the start-up hook
does it (the caller sets ``FAKEGRAD_PATCH=1``; where the hook is not installed in this interpreter
the records say ``fakegrad_patch_imported: false``). ``COEXIST_PROGRAMS=path.py`` runs the programs
of another module with the same interface (``PROGRAMS``, ``reset_torch_state``, ``Recorder``,
``Skip``, ``exception_record``, ``normalize_text``; tests/pt2/always_on.py). Before each program
a ``started`` line is written (and flushed), after it the record, so a crash (segfault) names the
program it hit.

Each record: the program's own observations (``result``), an unexpected exception (``exception``,
type and message, plus a traceback that is not compared), ``skip`` (the build lacks an API), the
warnings it raised (``warnings``: torch's; ``fakegrad_warnings``: ours), and in the patched run
every trace event fakegrad_patch emitted during the program (captured at ``debug``) and
``fakegrad_patch.status()`` before and after it.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
import traceback
import warnings
from typing import Any


def _main(argv: list[str]) -> int:
    mode, out_path, names = argv[0], argv[1], argv[2:]
    if mode not in ("patched", "unpatched", "env"):
        print(f"unknown mode {mode!r}", file=sys.stderr)
        return 2
    fakegrad_patch: Any = None
    if mode == "patched":
        import fakegrad_patch  # first, as a user switching it on for the whole process would

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    other = os.environ.get("COEXIST_PROGRAMS")
    if other:
        import importlib.util

        spec = importlib.util.spec_from_file_location("coexist_programs", other)
        assert spec is not None and spec.loader is not None
        programs: Any = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = programs  # dataclasses look their module up
        spec.loader.exec_module(programs)  # imports torch
    else:
        import programs  # imports torch
    if mode == "env":
        fakegrad_patch = sys.modules.get("fakegrad_patch")  # imported by the start-up hook

    fd = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)

    def write(line: dict[str, Any]) -> None:
        os.write(fd, (json.dumps(line, sort_keys=True) + "\n").encode())

    for name in names:
        write({"name": name, "started": True})
        write(_run_one(programs, fakegrad_patch, name))
    os.close(fd)
    return 0


def _is_ours(w: warnings.WarningMessage, fakegrad_patch: Any) -> bool:
    if fakegrad_patch is not None and issubclass(w.category, fakegrad_patch.FakeGradPatchWarning):
        return True
    return str(w.message).startswith("fakegrad_patch")


def _run_one(programs: Any, fakegrad_patch: Any, name: str) -> dict[str, Any]:
    _group, fn = programs.PROGRAMS[name]
    programs.reset_torch_state()
    rec = programs.Recorder()
    line: dict[str, Any] = {"name": name, "result": None, "exception": None, "skip": None}
    capture: Any = None
    events: list[dict[str, Any]] = []
    if fakegrad_patch is not None:
        from fakegrad_patch import trace

        line["status_before"] = fakegrad_patch.status()
        capture = trace.capture("debug")
        events = capture.__enter__()
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            fn(rec)
        except programs.Skip as skip:
            line["skip"] = str(skip)
        except Exception as exc:
            line["exception"] = programs.exception_record(exc)
            line["traceback"] = traceback.format_exc()
        line["result"] = rec.result()
        del rec
        gc.collect()
    line["seconds"] = round(time.perf_counter() - start, 3)
    if capture is not None:
        capture.__exit__(None, None, None)
        line["events"] = [
            {k: e.get(k) for k in ("event", "level", "where", "error", "defect", "name")}
            for e in events
        ]
        line["status_after"] = fakegrad_patch.status()
    ours = [w for w in caught if _is_ours(w, fakegrad_patch)]
    theirs = [w for w in caught if not _is_ours(w, fakegrad_patch)]
    line["fakegrad_warnings"] = [f"{w.category.__name__}: {w.message}" for w in ours]
    line["warnings"] = sorted(
        {programs.normalize_text(f"{w.category.__name__}: {w.message}") for w in theirs}
    )
    line["fakegrad_patch_imported"] = "fakegrad_patch" in sys.modules
    return line


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
