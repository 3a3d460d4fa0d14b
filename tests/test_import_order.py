"""A module of ours imported before torch, after ``import fakegrad_patch``, that imports torch at
its top (a private one: ``fakegrad_patch._core.dispatch.fast``; a tool: ``fakegrad_patch._tools.
verify``): torch's import runs the post-import hook while that module is half-made. Applying then
would import it half-made (0.4: an ImportError, "not patching", the patch never applied). Now the
patch waits for the first FakeTensorMode built (or the next ``install()``), says so in
``status()['deferred']`` and the trace (``patch_deferred``), and then applies, with no warning.

One fresh interpreter per case: which module, what comes first after it (a propagating mode, a
subclass of FakeTensorMode, ``install()``, ``uninstall()``, four threads building modes at once).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from test_trace import check_schema

pytestmark = pytest.mark.slow  # fresh interpreters

PRELUDE = """
import json, sys, threading, warnings
warnings.simplefilter("always")
caught = []
warnings.showwarning = lambda message, *a, **k: caught.append(str(message))
import fakegrad_patch
{setup}
with fakegrad_patch.trace.capture("info") as events:
    import {module}
assert "torch" in sys.modules, "{module} did not import torch"
before = fakegrad_patch.status()
import torch
import torch._functorch.config as fc
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

def step(cls=FakeTensorMode, patch=True):
    w = torch.nn.Parameter(torch.tensor([1.0, 2.0, 3.0]))
    if patch:
        with fc.patch(fake_tensor_propagate_real_tensors=True):
            mode = cls(allow_non_fake_inputs=True)
    else:  # the flag already set by the caller
        mode = cls(allow_non_fake_inputs=True)
    with mode:
        (w * w).sum().backward()
    return "fake" if isinstance(w.grad, FakeTensor) else w.grad.tolist()

def init_state():
    # FakeTensorMode.__init__: the one-shot ("shim"), the patch's wrapper over torch's own
    # ("patch", once), or torch's own ("torch")
    init = FakeTensorMode.__dict__["__init__"]
    if "first_mode" in getattr(init, "__qualname__", ""):
        return "shim"
    if type(init).__name__ == "FunctionWrapper":
        inner = init.__wrapped__
        return "patch" if type(inner).__name__ == "function" else "patch over " + repr(inner)
    return "torch"
