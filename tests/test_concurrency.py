"""Issue 19.1: concurrent backward passes into one real leaf lose nothing (every write path).

Eager accumulation into a shared leaf is exact because ``AccumulateGrad::apply`` holds its
node's mutex; the patch's pre-hook writes before that lock, so it holds the leaf's own lock.

Two kinds of test. The *forced* ones make the interleaving certain instead of waiting for it:
inside the write (after ``.grad`` was read, before it is written; and inside the in-place add,
replaced for the target gradient by a read-modify-write that waits for the other thread), each
thread waits up to a short time for the others to arrive. Unlocked, they all arrive and one
update is lost, on every run; with the lock the others cannot enter, the wait times out and the
sum is exact. The *natural* ones (sparse, mirroring, zeros) only make the backward passes start
together at a barrier and repeat many rounds, comparing with the exact sum (integer-valued
floats: any lost element shows).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch
from _helpers import fake_mode, is_real

import fakegrad_patch

pytestmark = pytest.mark.usefixtures("propagate")

THREADS = 4
ROUNDS = 12


def _race(work: Callable[[int, Callable[[], None]], None], threads: int = THREADS) -> None:
    """Run ``work(i, start)`` in ``threads`` threads; each calls ``start()`` right before its
    backward, so the backward passes (not the forwards) run together. Re-raises the first
    error."""
    barrier = threading.Barrier(threads)
    errors: list[BaseException] = []

    def start() -> None:
        barrier.wait(30)

    def run(i: int) -> None:
        try:
            import torch._functorch.config as functorch_config

            with functorch_config.patch(fake_tensor_propagate_real_tensors=True):
                work(i, start)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)
            barrier.abort()

    pool = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join(120)
    assert not errors, errors


def _grad_input(i: int, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.full(shape, float(i + 1))


class _Rendezvous:
    """Each caller waits until ``parties`` callers are inside at once, or ``timeout`` seconds
    passed; ``met`` counts the callers that found the others inside."""

    def __init__(self, parties: int, timeout: float = 0.3) -> None:
        self.parties, self.timeout = parties, timeout
        self.cond = threading.Condition()
        self.inside = 0
        self.met = 0

    def meet(self) -> None:
        with self.cond:
            self.inside += 1
            self.cond.notify_all()
            if self.cond.wait_for(lambda: self.inside >= self.parties, self.timeout):
                self.met += 1
            self.inside -= 1

    def reset(self) -> None:
        self.inside = 0


@pytest.fixture
def forced(monkeypatch: pytest.MonkeyPatch) -> _Rendezvous:
    """Make concurrent writes to one ``.grad`` interleave inside the critical section: after
    the prior gradient was read (set path: before the adopt-or-copy decision) and inside the
    in-place add into a real prior (a read-modify-write that waits for the others)."""
    from fakegrad_patch._core.accumulate import hooks as _accumulate

    meet = _Rendezvous(2)
    can_adopt = _accumulate.Materializer._can_adopt
    fresh_copy = _accumulate._fresh_copy
    add_ = torch.Tensor.add_
    targets: set[int] = set()

    def slow_can_adopt(self: object, *args: object) -> bool:
        meet.meet()
        return can_adopt(self, *args)  # type: ignore[arg-type]

    def slow_fresh_copy(*args: object) -> torch.Tensor:
        meet.meet()
        return fresh_copy(*args)  # type: ignore[arg-type]

    def slow_add_(self: torch.Tensor, other: object, *args: object, **kwargs: object) -> object:
        if id(self) not in targets:
            return add_(self, other, *args, **kwargs)
        snapshot = self.clone()
        meet.meet()
        self.copy_(add_(snapshot, other, *args, **kwargs))
        return self

    monkeypatch.setattr(_accumulate.Materializer, "_can_adopt", slow_can_adopt)
    monkeypatch.setattr(_accumulate, "_fresh_copy", slow_fresh_copy)
    monkeypatch.setattr(torch.Tensor, "add_", slow_add_)
    meet.targets = targets  # type: ignore[attr-defined]
    return meet


@pytest.mark.parametrize("prior", ["none", "real"], ids=["set", "accumulate"])
def test_concurrent_writes_into_one_leaf_lose_no_update_forced(
    prior: str, forced: _Rendezvous
) -> None:
    w = torch.zeros(64, requires_grad=True)
    for _ in range(4):
        forced.reset()
        w.grad = torch.zeros(64) if prior == "real" else None
        if w.grad is not None:
            forced.targets.add(id(w.grad))  # type: ignore[attr-defined]

        def work(i: int, start: Callable[[], None]) -> None:
            with fake_mode():
                loss = (w * float(i + 1)).sum()
                start()
                loss.backward()

        _race(work, threads=2)
        assert is_real(w.grad)
        assert torch.equal(w.grad, torch.full((64,), 3.0)), w.grad
    assert forced.met == 0  # the lock kept the second writer out of the critical section


@pytest.mark.parametrize("prior", ["none", "real"], ids=["set", "accumulate"])
def test_concurrent_fake_backward_into_one_leaf_loses_no_update(prior: str) -> None:
    """The issue's repro, smaller: threads share one leaf, each with its own mode."""
    shape = (1024, 1024)
    w = torch.zeros(shape, requires_grad=True)
    for _ in range(ROUNDS):
        w.grad = torch.zeros(shape) if prior == "real" else None

        def work(i: int, start: Callable[[], None]) -> None:
            with fake_mode():
                loss = (w * _grad_input(i, shape)).sum()
                start()
                loss.backward()

        _race(work)
        assert is_real(w.grad)
        expected = float(sum(range(1, THREADS + 1)))
        lost = int((w.grad != expected).sum())
        assert lost == 0, f"{lost} of {w.grad.numel()} elements lost an update"


