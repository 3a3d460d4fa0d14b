"""DistributedDataParallel inside a propagating fake mode: DDP's own machinery runs for real.

Upstream, a DDP forward and backward inside ``FakeTensorMode`` cannot give real, allreduced
gradients: DDP's C++ Reducer runs its autograd hooks and ``finalize_backward`` inside the
backward with the fake mode still in the graph task's thread-local state, so the bucket copies and
the collective (``c10d::allreduce_``) are dispatched to the fake mode (which copies the real
bucket into a propagated clone and then rejects the collective's schema); and ``_pre_forward``'s
bucket rebuild, buffer broadcast and join notification allocate fake buckets under the mode
(FINDINGS "DDP inside the mode").

What this module does, only for fake modes that propagate real tensors and in which a DDP forward
ran (nothing else is touched: a program without DDP never reaches the code below, and a mode that
does not propagate keeps upstream behaviour):

* ``DistributedDataParallel._pre_forward`` and ``_post_forward`` (WRAPPED) run with the fake mode
  popped (``unset_fake_temporarily``): the bucket rebuild, ``prepare_for_forward`` /
  ``prepare_for_backward``, the buffer broadcast, the join notifications and DDPSink see real
  tensors, or fakes that dispatch to their own mode. The mode is remembered (a weak set).
* A backward started inside such a mode runs with the fake mode popped for the whole engine run
  (:func:`backward_scope`): the graph task captures its thread-local state when it is created,
  so the Reducer's hooks, its ``finalize_backward`` and static graph's delayed allreduce (queued
  engine callbacks) run with no fake mode: the collective runs on the real buckets. The fake part
  of the backward still runs in the fake mode: every op with a FakeTensor argument re-enters its
  mode (``FakeTensor.__torch_dispatch__``). The patch's AccumulateGrad pre-hook makes each
  parameter's ``.grad`` real before the Reducer's hook (an AccumulateGrad post-hook) copies it into
  its bucket.

Measured (2 gloo processes, torch 2.13.0 and 2.14.1): equal to eager DDP on both ranks with the
default options, ``gradient_as_bucket_view``, ``static_graph``, ``find_unused_parameters``,
``no_sync`` then a synced step, several iterations, BatchNorm with ``broadcast_buffers`` and a
Python comm hook (tests/test_distributed.py).

FSDP2 (``fully_shard``): its ``FSDPState._pre_forward`` / ``_post_forward`` hooks get the same
treatment, wrapped when ``torch.distributed.fsdp._fully_shard._fsdp_state`` is imported (its hooks
are bound methods taken by ``fully_shard``); the backward scope covers its post-backward
reduce-scatter.

Contract with the core (three call sites, all in fakegrad_patch/_core/install.py):

* ``install(resolved)``: when the patch is applied (``Applied.__init__``, after
  ``_targets.resolve_all()``). Never raises; returns True when DDP is covered. A build where a DDP
  target is missing (torch.distributed available) leaves DDP to upstream with one warning.
* ``remove()``: from ``Applied.remove()``. Unwraps what ``install`` wrapped. Never raises.
* ``backward_scope()``: in the ``torch.autograd.backward`` wrapper, around the call of the
  wrapped (original) function, for *every* backward: ``with _ddp.backward_scope(): return
  wrapped(*args, **kwargs)``. It must enclose the engine call itself (the graph task captures the
  thread-local state when it is created) and be entered after the core has armed its pre-hooks
  (arming needs the fake mode; the pre-hooks themselves do not). Cost when no DDP forward ever ran
  in a propagating fake mode: one global read, and None is returned (no context to enter).
"""

from __future__ import annotations

import sys
import threading
import weakref
from typing import Any

import wrapt

from ... import trace


