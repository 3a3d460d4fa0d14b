"""torch.compile with the patch installed vs not (issue 17): P9, the first step (compile time),
and P10, 20 compiled steady steps, for the ``aot_eager`` and ``inductor`` backends.

A tiny training step (Linear(16, 32), ReLU, Linear(32, 4), batch 8, cross-entropy, backward,
SGD): ``torch.compile(model, backend=...)`` compiles the forward and AOTAutograd's backward;
``backward()`` and the SGD step run eagerly, as most training loops do. No user fake mode
anywhere: whatever the patch costs here it costs PyTorch's own fake-tensor machinery (dynamo
fakifies every parameter, AOTAutograd traces the joint graph with fakes). Goal <= 1.01 for both.

* **P9, first step.** Each round starts from a fresh compile state: the untimed setup calls
  ``torch._dynamo.reset()`` and wraps the model again; the timed round is the first training
  step (dynamo, AOTAutograd, the backend compile, then the step). The FX graph cache and
  AOTAutograd's cache are off for the case (else every round after the first would be a cache
  hit); the backend's compiled-kernel cache is left on and warmed by block 0's warm-up round
  (C++ compiler time is the same for identical kernels, and not the patch's). The variants
  alternate round by round as in every case (U P, P U, ...), in one process.
* **P10, steady steps.** Each slot compiles once (untimed, fresh state as above, plus one more
  untimed step) then times rounds of 20 compiled steps.

``extra_info`` keeps what would explain a ratio: graphs compiled and graph breaks (dynamo's
counters, when this torch has them) and the leaves the patch still has armed after the step
(``fakegrad_patch.status()["armed_leaves"]``; issue 17's goal: 0).

Skips with the reason when this torch/Python cannot run dynamo, when ``inductor`` has no C++
compiler (CPU) or no Triton (CUDA).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import fakegrad_patch
from benchmarks import _support

BACKENDS = ["aot_eager", "inductor"]
STEADY_STEPS = 20


def unsupported(backend: str, device: str) -> str | None:
    """Why this build cannot compile ``backend`` on ``device`` here, or None."""
    dynamo = getattr(torch, "_dynamo", None)
    is_supported = getattr(dynamo, "is_dynamo_supported", None)
    if dynamo is None or (is_supported is not None and not is_supported()):
        return f"torch.compile is not supported by torch {torch.__version__} on this Python"
    if backend == "inductor":
        if device == "cpu":
            compilers = [os.environ.get("CXX", ""), "g++", "c++", "clang++"]
            if not any(c and shutil.which(c) for c in compilers):
                return "inductor on CPU needs a C++ compiler (none found: g++, c++, clang++)"
        elif importlib.util.find_spec("triton") is None:
            return "inductor on CUDA needs Triton (not installed)"
    return None


@contextlib.contextmanager
def no_graph_caches() -> Iterator[None]:
    """FX graph cache and AOTAutograd cache off (the configs this build has), restored on exit."""
    with contextlib.ExitStack() as stack:
        import torch._functorch.config as functorch_config
        import torch._inductor.config as inductor_config

        for module, name in (
            (inductor_config, "fx_graph_cache"),
            (inductor_config, "fx_graph_remote_cache"),
            (functorch_config, "enable_autograd_cache"),
            (functorch_config, "enable_remote_autograd_cache"),
        ):
            if hasattr(module, name):
                stack.enter_context(module.patch(name, False))
        yield


def dynamo_counts() -> dict[str, int]:
    """Graphs compiled and graph breaks so far in this process (dynamo's private counters, which
    ``reset()`` does not clear; empty when this build does not have them)."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return {}
    return {
        "graphs": int(counters["stats"].get("unique_graphs", 0)),
        "graph_breaks": int(sum(counters["graph_break"].values())),
    }


def _build(device: str) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)
    ).to(device)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(8, 16, generator=gen).to(device)
    y = torch.randint(0, 4, (8,), generator=gen).to(device)
    return model, x, y, torch.optim.SGD(model.parameters(), lr=1e-3)


def _step(compiled: Any, x: torch.Tensor, y: torch.Tensor, opt: Any) -> None:
    opt.zero_grad(set_to_none=True)
    F.cross_entropy(compiled(x), y).backward()
    opt.step()


def _since(before: dict[str, int]) -> dict[str, int]:
    """Graphs compiled and graph breaks since the snapshot ``before``."""
    now = dynamo_counts()
    return {k: v - before.get(k, 0) for k, v in now.items()}


def _check(model: torch.nn.Module, slot: _support.Slot, compiled: dict[str, int]) -> dict[str, Any]:
    """The variant is what it claims; what one compile did and the step left behind."""
    assert fakegrad_patch.is_installed() is (slot.variant == "patched")
    assert _support.grads_are_real(model)  # a compiled real step: real grads either way
    return {**compiled, "armed_leaves_after": fakegrad_patch.status().get("armed_leaves")}


@pytest.mark.paired("unpatched", "patched")
@pytest.mark.parametrize("backend", BACKENDS)
def test_p9_compile_first_step(benchmark, device: str, backend: str, slot: _support.Slot) -> None:
    reason = unsupported(backend, device)
    if reason:
        pytest.skip(reason)
    model, x, y, opt = _support.cached(("P9", backend, device), lambda: _build(device))
    _support.use_patch(slot.variant == "patched")
    holder: dict[str, Any] = {}

    def fresh() -> None:
        torch._dynamo.reset()
        holder["compiled"] = torch.compile(model, backend=backend)
        holder["before"] = dynamo_counts()

    def first_step() -> None:
        _step(holder["compiled"], x, y, opt)

    with no_graph_caches():
        _support.record(
            benchmark,
            slot,
            case="P9",
            device=device,
            detail=f"torch.compile first step, {backend}",
            goal=1.01,
            target=first_step,
            setup=fresh,
            rounds=3,
        )
        # what the last round's compile did
        benchmark.extra_info.update(_check(model, slot, _since(holder["before"])))
    torch._dynamo.reset()


