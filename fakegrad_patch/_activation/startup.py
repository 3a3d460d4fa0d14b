"""The package's handle on the start-up hook module (``_fakegrad_patch_startup``).

The hook logic lives in ``fakegrad_patch/_activation/hooks/_fakegrad_patch_startup.py``, which a
wheel installs at the root of site-packages (see that module for why). This module finds it:

* installed (``pip install .`` / ``-e .``): the top-level module ``_fakegrad_patch_startup``,
  already imported when the hook ran at start-up, so its ``state`` says what happened;
* otherwise (not run at start-up; or reached through PYTHONPATH): loaded from ``hooks/`` under
  the same name, so the sitecustomize route and the ``.pth`` route share one ``state`` and one
  guard, and the hook always matches this package's version.

Standard library only. ``activate`` is what the sitecustomize line calls.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from types import ModuleType

HOOK_MODULE = "_fakegrad_patch_startup"
HOOK_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hooks", HOOK_MODULE + ".py")


def hook_module() -> ModuleType:
    """The start-up hook module (imported if needed; never runs :func:`init`).

    The one the start-up ran, if any (its ``state`` is what happened); else this package's own
    copy, so that the hook logic always matches the package version even when another version
    of fakegrad-patch is installed in site-packages and this one is a checkout on PYTHONPATH;
    else (a package without ``hooks/``) the top-level module."""
    module = sys.modules.get(HOOK_MODULE)
    if module is not None:
        return module
    spec = importlib.util.spec_from_file_location(HOOK_MODULE, HOOK_SOURCE)
    if spec is None or spec.loader is None or not os.path.isfile(HOOK_SOURCE):
        return importlib.import_module(HOOK_MODULE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[HOOK_MODULE] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(HOOK_MODULE, None)
        raise
    return module


def hook_ran() -> bool:
    """True when the start-up hook module was imported by the interpreter's start-up (it is
    only ever imported by the ``.pth``/``.start`` hook, by this module, or by the doctor)."""
    return HOOK_MODULE in sys.modules and bool(sys.modules[HOOK_MODULE].state["handled"])


def activate(origin: str) -> bool:
    """Called by the sitecustomize line once it has seen an "on" value: record and install."""
    return bool(hook_module().activate(origin))


def sitecustomize_line() -> str:
    """The line for users' ``sitecustomize.py`` (see the hook module)."""
    return str(hook_module().sitecustomize_line())
