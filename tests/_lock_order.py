"""The child program of tests/test_lock_order.py (issue 40): one scenario per fresh interpreter.

``python tests/_lock_order.py SCENARIO [HOOK_SOURCE]`` prints one JSON line and exits 0, or dumps
every thread's stack on stderr and exits 3 when the threads do not finish in time (a deadlock
fails, it never hangs the suite; ``faulthandler`` is the backstop if even that check hangs).

The interleaving of issue 40 is made certain instead of waited for. A ``sys.meta_path``
finder (:class:`HoldImport`) holds a worker's import of FSDP2's state module
(``targets.FSDP_STATE_MODULE``) after the module's body ran and before wrapt's post-import
hooks are called, with the module's import lock (and those of its parents) held: exactly where
the worker of the issue was when its first ``FakeTensorMode()`` imported
``torch._dynamo.config``. The worker imports it the way the issue's did, by building the first
``FakeTensorMode``. Then another thread calls the patch's API; once that thread has finished or
waits for an import lock, the worker is let go, and every thread must finish:

* ``install``: ``install()`` while the worker is held (before the fix: ``install()`` held the
  DDP lock while it resolved FSDP2's targets, i.e. waited for the worker's import, and the
  worker's post-import hook waited for that lock);
* ``uninstall``: ``uninstall()`` on a third thread while that ``install()`` is under way;
* ``stress`` (:func:`stress`, tests/test_concurrency.py runs it in process too): threads train
  while another re-installs the patch, across the first import of ``torch._dynamo``;
* ``startup``: the process was started with ``FAKEGRAD_PATCH=1`` and the start-up hook (loaded
  from ``HOOK_SOURCE`` and run as ``site`` would) installed the patch when torch was imported:
  its post-import hooks were registered from inside torch's import; then ``uninstall()`` and
  ``install()`` while the worker is held.
"""

from __future__ import annotations

import faulthandler
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys
import threading
import time
from typing import Any

#: seconds the threads get to finish once the worker is let go (they need well under one)
FINISH_S = float(os.environ.get("FAKEGRAD_LOCK_ORDER_FINISH_S", "20"))
#: seconds to wait for the caller to finish or to wait for an import lock
BLOCKED_S = 20.0


class HoldImport(importlib.abc.MetaPathFinder):
    """Holds the first import of ``name`` after its body ran, before wrapt's post-import hooks
    (placed after wrapt's finder, so wrapt's loader wraps ours), until :attr:`release` is set."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.entered = threading.Event()
        self.release = threading.Event()
        self.done = False

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != self.name or self.done:
            return None
        self.done = True
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        inner, hold = spec.loader, self

        class Loader(importlib.abc.Loader):
            def create_module(self, spec: Any) -> Any:
                return inner.create_module(spec)

            def exec_module(self, module: Any) -> None:
                inner.exec_module(module)  # type: ignore[attr-defined]
                hold.entered.set()
                hold.release.wait()

        spec.loader = Loader()
        return spec

    def place(self) -> None:
        """Right before the path finder: after wrapt's finder, which then wraps our loader."""
        index = next(i for i, f in enumerate(sys.meta_path) if f is importlib.machinery.PathFinder)
        sys.meta_path.insert(index, self)


def waiting_for_an_import(thread: threading.Thread) -> bool:
    """Is ``thread`` blocked on a module's import lock (importlib's ``_ModuleLock.acquire``)?"""
    frame = sys._current_frames().get(thread.ident or -1)
    return (
        frame is not None
        and frame.f_code.co_name == "acquire"
        and "importlib._bootstrap" in frame.f_code.co_filename
    )


def run(target: Any, errors: list[str]) -> threading.Thread:
    def body() -> None:
        try:
            target()
        except BaseException as exc:  # reported in the JSON line
            errors.append(f"{type(exc).__name__}: {exc}")

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    return thread


def settle(thread: threading.Thread, *, any_wait: bool = False) -> str:
    """Wait until ``thread`` finished or waits for an import lock (``any_wait``: or stays on
    one line for 0.3 s, waiting for anything); say which."""
    deadline = time.monotonic() + BLOCKED_S
    seen, since = None, time.monotonic()
    while time.monotonic() < deadline:
        if not thread.is_alive():
            return "finished"
        if waiting_for_an_import(thread):
            return "waiting for an import"
        frame = sys._current_frames().get(thread.ident or -1)
        where = None if frame is None else (frame.f_code, frame.f_lineno)
        if where != seen:
            seen, since = where, time.monotonic()
        elif any_wait and time.monotonic() - since > 0.3:
            return f"waiting in {where[0].co_name}" if where else "waiting"
        time.sleep(0.005)
    return "neither"


def fail(message: str) -> None:
    sys.stderr.write(f"DEADLOCK: {message}\n")
    sys.stderr.flush()
    faulthandler.dump_traceback(all_threads=True)
    os._exit(3)


