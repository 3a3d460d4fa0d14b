"""The package shows its parts and its imports run one way (issue 26, points 3 and 4).

``fakegrad_patch/`` holds four parts, each a folder: ``_core/`` (the fix: targets, probes, values,
arming, accumulate, write-back, DDP, and ``install``, which puts them in place), ``trace/``
(tracing and the trace reader), ``_tools/`` (verify and its report and CLI, doctor, demo,
materialize) and ``_activation/`` (the start-up hook, sitecustomize, the pytest plugin), around
the public facade ``__init__.py``, the command line ``__main__.py`` and the two modules everything
may read (``_config``, ``_errors``). These tests read every ``import`` statement of the package,
function-level ones included, and check that the graph has no circle and that every import goes
down the layers below; and that what users import keeps working after the move.
"""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "fakegrad_patch"
HOOKS = PACKAGE / "_activation" / "hooks"  # top-level modules in the wheel, not package modules

#: lowest first: a module may import only modules of a strictly lower rank
RANKS: list[tuple[str, list[str]]] = [
    ("errors", ["_errors"]),
    ("settings", ["_config"]),
    ("trace timeline export (standard library only)", ["trace._chrome"]),
    ("trace configuration: levels, TraceConfig, the environment", ["trace._env"]),
    ("trace sinks: the file, stderr", ["trace._sinks"]),
    ("the trace pipeline: envelope, buffer, renderer, structlog logger", ["trace._pipeline"]),
    ("tracing", ["trace", "trace._reader"]),
    ("parts", ["_core", "_tools", "_activation"]),
    (
        "registries and the touch points",
        [
            "_core.state",
            "_core.weak",
            "_core.typing",
            "_core.touchpoints",
            "_core.touchpoints.targets",
        ],
    ),
    (
        "probes, sites, per-leaf bookkeeping",
        [
            "_core.touchpoints.probes",
            "_core.touchpoints.sites",
            "_core.convert",
            "_core.convert.leaves",
            "_core.convert.lending",
            "_core.accumulate",
            "_core.accumulate.profiling",
        ],
    ),
    ("converter: records of conversions and copies", ["_core.convert.records"]),
    ("converter: conversions the patch did not see", ["_core.convert.unseen"]),
    (
        "dispatch: shared helpers",
        [
            "_core.dispatch",
            "_core.dispatch.tensors",
            "_core.dispatch.ops",
            "_core.dispatch.frames",
            "_core.dispatch.stats",
            "_core.dispatch.mismatch",
        ],
    ),
    ("dispatch: stand-ins, aliases", ["_core.dispatch.standins", "_core.dispatch.aliases"]),
    (
        "dispatch: the parts",
        [
            "_core.dispatch.watch",
            "_core.dispatch.objects",
            "_core.dispatch.fast",
            "_core.dispatch.methods",
        ],
    ),
    (
        "dispatch: upstream's path and what depends on it",
        ["_core.dispatch.upstream", "_core.dispatch.refused", "_core.dispatch.fallback"],
    ),
    ("dispatch: nested ops", ["_core.dispatch.nested"]),
    ("dispatch: the wrapper", ["_core.dispatch.wrapper"]),
    (
        "converter wrapper, accumulate, arming",
        [
            "_core.convert.values",
            "_core.accumulate.hooks",
            "_core.accumulate.arming",
            "_core.accumulate.ddp",
        ],
    ),
    ("fake leaves", ["_core.convert.fakeleaves"]),
    ("install: what is measured at first need", ["_core.install.first_need"]),
    ("install: one application of the patch", ["_core.install.applied"]),
    ("install: install(), uninstall(), configure(), status()", ["_core.install"]),
    ("tools used by the API", ["_tools.materialize", "_tools.verify_report"]),
    ("verify: the comparison", ["_tools.verify_compare"]),
    ("verify", ["_tools.verify"]),
    ("the public facade", [""]),
    ("activation: the start-up hook's handle", ["_activation.startup"]),
    ("activation: sitecustomize, the 0.3 shim", ["_activation.sitecustomize", "_startup"]),
    ("commands (users of the public API)", ["_tools.doctor", "_tools.demo", "_tools.verify_cli"]),
    ("command line", ["__main__"]),
]


def _name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _modules() -> dict[str, pathlib.Path]:
    return {_name(p): p for p in sorted(PACKAGE.rglob("*.py")) if HOOKS not in p.parents}


