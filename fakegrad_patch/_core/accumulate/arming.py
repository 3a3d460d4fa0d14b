"""Where leaves are armed: the wrapper around ``torch.autograd.backward``.

A fake gradient reaches a *real* leaf only when a backward pass runs from a fake root, or with
fake ``grad_tensors``, through a graph that holds the real leaf's AccumulateGrad node (the leaf
was an op input under ``allow_non_fake_inputs``, or a real op on it fed the mode: FINDINGS D3).
So arming happens there, once per backward call, outside any dispatch:

1. The call's roots and gradients are looked at (one type test each). No fake one, or fakes of a
   mode that does not propagate real values while ``on_missing`` was not set explicitly: the call
   goes to torch untouched. That is every real backward, and every backward of PyTorch's own
   fake-tensor users (torch.compile, compiled autograd, export, make_fx, FlopCounterMode, memory
   estimators), none of which propagates real values; inside a functorch transform or a
   compiled-autograd trace nothing is armed either.
2. Otherwise the graph is walked once from the roots (``Node.next_functions``) to its
   AccumulateGrad nodes; every node whose ``variable`` is a real tensor gets the pre-hook of
   _accumulate (one per node, reference-counted across concurrent and reentrant backward calls).
   The hook is the leaf's own, made at its first arming and reused by every later backward that
   arms it (held weakly, with the leaf): arming allocates no closure, weak reference or lock per
   leaf per call. What is left per leaf is the walk's node wrappers and torch's own
   ``register_prehook`` (a handle and a hook dict per new node, ~2-4 us: docs/performance.md).
3. When the call returns (or raises), the hooks it added are removed: nothing of the patch stays
   on any node, so later real backward passes, DistributedDataParallel's kept-alive
   AccumulateGrad nodes and compiled-autograd captures never see it. (torch's ``remove()`` leaves
   the node's emptied hook dict and its C++ caller for the node's life: ~0.7-0.9 us per real
   backward through a node that outlives the fake graph; docs/how-it-works.md.)

Entry points covered: ``Tensor.backward`` (it calls ``torch.autograd.backward`` at call time),
``torch.autograd.backward`` with a fake root, fake ``grad_tensors`` into a real graph (and a real
leaf given as the root: its node is created here and held for the call), ``inputs=...``,
reentrant checkpointing (its inner backward calls ``torch.autograd.backward``), real non-leaves
with ``retain_grad()`` that feed the mode (armed at conversion by convert/values.py, see
``Hooks.arm_retained`` in accumulate/hooks.py), graphs spanning several modes, one thread per
backward. Graphs built while the patch is installed and backwarded after ``uninstall()``:
``uninstall()`` arms the leaves of every live propagating converter's records with hooks that
stay until their node dies
(:meth:`Arming.arm_lasting`). Not covered (they never call ``torch.autograd.backward``): the
private engine entry ``torch._C._EngineBase.run_backward`` called directly, and references to
``torch.autograd.backward`` taken before the patch was applied.
"""

from __future__ import annotations

import os
import pydoc
import sys
import threading
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
import wrapt

from ... import _config, trace
from ..convert import leaves as _leaves
from ..convert import lending as _lending
from ..touchpoints.probes import bypassed
from ..touchpoints.targets import Resolved
from ..typing import BackwardScopes, InternalErrors, ModeTrust, RetainedArmer
from . import profiling as _profiling

#: The one lock of arming: taken once per armed backward call (a batch of leaves), never by a
#: gradient write.
_lock = threading.Lock()
#: id(AccumulateGrad node) -> [node, RemovableHandle, count of backward calls that armed it]
_hooked: dict[int, list[Any]] = {}
#: hooks that outlive their backward call (armed by uninstall()): they die with their node
_lasting: list[Any] = []

_Tensor = torch.Tensor

#: ``prehooks(leaves) -> [each leaf's AccumulateGrad pre-hook]``
PreHookFactory = Callable[[list[torch.Tensor]], list[Callable[[tuple[Any, ...]], Any]]]