def stress(threads: int = 3, steps: int = 20, timeout_s: float = 60.0) -> dict[str, Any]:
    """``threads`` threads train (``steps`` steps each, every step under a fresh propagating
    ``FakeTensorMode``) while another thread re-installs the patch (``uninstall()`` then
    ``install()`` at once): every 50 ms until the first step ends (a fresh interpreter: while
    the trainers' first ``FakeTensorMode`` imports ``torch._dynamo``), then after every
    ``4 * threads`` steps (polled every 2 ms), so that the steps are long against the toggling
    whatever the machine's load, and the toggles happen however fast the steps are. A step is
    *wholly installed* when the patch was installed when it started and when it ended, with no
    ``install()``/``uninstall()`` call in between: its gradients must be real and exact. Any
    other step may get upstream's (fake) gradients or none (on a D2 build a forward that
    straddled ``uninstall()`` is refused), never a wrong real one. At the end ``uninstall()``
    must leave torch's own functions everywhere (:func:`wrappers_left`: no installation's
    wrapper stacked under another's). Returns the counts; a thread still running after
    ``timeout_s`` fails (stacks dumped, exit 3) instead of hanging."""
    import copy

    import torch
    import torch._functorch.config as functorch_config
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    import fakegrad_patch

    template = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
    with torch.no_grad():  # the same values in every process and thread (no global RNG)
        for i, p in enumerate(template.parameters()):
            p.copy_(torch.linspace(-1.0, 1.0, p.numel()).reshape(p.shape) * (0.5 + 0.1 * i))
    x = torch.linspace(-2.0, 2.0, 8 * 8).reshape(8, 8)
    reference = copy.deepcopy(template)
    reference(x).sum().backward()
    expected = [p.grad for p in reference.parameters()]

    epoch = [0]  # bumped before every install()/uninstall() call
    stop = threading.Event()
    counts = {"steps": 0, "wholly_installed": 0, "real": 0, "fake": 0, "none": 0, "toggles": 0}
    problems: list[str] = []
    lock = threading.Lock()

    def toggler() -> None:
        last = 0
        # 50 ms while nothing has finished (a fresh interpreter's first import), then 2 ms: a
        # step takes longer than that on any machine, so the toggles follow the step count
        # (one per 4 * threads steps) rather than the clock.
        while not stop.wait(0.002 if counts["steps"] else 0.05):
            done = counts["steps"]
            if done and done - last < 4 * threads:
                continue
            last = done
            epoch[0] += 1
            fakegrad_patch.uninstall()
            epoch[0] += 1
            fakegrad_patch.install()
            counts["toggles"] += 1

    def trainer() -> None:
        with functorch_config.patch(fake_tensor_propagate_real_tensors=True):
            for _ in range(steps):
                model = copy.deepcopy(template)
                before, on = epoch[0], fakegrad_patch.is_installed()
                with FakeTensorMode(allow_non_fake_inputs=True):
                    model(x).sum().backward()
                whole = on and fakegrad_patch.is_installed() and epoch[0] == before
                grads = [p.grad for p in model.parameters()]
                with lock:
                    counts["steps"] += 1
                    counts["wholly_installed"] += whole
                    for grad, want in zip(grads, expected, strict=True):
                        if grad is None:
                            counts["none"] += 1
                        elif isinstance(grad, FakeTensor):
                            counts["fake"] += 1
                        else:
                            counts["real"] += 1
                            if not torch.allclose(grad, want, rtol=1e-5, atol=1e-5):
                                problems.append("a real gradient with wrong values")
                        if whole and (grad is None or isinstance(grad, FakeTensor)):
                            problems.append(f"a wholly installed step got {type(grad).__name__}")

    errors: list[str] = []
    # Each trainer turns propagation on for itself (torch's config patches are thread-local on
    # recent builds), and this thread for all of them: where the config is process-wide (2.4),
    # the first trainer to finish would otherwise restore the flag under the others, whose
    # next modes would not propagate (fake gradients, counted as a wholly installed step's).
    with functorch_config.patch(fake_tensor_propagate_real_tensors=True):
        toggling = run(toggler, errors)
        training = [run(trainer, errors) for _ in range(threads)]
        deadline = time.monotonic() + timeout_s
        for thread in training:
            thread.join(max(0.0, deadline - time.monotonic()))
        stop.set()
        toggling.join(max(0.0, deadline - time.monotonic()))
    if any(t.is_alive() for t in (*training, toggling)):
        fail(f"threads still running after {timeout_s:.0f} s: {counts}")
    # after so many re-installs, uninstall() must still leave torch's own functions everywhere
    # (no installation's wrapper stacked under another's)
    fakegrad_patch.uninstall()
    problems += wrappers_left()
    fakegrad_patch.install()
    return {**counts, "problems": sorted(set(problems)), "errors": errors}


