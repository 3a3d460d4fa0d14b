"""Command line: ``python -m fakegrad_patch <command>`` (also the ``fakegrad-patch`` script).

Commands live in their own modules and are imported only when run.
"""

from __future__ import annotations

import importlib
import sys

COMMANDS: dict[str, tuple[str, str]] = {
    "demo": (
        "fakegrad_patch._tools.demo",
        "train a model one step inside FakeTensorMode, unpatched vs patched",
    ),
    "doctor": (
        "fakegrad_patch._tools.doctor",
        "report versions, start-up hook, targets, defects, status",
    ),
    "trace": ("fakegrad_patch.trace._reader", "summarize trace files (JSONL)"),
    "verify": (
        "fakegrad_patch._tools.verify_cli",
        "train your model eagerly and patched under FakeTensorMode, compare every gradient",
    ),
    "sitecustomize": (
        "fakegrad_patch._activation.sitecustomize",
        "print or append the sitecustomize line",
    ),
}


def _usage() -> str:
    lines = ["usage: python -m fakegrad_patch <command> [options]", "", "commands:"]
    lines += [f"  {name:<14} {summary}" for name, (_, summary) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(_usage())
        return 0 if args else 2
    command = COMMANDS.get(args[0])
    if command is None:
        print(f"unknown command {args[0]!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(command[0])
    return int(module.main(args[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