class Arming:
    """One installation's arming: the backward wrapper and the hook bookkeeping."""

    def __init__(
        self,
        resolved: Resolved,
        prehooks: PreHookFactory,
        *,
        retained: RetainedArmer,
        trust: ModeTrust,
        ready: Callable[[], bool],
        scopes: BackwardScopes,
        errors: InternalErrors,
    ) -> None:
        self._resolved = resolved
        self._prehooks = prehooks
        #: arms a real non-leaf whose retain_grad() may receive a fake gradient
        self.arm_retained = retained.arm_retained
        #: the modes whose propagated values cannot be trusted (checked before arming)
        self._trust = trust
        #: whether leaves are armed on this build (probe D1, at first need)
        self._ready = ready
        #: DDP's scope around the engine call
        self._scopes = scopes
        self._errors = errors
        self._is_fake = resolved.is_fake
        self._tracing = resolved.torch_is_tracing
        self._fake_mode = resolved.current_fake_mode
        self.active = True
        # the node class, from a node (installation may happen inside inference_mode)
        with resolved.ordinary_dispatch(), torch.inference_mode(False), torch.enable_grad():
            probe = torch.zeros(1, requires_grad=True)
            self._accumulate_grad_cls = type(resolved.grad_accumulator(probe))
        del probe

    # -- the wrapper ---------------------------------------------------------------------------

    def backward(
        self, wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        if kwargs and "grad_variables" in kwargs:
            kwargs = _grad_variables_at_callers_line(args, kwargs)
        elif (
            len(args) > 1
            and type(args[0]) is _Tensor
            and (args[1] is None or type(args[1]) is _Tensor)
            and (self._fake_mode is None or self._fake_mode() is None)
        ):
            # Tensor.backward's call on a real root with a real or no gradient, outside any fake
            # mode: nothing to arm (what _arm_call would find), only DDP's scope to check
            scope = self._scopes.backward_scope()
            if scope is None:
                return wrapped(*args, **kwargs)
            with scope:
                return wrapped(*args, **kwargs)
        if not self.active or bypassed():
            return wrapped(*args, **kwargs)
        token = None
        try:
            token = self._arm_call(args, kwargs)
        except Exception as exc:  # never break the host's backward
            self._errors.internal_error("backward", exc)
        # DDP inside a fake mode: its Reducer runs with the mode popped (see _ddp); None (no
        # context, no extra Python frame) when no DDP forward ever ran in a fake mode.
        scope = self._scopes.backward_scope()
        # the call's lines (an event per leaf it reaches) in one write
        held = trace.hold() if token is not None and trace.file_sink_on else None
        try:
            if scope is None:
                return wrapped(*args, **kwargs)
            with scope:
                return wrapped(*args, **kwargs)
        finally:
            if token is not None:
                span = _profiling.begin(_profiling.DISARM)  # None unless profiling
                self.disarm(token)
                _profiling.end(span)
            if held is not None:
                trace.release(held)

    def _arm_call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[list[Any]] | None:
        tensors = args[0] if args else kwargs.get("tensors")
        grads = args[1] if len(args) > 1 else kwargs.get("grad_tensors")
        is_fake = self._is_fake
        roots = _as_tuple(tensors)
        if roots is None:
            return None
        given = _as_tuple(grads) if grads is not None else ()
        if given is None:
            return None
        modes = [t.fake_mode for t in roots if is_fake(t)]
        modes += [g.fake_mode for g in given if g is not None and is_fake(g)]
        if not modes and self._fake_mode is not None:
            # a real backward started inside a fake mode: AccumulateGrad (and torch's own
            # ``ones_like`` of a scalar root) would run under it, giving real leaves FakeTensor
            # gradients (``leaf.contiguous().backward(g)`` inside the ``with`` block)
            current = self._fake_mode()
            if current is not None:
                modes.append(current)
        if not modes:
            return None  # the common case: a real backward
        if not (
            any(getattr(m, "propagate_real_tensors", False) for m in modes)
            or _config.current().on_missing_explicit
        ):
            return None  # upstream's behaviour where no real values exist
        if self._tracing():
            return None
        if not self._ready():
            return None  # probe D1: this torch writes real gradients itself
        for mode in modes:
            self._trust.check_mode(mode)
        # saved fakes over a parameter's bytes that a C++ caller freed since: NaN, reported
        _lending.check()
        span = _profiling.begin(_profiling.ARM)  # None unless a profiler records
        try:
            pairs, keep = self.collect(roots)
            for t in roots:
                if not is_fake(t) and t.requires_grad and t.grad_fn is not None and t.retains_grad:
                    self.arm_retained(t)
            return self.arm(pairs, keep)
        finally:
            _profiling.end(span)

    # -- the walk ------------------------------------------------------------------------------

    def collect(self, roots: Iterable[Any]) -> tuple[list[tuple[Any, Any]], list[Any]]:
        """``(real leaf, its AccumulateGrad node)`` for every real leaf of the roots' graphs, and
        the nodes to hold for the call (a real leaf given as a root has no graph yet)."""
        is_fake, acc_cls = self._is_fake, self._accumulate_grad_cls
        pairs: list[tuple[Any, Any]] = []
        keep: list[Any] = []
        stack: list[Any] = []
        for t in roots:
            if not isinstance(t, torch.Tensor) or not t.requires_grad:
                continue
            fn = t.grad_fn
            if fn is not None:
                stack.append(fn)
            elif not is_fake(t):
                node = self._resolved.grad_accumulator(t)
                if node is not None:
                    keep.append(node)
                    pairs.append((t, node))
        seen = {id(n) for n in stack}
        keep.extend(stack)  # wrappers stay alive during the walk: their ids stay unique
        while stack:
            for nxt, _ in stack.pop().next_functions:
                if nxt is None or id(nxt) in seen:
                    continue
                seen.add(id(nxt))
                keep.append(nxt)
                if type(nxt) is acc_cls:
                    leaf = nxt.variable
                    if not is_fake(leaf):
                        pairs.append((leaf, nxt))
                else:
                    stack.append(nxt)
        return pairs, keep

    # -- hooks -----------------------------------------------------------------------------------

    def arm(self, pairs: list[tuple[Any, Any]], keep: Any = None) -> list[list[Any]]:
        """Hook every node of ``pairs`` for one backward call; returns the token for disarm.

        Per leaf only torch's ``register_prehook`` and a few dict and list operations: the hooks
        are looked up, and the leaves' gradients noted, by one call each."""
        leaves = [leaf for leaf, _node in pairs]
        hooks = self._prehooks(leaves)
        debug = trace.enabled(trace.DEBUG)
        token: list[list[Any]] = []
        new: list[Any] = []
        hooked = _hooked
        with _lock:
            for (leaf, node), hook in zip(pairs, hooks, strict=True):
                key = id(node)
                entry = hooked.get(key)
                if entry is not None and entry[0] is node:
                    entry[2] += 1
                else:
                    # [node, handle, backward calls that armed it, key]
                    entry = [node, node.register_prehook(hook), 1, key]
                    hooked[key] = entry
                    if debug:
                        new.append(leaf)
                token.append(entry)
        _leaves.note_grads(leaves)
        if new and not bypassed():
            for leaf in new:
                trace.emit("leaf_armed", trace.DEBUG, **_leaves.leaf_fields(leaf))
        del keep
        return token

    def disarm(self, token: list[list[Any]]) -> None:
        debug = trace.enabled(trace.DEBUG)
        released: list[Any] = []
        hooked = _hooked
        with _lock:
            entry: list[Any]
            for entry in token:
                entry[2] -= 1
                if entry[2] == 0:
                    entry[1].remove()
                    if hooked.get(entry[3]) is entry:
                        del hooked[entry[3]]
                    if debug:
                        released.append(entry[0])
        if released and not bypassed():
            for node in released:
                leaf = getattr(node, "variable", None)
                if leaf is not None:
                    trace.emit("leaf_released", trace.DEBUG, **_leaves.leaf_fields(leaf))

    def arm_lasting(self, tensors: Iterable[Any]) -> int:
        """Hooks that stay until their node dies, on the leaves reachable from ``tensors`` (real
        leaves, or real non-leaves whose graph is walked): for graphs built while the patch was
        installed and backwarded after ``uninstall()``."""
        leaves: list[Any] = []
        roots: list[Any] = []
        for t in tensors:
            if t.grad_fn is None:
                leaves.append(t)
            else:
                roots.append(t)
        pairs, keep = self.collect(roots)
        get_node = self._resolved.grad_accumulator
        for leaf in leaves:
            # A leaf whose node is gone gets a fresh one that dies with this call, hook and all.
            node = get_node(leaf)
            if node is not None:
                keep.append(node)
                pairs.append((leaf, node))
        count = 0
        hooks = self._prehooks([leaf for leaf, _node in pairs])
        with _lock:
            for (_leaf, node), hook in zip(pairs, hooks, strict=True):
                entry = _hooked.get(id(node))
                if entry is not None and entry[0] is node:
                    continue  # a running backward holds it; it finishes that call itself
                _lasting.append(node.register_prehook(hook))
                count += 1
            _prune_lasting()
        del keep
        return count

    # -- real non-leaves with retain_grad() ----------------------------------------------------


def _as_tuple(x: Any) -> tuple[Any, ...] | None:
    """The tensors of a ``backward`` argument, or None for a kind we do not look into (an
    iterator would be consumed)."""
    if isinstance(x, torch.Tensor):
        return (x,)
    if isinstance(x, (tuple, list)):
        return tuple(x)
    return None


def _prune_lasting() -> None:
    """Drop handles whose node is gone (caller holds the lock); amortized O(1)."""
    global _lasting
    if len(_lasting) > 64 and len(_lasting) > 2 * _Lasting.after_prune:
        _lasting = [h for h in _lasting if h.hooks_dict_ref() is not None]
        _Lasting.after_prune = len(_lasting)


class _Lasting:
    after_prune = 0


def release_all() -> int:
    """Remove every hook of the patch still attached to a live node; return how many."""
    removed = 0
    with _lock:
        for entry in list(_hooked.values()):
            entry[1].remove()
            removed += 1
        _hooked.clear()
        for handle in _lasting:
            if handle.hooks_dict_ref() is not None:
                handle.remove()
                removed += 1
        _lasting.clear()
        _Lasting.after_prune = 0
    return removed


def armed_count() -> int:
    """Hooks of the patch on live nodes now (for ``status()``, tests and doctor)."""
    with _lock:
        return len(_hooked) + sum(1 for h in _lasting if h.hooks_dict_ref() is not None)


# -- where the interception is in place -----------------------------------------------

#: torch's own words (``torch.autograd.backward``; read on 2.13.0 and 2.14.1)
_GRAD_VARIABLES_DEPRECATED = "`grad_variables` is deprecated. Use `grad_tensors` instead."
_WRAPT_DIR = os.path.dirname(os.path.abspath(wrapt.__file__))


def _grad_variables_at_callers_line(
    args: tuple[Any, ...], kwargs: dict[str, Any]
) -> dict[str, Any]:
    """``backward(..., grad_variables=g)`` through the wrapper: torch's FutureWarning (its
    ``stacklevel=2``) would name the wrapper's frame. Warn here for torch, at the caller's line,
    and hand torch ``grad_tensors`` instead. When ``grad_tensors`` is also given, torch's own
    error is left to torch."""
    if kwargs.get("grad_variables") is None or len(args) > 1 or "grad_tensors" in kwargs:
        return kwargs
    level = 3  # 1: here, 2: Arming.backward, 3: its caller
    frame: Any = sys._getframe(2)
    while frame is not None and os.path.dirname(frame.f_code.co_filename) == _WRAPT_DIR:
        level, frame = level + 1, frame.f_back  # wrapt without its C extension: Python frames
    warnings.warn(_GRAD_VARIABLES_DEPRECATED, FutureWarning, stacklevel=level)
    kwargs = dict(kwargs)
    kwargs["grad_tensors"] = kwargs.pop("grad_variables")
    return kwargs


class BackwardWrapper(wrapt.FunctionWrapper):
    """The ``torch.autograd.backward`` wrapper, as transparent as a wrapper can be: it pickles
    (by reference, the bytes torch's function gives), copies and deep-copies as torch's function
    does (wrapt's proxy raises ``NotImplementedError`` for ``__reduce__``)."""

    def __reduce_ex__(self, protocol: Any) -> Any:
        module = sys.modules.get(self.__module__)
        name = self.__qualname__
        if module is not None and getattr(module, name, None) is self:
            return name  # pickle by reference: module and name, exactly torch's bytes
        # not in place now (a reference kept after it was removed): whatever that name is
        # when unpickled, without needing fakegrad_patch there
        return (pydoc.locate, (f"{self.__module__}.{name}",))

    def __reduce__(self) -> Any:
        return self.__reduce_ex__(2)

    def __copy__(self) -> Any:
        return self

    def __deepcopy__(self, memo: Any) -> Any:
        return self