@pytest.mark.paired("unpatched", "patched")
@pytest.mark.parametrize("backend", BACKENDS)
def test_p10_compiled_steady_steps(
    benchmark, device: str, backend: str, slot: _support.Slot
) -> None:
    reason = unsupported(backend, device)
    if reason:
        pytest.skip(reason)
    model, x, y, opt = _support.cached(("P10", backend, device), lambda: _build(device))
    _support.use_patch(slot.variant == "patched")
    with no_graph_caches():
        torch._dynamo.reset()
        before = dynamo_counts()
        compiled = torch.compile(model, backend=backend)
        _step(compiled, x, y, opt)  # compile (untimed)
        _step(compiled, x, y, opt)
        counts = dynamo_counts()
        compile_counts = _since(before)

        def steps() -> None:
            for _ in range(STEADY_STEPS):
                _step(compiled, x, y, opt)

        _support.record(
            benchmark,
            slot,
            case="P10",
            device=device,
            detail=f"torch.compile {STEADY_STEPS} steady steps, {backend}",
            goal=1.01,
            target=steps,
            rounds=5,
            extra={"steps_per_round": STEADY_STEPS},
        )
        check = _check(model, slot, compile_counts)
        # No recompilation during the timed steps (else this would be compile time again).
        assert dynamo_counts().get("graphs") == counts.get("graphs"), (counts, dynamo_counts())
        benchmark.extra_info.update(check)
    torch._dynamo.reset()


#: Run in a fresh interpreter: the first training step, timed inside the process (after the
#: imports), and what the variant claims. argv: backend, "patched" / "unpatched".
FRESH_SCRIPT = """
import json, sys, time
backend, variant = sys.argv[1], sys.argv[2]
start = time.perf_counter()
if variant == "patched":
    import fakegrad_patch  # first, as a user who switches the patch on for a process would
import torch
import torch.nn.functional as F
torch.set_num_threads(1)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
gen = torch.Generator().manual_seed(5)
x = torch.randn(8, 16, generator=gen)
y = torch.randint(0, 4, (8,), generator=gen)
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
imported = time.perf_counter()
compiled = torch.compile(model, backend=backend)
opt.zero_grad(set_to_none=True)
F.cross_entropy(compiled(x), y).backward()
opt.step()
done = time.perf_counter()
installed = "fakegrad_patch" in sys.modules and sys.modules["fakegrad_patch"].is_installed()
real = all(type(p.grad) is torch.Tensor for p in model.parameters())
print(json.dumps({"first_step_s": done - imported, "import_s": imported - start,
                  "installed": installed, "grads_real": real}))
"""


def _fresh_env() -> dict[str, str]:
    """This environment without FAKEGRAD_* (the unpatched side must not be activated by the
    start-up hook) and with the inductor/AOTAutograd graph caches off, as in P9."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FAKEGRAD_")}
    env.update(TORCHINDUCTOR_FX_GRAPH_CACHE="0", TORCHINDUCTOR_AUTOGRAD_CACHE="0")
    return env


@pytest.mark.paired("unpatched", "patched", max_blocks=2)  # a process per round: seconds each
@pytest.mark.parametrize("backend", BACKENDS)
def test_p9_compile_first_step_fresh_process(
    benchmark, device: str, backend: str, slot: _support.Slot
) -> None:
    """P9 in a fresh interpreter per round: ``import fakegrad_patch`` (patched) or not, then
    torch, then the first compiled training step. The ratio uses the first step's time measured
    inside the process (``extra_info["inner_seconds"]``; the benchmark's own stats are whole
    processes, imports included). Unlike the in-process P9, whatever the patch does on first need
    falls inside this step. Under ``--bench-smoke`` only ``aot_eager`` runs."""
    if device != "cpu":
        pytest.skip("the fresh-process row runs on CPU only")
    reason = unsupported(backend, device)
    if reason:
        pytest.skip(reason)
    if _support.SMOKE and backend != "aot_eager":
        pytest.skip("--bench-smoke: the fresh-process row runs aot_eager only")
    inner: list[float] = []
    claims: list[dict[str, Any]] = []

    def one_process() -> None:
        run = subprocess.run(
            [sys.executable, "-c", FRESH_SCRIPT, backend, slot.variant],
            env=_fresh_env(),
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        assert run.returncode == 0, run.stderr[-3000:]
        result = json.loads(run.stdout.strip().splitlines()[-1])
        inner.append(result["first_step_s"])
        claims.append(result)

    _support.record(
        benchmark,
        slot,
        case="P9",
        device=device,
        detail=f"torch.compile first step in a fresh process, {backend}",
        goal=1.01,
        target=one_process,
        rounds=1,
        warmup_rounds=0,
        extra={"fresh_process": True},
    )
    benchmark.extra_info["inner_seconds"] = inner
    benchmark.extra_info["import_seconds"] = [c["import_s"] for c in claims]
    for claim in claims:
        assert claim["installed"] is (slot.variant == "patched"), claim
        assert claim["grads_real"], claim
