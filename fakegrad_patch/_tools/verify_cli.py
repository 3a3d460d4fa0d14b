"""``python -m fakegrad_patch verify module:factory``: run ``fakegrad_patch.verify`` on a model
the user's factory builds, print the report (problems first) or ``--json``.

The factory is called without arguments and returns either a tuple ``(model, inputs[, loss_fn[,
optimizer]])`` or a dict with the keys ``model``, ``inputs`` and optionally ``loss_fn``,
``optimizer``, ``steps``, ``zero_grad`` (``verify``'s arguments). ``module`` is a dotted module
name importable from the current directory, or a path to a ``.py`` file.

Exit codes: 0 when the patched run matches eager, 1 on any mismatch, 2 when the comparison could
not be made (bad ``module:factory``, the factory failed, ``VerifyError``).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import sys
import warnings
from collections.abc import Callable
from typing import Any

_KEYS = ("model", "inputs", "loss_fn", "optimizer", "steps", "zero_grad")


def _option(name: str) -> Callable[[str], Any]:
    """An argparse ``type=`` for the settings-table row ``name``: its parser, and on a bad value
    an argparse error naming the option, the value given and the allowed values."""
    from .. import _config

    row = _config.setting(name)

    def convert(text: str) -> Any:
        try:
            return row.parse(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"invalid value {_config.shown(text)}: expected {row.cli_allowed or row.allowed}"
            ) from None

    convert.__name__ = name  # argparse names the type in some messages
    return convert


class _Usage(Exception):
    """A problem with the command line or the factory: exit 2 with this message."""


def load_factory(spec: str) -> Callable[[], Any]:
    """``module:factory`` or ``path/to/file.py:factory`` -> the factory."""
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise _Usage(f"expected module:factory or path/to/file.py:factory, got {spec!r}")
    try:
        if module_name.endswith(".py") or os.sep in module_name or "/" in module_name:
            module = _load_file(module_name)
        else:
            if "" not in sys.path and os.getcwd() not in sys.path:
                sys.path.insert(0, os.getcwd())
            module = importlib.import_module(module_name)
    except _Usage:
        raise
    except Exception as exc:
        raise _Usage(f"cannot import {module_name!r}: {type(exc).__name__}: {exc}") from exc
    factory = module
    for part in attr.split("."):
        factory = getattr(factory, part, None)
        if factory is None:
            raise _Usage(f"{module_name!r} has no attribute {attr!r}")
    if not callable(factory):
        raise _Usage(f"{spec!r} is not callable")
    return factory


def _load_file(path: str) -> Any:
    path = os.path.abspath(path)
    if not os.path.isfile(path):
        raise _Usage(f"no such file: {path}")
    name = "_fakegrad_verify_" + os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise _Usage(f"cannot load {path} as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, os.path.dirname(path))  # sibling imports of the user's file
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def case_from(result: Any) -> dict[str, Any]:
    """The factory's result as ``verify`` keyword arguments."""
    if isinstance(result, dict):
        unknown = sorted(set(result) - set(_KEYS))
        if unknown:
            raise _Usage(f"the factory returned unknown keys {unknown}; known: {list(_KEYS)}")
        case = dict(result)
    elif isinstance(result, tuple | list) and 2 <= len(result) <= 4:
        case = dict(zip(_KEYS, result, strict=False))
    else:
        raise _Usage(
            "the factory must return (model, inputs[, loss_fn[, optimizer]]) or a dict with keys "
            f"{list(_KEYS)}, not {type(result).__name__}"
        )
    missing = [k for k in ("model", "inputs") if k not in case]
    if missing:
        raise _Usage(f"the factory's result lacks {missing}")
    return case


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m fakegrad_patch verify",
        description="Train a copy of your model eagerly and a copy under FakeTensorMode with "
        "the patch, compare every parameter's gradient, print the report. Exit 1 on any "
        "mismatch, 2 when the comparison could not be made.",
    )
    parser.add_argument(
        "factory",
        metavar="module:factory",
        help="returns (model, inputs[, loss_fn[, optimizer]]) or a dict; module may be a "
        "path/to/file.py",
    )
    parser.add_argument(
        "--steps", type=_option("steps"), help="training steps (default: the factory's, or 1)"
    )
    parser.add_argument(
        "--zero-grad",
        choices=("none", "zeros", "never"),
        help="between steps: zero_grad() (none), zero_grad(set_to_none=False) (zeros), or "
        "accumulate (never); default: the factory's, or none",
    )
    parser.add_argument(
        "--atol", type=_option("atol"), help="absolute tolerance, >= 0 (default: per dtype)"
    )
    parser.add_argument(
        "--rtol", type=_option("rtol"), help="relative tolerance, >= 0 (default: per dtype)"
    )
    parser.add_argument(
        "--strict-buffers", action="store_true", help="buffers that differ fail the verdict"
    )
    parser.add_argument(
        "--buffers",
        type=_option("buffers"),
        help="upstream or write_back: in-place buffer updates inside the mode reach the real "
        "buffers (default: the setting in force, FAKEGRAD_BUFFERS)",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)

    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    from .verify import VerifyError, verify

    try:
        case = case_from(load_factory(args.factory)())
    except _Usage as exc:
        print(f"fakegrad_patch verify: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:
        print(
            f"fakegrad_patch verify: the factory {args.factory!r} failed: "
            f"{type(exc).__name__}: {exc}",
            file=sys.stderr,
        )
        return 2
    if args.steps is not None:
        case["steps"] = args.steps
    if args.zero_grad is not None:
        case["zero_grad"] = args.zero_grad
    model, inputs = case.pop("model"), case.pop("inputs")
    try:
        report = verify(
            model,
            inputs,
            case.pop("loss_fn", None),
            atol=args.atol,
            rtol=args.rtol,
            check_buffers="strict" if args.strict_buffers else True,
            buffers=args.buffers,
            **case,
        )
    except (VerifyError, TypeError, ValueError) as exc:
        print(f"fakegrad_patch verify: {exc}", file=sys.stderr)
        return 2
    if args.json:
        json.dump(report.to_dict(), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(report.format())
    sys.stdout.flush()
    return 0 if report.ok else 1