"""

REPORT = """
print(json.dumps({
    "deferred_before": before["deferred"],
    "installed_before": before["installed"],
    "installed": fakegrad_patch.is_installed(),
    "deferred_after": fakegrad_patch.status()["deferred"],
    "skipped": fakegrad_patch.status()["skipped_reason"],
    "init": init_state(),
    "grads": grads,
    "warnings": [w for w in caught if "fakegrad" in w],
    "events": [e for e in events if e["event"].startswith("patch_")],
}))
"""


def run(module: str, body: str, setup: str = "") -> dict:
    code = PRELUDE.format(module=module, setup=setup) + body + REPORT
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip(), done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


EXPECTED = [2.0, 4.0, 6.0]


def waited_then_applied(out: dict, module: str) -> None:
    """``module`` made the patch wait (said in ``status()`` and in one ``patch_deferred``
    event), and the patch is applied now, by its own wrapper, with no warning."""
    assert not out["installed_before"], out
    assert module in (out["deferred_before"] or ""), out
    assert out["installed"] and out["deferred_after"] is None and out["skipped"] is None, out
    assert out["warnings"] == [] and out["init"] == "patch", out
    deferred = [e for e in out["events"] if e["event"] == "patch_deferred"]
    assert len(deferred) == 1 and module in deferred[0]["reason"], out["events"]
    for event in out["events"]:
        check_schema(event)


# The family: modules of ours that import torch at their top, in the patch's own import graph (a
# dispatch part, a conversion part whose half-made state raises AttributeError, not ImportError,
# accumulation, a probe of the touch points, the installation's root), each first in a fresh
# interpreter, each met by a different first call (a mode, install(), a subclass, four threads).


def test_a_dispatch_part_waits_for_the_first_mode() -> None:
    module = "fakegrad_patch._core.dispatch.fast"
    out = run(module, "grads = [step()]\n")
    waited_then_applied(out, module)
    assert out["grads"] == [EXPECTED], out  # the first mode was built by the patch's __init__


def test_accumulation_waits_for_the_first_mode() -> None:
    module = "fakegrad_patch._core.accumulate.hooks"
    out = run(module, "grads = [step()]\n")
    waited_then_applied(out, module)
    assert out["grads"] == [EXPECTED], out


def test_a_touch_point_probe_waits_for_install() -> None:
    module = "fakegrad_patch._core.touchpoints.probes"
    body = "applied = fakegrad_patch.install()\nassert applied\ngrads = [step()]\n"
    out = run(module, body)
    waited_then_applied(out, module)
    assert out["grads"] == [EXPECTED], out


def test_the_installation_root_waits_for_a_subclass_built_first() -> None:
    module = "fakegrad_patch._core.install.applied"
    body = (
        "class Mine(FakeTensorMode):\n"
        "    def __init__(self, **kw):\n"
        "        super().__init__(**kw)\n"
        "        self.mine = True\n"
        "grads = [step(Mine), step()]\n"
    )
    out = run(module, body)
    waited_then_applied(out, module)
    assert out["grads"] == [EXPECTED, EXPECTED], out


def test_a_conversion_part_waits_for_four_threads_building_modes_at_once() -> None:
    module = "fakegrad_patch._core.convert.values"
    body = (
        "grads = []\n"
        "barrier = threading.Barrier(4)\n"
        "def worker():\n"
        # set, never restored: a per-thread override on 2.13+, process-wide on 2.4 (where
        # patching it per thread races: one thread's exit turns another's mode plain)
        "    fc.fake_tensor_propagate_real_tensors = True\n"
        "    barrier.wait()\n"
        "    grads.append(step(patch=False))\n"
        "threads = [threading.Thread(target=worker) for _ in range(4)]\n"
        "[t.start() for t in threads]\n"
        "[t.join() for t in threads]\n"
    )
    out = run(module, body)
    waited_then_applied(out, module)
    assert out["grads"] == [EXPECTED] * 4, out


def test_no_thread_finds_torchs_own_init_while_the_patch_applies() -> None:
    """While the first mode applies the patch, ``FakeTensorMode.__init__`` is the one-shot
    (a thread building a mode waits in it) and then the patch's wrapper: never torch's own,
    which would build a mode the patch never saw (its gradients fake: found on 2.4.0 by the
    four threads above, when the one-shot put torch's back before applying)."""
    module = "fakegrad_patch._core.dispatch.aliases"
    body = (
        "sys.setswitchinterval(1e-5)\n"
        "seen, stop = set(), []\n"
        "def watch():\n"
        "    while not stop:\n"
        "        seen.add(init_state())\n"
        "watcher = threading.Thread(target=watch)\n"
        "watcher.start()\n"
        "grads = [step()]\n"
        "stop.append(1)\n"
        "watcher.join()\n"
        "grads.append(sorted(seen))\n"
    )
    out = run(module, body)
    waited_then_applied(out, module)
    assert out["grads"][0] == EXPECTED, out
    assert "torch" not in out["grads"][1] and "patch" in out["grads"][1], out


def test_a_module_outside_the_patch_applies_at_once() -> None:
    """A tool (``_tools.verify``) is not imported by the patch: applying does not wait."""
    out = run("fakegrad_patch._tools.verify", "grads = [step()]\n")
    assert out["installed_before"] and out["deferred_before"] is None, out
    assert out["grads"] == [EXPECTED] and out["warnings"] == [], out


def test_uninstall_before_the_first_mode_leaves_torch_alone() -> None:
    """``uninstall()`` while waiting: torch's own ``__init__`` back at once, and the first mode
    applies nothing (upstream's fake gradient)."""
    body = "fakegrad_patch.uninstall()\ngrads = [init_state(), step()]\n"
    out = run("fakegrad_patch._core.dispatch.fast", body)
    assert not out["installed"] and out["init"] == "torch" and out["deferred_after"] is None, out
    assert out["grads"] == ["torch", "fake"] and out["warnings"] == [], out


def test_a_failure_of_another_cause_is_reported_at_the_first_mode() -> None:
    """Applying fails for a reason of its own while a module of ours imports: deferred, then
    reported at the retry (one warning, torch left as it was), never silent."""
    setup = (
        "import types\n"
        "stub = types.ModuleType('fakegrad_patch._core.install.applied')\n"
        "def broken(**kwargs):\n"
        "    raise RuntimeError('broken on purpose')\n"
        "stub.Applied = broken\n"
        "sys.modules[stub.__name__] = stub\n"
    )
    out = run("fakegrad_patch._core.dispatch.fast", "grads = [step()]\n", setup)
    assert "fakegrad_patch._core.dispatch.fast" in (out["deferred_before"] or ""), out
    assert not out["installed"] and out["init"] == "torch" and out["grads"] == ["fake"], out
    assert "broken on purpose" in (out["skipped"] or "") and out["deferred_after"] is None, out
    assert len(out["warnings"]) == 1 and "not patching" in out["warnings"][0], out