class _State:
    def __init__(self) -> None:
        #: guards the fields below. Held only to read and publish them and to put wrappers in
        #: place or take them off: never while importing or resolving a target, never by a
        #: post-import hook that finds it taken (it defers: ``fsdp_pending``, :func:`_settle`).
        self.lock = threading.Lock()
        #: fake modes in which a DDP forward ran (weak: a finished mode is forgotten)
        self.modes: weakref.WeakSet[Any] = weakref.WeakSet()
        #: a DDP forward ran in some fake mode since install (read on every backward)
        self.any_mode = False
        #: wrapped (owner, attribute, wrapper, original) while installed
        self.wrapped: list[tuple[Any, str, Any, Any]] = []
        self.targets: Any = None  # the resolved DDP touch points while installed
        self.warned: set[str] = set()
        self.fsdp_wrapped = False
        self.fsdp_hook_registered = False
        #: FSDP2's state class, resolved and waiting to be wrapped by whoever holds the lock
        self.fsdp_pending: type | None = None


_state = _State()


def install(resolved: Any = None) -> bool:
    """Wrap DDP's forward pieces now and FSDP2's when its module is imported (idempotent).
    False when DDP is left to upstream.

    Import first, then lock: the targets are resolved (``torch.distributed``, DDP's
    module: imports) before the lock is taken; under it the wrappers are only put in place."""
    from ..touchpoints import targets as _targets

    if _state.targets is not None:
        return True
    try:
        targets = _targets.resolve_ddp()
    except _targets.MissingTargetError as exc:
        _warn_missing(str(exc))
        return False
    except Exception as exc:  # never break the host
        _warn_missing(f"unexpected {type(exc).__name__}: {exc}")
        return False
    if targets is None:  # no torch.distributed on this build: nothing to cover
        return False
    problem: Exception | None = None
    with _state.lock:
        if _state.targets is None:
            try:
                _wrap(targets.ddp_cls, ("_pre_forward", "_post_forward"))
            except Exception as exc:
                _unwrap_all()
                problem = exc
            else:
                _state.targets = targets
    _settle()  # what a post-import hook left while the lock was held
    if problem is not None:
        _warn_missing(f"could not wrap DistributedDataParallel: {problem}")
        return False
    if sys.modules.get(_targets.FSDP_STATE_MODULE) is not None:
        _wrap_fsdp()
        return True
    with _state.lock:
        register = not _state.fsdp_hook_registered
        _state.fsdp_hook_registered = True
    if register:
        # outside the lock: wrapt calls the hook at once when the module was imported meanwhile
        wrapt.register_post_import_hook(_on_fsdp_imported, _targets.FSDP_STATE_MODULE)
    return True


def _on_fsdp_imported(_module: Any) -> None:
    """Post-import hook of FSDP2's state module: runs inside that import, holding its import
    lock (and its parents'). Never waits for our lock (:func:`_wrap_fsdp`)."""
    _wrap_fsdp()


def _wrap(owner: Any, attrs: tuple[str, ...]) -> None:
    for attr in attrs:
        wrapt.wrap_function_wrapper(owner, attr, _around_forward_piece)
        wrapper = owner.__dict__[attr]
        _state.wrapped.append((owner, attr, wrapper, wrapper.__wrapped__))


def _wrap_fsdp() -> None:
    """FSDP2 (``fully_shard``): its forward pre/post hooks (unshard: all-gather; reshard;
    the pre-backward and post-backward registrations) like DDP's forward pieces. Its hooks are
    bound methods taken when ``fully_shard`` is called, so this must run before: at install when
    the module is loaded, else when it is imported. Never raises, never waits for the lock: the
    class is resolved first (an import: the caller may wait for another thread's import of the
    module, holding no lock of ours), then wrapped by whoever holds the lock (:func:`_settle`)."""
    from ..touchpoints import targets as _targets

    if _state.targets is None or _state.fsdp_wrapped:
        return
    try:
        state_cls = _targets.resolve_fsdp()
    except _targets.MissingTargetError as exc:
        _warn_missing(str(exc), what="FSDP2 (fully_shard)")
        return
    except Exception as exc:  # never break the host
        _warn_missing(f"unexpected {type(exc).__name__}: {exc}", what="FSDP2 (fully_shard)")
        return
    _state.fsdp_pending = state_cls
    _settle()


