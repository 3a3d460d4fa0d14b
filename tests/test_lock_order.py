"""Issue 40: no lock of the patch is held across an import, so ``install()``/``uninstall()`` on
one thread never deadlock with a first import (a first ``FakeTensorMode``) on another.

Before, a worker whose first ``FakeTensorMode()`` imported ``torch._dynamo.config`` (which
imports FSDP2's state module) ran the patch's post-import hook inside that import, and the hook
waited for the DDP lock; ``install()`` on another thread held that lock while resolving FSDP2's
targets, i.e. waited for the worker's import: both hung for good. Each test runs
``tests/_lock_order.py`` in a fresh interpreter: a ``sys.meta_path`` finder holds the worker inside
that import (its body run, the post-import hooks not yet called, the import locks held) until the
other thread has finished or waits for the import; then every thread must finish within seconds.
On the code before the fix all three scenarios hung (the child then dumps every thread's stack
and exits 3; the subprocess timeout is the backstop): a regression fails, it never hangs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from fakegrad_patch._activation import startup as _startup

pytestmark = pytest.mark.slow

CHILD = Path(__file__).with_name("_lock_order.py")


def _child(*args: str) -> dict[str, Any]:
    """Run tests/_lock_order.py with ``args`` in a fresh interpreter (no FAKEGRAD_ variable);
    the JSON it prints last."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FAKEGRAD_")}
    out = subprocess.run(
        [sys.executable, str(CHILD), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-6000:]
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def _run(scenario: str) -> dict[str, Any]:
    hook_source = _startup.hook_module().__file__
    assert hook_source is not None
    result = _child(scenario, hook_source)
    if "skip" in result:
        pytest.skip(str(result["skip"]))
    assert result["errors"] == [], result
    # the interleaving happened: the caller finished, or waited for the worker's import
    assert result["caller"] in ("finished", "waiting for an import"), result
    return result


@pytest.mark.parametrize("scenario", ["install", "startup"])
def test_install_while_a_first_fake_mode_imports_fsdp(scenario: str) -> None:
    """``install()`` (after ``uninstall()``) while the worker is held; ``startup``: the first
    installation was the start-up hook's (``FAKEGRAD_PATCH=1``, at torch's import)."""
    result = _run(scenario)
    if scenario == "startup":
        assert result["activated_by"] == "pth", result
    assert result["installed_first"] is True, result
    assert result["installed"] is True, result
    assert result["ddp"] == {"installed": True, "fsdp2": True, "modes_seen": 0}, result
    assert result["fsdp_wrapped"] is True, result
    assert result["grad"] == "Tensor", result


def test_uninstall_while_an_install_waits_for_that_import() -> None:
    """``uninstall()`` on a third thread while that ``install()`` is under way: both finish,
    and the patch is off, FSDP2's hooks and DDP's torch's own again."""
    result = _run("uninstall")
    assert result["remover"] != "neither", result
    assert result["installed"] is False, result
    assert result["ddp"] == {"installed": False, "fsdp2": False, "modes_seen": 0}, result
    assert result["fsdp_wrapped"] is False, result
    assert result["grad"] == "FakeTensor", result  # upstream's behaviour, uninstalled


def test_training_threads_across_the_first_import_while_the_patch_is_reinstalled() -> None:
    """tests/test_concurrency.py's stress test in a fresh interpreter: each trainer's first
    ``FakeTensorMode`` imports ``torch._dynamo`` (seconds) while the patch is re-installed every
    50 ms (the hang of issue 40, 1 run in 4 to 6 before the fix); then every 12 steps."""
    result = _child("stress")
    assert result["first_import"] is True, result
    assert result["errors"] == [] and result["problems"] == [], result
    assert result["steps"] == 60 and result["toggles"] >= 2, result
    assert result["wholly_installed"] > result["steps"] // 2, result