def wrappers_left() -> list[str]:
    """After ``uninstall()``: every attribute of the classes and modules the patch wraps that
    still holds a wrapt wrapper (torch uses none of its own), and ``Tensor.data`` if defined on
    ``Tensor`` itself (torch defines it on ``TensorBase``)."""
    import torch
    import torch._subclasses.fake_tensor as fake_tensor
    import torch._subclasses.meta_utils as meta_utils
    import wrapt

    owners: list[Any] = [
        fake_tensor,
        fake_tensor.FakeTensorMode,
        fake_tensor.FakeTensorConverter,
        fake_tensor.FakeTensor,
        meta_utils,
        meta_utils.MetaConverter,
        torch.Tensor,
        torch.autograd,
    ]
    scaler = getattr(getattr(torch, "amp", None), "GradScaler", None)
    if isinstance(scaler, type):
        owners.append(scaler)
    left = [
        f"{getattr(owner, '__name__', owner)}.{name} still wrapped after uninstall()"
        for owner in owners
        for name, value in list(vars(owner).items())
        if isinstance(value, wrapt.ObjectProxy)
    ]
    if "data" in torch.Tensor.__dict__:
        left.append("Tensor.data still defined on Tensor after uninstall()")
    return left


def main() -> None:
    scenario = sys.argv[1]
    # the backstop, should a check below hang too: every stack, then exit 1
    faulthandler.dump_traceback_later(150, exit=True)
    if scenario == "stress":
        # across the first-import boundary: torch imported and the patch installed, but no
        # FakeTensorMode built yet, so each trainer's first step imports torch._dynamo while
        # install()/uninstall() run on the toggling thread
        import torch

        import fakegrad_patch

        assert fakegrad_patch.is_installed()
        first = "torch._dynamo.config" not in sys.modules
        print(json.dumps({"first_import": first, **stress()}), flush=True)
        return
    if scenario == "startup":
        os.environ["FAKEGRAD_PATCH"] = "1"
        spec = importlib.util.spec_from_file_location("_fakegrad_patch_startup", sys.argv[2])
        assert spec is not None and spec.loader is not None
        hook = importlib.util.module_from_spec(spec)
        sys.modules["_fakegrad_patch_startup"] = hook
        spec.loader.exec_module(hook)
        hook.init()  # arms its finder; the patch is installed when torch is imported
        assert "fakegrad_patch" not in sys.modules
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    import fakegrad_patch
    from fakegrad_patch._core.accumulate import ddp
    from fakegrad_patch._core.touchpoints import targets

    result: dict[str, Any] = {"scenario": scenario}
    if scenario == "startup":
        result["activated_by"] = hook.state["activated_by"]
    result["installed_first"] = fakegrad_patch.is_installed()
    assert targets.FSDP_STATE_MODULE not in sys.modules
    # looked up without importing anything: the worker must be the one that imports it
    source = os.path.join(
        os.path.dirname(torch.__file__), *targets.FSDP_STATE_MODULE.split(".")[1:]
    )
    if not torch.distributed.is_available() or not os.path.isfile(source + ".py"):
        print(json.dumps({"skip": f"no {targets.FSDP_STATE_MODULE} on torch {torch.__version__}"}))
        return
    if scenario == "install":
        fakegrad_patch.uninstall()

    hold = HoldImport(targets.FSDP_STATE_MODULE)
    hold.place()
    errors: list[str] = []
    # the first FakeTensorMode imports torch._dynamo.config, which imports FSDP2 (2.13, 2.14);
    # a build where it does not: the worker imports it next
    worker = run(
        lambda: (
            FakeTensorMode(allow_non_fake_inputs=True),
            importlib.import_module(targets.FSDP_STATE_MODULE),
        ),
        errors,
    )
    if not hold.entered.wait(BLOCKED_S):
        fail("the worker never reached the FSDP2 import")
    threads = [worker]
    if scenario == "install":
        caller = run(fakegrad_patch.install, errors)
    elif scenario == "uninstall":
        fakegrad_patch.uninstall()
        caller = run(fakegrad_patch.install, errors)
    else:
        caller = run(lambda: (fakegrad_patch.uninstall(), fakegrad_patch.install()), errors)
    threads.append(caller)
    result["caller"] = settle(caller)
    if scenario == "uninstall":
        remover = run(fakegrad_patch.uninstall, errors)
        threads.append(remover)
        result["remover"] = settle(remover, any_wait=True)
    hold.release.set()
    deadline = time.monotonic() + FINISH_S
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    if any(t.is_alive() for t in threads):
        fail(f"threads still running {FINISH_S:.0f} s after the import was let go: {result}")
    result["errors"] = errors
    result["installed"] = fakegrad_patch.is_installed()
    result["ddp"] = ddp.status()
    import wrapt

    fsdp_state = sys.modules[targets.FSDP_STATE_MODULE].FSDPState
    result["fsdp_wrapped"] = isinstance(fsdp_state.__dict__["_pre_forward"], wrapt.FunctionWrapper)
    # the patch works (or, uninstalled, torch's own) after the race
    lin = torch.nn.Linear(3, 2)
    import torch._functorch.config as functorch_config

    with (
        functorch_config.patch(fake_tensor_propagate_real_tensors=True),
        FakeTensorMode(allow_non_fake_inputs=True),
    ):
        lin(torch.randn(4, 3)).sum().backward()
    result["grad"] = type(lin.weight.grad).__name__
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
