"""DDP (gloo, 2 processes on 127.0.0.1, CPU) against eager DDP (docs/compatibility.md,
"Distributed"); the same matrix with NCCL, world size 1 on one GPU (issue 38: marked ``cuda``).

* Forward and backward inside a propagating fake mode (fakegrad_patch/_core/ddp.py): every DDP
  configuration of the matrix gives, on each rank and at every step, the parameters' ``.grad`` of
  an eager DDP replica fed the same data. Losses are rank-dependent (different data, loss scaled
  by ``rank + 1``), and each rank also checks that the reduced gradient differs from its own
  un-reduced one, so a gradient that was never allreduced cannot pass (gloo; with NCCL on one
  GPU the world has one rank, whose reduced gradient is its own).
* The older workaround, forward inside the mode and backward after leaving it.
* Upstream (patch uninstalled) on the same programs.

One pair of fresh interpreters runs the whole matrix (a module-scoped fixture), so the file costs
a few process pairs, not one per configuration. Every pair runs under a timeout on a free port;
the workers tear down in an order that cannot abort (see ``TEARDOWN``).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from typing import Any

import pytest
import torch.distributed as dist

#: Set by tests/test_can_fail.py (see conftest.py): the workers then run with the patch
#: uninstalled, and every test of the patched behaviour must fail.
UNPATCHED = os.environ.get("FAKEGRAD_TEST_UNPATCHED") == "1"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="no gloo"),
]

#: How every worker ends. A rank that reaches interpreter exit with a live ProcessGroupGloo (held
#: by the Reducer of a DDP module still referenced from module globals: destroy_process_group()
#: only drops the registry's reference) destroys it during finalization, where gloo's threads and
#: the interpreter's teardown race: ``terminate called without an active exception`` (SIGABRT)
#: under load. So: a barrier (no rank leaves while its peer still communicates), every DDP module
#: and optimizer dropped and collected while the interpreter is whole, the group destroyed (its
#: threads joined), output flushed, and ``os._exit`` (no finalization left to race).
TEARDOWN = r"""
def _teardown(result):
    import gc, sys
    print(json.dumps(result))
    dist.barrier()
    held = (torch.nn.Module, torch.optim.Optimizer, dict)
    for name in [n for n, v in globals().items() if isinstance(v, held) and n[:2] != "__"]:
        del globals()[name]
    gc.collect()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
"""

PRELUDE = (
    r"""
import contextlib, datetime, json, os, sys
import torch, torch.distributed as dist
import torch._functorch.config as functorch_config
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.nn.parallel import DistributedDataParallel as DDP

import fakegrad_patch
if os.environ["PATCHED"] != "1":
    fakegrad_patch.uninstall()
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
BACKEND = os.environ.get("BACKEND", "gloo")
DEVICE = torch.device("cuda", rank) if BACKEND == "nccl" else torch.device("cpu")
if DEVICE.type == "cuda":
    torch.cuda.set_device(DEVICE)
dist.init_process_group(
    BACKEND, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60)
)
functorch_config.fake_tensor_propagate_real_tensors = True
"""
    + TEARDOWN
)

#: The configuration matrix: forward and backward both inside a fresh propagating mode each step
#: (``one_mode``: one mode for every step), an SGD step after each synced step, ``zero_grad``
#: alternating between set_to_none True and False.
MATRIX_WORKER = (
    PRELUDE
    + r"""
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
STEPS = 3

def make(cfg):
    cfg = cfg.removeprefix("after_")
    torch.manual_seed(0)
    layers = [torch.nn.Linear(8, 16)]
    if cfg == "batchnorm":
        layers.append(torch.nn.BatchNorm1d(16))
    layers += [torch.nn.Tanh(), torch.nn.Linear(16, 4)]
    m = torch.nn.Sequential(*layers)
    if cfg == "find_unused":
        m.unused = torch.nn.Linear(4, 4)  # never called: DDP marks it ready itself
    return m.to(DEVICE)

