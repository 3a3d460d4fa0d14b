"""Per-leaf bookkeeping shared by every path: names, write locks, managed real gradients.

* **Names** (:func:`name_parameters`): qualified parameter names for trace events and messages.
* **Write locks** (:func:`leaf_lock`): every read-modify-write of a real leaf's ``.grad`` by the
  patch (set, accumulate, sparse, the zeros/drop policies, mirroring, retained non-leaves) holds
  the leaf's own lock, as ``AccumulateGrad::apply`` holds its node's mutex: concurrent backward
  passes into one leaf never lose an update, and unrelated leaves never wait for each other.
* **Managed gradients** (:func:`note_grad`, :func:`managed_grad`): the real gradients the patch
  wrote or saw on a leaf it handled. When such a gradient is converted by a propagating mode
  (``zero_grad(set_to_none=False)``, ``clip_grad_norm_`` inside the mode), the fake's propagated
  values are the real gradient itself (convert/values.py), so in-place changes reach it as in
  eager mode.

Every registry here is a :class:`~fakegrad_patch._core.weak.WeakIdTable`: O(1) per operation at any
size, never keeping a tensor alive.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable
from typing import Any

import torch

from ..weak import WeakIdTable

#: Guards the registries below while they are written: table operations only, never an import
#: or a call out. Not a leaf's write lock (:func:`leaf_lock`).
_lock = threading.Lock()
#: leaf -> its write lock (made on first need)
_locks: WeakIdTable[threading.RLock] = WeakIdTable()
#: leaf -> name given by name_parameters()
_names: WeakIdTable[str] = WeakIdTable()
#: real grad -> weak reference to the leaf it was written to or seen on
_grads: WeakIdTable[Any] = WeakIdTable()


def leaf_lock(leaf: torch.Tensor) -> Any:
    """The lock that guards ``leaf.grad`` against concurrent writes by the patch."""
    lock = _locks.get(leaf)
    if lock is None:
        with _lock:
            lock = _locks.get(leaf)
            if lock is None:
                lock = threading.RLock()
                _locks.set(leaf, lock)
    return lock


def note_grad(leaf: torch.Tensor) -> None:
    """Remember ``leaf.grad`` when it is a real strided tensor (after a copy or an accumulation
    the patch made)."""
    note_grads((leaf,))


def note_grads(leaves: Iterable[torch.Tensor]) -> None:
    """:func:`note_grad` for each of ``leaves`` (arming: one call per armed backward, not one per
    leaf). Usually the gradient is noted already: a read, no write."""
    tensor, strided, ref = torch.Tensor, torch.strided, weakref.ref
    for leaf in leaves:
        grad = leaf.grad
        if grad is None or type(grad) is not tensor or grad.layout != strided:
            continue
        noted = _grads.get(grad)
        if noted is None or noted() is not leaf:
            _grads.set(grad, ref(leaf))


def note_written(leaf: torch.Tensor, grad: torch.Tensor) -> None:
    """:func:`note_grad` for a plain strided ``grad`` just written to ``leaf`` (the zero-copy set
    path): no re-read of ``.grad``, one table operation. (:func:`note_grads` reads first because
    arming calls it every backward on grads that are usually noted already: a read, no write.)"""
    _grads.set(grad, weakref.ref(leaf))


def managed_grad(t: torch.Tensor) -> bool:
    """Is ``t`` (still) the real ``.grad`` of a leaf the patch knows?"""
    ref = _grads.get(t)
    leaf = None if ref is None else ref()
    return leaf is not None and leaf.grad is t


def has_managed_grads() -> bool:
    return len(_grads) > 0


def name_parameters(module: torch.nn.Module, prefix: str = "") -> int:
    """Give every parameter of ``module`` its qualified name in trace events and messages (its
    buffers too: write-back events name them).

    Weakly held: naming never keeps a tensor alive. Returns how many parameters were named.
    """
    # the module's own code runs first, then the lock is taken only to record
    params = list(module.named_parameters(prefix=prefix.rstrip(".")))
    buffers = list(module.named_buffers(prefix=prefix.rstrip(".")))
    with _lock:
        for name, tensor in (*params, *buffers):
            _names.set(tensor, name)
    return len(params)


def name_of(leaf: torch.Tensor) -> str | None:
    return _names.get(leaf)


#: str() of dtypes and devices, cached: formatting them is most of what describing a leaf costs
_dtype_names: dict[torch.dtype, str] = {}
_device_names: dict[torch.device, str] = {}


def leaf_fields(leaf: torch.Tensor) -> dict[str, Any]:
    """How trace events describe a real leaf: id, registered name, shape, dtype, device."""
    dtype, device = leaf.dtype, leaf.device
    dtype_name = _dtype_names.get(dtype)
    if dtype_name is None:
        dtype_name = _dtype_names[dtype] = str(dtype).removeprefix("torch.")
    device_name = _device_names.get(device)
    if device_name is None:
        device_name = _device_names[device] = str(device)
    return {
        "leaf_id": id(leaf),
        "name": _names.get(leaf) if len(_names) else None,
        "shape": list(leaf.shape),
        "dtype": dtype_name,
        "device": device_name,
    }