def _imports() -> dict[str, set[str]]:
    """module -> the package modules it imports (every import statement, at any depth)."""
    modules = _modules()
    full = {("fakegrad_patch." + m).rstrip("."): m for m in modules}
    edges: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        package = ("fakegrad_patch." + name).rstrip(".")
        if path.name != "__init__.py":
            package = package.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    module = ".".join([*base, *([node.module] if node.module else [])])
                else:
                    module = node.module or ""
                targets = [f"{module}.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            for target in targets:  # every name: ``from . import a, b`` imports both
                while target and target not in full:
                    target = target.rpartition(".")[0]
                if target and full[target] != name:
                    edges[name].add(full[target])
    return edges


def test_every_module_belongs_to_one_layer_and_the_parts_are_folders() -> None:
    ranked = [m for _, members in RANKS for m in members]
    assert sorted(ranked) == sorted(_modules()), "a module without a layer, or a layer without it"
    for part in ("_core", "trace", "_tools", "_activation"):
        assert (PACKAGE / part / "__init__.py").is_file(), part
    at_root = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert at_root == ["__init__.py", "__main__.py", "_config.py", "_errors.py", "_startup.py"]


def test_imports_have_no_circle() -> None:
    edges = _imports()
    seen: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> None:
        seen[node] = 1
        for nxt in sorted(edges[node]):
            if seen.get(nxt) == 1:
                cycle = [*path[path.index(nxt) :], nxt]
                pytest.fail("import circle: " + " -> ".join(cycle or [nxt]))
            if nxt not in seen:
                visit(nxt, [*path, nxt])
        seen[node] = 2

    for module in sorted(edges):
        if module not in seen:
            visit(module, [module])


def test_imports_go_down_the_layers() -> None:
    rank = {m: i for i, (_, members) in enumerate(RANKS) for m in members}
    upward = [
        f"{a or 'fakegrad_patch'} ({RANKS[rank[a]][0]}) imports {b or 'fakegrad_patch'} "
        f"({RANKS[rank[b]][0]})"
        for a, targets in sorted(_imports().items())
        for b in sorted(targets)
        if rank[b] >= rank[a]
    ]
    assert not upward, "\n".join(upward)


# -- what users import keeps working ---------------------------------------------------------------


def test_the_public_names_import() -> None:
    import fakegrad_patch

    for name in fakegrad_patch.__all__:
        assert getattr(fakegrad_patch, name) is not None, name
    from fakegrad_patch import trace

    for name in ("configure_trace", "capture", "events", "clear", "restore", "set_level", "emit"):
        assert callable(getattr(trace, name)), name
    assert importlib.import_module("fakegrad_patch.trace") is trace


def test_every_command_runs_its_help() -> None:
    from fakegrad_patch.__main__ import COMMANDS

    for command, (module, _summary) in COMMANDS.items():
        assert callable(importlib.import_module(module).main), command
        out = subprocess.run(
            [sys.executable, "-m", "fakegrad_patch", command, "--help"],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert out.returncode == 0, (command, out.stderr[-2000:])
        assert "usage" in out.stdout.lower(), command


def test_the_start_up_hook_and_the_pytest_plugin_keep_their_names() -> None:
    """The installed distribution's pytest11 entry point, and the wheel-root files the hook
    uses (pyproject's force-include), name the same top-level modules as in 0.3."""
    points = importlib.metadata.entry_points(group="pytest11")
    assert [p.value for p in points if p.name == "fakegrad"] == ["fakegrad_patch_pytest"]
    assert importlib.import_module("fakegrad_patch_pytest").__file__
    pyproject = (ROOT / "pyproject.toml").read_text()
    for source, target in (
        ("fakegrad_patch.pth", "fakegrad_patch.pth"),
        ("fakegrad_patch.start", "fakegrad_patch.start"),
        ("_fakegrad_patch_startup.py", "_fakegrad_patch_startup.py"),
        ("fakegrad_patch_pytest.py", "fakegrad_patch_pytest.py"),
    ):
        assert f'"fakegrad_patch/_activation/hooks/{source}" = "{target}"' in pyproject, source
        assert (HOOKS / source).is_file(), source
    assert "_fakegrad_patch_startup" in (HOOKS / "fakegrad_patch.pth").read_text()
    assert "_fakegrad_patch_startup:init" in (HOOKS / "fakegrad_patch.start").read_text()


@pytest.mark.parametrize("line", ["0.3", "current"])
def test_a_sitecustomize_line_activates(tmp_path: pathlib.Path, line: str) -> None:
    """The line ``python -m fakegrad_patch sitecustomize --append`` writes into users' files: the
    one 0.3 wrote (``fakegrad_patch._startup``) and today's both activate the patch."""
    from fakegrad_patch._activation import startup

    text = startup.sitecustomize_line()
    if line == "0.3":
        new = '__import__("fakegrad_patch._activation.startup", None, None, ("activate",))'
        assert new + '.activate("sitecustomize")' in text
        text = text.replace(
            new + '.activate("sitecustomize")',
            '__import__("fakegrad_patch._startup")._startup.activate("sitecustomize")',
        )
    (tmp_path / "sitecustomize.py").write_text(text + "\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("FAKEGRAD_")}
    env.update(FAKEGRAD_PATCH="1", PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT)]))
    code = (
        "import json, fakegrad_patch, torch, _fakegrad_patch_startup as h\n"
        "print(json.dumps([fakegrad_patch.is_installed(), h.state['activated_by']]))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.splitlines()[-1]) == [True, "sitecustomize"]


# -- the size of the parts and what they share -------------------------------------------------

#: a module longer than this says why at its top (a "Why it is long:" paragraph in its docstring)
MODULE_LINES = 600
#: no class longer than this: a class past it carries more than one concern
CLASS_LINES = 260


def _trees() -> dict[str, ast.Module]:
    return {name: ast.parse(path.read_text()) for name, path in _modules().items()}


def test_a_long_module_says_why_and_no_class_is_long() -> None:
    """Issue 45: modules stay short enough to read whole, or say at their top why they are one
    file (the touch points in one place, the reader that runs alone, the settings table); no
    class runs past ~250 lines."""
    long_modules, long_classes = {}, {}
    for name, tree in _trees().items():
        lines = (PACKAGE / _modules()[name].relative_to(PACKAGE)).read_text().count("\n")
        doc = ast.get_docstring(tree) or ""
        if lines > MODULE_LINES and "Why it is long:" not in doc:
            long_modules[name] = lines
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                size = (node.end_lineno or node.lineno) - node.lineno + 1
                if size > CLASS_LINES:
                    long_classes[f"{name}.{node.name}"] = size
    assert long_modules == {}, "modules over 600 lines without a 'Why it is long:' paragraph"
    assert long_classes == {}, f"classes over {CLASS_LINES} lines"


def _private_uses(name: str, tree: ast.Module, modules: dict[str, pathlib.Path]) -> list[str]:
    """The private names (``_x``, not modules) this module takes from another module of the
    package: ``from .m import _x`` or ``m._x`` where ``m`` is a package module it imported."""
    package = ("fakegrad_patch." + name).rstrip(".")
    is_package = modules[name].name == "__init__.py"
    known = {("fakegrad_patch." + m).rstrip(".") for m in modules}
    found: list[str] = []
    aliases: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package if is_package else package.rsplit(".", 1)[0]
                for _ in range(node.level - 1):
                    base = base.rsplit(".", 1)[0]
                source = f"{base}.{node.module}" if node.module else base
            else:
                source = node.module or ""
            if not source.startswith("fakegrad_patch"):
                continue
            for alias in node.names:
                if f"{source}.{alias.name}" in known:
                    aliases.add(alias.asname or alias.name)  # a module, private or not
                elif alias.name.startswith("_") and not alias.name.startswith("__"):
                    found.append(f"from {source} import {alias.name}")
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in aliases
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
        ):
            found.append(f"{node.value.id}.{node.attr}")
    return found


def test_no_private_name_is_used_across_modules() -> None:
    """Issue 45: what a module shares is public in it (a private module of the package may be
    imported; a private name of a module may not be used by another)."""
    modules = _modules()
    offenders = {}
    for name, tree in _trees().items():
        found = _private_uses(name, tree, modules)
        if found:
            offenders[name] = sorted(set(found))
    assert offenders == {}


def test_the_private_name_check_finds_them() -> None:
    """The check above is not vacuous: it finds both spellings."""
    modules = _modules()
    source = (
        "from .._config import _shown\n"
        "from .._core.touchpoints import targets as _targets\n"
        "_targets._strided()\n"
        "from .. import _config\n"
        "_config.current()\n"
    )
    found = _private_uses("_tools.verify", ast.parse(source), modules)
    assert sorted(found) == ["_targets._strided", "from fakegrad_patch._config import _shown"]