def ddp(m, **kw):
    # on CUDA as DDP is used there: one device per process, named in device_ids
    return DDP(m, device_ids=[DEVICE.index] if DEVICE.type == "cuda" else None, **kw)

def wrap(cfg, m):
    cfg = cfg.removeprefix("after_")
    kw = {
        "bucket_view": {"gradient_as_bucket_view": True},
        "static_graph": {"static_graph": True},
        "find_unused": {"find_unused_parameters": True},
        "many_buckets": {"bucket_cap_mb": 0.0001},  # one bucket per parameter
        "batchnorm": {"broadcast_buffers": True},
    }.get(cfg, {})
    d = ddp(m, **kw)
    if cfg == "comm_hook":
        d.register_comm_hook(None, default_hooks.allreduce_hook)  # a Python comm hook
    return d

def verdict(model, ref):
    kinds = set()
    for p, r in zip(model.parameters(), ref.parameters()):
        if isinstance(p.grad, FakeTensor):
            kinds.add("FakeTensor")
        elif p.grad is None and r.grad is None:
            continue
        elif p.grad is None:
            kinds.add("None")
        elif not (torch.allclose(p.grad, r.grad, atol=1e-6) and torch.allclose(p, r, atol=1e-6)):
            kinds.add("!= eager")
        else:
            kinds.add("== eager DDP")
    return ", ".join(sorted(kinds))

def data(step):
    torch.manual_seed(100 + 10 * step + rank)  # different data on each rank
    return torch.randn(6, 8).to(DEVICE)

def loss_of(m, x):
    return m(x).square().sum() * float(rank + 1)  # rank-dependent loss

def differs(ref, local):
    pairs = zip(ref.parameters(), local.parameters())
    return any(not torch.allclose(r.grad, l.grad) for r, l in pairs if r.grad is not None)

def run(cfg):
    if cfg == "join":
        return run_join()
    if cfg == "fsdp2":
        return run_fsdp2()
    model, ref, local = wrap(cfg, make(cfg)), wrap(cfg, make(cfg)), make(cfg)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref)]
    one_mode = FakeTensorMode(allow_non_fake_inputs=True) if cfg == "one_mode" else None
    after = cfg.startswith("after_")  # the older workaround: backward after leaving the mode
    steps, reduced = [], False
    for step in range(STEPS):
        x = data(step)
        skip_sync = cfg == "no_sync" and step < STEPS - 1  # two local steps, then a synced one
        try:
            with (model.no_sync() if skip_sync else contextlib.nullcontext()):
                with one_mode or FakeTensorMode(allow_non_fake_inputs=True):
                    loss = loss_of(model, x)
                    if not after:
                        loss.backward()
                if after:
                    loss.backward()
                del loss
        except Exception as exc:
            steps.append(f"raises {type(exc).__name__}: {str(exc).splitlines()[0][:100]}")
            break
        with (ref.no_sync() if skip_sync else contextlib.nullcontext()):
            loss_of(ref, x).backward()
        loss_of(local, x).backward()
        if skip_sync:
            continue
        steps.append(verdict(model, ref))
        reduced = reduced or differs(ref, local)
        if steps[-1] != "== eager DDP":
            break  # upstream: no optimizer step on fake gradients
        for o in opts:
            o.step()
        for m in (model, ref, local):
            m.zero_grad(set_to_none=step % 2 == 0)
        with torch.no_grad():
            for l, r in zip(local.parameters(), ref.parameters()):
                l.copy_(r)
    return {"steps": steps, "reduced": reduced}

