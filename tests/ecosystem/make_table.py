"""Run the ecosystem zoo (both comparisons, as the tests do) and print the "tested models" table
of docs/verify.md in Markdown.

    python tests/ecosystem/make_table.py [CASE ...]

Columns: the case, the library and its version, the result (``OK``: ``verify`` and the
independent comparison both match eager; ``xfail``: the known upstream failure, with its reason;
``FAIL``/``skipped``: the reason), and the seconds of the independent comparison's fake-mode run
and eager run (two optimizer steps of two micro-batches each) with their ratio. Exit status 1 when
any case fails or an xfail case passes.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import platform
import sys
import time
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import _eco_train
import _eco_zoo
import torch

import fakegrad_patch
from fakegrad_patch import trace


def _row(case: _eco_zoo.Case) -> tuple[str, str, float | None, float | None]:
    """(result, library version, fake seconds, eager seconds)."""
    try:
        __import__(case.library)
        version = f"{case.library} {_eco_zoo.library_version(case.library)}"
    except Exception as exc:
        return f"skipped: {case.library} does not import ({type(exc).__name__})", "-", None, None
    try:
        report = _eco_train.run_verify(case.build())
        if not report.ok:
            return f"FAIL (verify): {report.problems[0]}", version, None, None
        timing = _eco_train.independent_comparison(case.build())
    except Exception as exc:
        cause = exc.__cause__ if exc.__cause__ is not None else exc
        if case.xfail and type(cause).__name__ == case.xfail_raises:
            return f"xfail: {case.xfail}", version, None, None
        first = (str(cause).splitlines() or [""])[0][:160]
        return f"FAIL: {type(cause).__name__}: {first}", version, None, None
    if case.xfail:
        return "FAIL: passes but is marked xfail (fixed upstream?)", version, None, None
    return "OK", version, timing.fake_s, timing.eager_s


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cases", nargs="*", help="case names (default: all)")
    args = parser.parse_args(argv)

    warnings.simplefilter("ignore")
    trace.set_level(trace.WARNING)
    fakegrad_patch.install()
    cases = [_eco_zoo.BY_NAME[n] for n in args.cases] if args.cases else _eco_zoo.CASES
    threads = torch.get_num_threads()
    start = time.perf_counter()
    lines = [
        "| model | what | library | result | fake / eager (s) |",
        "|---|---|---|---|---|",
    ]
    failed = 0
    for case in cases:
        result, version, fake_s, eager_s = _row(case)
        failed += result.startswith("FAIL")
        timing = (
            "-"
            if fake_s is None or eager_s is None
            else (f"{fake_s:.2f} / {eager_s:.2f} ({fake_s / eager_s:.0f}x)")
        )
        lines.append(f"| `{case.name}` | {case.what} | {version} | {result} | {timing} |")
        print(f"{case.name}: {result}", file=sys.stderr, flush=True)
    total = time.perf_counter() - start
    print(
        f"torch {torch.__version__}, Python {platform.python_version()}, fakegrad-patch "
        f"{fakegrad_patch.__version__}, CPU, {threads} thread(s); {len(cases)} case(s) in "
        f"{total:.0f} s\n"
    )
    print("\n".join(lines))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
