"""Functions of torch that the patch replaces only while they are needed.

A :class:`Site` puts a wrapper in place of ``owner.<attr>`` while a propagating mode it follows
lives (or a policy asks for it) and torch's own object back, the same object, when none does:
a process whose propagating modes are gone runs torch's own functions at torch's own cost.
The sites: ``torch.autograd.backward`` (accumulate/arming.py: needed while any propagating mode
lives) and ``FakeTensorMode.dispatch`` with its companions (dispatch/wrapper.py: needed while a
propagating *user* mode, one without a ShapeEnv, lives, or while ``buffers="write_back"`` is
on). A plain fake mode, a tracer's, then pays nothing per op. A :class:`HookSite` registers a
global hook of torch the same way, from the first propagating user mode on: write-back's
optimizer step post-hook, which TorchDynamo would otherwise meet in every ``Optimizer.step``
it traces.

Modes are registered when they are built (the ``FakeTensorMode.__init__`` wrapper) or when they
convert a real tensor, and held weakly: a mode's death (a weak reference callback, possibly run
by the garbage collector in the middle of other code, in any thread) tells every started site.
"""

from __future__ import annotations

import functools
import threading
import weakref
from typing import Any

import wrapt

from ... import trace

#: Propagating modes seen alive by any installation: id(mode) -> weak reference (its callback
#: removes the entry). Process-wide, so a mode built while one installation was applied keeps a
#: later installation's interception in place too.
modes: dict[int, weakref.ref[Any]] = {}
#: The subset of :data:`modes` without a ShapeEnv: users' modes, not PyTorch's tracers'.
user_modes: dict[int, weakref.ref[Any]] = {}

#: ``Site.original`` for an attribute the owner does not define itself (it inherits it): the
#: wrapper is deleted again when no longer needed
ABSENT: Any = object()
#: the started sites (of the installation in force), told when a mode is seen or dies
_started: list[_Follower] = []


def need_mode(mode: Any) -> None:
    """``mode`` propagates real values: the sites that follow it stay in place while it lives."""
    key = id(mode)
    ref = modes.get(key)
    if ref is not None and ref() is mode:
        return
    ref = modes[key] = weakref.ref(mode, functools.partial(_mode_died, key))
    if getattr(mode, "shape_env", None) is None:
        user_modes[key] = ref  # one weak reference per mode, in both registries
    for site in tuple(_started):
        site.changed()


def _mode_died(key: int, ref: Any) -> None:
    # A weak reference callback: may run inside the garbage collector anywhere, the trace
    # sink's own write included, so this settles without emitting an event.
    for registry in (modes, user_modes):
        if registry.get(key) is ref:
            del registry[key]
    for site in tuple(_started):
        site.changed(quiet=True)


class _Follower:
    """Something of the patch that is in place only while it is needed: while a mode of
    ``registry`` lives or a policy is set (:meth:`set_policy`); :meth:`_settle` says what in
    place means. Thread-safe: any thread may change the need, a mode's death included: the
    change is recorded at once and applied by whoever holds the lock, never waiting for it."""

    def __init__(self, *, registry: dict[int, Any] = modes) -> None:
        self._registry = registry
        self._policy = False
        self._closed = False
        self._in_place = False
        self._dirty = False
        self._lock = threading.Lock()
        #: [times put in place, times removed], for tests
        self.counts = [0, 0]
        self._started = False

    def start(self) -> None:
        """Follow the need from now on (the installation is complete): modes seen by an
        earlier installation may still live. A closed site stays closed."""
        if self._closed:
            return
        self._started = True
        if self not in _started:
            _started.append(self)
        self.changed()

    def in_place(self) -> bool:
        return self._in_place

    need_mode = staticmethod(need_mode)

    def set_policy(self, explicit: bool) -> None:
        if explicit != self._policy:
            self._policy = explicit
            self.changed()

    def close(self) -> bool:
        """For ``uninstall()``: torch's own back for good, before this returns. Returns False
        when a :class:`Site` finds somebody wrapped over ours (theirs is left in place; ours
        passes calls through).

        Unlike other changes, this waits for a thread applying a change right now (a mode
        built or dead on another thread: a short ``setattr``, no lock of ours taken inside):
        handing the close over to it let ``uninstall()`` return with our wrapper still in place
        for a moment, and the next installation then took that wrapper for torch's own function
        (a site built then reads the attribute), wrapped it, and put it back for good when it
        was removed in turn (two installations' wrappers stacked: the old one's passed
        gradients through a removed installation). Never called by a weak reference callback
        or under this site's lock, so waiting cannot deadlock."""
        self._closed = True
        if self in _started:
            _started.remove(self)
        self.changed(wait=True)
        return not self._in_place

    def changed(self, *, quiet: bool = False, wait: bool = False) -> None:
        # Lock-free hand-over: record the change, then apply it unless another thread (or this
        # one, below us on the stack) holds the lock; that one re-checks after releasing it.
        # ``wait`` (close() only): wait for the lock instead, so the change is applied on return.
        self._dirty = True
        if not self._started:
            return
        while self._dirty:
            if not self._lock.acquire(blocking=wait):
                return
            try:
                self._dirty = False
                report = self._settle(quiet)
            finally:
                self._lock.release()
            if report is not None:
                report()  # after releasing: a trace event or a warning may import

    def _settle(self, quiet: bool) -> Any:
        """Put in place or take away as needed, under the lock; returns what to report (a
        callable: run it without the lock), or None."""
        raise NotImplementedError