def run_fsdp2():
    # FSDP2: the same checks on the local shards of the DTensor gradients and parameters
    try:
        from torch.distributed.fsdp import fully_shard  # imported after the patch: lazy wrapping
    except ImportError as exc:  # FSDP2 is not public on this build (2.4)
        return {"skip": f"no torch.distributed.fsdp.fully_shard: {exc}"}
    from torch.distributed.device_mesh import init_device_mesh

    # the mesh on this test's device (fully_shard's default is the accelerator whenever the
    # machine has one, which gloo cannot serve)
    mesh = init_device_mesh(DEVICE.type, (world,))

    def sharded():
        m = make("fsdp2")
        fully_shard(m[0], mesh=mesh)
        fully_shard(m[2], mesh=mesh)
        return fully_shard(m, mesh=mesh)

    model, ref, local = sharded(), sharded(), make("fsdp2")
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref)]
    steps, reduced = [], False
    for step in range(STEPS):
        x = data(step)
        try:
            with FakeTensorMode(allow_non_fake_inputs=True):
                loss_of(model, x).backward()
        except Exception as exc:
            steps.append(f"raises {type(exc).__name__}: {str(exc).splitlines()[0][:100]}")
            break
        loss_of(ref, x).backward()
        loss_of(local, x).backward()
        kinds = set()
        for p, r in zip(model.parameters(), ref.parameters()):
            g = None if p.grad is None else p.grad.to_local()
            if isinstance(g, FakeTensor):
                kinds.add("FakeTensor")
            elif g is None:
                kinds.add("None")
            else:
                same = torch.allclose(g, r.grad.to_local(), atol=1e-6)
                same = same and torch.allclose(p.to_local(), r.to_local(), atol=1e-6)
                kinds.add("== eager DDP" if same else "!= eager")
        steps.append(", ".join(sorted(kinds)))
        full = [r.grad.full_tensor() for r in ref.parameters()]  # a collective, on both ranks
        reduced = reduced or any(not torch.allclose(f, l.grad) for f, l in
                                 zip(full, local.parameters()))
        if steps[-1] != "== eager DDP":
            break
        for o in opts:
            o.step()
        for m in (model, ref, local):
            m.zero_grad()
        with torch.no_grad():
            for l, r in zip(local.parameters(), ref.parameters()):
                l.copy_(r.full_tensor())
    return {"steps": steps, "reduced": reduced}

def run_join():
    # Uneven inputs: rank 0 has 2 batches, rank 1 has 3; DDP's join context shadows the
    # collectives of the rank that ran out. Gradients recorded per step, fake run then eager run.
    def train(m, fake):
        grads = []
        with m.join():
            for step in range(2 + rank):
                x = data(step)
                mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else None
                with mode or contextlib.nullcontext():
                    loss_of(m, x).backward()
                grads.append([None if p.grad is None else p.grad.clone() for p in m.parameters()])
                m.zero_grad()
        return grads
    model, ref = ddp(make("join")), ddp(make("join"))
    try:
        got = train(model, True)
    except Exception as exc:
        return {"steps": [f"raises {type(exc).__name__}: {str(exc).splitlines()[0][:100]}"]}
    want = train(ref, False)
    steps = []
    for g, w in zip(got, want):
        if any(isinstance(t, FakeTensor) for t in g):
            steps.append("FakeTensor")
        elif any(t is None for t in g):
            steps.append("None")
        else:
            same = all(torch.allclose(a, b, atol=1e-6) for a, b in zip(g, w))
            steps.append("== eager DDP" if same else "!= eager")
    # rank 1's last step was reduced with a joined rank 0: its gradient is halved, not local
    return {"steps": steps, "reduced": True}

out = {}
for cfg in os.environ["CONFIGS"].split(","):
    try:
        out[cfg] = run(cfg)
    except Exception as exc:
        out[cfg] = {"steps": [f"setup raises {type(exc).__name__}: {str(exc)[:200]}"]}
    dist.barrier()
_teardown(out)
"""
)

#: P1 under DDP: real DDP training steps of a model that had one fake session (forward and
#: backward in the mode, or SESSION=after: backward after it) vs a model never touched by fakes,
#: same process, interleaved, medians of 20 steps per repetition; CONTROL=1 skips the fake
#: session (the A/A noise floor).
P1_WORKER = (
    PRELUDE
    + r"""
