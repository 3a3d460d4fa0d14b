"""Run upstream PyTorch's compiled-autograd tests with and without fakegrad_patch; print the
tests whose outcome differs (issue 17: the patch must cost PyTorch's own tests nothing).

The test file is not shipped with the wheel (``torch.testing._internal``, which it needs, is; and
``expecttest`` and ``numpy``: ``pip install expecttest numpy``). Give it one of two ways:

    python tests/pt2/run_upstream_compiled_autograd.py --file test_compiled_autograd.py
    python tests/pt2/run_upstream_compiled_autograd.py --pytorch-git /path/pytorch.git --rev v2.13.0

(``--pytorch-git``: a pytorch clone, bare or not; the file is read with ``git show
REV:test/inductor/test_compiled_autograd.py``.) Both runs use this interpreter's pytest, each in a
fresh process with its own cold inductor cache, in parallel: ``-p fakegrad --fakegrad-patch``
(the package's pytest plugin installs the patch before the test module imports torch) and ``-p
no:fakegrad`` (fakegrad_patch never imported). ``-k EXPR`` selects a subset (the whole file takes
long on a CPU: inductor compiles in most tests); ``--timeout`` bounds each run. Exit status 1 when
an outcome differs, 0 otherwise.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import pathlib
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET

UPSTREAM_PATH = "test/inductor/test_compiled_autograd.py"


def _outcomes(junit: pathlib.Path) -> dict[str, str]:
    """test id -> passed / failed / error / skipped, from a junit XML report."""
    out: dict[str, str] = {}
    if not junit.exists():
        return out
    for case in ET.parse(junit).getroot().iter("testcase"):
        test_id = f"{case.get('classname')}::{case.get('name')}"
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                message = (child.get("message") or "").splitlines()
                outcome = child.tag + (f": {message[0][:200]}" if message else "")
                break
        out[test_id] = outcome
    return out


def _run(
    mode: str, test_file: pathlib.Path, args: argparse.Namespace, tmp: pathlib.Path
) -> tuple[dict[str, str], str, str, float]:
    junit = tmp / f"{mode}.xml"
    plugin = ["-p", "fakegrad", "--fakegrad-patch"] if mode == "patched" else ["-p", "no:fakegrad"]
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        str(test_file),
        "-q",
        "-p",
        "no:cacheprovider",
        f"--junitxml={junit}",
        *plugin,
    ]
    if args.k:
        cmd += ["-k", args.k]
    env = {k: v for k, v in os.environ.items() if not k.startswith("FAKEGRAD_")}
    env.update(
        TORCHINDUCTOR_CACHE_DIR=str(tmp / f"inductor-{mode}"),
        TORCHINDUCTOR_COMPILE_THREADS="1",
        PYTHONHASHSEED="0",
    )
    start = time.perf_counter()
    try:
        proc = subprocess.run(
            cmd,
            cwd=test_file.parent,
            env=env,
            capture_output=True,
            text=True,
            timeout=args.timeout,
        )
        status = f"exit {proc.returncode}"
        tail = (proc.stdout + proc.stderr)[-2000:]
    except subprocess.TimeoutExpired:
        status, tail = f"timed out after {args.timeout} s", ""
    return _outcomes(junit), status, tail, time.perf_counter() - start


def _test_file(args: argparse.Namespace, tmp: pathlib.Path) -> pathlib.Path:
    if args.file:
        src = pathlib.Path(args.file).read_text()
    else:
        src = subprocess.run(
            ["git", "--git-dir", _git_dir(args.pytorch_git), "show", f"{args.rev}:{UPSTREAM_PATH}"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
    path = tmp / "test_compiled_autograd.py"
    path.write_text(src)
    return path


def _git_dir(path: str) -> str:
    p = pathlib.Path(path)
    return str(p / ".git") if (p / ".git").exists() else str(p)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--file", help="upstream's test_compiled_autograd.py")
    source.add_argument("--pytorch-git", help="a pytorch clone (bare or not)")
    parser.add_argument("--rev", default="v2.13.0", help="with --pytorch-git (default v2.13.0)")
    parser.add_argument("-k", help="pytest -k expression: a subset of the tests")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per run")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="upstream-ca-") as tmp_name:
        tmp = pathlib.Path(tmp_name)
        test_file = _test_file(args, tmp)
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            futures = {m: pool.submit(_run, m, test_file, args, tmp) for m in ("patched", "base")}
            (p_out, p_status, p_tail, p_s), (u_out, u_status, u_tail, u_s) = (
                futures["patched"].result(),
                futures["base"].result(),
            )
    print(f"without fakegrad_patch: {len(u_out)} tests, {u_status}, {u_s:.0f} s")
    print(f"with fakegrad_patch:    {len(p_out)} tests, {p_status}, {p_s:.0f} s")
    for label, out, tail in (("without", u_out, u_tail), ("with", p_out, p_tail)):
        if not out:
            print(f"no junit report from the run {label} the patch:\n{tail}")
    counts: dict[str, dict[str, int]] = {}
    for label, out in (("without", u_out), ("with", p_out)):
        for outcome in out.values():
            kind = outcome.split(":")[0]
            counts.setdefault(label, {}).setdefault(kind, 0)
            counts[label][kind] += 1
    print(f"outcomes: {counts}")

    def kind(out: dict[str, str], test: str) -> str:
        return out.get(test, "missing").split(":")[0]

    differing = sorted(t for t in set(p_out) | set(u_out) if kind(p_out, t) != kind(u_out, t))
    regressions = [t for t in differing if u_out.get(t) == "passed"]
    print(f"{len(differing)} tests differ ({len(regressions)} pass only without the patch):")
    for t in differing:
        print(
            f"  {t}\n    without: {u_out.get(t, 'missing')}\n    with:    {p_out.get(t, 'missing')}"
        )
    return 1 if differing or not p_out or not u_out else 0


if __name__ == "__main__":
    sys.exit(main())
