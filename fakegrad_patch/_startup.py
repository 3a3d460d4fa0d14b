"""The package's handle on the start-up hook module (``_fakegrad_patch_startup``).

The hook logic lives in ``fakegrad_patch/_hooks/_fakegrad_patch_startup.py``, which a wheel
installs at the root of site-packages (see that module for why). This module finds it:

* installed (``pip install .`` / ``-e .``): the top-level module ``_fakegrad_patch_startup``,
  already imported when the hook ran at start-up, so its ``state`` says what happened;
* reached through PYTHONPATH (source tree): loaded from ``_hooks/`` under the same name, so the
  sitecustomize route and the ``.pth`` route share one ``state`` and one guard.

Standard library only. ``activate`` is what the sitecustomize line calls.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from types import ModuleType

HOOK_MODULE = "_fakegrad_patch_startup"
HOOK_SOURCE = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "_hooks", HOOK_MODULE + ".py"
)


def hook_module() -> ModuleType:
    """The start-up hook module (imported if needed; never runs :func:`init`)."""
    module = sys.modules.get(HOOK_MODULE)
    if module is not None:
        return module
    try:
        return importlib.import_module(HOOK_MODULE)
    except ImportError:
        pass
    spec = importlib.util.spec_from_file_location(HOOK_MODULE, HOOK_SOURCE)
    if spec is None or spec.loader is None:  # pragma: no cover - the file ships with the package
        raise ImportError(f"fakegrad_patch start-up hook module not found at {HOOK_SOURCE}")
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