def _settle() -> None:
    """Wrap a pending FSDP2 class unless another thread holds the lock: that thread settles
    after releasing it (every holder calls this then), so the work is never lost and nobody
    waits. Never raises."""
    while _state.fsdp_pending is not None:
        if not _state.lock.acquire(blocking=False):
            return
        problem: Exception | None = None
        try:
            state_cls, _state.fsdp_pending = _state.fsdp_pending, None
            if state_cls is not None and _state.targets is not None and not _state.fsdp_wrapped:
                try:
                    _wrap(state_cls, ("_pre_forward", "_post_forward"))
                except Exception as exc:  # never break the host
                    problem = exc
                else:
                    _state.fsdp_wrapped = True
        finally:
            _state.lock.release()
        if problem is not None:
            _warn_missing(
                f"unexpected {type(problem).__name__}: {problem}", what="FSDP2 (fully_shard)"
            )


def remove() -> None:
    """Unwrap DDP (idempotent, never raises). Modes remembered so far are forgotten."""
    with _state.lock:
        _unwrap_all()
        _state.targets = None
        _state.fsdp_wrapped = False
        _state.fsdp_pending = None
        _state.modes = weakref.WeakSet()
        _state.any_mode = False
    _settle()


def _unwrap_all() -> None:
    while _state.wrapped:
        owner, attr, wrapper, original = _state.wrapped.pop()
        if owner.__dict__.get(attr) is wrapper:
            setattr(owner, attr, original)
        # else: somebody wrapped over us; our wrapper stays, inert (targets is None)


def _warn_missing(reason: str, what: str = "DistributedDataParallel") -> None:
    if what in _state.warned:
        return
    _state.warned.add(what)
    from ..state import warn_once

    warn_once(
        f"ddp:{what}",
        f"fakegrad_patch: {what} is left to upstream on this torch build ({reason}): its "
        "backward inside a fake mode does not give real, reduced gradients.",
    )
    if trace.enabled(trace.WARNING):
        trace.emit("ddp_skipped", trace.WARNING, what=what, reason=reason)


def _around_forward_piece(
    wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """``DDP._pre_forward`` / ``_post_forward``, FSDP2's ``FSDPState._pre_forward`` /
    ``_post_forward``: with the fake mode popped when it propagates."""
    targets = _state.targets
    if targets is None:
        return wrapped(*args, **kwargs)
    mode = targets.current_fake_mode()
    if mode is None or not getattr(mode, "propagate_real_tensors", False):
        return wrapped(*args, **kwargs)  # no fake mode, or one the patch cannot make real
    if mode not in _state.modes:
        _state.modes.add(mode)
        _state.any_mode = True
        if trace.enabled(trace.INFO):
            trace.emit("ddp_mode_seen", trace.INFO, ddp=type(instance).__name__)
    with targets.unset_fake():
        return wrapped(*args, **kwargs)


def backward_scope() -> Any:
    """A context manager for the engine call of one backward: the fake mode popped when it is
    one in which a DDP forward ran, else None (the caller then calls the engine directly: no
    Python frame is added to a backward that has nothing to do with DDP, which TorchDynamo would
    count as frames of its own)."""
    if not _state.any_mode:  # a plain attribute: no Python frame (WeakSet.__len__ is one)
        return None
    targets = _state.targets
    if targets is None:
        return None
    mode = targets.current_fake_mode()
    if mode is None or mode not in _state.modes:
        return None
    return targets.unset_fake()


def status() -> dict[str, Any]:
    """For ``doctor`` and tests."""
    return {
        "installed": _state.targets is not None,
        "fsdp2": _state.fsdp_wrapped,
        "modes_seen": len(_state.modes),
    }