def test_concurrent_sparse_gradients_are_all_kept() -> None:
    emb = torch.nn.Embedding(64, 32, sparse=True)
    ids = torch.arange(64)
    for _ in range(ROUNDS):
        emb.weight.grad = None

        def work(i: int, start: Callable[[], None]) -> None:
            with fake_mode():
                loss = (emb(ids) * float(i + 1)).sum()
                start()
                loss.backward()

        _race(work)
        grad = emb.weight.grad
        assert is_real(grad)
        dense = grad.to_dense() if grad.is_sparse else grad
        assert torch.equal(dense, torch.full((64, 32), float(sum(range(1, THREADS + 1)))))


def test_concurrent_mirrored_gradients_reach_the_source_exactly() -> None:
    """mirror_to_sources: per-thread modes convert the same real source; every fake leaf's
    gradient is mirrored onto it under the source's lock."""
    shape = (1024, 1024)
    w = torch.zeros(shape, requires_grad=True)
    for _ in range(ROUNDS):
        w.grad = torch.zeros(shape)

        def work(i: int, start: Callable[[], None]) -> None:
            mode = fake_mode()
            with fakegrad_patch.mirror_to_sources(mode), mode:
                fw = mode.from_tensor(w)
                loss = (fw * _grad_input(i, shape)).sum()
                start()
                loss.backward()

        _race(work)
        assert is_real(w.grad)
        assert torch.equal(w.grad, torch.full(shape, float(sum(range(1, THREADS + 1)))))


@pytest.mark.usefixtures("quiet")
def test_concurrent_zeros_policy_keeps_the_prior_gradient() -> None:
    """Without values (a non-propagating mode) and ``on_missing="zeros"``: the prior real
    gradient is added to in place from every thread; it must end exactly as it started."""
    fakegrad_patch.configure(on_missing="zeros")
    shape = (1024, 1024)
    w = torch.zeros(shape, requires_grad=True)
    w.grad = torch.full(shape, 7.0)
    prior = w.grad

    def work(i: int, start: Callable[[], None]) -> None:
        import torch._functorch.config as functorch_config

        with functorch_config.patch(fake_tensor_propagate_real_tensors=False), fake_mode():
            loss = (w * 2).sum()
            start()
            loss.backward()

    for _ in range(ROUNDS):
        _race(work)
    assert w.grad is prior and torch.equal(w.grad, torch.full(shape, 7.0))


# -- issue 40: install()/uninstall() on one thread while others train -----------------------------


@pytest.mark.filterwarnings("ignore::fakegrad_patch.FakeGradPatchWarning")
def test_training_threads_while_another_thread_reinstalls_the_patch() -> None:
    """Three threads train (a fresh propagating mode per step) while a fourth re-installs the
    patch after every 12 steps (tests/_lock_order.py's ``stress``, 12 steps per thread here):
    nobody hangs or raises;
    every step that ran wholly installed gets exact real gradients, and they are the majority;
    the others get upstream's or none, never a wrong real one. The same across the first import
    of ``torch._dynamo``, in a fresh interpreter: tests/test_lock_order.py."""
    import _lock_order

    result = _lock_order.stress(steps=12)
    assert result["errors"] == [] and result["problems"] == [], result
    assert result["steps"] == 36 and result["toggles"] >= 2, result
    assert result["wholly_installed"] > result["steps"] // 2, result
    assert fakegrad_patch.is_installed()


