"""The leaf registry: which real leaves are armed, and their human names.

Arming a leaf registers a pre-hook on its AccumulateGrad node (``Node.register_prehook``; the
node is found the way ``torch.autograd.graph.get_gradient_edge`` finds it, see _targets). Node
pre-hooks run after every tensor hook on the leaf, so they see exactly what AccumulateGrad is
about to accumulate.

Why this is nearly free once the fake computation is gone: a leaf only holds a *weak* reference to
its AccumulateGrad node; the graphs that use the leaf hold it strongly. We arm while the fake op
that uses the leaf is being dispatched, i.e. while that op's autograd node already holds the
AccumulateGrad node. When the fake graph is freed (and nothing else holds the node), the node and
our hook die with it, and the next real forward creates a fresh AccumulateGrad with no hook at all.
Something else *can* hold the node: DistributedDataParallel keeps every parameter's AccumulateGrad
node for its lifetime, so there the hook stays registered and real backward passes call it; it
returns at once for real gradients (one type check). Nothing keeps a leaf or a mode alive: the hook
holds a weak reference to the leaf, the registry is keyed weakly.

An armed hook outlives ``uninstall()``: a graph armed while the patch was installed finishes with
real gradients (also when its backward runs after the ``patched()`` block, or in another thread
while ``uninstall()`` runs). Only new graphs are left to upstream.

The registry also remembers the real gradients the patch wrote or saw on armed leaves
(:func:`note_grad`): when such a gradient is converted by a propagating mode (``zero_grad
(set_to_none=False)``, ``clip_grad_norm_`` inside the mode), the fake's propagated values are the
real gradient itself, so in-place changes reach it as they would in eager mode.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from . import trace
from ._probes import bypassed

_lock = threading.RLock()
#: id(leaf) -> RemovableHandle of our pre-hook on the leaf's AccumulateGrad node. Plain ids (this
#: is the hot path of every conversion): an entry is valid while the handle's hook dict is alive,
#: i.e. while the node is alive; the node holds its leaf strongly, so a live handle can never
#: belong to a dead leaf whose id was reused. Dead entries are pruned as the dict grows.
_armed: dict[int, Any] = {}
#: id(real non-leaf) -> weak reference to it: its graph was walked (a non-leaf's graph never
#: changes). The reference is compared on lookup, so a reused id is not mistaken for it.
_walked: dict[int, weakref.ref[torch.Tensor]] = {}
_PRUNE_AT = 4096
#: leaf -> name given by name_parameters()
_names: WeakIdKeyDictionary = WeakIdKeyDictionary()

PreHookFactory = Callable[["weakref.ref[torch.Tensor]"], Callable[[tuple[Any, ...]], Any]]


class Registry:
    """Arms leaves with pre-hooks made by ``make_prehook``; one per installation."""

    def __init__(
        self, make_prehook: PreHookFactory, grad_accumulator: Callable[[Any], Any]
    ) -> None:
        self._make_prehook = make_prehook
        self._grad_accumulator = grad_accumulator

    def arm_tensor(self, t: torch.Tensor) -> None:
        """Arm every real leaf whose gradient can flow from a fake use of ``t``.

        ``t`` is a leaf: arm it. ``t`` is a real non-leaf (FINDINGS D3: a real op on a leaf, only
        the result enters the fake computation): walk its autograd graph to the AccumulateGrad
        nodes and arm those leaves.
        """
        grad_fn = t.grad_fn
        if grad_fn is None:
            self.arm_leaf(t)
            return
        key = id(t)
        with _lock:
            seen = _walked.get(key)
            if seen is not None and seen() is t:
                return
            _walked[key] = weakref.ref(t, functools.partial(_forget_walked, key))
        self._walk(grad_fn)

    def arm_leaf(self, leaf: torch.Tensor, node: Any = None) -> None:
        key = id(leaf)
        with _lock:
            handle = _armed.get(key)
            if handle is not None and handle.hooks_dict_ref() is not None:
                return  # its AccumulateGrad node is alive and already carries our hook
            if node is None:
                node = self._grad_accumulator(leaf)
                if node is None:  # does not require grad (any more): nothing can reach it
                    return
            note_grad(leaf)
            prehook = self._make_prehook(weakref.ref(leaf))
            _armed[key] = node.register_prehook(prehook)
            if len(_armed) >= _PRUNE_AT and len(_armed) % _PRUNE_AT == 0:
                _prune()
        if trace.enabled(trace.DEBUG) and not bypassed():  # not the probes' own leaves
            fields = leaf_fields(leaf)
            trace.emit("leaf_armed", trace.DEBUG, **fields)
            # The pre-hook dies with the AccumulateGrad node, i.e. when the fake graph is freed
            # (or on uninstall): that is when the leaf is released.
            weakref.finalize(prehook, _released, fields)

    def _walk(self, root: Any) -> None:
        seen: set[int] = set()
        keep: list[Any] = []  # hold wrappers so ids stay unique during the walk
        stack = [root]
        while stack:
            node = stack.pop()
            for nxt, _ in node.next_functions:
                if nxt is None or id(nxt) in seen:
                    continue
                seen.add(id(nxt))
                keep.append(nxt)
                leaf = getattr(nxt, "variable", None)
                if leaf is not None and type(nxt).__name__ == "AccumulateGrad":
                    self.arm_leaf(leaf, nxt)
                else:
                    stack.append(nxt)

    @staticmethod
    def disarm_all() -> int:
        """Remove every pre-hook still attached to a live node; return how many."""
        removed = 0
        with _lock:
            for handle in list(_armed.values()):
                if handle.hooks_dict_ref() is not None:
                    handle.remove()
                    removed += 1
            _armed.clear()
            _walked.clear()
        return removed

    @staticmethod
    def armed_count() -> int:
        """Leaves whose AccumulateGrad node is alive and hooked (for tests and doctor)."""
        with _lock:
            return sum(1 for h in _armed.values() if h.hooks_dict_ref() is not None)


#: id(real grad) -> (weak ref to it, weak ref to its leaf): real gradients the patch wrote or saw
#: on an armed leaf (see the module docstring). Checked on the conversion of tensors that do not
#: require grad, so a plain dict by id, validated by identity.
_grads: dict[int, tuple[weakref.ref[torch.Tensor], weakref.ref[torch.Tensor]]] = {}


def note_grad(leaf: torch.Tensor) -> None:
    """Remember ``leaf.grad`` when it is a real strided tensor (hot path: once per interception;
    plain weak references validated on lookup, dead entries pruned as the dict grows)."""
    grad = leaf.grad
    if grad is None or type(grad) is not torch.Tensor or grad.layout != torch.strided:
        return
    key = id(grad)
    entry = _grads.get(key)
    if entry is not None and entry[0]() is grad:
        return
    _grads[key] = (weakref.ref(grad), weakref.ref(leaf))
    if len(_grads) >= _PRUNE_AT and len(_grads) % _PRUNE_AT == 0:
        for k in [k for k, (g, _) in _grads.items() if g() is None]:
            del _grads[k]


def managed_grad(t: torch.Tensor) -> bool:
    """Is ``t`` (still) the real ``.grad`` of a leaf the patch knows?"""
    entry = _grads.get(id(t))
    if entry is None or entry[0]() is not t:
        return False
    leaf = entry[1]()
    return leaf is not None and leaf.grad is t


def has_managed_grads() -> bool:
    return bool(_grads)


def _forget_walked(key: int, _ref: object) -> None:
    _walked.pop(key, None)


def _prune() -> None:
    """Drop entries whose node is gone (caller holds the lock)."""
    for key in [k for k, h in _armed.items() if h.hooks_dict_ref() is None]:
        del _armed[key]


def _released(fields: dict[str, Any]) -> None:
    if trace.enabled(trace.DEBUG):
        trace.emit("leaf_released", trace.DEBUG, **fields)


def name_parameters(module: torch.nn.Module, prefix: str = "") -> int:
    """Give every parameter of ``module`` its qualified name in trace events and messages.

    Weakly held: naming never keeps a parameter alive. Returns how many were named.
    """
    count = 0
    with _lock:
        for name, param in module.named_parameters(prefix=prefix.rstrip(".")):
            _names[param] = name
            count += 1
    return count


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
        "name": _names.get(leaf) if _names else None,
        "shape": list(leaf.shape),
        "dtype": dtype_name,
        "device": device_name,
    }
