"""No lock of the dispatcher is held across an import (issue 40's rule: "never an import or a call
that may import while holding a lock of ours"). ``Dispatcher.observe`` builds its sites under its
lock; whatever may import (resolving a target, ``torch.amp``'s GradScaler, ``TensorBase``'s
``retain_grad``, ``Tensor.data``'s descriptor) is found before the lock is taken. An import under
a lock of ours is a deadlock waiting for a thread that holds the module's import lock and waits
for ours (tests/test_lock_order.py has the real ones)."""

from __future__ import annotations

import builtins
import importlib
import threading
import traceback
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import fakegrad_patch
from fakegrad_patch._core.install import current


class _Recording:
    """A lock that records which thread holds it."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._lock = threading.Lock()
        self.owner: int | None = None

    def acquire(self, *args: Any, **kwargs: Any) -> bool:
        got = self._lock.acquire(*args, **kwargs)
        if got:
            self.owner = threading.get_ident()
        return got

    def release(self) -> None:
        self.owner = None
        self._lock.release()

    def locked(self) -> bool:
        return self._lock.locked()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()


@pytest.fixture
def dispatcher_locks(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The installed dispatcher's locks (its own, write-back's aliases', the state objects')
    replaced by recording ones; every import (``import`` statements and ``import_module``) made
    while one is held is listed."""
    fakegrad_patch.uninstall()
    fakegrad_patch.install()  # a fresh installation: its dispatcher builds its sites at first need
    applied = current()
    assert applied is not None
    dispatcher = applied.dispatch
    owners = {
        "Dispatcher": dispatcher,
        "Aliases": dispatcher.aliases,
        "BornInside": dispatcher.born_inside,
    }
    locks = []
    for name, owner in owners.items():
        lock = _Recording(name)
        monkeypatch.setattr(owner, "_lock", lock)
        locks.append(lock)
    found: list[str] = []
    me = threading.get_ident()

    def check(name: str) -> None:
        held = [lock.name for lock in locks if lock.owner == me]
        if held:
            where = "".join(traceback.format_stack(limit=5)[:-2])
            found.append(f"import {name} under {held}:\n{where}")

    real_import, real_import_module = builtins.__import__, importlib.import_module

    def recording_import(name: str, *args: Any, **kwargs: Any) -> Any:
        check(name)
        return real_import(name, *args, **kwargs)

    def recording_import_module(name: str, package: str | None = None) -> Any:
        check(name)
        return real_import_module(name, package)

    monkeypatch.setattr(builtins, "__import__", recording_import)
    monkeypatch.setattr(importlib, "import_module", recording_import_module)
    try:
        yield found
    finally:
        monkeypatch.undo()
        fakegrad_patch.install()


def test_the_sites_are_built_without_an_import_under_the_lock(
    dispatcher_locks: list[str], propagate: None
) -> None:
    """From scratch (a fresh installation), a propagating mode makes the dispatcher build and
    start its sites; write-back on and off follows."""
    applied = current()
    assert applied is not None
    assert not applied.dispatch.observing
    leaf = torch.nn.Parameter(torch.ones(3))
    with (
        fakegrad_patch.patched(buffers="write_back"),
        FakeTensorMode(allow_non_fake_inputs=True),
    ):
        (leaf * 2).sum().backward()
    assert applied.dispatch.observing  # the sites were built (the check above ran)
    assert leaf.grad is not None and torch.equal(leaf.grad, torch.full((3,), 2.0))
    assert dispatcher_locks == [], "\n".join(dispatcher_locks)