class Site(_Follower):
    """Puts ``wrapper`` in place of ``owner.<attr>`` only while it is needed, and torch's own
    object (``original``) back when it no longer is.

    Needed while a mode of ``registry`` lives or a policy is set (:meth:`set_policy`).
    ``events``: the (installed, removed) trace event names, or None for none; ``lost``: what
    stops working when somebody else replaced the attribute (the warning says it)."""

    def __init__(
        self,
        owner: Any,
        attr: str,
        wrapper: Any,
        original: Any,
        *,
        registry: dict[int, Any] = modes,
        events: tuple[str, str] | None = None,
        lost: str = "",
    ) -> None:
        super().__init__(registry=registry)
        self._owner = owner
        self._attr = attr
        self.wrapper = wrapper
        self.original = original
        self._events = events
        self._lost = lost

    def _settle(self, quiet: bool) -> Any:
        want = not self._closed and (self._policy or bool(self._registry))
        if want == self._in_place:
            return None
        owner, attr = self._owner, self._attr
        current = owner.__dict__.get(attr, ABSENT)
        if want:
            if current is not self.original and current is not self.wrapper:
                return functools.partial(_rewrapped, owner, attr, self._lost, before=True)
            setattr(owner, attr, self.wrapper)
            self._in_place = True
            self.counts[0] += 1
            event = self._events[0] if self._events else None
        else:
            if current is not self.wrapper:
                if self._closed:
                    return functools.partial(_rewrapped, owner, attr, self._lost, before=False)
                return None  # somebody wrapped over ours: theirs stays; ours passes calls through
            if self.original is ABSENT:
                delattr(owner, attr)  # inherited again (a base class's descriptor)
            else:
                setattr(owner, attr, self.original)
            self._in_place = False
            self.counts[1] += 1
            event = self._events[1] if self._events else None
        if event is not None and not quiet and trace.enabled(trace.DEBUG):
            return functools.partial(
                trace.emit,
                event,
                trace.DEBUG,
                modes=len(self._registry),
                explicit_policy=self._policy,
            )
        return None


def function_site(owner: Any, attr: str, handler: Any, lost: str) -> Site | None:
    """A :class:`Site` putting ``wrapt.FunctionWrapper(original, handler)`` in place of the
    function ``owner`` defines as ``attr`` while a propagating user mode lives (or a policy asks
    for it); None where ``owner`` defines no such function. ``lost``: see :class:`Site`."""
    original = owner.__dict__.get(attr)
    if not callable(original):
        return None
    return Site(
        owner,
        attr,
        wrapt.FunctionWrapper(original, handler),
        original,
        registry=user_modes,
        lost=lost,
    )


class HookSite(_Follower):
    """Registers ``hook`` with torch (``register(hook)``, a handle with ``remove()``) from the
    first propagating user mode seen on (one alive at :meth:`start` included) until
    :meth:`close`; never while none has lived.

    Not removed when the last such mode dies: a mode's death may come from the garbage
    collector while torch iterates over the very dict of hooks (``Optimizer.step`` calling its
    post-hooks), and removing an entry there raises in the user's step. Registering happens
    where a mode is built or first converts a real tensor, as ``enable()`` itself did."""

    def __init__(self, register: Any, hook: Any) -> None:
        super().__init__(registry=user_modes)
        self._register = register
        self.hook = hook
        self._handle: Any = None

    def _settle(self, quiet: bool) -> Any:
        want = not self._closed and (self._in_place or bool(self._registry))
        if want == self._in_place:
            return None
        if want:
            self._handle = self._register(self.hook)
            self._in_place = True
            self.counts[0] += 1
        else:
            handle, self._handle = self._handle, None
            handle.remove()
            self._in_place = False
            self.counts[1] += 1
        return None


def _rewrapped(owner: Any, attr: str, lost: str, *, before: bool) -> None:
    from ..state import warn_once

    name = f"{getattr(owner, '__name__', owner)}.{attr}"
    if before:
        message = (
            f"fakegrad_patch: {name} was replaced by someone else after fakegrad_patch was "
            f"applied; not putting the fakegrad_patch layer over it ({lost})."
        )
    else:
        message = (
            f"fakegrad_patch: {name} was re-wrapped by someone else after fakegrad_patch; leaving "
            "it in place (the fakegrad_patch layer is now inactive)."
        )
    warn_once(f"rewrapped:{attr}", message, stacklevel=4)