import gc, statistics, time
torch.set_num_threads(1)

def make():
    torch.manual_seed(0)
    layers = []
    for _ in range(25):
        layers += [torch.nn.Linear(32, 32), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers)  # 50 parameter tensors

touched = DDP(make(), find_unused_parameters=True)
fresh = DDP(make(), find_unused_parameters=True)
x = torch.randn(16, 32)
if os.environ.get("CONTROL") != "1":
    with FakeTensorMode(allow_non_fake_inputs=True):
        loss = touched(x).sum()
        if os.environ.get("SESSION") != "after":
            loss.backward()
    if os.environ.get("SESSION") == "after":
        loss.backward()
    del loss
gc.collect()
armed = fakegrad_patch.status()["armed_leaves"]
opts = {m: torch.optim.SGD(m.parameters(), lr=1e-3) for m in (touched, fresh)}

def step(m):
    opts[m].zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    m(x).sum().backward()
    opts[m].step()
    return time.perf_counter() - t0

for _ in range(20):
    step(touched), step(fresh)
ratios = []
for rep in range(15):
    a, b = [], []
    for i in range(20):
        order = (touched, fresh) if i % 2 else (fresh, touched)
        for m in order:
            (a if m is touched else b).append(step(m))
    ratios.append(statistics.median(a) / statistics.median(b))
_teardown({"rank": rank, "armed_after_fake_session": armed,
           "ratio_median": round(statistics.median(ratios), 3)})
"""
)

#: Every configuration of the matrix (docs/compatibility.md, "Distributed", the table), a plain
#: test on every build (BatchNorm with ``broadcast_buffers`` was an xfail on 2.4.0, its third
#: synced step off eager DDP's; it has passed there since issue 44's fixes, every run).
CONFIGS = (
    "default",
    "bucket_view",
    "static_graph",
    "find_unused",
    "many_buckets",
    "no_sync",
    "batchnorm",
    "comm_hook",
    "one_mode",
    "join",
    "after_default",
    "after_find_unused",
    "fsdp2",
)


#: Synced steps each configuration reports (no_sync: two local steps, then one synced; join:
#: rank 0 has two batches, rank 1 three).
SYNCED = {"no_sync": [1, 1], "join": [2, 3]}

TIMEOUT_S = 240


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run_ranks(code: str, world_size: int = 2, **extra: str) -> list[Any]:
    """Run ``code`` as ranks 0 ... ``world_size - 1`` of a group on 127.0.0.1 (gloo; ``BACKEND=
    "nccl"`` in ``extra`` for NCCL, rank r on GPU r); each rank's JSON line.

    A fresh free port per group: between ``_free_port`` closing its socket and rank 0's store
    binding it, another process may take it; rank 0 then fails to bind and the group is retried
    once on a new port (the only retry: any other failure is reported)."""
    for attempt in (0, 1):
        results, errors = _attempt(code, world_size, extra)
        if results is not None:
            return results
        if attempt == 0 and any("EADDRINUSE" in e or "address already in use" in e for e in errors):
            continue
        break
    raise AssertionError("\n---\n".join(errors))


def _attempt(
    code: str, world_size: int, extra: dict[str, str]
) -> tuple[list[Any] | None, list[str]]:
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("FAKEGRAD_")},
        "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),  # the same fakegrad_patch
        "PYTHONWARNINGS": "ignore",
        "PYTHONFAULTHANDLER": "1",  # a native crash prints the Python stacks of every thread
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "WORLD_SIZE": str(world_size),
        "GLOO_SOCKET_IFNAME": "lo",
        # NCCL's bootstrap on the loopback: one machine, which may have no other interface
        "NCCL_SOCKET_IFNAME": os.environ.get("NCCL_SOCKET_IFNAME", "lo"),
        "PATCHED": "0" if UNPATCHED else "1",
        **extra,
    }
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code],
            env={**env, "RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(world_size)
    ]
    results: list[Any] = []
    errors: list[str] = []
    try:
        for rank, proc in enumerate(procs):
            try:
                out, err = proc.communicate(timeout=TIMEOUT_S)
            except subprocess.TimeoutExpired:
                for p in procs:
                    p.kill()
                errors.append(f"rank {rank}: timed out after {TIMEOUT_S} s")
                continue
            if proc.returncode != 0:
                errors.append(f"rank {rank}: exit status {proc.returncode}\n{err[-3000:]}")
                continue
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    return (results if not errors else None), errors


@pytest.fixture(scope="module")
def matrix() -> list[dict[str, Any]]:
    """Both ranks' results for every configuration, one process pair for the whole matrix."""
    return _run_ranks(MATRIX_WORKER, CONFIGS=",".join(CONFIGS))