@pytest.mark.parametrize("via", ["first need", "write-back on"])
def test_an_uninstalled_installation_never_wraps_again(via: str) -> None:
    """``uninstall()`` on one thread while another thread's mode construction or conversion has
    just passed its installation's ``active`` test (or turns write-back on through it): that
    thread then asks the old installation's dispatcher to watch ops (``observe()``). It must
    refuse: before, it built and started a new set of wrappers for the removed installation,
    which stayed for good, and every later installation found ``FakeTensorMode.dispatch`` (and
    its companions) "replaced by someone else" and stood aside (the entry's device answers, the
    write watch, the fallback repairs gone). Seen by chance in the suite, after the stress test
    above; here the interleaving is made by hand: the late call after ``uninstall()``."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fakegrad_patch._core.install import current

    fakegrad_patch.install()
    old = current()
    assert old is not None
    fakegrad_patch.uninstall()
    if via == "first need":  # FakeTensorMode.__init__'s and the converter's wrappers
        assert old.dispatch.observe() is False
    else:
        assert old.dispatch.write_back(True) is False
    assert not old.dispatch.observing
    fakegrad_patch.install()
    new = current()
    assert new is not None and new is not old
    p = torch.nn.Parameter(torch.ones(3))
    with fake_mode():
        (p * 2).sum().backward()
        assert new.dispatch.observing
        wrapper = new.dispatch._sites[0].wrapper
        assert FakeTensorMode.__dict__["dispatch"] is wrapper  # the installation in force's
    assert is_real(p.grad) and torch.equal(p.grad, torch.full((3,), 2.0))


@pytest.mark.parametrize("which", ["FakeTensorMode.dispatch", "torch.autograd.backward"])
def test_uninstall_returns_with_torch_own_functions_back(which: str) -> None:
    """``uninstall()`` while another thread applies a change to one of the patch's sites (a mode
    built or dead there: it holds the site's lock for a moment). Before, ``uninstall()`` handed
    the close over to that thread and returned with our wrapper still in place; an ``install()``
    right then took the old wrapper for torch's own function, wrapped it, and put it back for
    good at its own ``uninstall()``: two installations' wrappers stacked, a removed one's in the
    path of every later op or backward (seen in the re-install stress test: wrong real
    gradients, once in ~40 runs). Now ``uninstall()`` returns only with torch's own functions
    back, and the next installation wraps torch's own."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fakegrad_patch._core.install import current

    owner, attr = {
        "FakeTensorMode.dispatch": (FakeTensorMode, "dispatch"),
        "torch.autograd.backward": (torch.autograd, "backward"),
    }[which]
    fakegrad_patch.install()
    first = current()
    assert first is not None
    p = torch.nn.Parameter(torch.ones(3))
    mode = fake_mode()
    with mode:  # a live propagating mode: every site in place
        (p * 2).sum().backward()
    site = first.dispatch._sites[0] if attr == "dispatch" else first.backward_site
    torch_own = site.original
    assert owner.__dict__[attr] is site.wrapper
    held, go = threading.Event(), threading.Event()
    settle = site._settle

    def slow(quiet: bool) -> object:  # the other thread, inside the site's lock
        held.set()
        go.wait(10)
        return settle(quiet)

    site._settle = slow  # type: ignore[method-assign]
    changing = threading.Thread(target=site.changed)
    changing.start()
    assert held.wait(10)
    site._settle = settle  # type: ignore[method-assign]
    seen: list[object] = []

    def remove() -> None:
        fakegrad_patch.uninstall()
        seen.append(owner.__dict__.get(attr))  # what uninstall() left, as it returns
        fakegrad_patch.install()  # at once, as the stress test's toggling thread does

    removing = threading.Thread(target=remove)
    removing.start()
    removing.join(0.5)
    go.set()
    changing.join(10)
    removing.join(10)
    assert len(seen) == 1 and seen[0] is torch_own  # identity: a wrapt proxy == what it wraps
    second = current()
    assert second is not None and second is not first
    with mode:  # the second installation's wrappers, over torch's own
        p.grad = None
        (p * 3).sum().backward()
        new = second.dispatch._sites[0] if attr == "dispatch" else second.backward_site
        assert new.original is torch_own and owner.__dict__[attr] is new.wrapper
    assert is_real(p.grad) and torch.equal(p.grad, torch.full((3,), 3.0))
    del mode
    fakegrad_patch.uninstall()
    assert owner.__dict__[attr] is torch_own
    fakegrad_patch.install()