@pytest.mark.parametrize("config", CONFIGS)
def test_fake_forward_and_backward_inside_ddp_give_eager_ddp_grads(
    matrix: list[dict[str, Any]], config: str
) -> None:
    for rank, result in enumerate(matrix):
        if "skip" in result[config]:
            pytest.skip(result[config]["skip"])
        want = SYNCED.get(config, [3, 3])[rank]
        assert result[config]["steps"] == ["== eager DDP"] * want, (rank, result[config])
        assert result[config]["reduced"], "the reference gradient was not reduced"


@pytest.fixture(scope="module")
def nccl_matrix() -> dict[str, Any]:
    """The matrix with NCCL, one process for every configuration: world size 1 on GPU 0 (NCCL
    takes one GPU per rank, and refuses two ranks on one GPU)."""
    (result,) = _run_ranks(MATRIX_WORKER, world_size=1, BACKEND="nccl", CONFIGS=",".join(CONFIGS))
    return dict(result)


@pytest.mark.cuda
@pytest.mark.skipif(not dist.is_nccl_available(), reason="this torch build has no NCCL")
@pytest.mark.parametrize("config", CONFIGS)
def test_nccl_on_one_gpu_fake_forward_and_backward_give_eager_ddp_grads(
    nccl_matrix: dict[str, Any], config: str
) -> None:
    """The gloo matrix's CUDA twin (issue 38): the model, data and gradients on the GPU, DDP
    with ``device_ids``, FSDP2 on a CUDA mesh, NCCL collectives; every synced step's gradients
    and parameters equal eager DDP's. One rank: its reduced gradient is its own, so the gloo
    test's "was it reduced" check has nothing to see here."""
    result = nccl_matrix[config]
    if "skip" in result:
        pytest.skip(result["skip"])
    want = SYNCED.get(config, [3, 3])[0]
    assert result["steps"] == ["== eager DDP"] * want, result


def test_upstream_ddp_fails_inside_the_mode_and_leaves_fake_grads_after_it() -> None:
    """The same programs without the patch: inside the mode the allreduce is dispatched to the
    fake mode and rejected; backward after the mode leaves FakeTensors in ``.grad``."""
    for result in _run_ranks(MATRIX_WORKER, CONFIGS="default,after_find_unused", PATCHED="0"):
        (inside,) = result["default"]["steps"]
        # 2.13+: the mutation check; 2.4: the fake mode has no kernel for the collective
        assert inside.startswith(
            ("raises RuntimeError: c10d::allreduce_", "raises UnsupportedOperatorException: c10d")
        ), inside
        assert result["after_find_unused"]["steps"] == ["FakeTensor"]


if __name__ == "__main__":
    # P1 under DDP (docs/compatibility.md "Distributed"): python tests/test_distributed.py p1
    assert sys.argv[1:] == ["p1"], "usage: python tests/test_distributed.py p1"
    for session in ("inside", "after"):
        for control in ("1", "0", "1", "0"):
            for rank in _run_ranks(P1_WORKER, CONTROL=control, SESSION=session):
                print(f"session={session} control={control}", json.dumps(rank))
