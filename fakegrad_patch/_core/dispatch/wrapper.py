"""The one wrapper of ``FakeTensorMode.dispatch``, top to bottom.

It acts only in modes that propagate real values and have no ShapeEnv (a user's; torch.compile,
export and the other tracers keep upstream's behaviour exactly). For each op it:

1. keeps a :class:`~.frames.Frame` for the outermost op of the mode on this thread, and tells the
   write-back watch what the op writes (``enter``, ``nested_write``, ``returned``);
2. shadows a nested op's writes and keeps a nested random op's generators when the outer op ran
   for real (:mod:`.nested`);
3. takes the ops FakeTensorMode refuses with real storages or tensors (:mod:`.refused`);
4. takes the fast path for new tensors, views and in-place ops (:mod:`.fast`, the default);
5. else hands the op to upstream's path with its repairs (:mod:`.upstream`).

Before it, the mode's entry (``FakeTensorMode.__torch_dispatch__``, :meth:`Dispatcher.entry`)
answers ``prim.device`` of a propagating user mode with upstream's own handler.

``FakeTensorMode.dispatch`` is this wrapper only while a propagating user mode lives or
write-back is on (a :class:`~..sites.Site`); with the entry, the unsafe fallback,
``Tensor.data``, ``Tensor.retain_grad``, ``FakeTensor.tolist`` and ``GradScaler.update``
likewise.
"""

from __future__ import annotations

import threading
from typing import Any, NamedTuple

from ... import trace
from ..touchpoints import sites as _sites
from ..touchpoints import targets as _targets
from ..touchpoints.targets import Resolved
from ..typing import CopyRefresher, InternalErrors, MismatchReporter, RetainedArmer
from .aliases import Aliases
from .fallback import Fallback
from .fast import NOT_FAST, FastPath
from .frames import Frame, Frames
from .methods import method_sites, tensor_data_descriptor
from .nested import GeneratorsKept, Nested
from .objects import BornInside, grad_scaler_class
from .ops import Kind, facts
from .refused import Converted, Refused
from .stats import Settings, Stats
from .tensors import CannotRebuild, op_arguments, own_written, real_write_ptrs
from .upstream import Upstream, name_the_op
from .watch import Watch


class Dispatcher:
    """One installation's dispatch wrapper and the parts it calls."""

    def __init__(
        self,
        resolved: Resolved,
        errors: InternalErrors,
        mismatch: MismatchReporter,
        copies: CopyRefresher,
        armer: RetainedArmer,
    ) -> None:
        self._resolved = resolved
        self._errors = errors
        self._armer = armer
        self._lock = threading.Lock()
        #: ``FakeTensorMode.dispatch`` wrapped while needed (reports; write-back; repairs)
        self.observing = False
        #: ``remove()`` ran (uninstall): this installation never wraps again
        self._removed = False
        self._sites: list[_sites.Site] = []
        self._policy = False
        self.settings = Settings()
        self.stats = Stats()
        self.frames = Frames()
        self.aliases = Aliases(resolved, self.frames, self)
        self.born_inside = BornInside(resolved, errors)
        self.watch = Watch(resolved, self.frames, self.aliases, copies)
        self._fast = FastPath(resolved, self.stats, self.frames, self.aliases)
        #: the fast path's fake constructor (``targets.FakeMaker``; None where absent)
        self.fake_maker = self._fast.fake_maker
        self._upstream = Upstream(resolved, self.settings, self.stats, self._fast, mismatch)
        self._nested = Nested(resolved, self.stats, self.watch, self._upstream)
        self._refused = Refused(resolved, self.stats, self._fast)
        self._fallback = Fallback(resolved, self.settings, self.stats, self._fast, errors)
        #: ops the mode answers from metadata (``prim.device``): handed straight on
        self._direct = _targets.direct_ops(resolved.fake_tensor_module)
        #: ``(prim.device, upstream's handler)``, answered at the mode's entry (or None)
        self._device = _targets.device_handler(resolved.fake_tensor_module)
        real_out = _targets.resolve_optional(_targets.DISPATCH_IMPL_REAL_OUT)
        self._can_read_frames = real_out is not None

    # -- on / off -------------------------------------------------------------------------------

    def observe(self) -> bool:
        """Watch the ops of propagating user modes (idempotent, thread-safe): from now on the
        wrappers are in place while such a mode lives or write-back is on, and torch's own
        functions otherwise (a plain mode, a tracer's, pays nothing per op). False where
        ``dispatch`` is missing, or once :meth:`remove` ran (a thread that passed the
        installation's ``active`` test before ``uninstall()`` must not put its wrappers back:
        they would stay, and every later installation's would stand aside)."""
        if self.observing:
            return True
        if self._removed:
            return False
        # import first, then lock: resolving a target may import
        if _targets.resolve_optional(_targets.FAKE_MODE_DISPATCH) is None:
            return False
        found = _find()
        with self._lock:
            if self.observing:
                return True
            if self._removed:
                return False
            sites = self._sites
            if not sites:
                sites = _make_sites(self, found)
                if not sites:
                    return False
                for site in sites:
                    site.set_policy(self._policy)
                self._sites = sites
        # Started before ``observing`` is set: a thread that finds it set finds the wrappers in
        # place when a mode needs them. Outside our lock: starting may warn (somebody replaced
        # ``dispatch``); a site closed meanwhile (uninstall) stays closed.
        for site in sites:
            site.start()
        with self._lock:
            if self._sites is sites:
                self.observing = True
        return True

    def set_policy(self, explicit: bool) -> None:
        """Wrapped whether or not a mode lives (write-back on)."""
        self._policy = explicit
        for site in self._sites:
            site.set_policy(explicit)

    def write_back(self, on: bool) -> bool:
        """``buffers="write_back"`` on or off; False where it is unavailable."""
        if not on:
            self.aliases.disable()
        elif not self.aliases.enable():
            return False
        self.born_inside.follow(on)
        return True

    def remove(self) -> None:
        """``uninstall()``: torch's functions back."""
        with self._lock:
            self.observing = False
            self._removed = True
            sites, self._sites = self._sites, []  # also those observe() is starting
        for site in sites:
            site.close()  # torch's back, unless somebody wrapped over ours (warned)

    # -- the wrappers ---------------------------------------------------------------------------

    def entry(self, wrapped: Any, mode: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``FakeTensorMode.__torch_dispatch__``: ``prim.device`` of a propagating user mode
        answered by upstream's own handler, before the entry's decorators and ``dispatch``."""
        device = self._device
        if (
            device is not None
            and args
            and args[0] is device[0]
            and len(args) > 2
            and self.observing
            and getattr(mode, "propagate_real_tensors", False)
            and getattr(mode, "shape_env", None) is None
        ):
            return device[1](args[2])
        return wrapped(*args, **kwargs)

    def dispatch(
        self, wrapped: Any, mode: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        if (
            not self.observing
            or not getattr(mode, "propagate_real_tensors", False)
            or getattr(mode, "shape_env", None) is not None
            or (args and args[0] in self._direct)
        ):
            return wrapped(*args, **kwargs)
        frames = self.frames
        frame = frames.of(mode)
        try:
            func = args[0] if args else kwargs["func"]
            op_facts = facts(func)
            op_args, op_kwargs = op_arguments(args, kwargs)
        except Exception as exc:  # never break the host's fake computation
            self._errors.internal_error("dispatch", exc)
            return wrapped(*args, **kwargs)
        if frame is None:
            return self._outermost(wrapped, args, kwargs, mode, func, op_facts, op_args, op_kwargs)
        written = op_facts.writes(op_args, op_kwargs, self.settings.fast)  # BatchNorm's too
        if written:  # lent values it writes copied first; no conversion lends meanwhile
            own_written(written, op_args, op_kwargs)
        frame.depth += 1
        frame.writing += bool(written)
        try:
            if written:
                # the watch first: it reads the written values' places before the shadow
                self._guarded(self.watch.nested_write, frame, func, written, op_args, op_kwargs)
                if self.settings.repair or self.aliases.enabled:  # write-back needs it anyway
                    self._guarded(self._nested.shadow, frame, func, written, op_args, op_kwargs)
            if frame.depth == 1 and frame.real_out is None and self.settings.repair:
                # the outer op's real output, before its nested ops run
                frame.real_out = _targets.running_real_out(mode, depth=2, limit=40)
            op = (op_args, op_kwargs)
            if self.settings.repair and op_facts.random and self._nested.ran_for_real(frame):
                # the outer op drew its random numbers when it ran for real; its decomposition
                # (uniform_ -> prims.uniform) must not draw them again
                with GeneratorsKept(op_args, op_kwargs):
                    return self._call(wrapped, args, kwargs, mode, func, op, op_facts)
            return self._call(wrapped, args, kwargs, mode, func, op, op_facts)
        finally:
            frame.depth -= 1
            frame.writing -= bool(written)

    def _outermost(
        self,
        wrapped: Any,
        args: Any,
        kwargs: Any,
        mode: Any,
        func: Any,
        op_facts: Any,
        op_args: Any,
        op_kwargs: Any,
    ) -> Any:
        frame = Frame(mode, (op_args, op_kwargs), func)
        written = op_facts.writes(op_args, op_kwargs, self.settings.fast)
        if written:
            own_written(written, op_args, op_kwargs)  # raises: the op must not run
            frame.writing = 1
            frame.real_writes = real_write_ptrs(written, op_args, op_kwargs, self._resolved.is_fake)
            self._guarded(self.watch.enter, frame, written)
        held = trace.hold() if trace.file_sink_on else None  # the op's lines: one write
        stack = self.frames.stack
        stack.append(frame)
        ok, result = False, None
        try:
            result = self._call(wrapped, args, kwargs, mode, func, frame.op, op_facts)
            if (
                frame.real_out is not None
                and frame.real_out is not _targets.NO_REAL_OUT
                and op_facts.fresh_outputs
            ):
                result = self._nested.values_of_the_real_run(mode, func, result, frame.real_out)
            ok = True
            return result
        except Exception as exc:
            name_the_op(exc, func)
            raise
        finally:
            stack.pop()
            if frame.swaps:
                self._guarded(self._nested.unshadow, frame)
            self._guarded(self.watch.returned, frame, func, result, ok)
            if held is not None:
                trace.release(held)

    def _call(
        self, wrapped: Any, args: Any, kwargs: Any, mode: Any, func: Any, op: Any, op_facts: Any
    ) -> Any:
        """One op: what FakeTensorMode refuses, the fast path, else upstream's path."""
        settings = self.settings
        if settings.repair:
            if op_facts.sets_storage:
                result = self._refused.set_storage(mode, func, op)
                if result is not NOT_FAST:
                    return result
            if op_facts.mutates_metadata and mode.allow_non_fake_inputs:
                result = self._refused.mutate_metadata(mode, func, op)
                if isinstance(result, Converted):  # upstream's, on the converted arguments
                    op = (result.args, result.kwargs)
                    args, kwargs = (args[0], args[1], result.args, result.kwargs), {}
                elif result is not NOT_FAST:
                    return result
        kind = op_facts.kind
        if settings.fast and kind is not Kind.OTHER:
            if kind is Kind.NEW:
                result = self._fast.new(mode, func, op, op_facts)
            elif kind is Kind.VIEW:
                try:
                    result = self._fast.view(mode, func, op, op_facts)
                except CannotRebuild:
                    return wrapped(*args, **kwargs)  # upstream's view, its own values
            else:
                result = self._fast.in_place(mode, func, op)
            if result is not NOT_FAST:
                return result
        elif settings.repair and op_facts.bit_view and not settings.fast:
            # upstream's conj of a 0-d tensor (its constant path) loses the bit, fake and values
            try:
                result = self._fast.view(mode, func, op, op_facts)
            except CannotRebuild:
                return wrapped(*args, **kwargs)
            if result is not NOT_FAST:
                return result
        return self._upstream.call(wrapped, args, kwargs, mode, func, op, op_facts)

    def _guarded(self, method: Any, *args: Any) -> None:
        try:
            method(*args)
        except Exception as exc:  # never break the host's fake computation
            self._errors.internal_error("dispatch", exc)


class _Found(NamedTuple):
    """What the sites need that may import, found before the dispatcher's lock is taken."""

    entry: bool  # ``FakeTensorMode.__torch_dispatch__``
    fallback: bool  # ``run_fallback_kernel``
    data: Any  # ``TensorBase.data``'s descriptor, where ``Tensor.data`` is wrapped
    retain_grad: Any  # ``TensorBase.retain_grad`` (or None)
    scaler: Any  # ``torch.amp.GradScaler`` (or None)


def _find() -> _Found:
    """What the sites need that may import (before the lock)."""
    return _Found(
        entry=_targets.resolve_optional(_targets.FAKE_MODE_TORCH_DISPATCH) is not None,
        fallback=_targets.resolve_optional(_targets.RUN_FALLBACK_KERNEL) is not None,
        data=tensor_data_descriptor(),
        retain_grad=_targets.tensor_retain_grad(),
        scaler=grad_scaler_class(),
    )


def _make_sites(self: Dispatcher, found: _Found) -> list[_sites.Site]:
    """The dispatch wrapper's sites: ``FakeTensorMode.dispatch``, its entry, the methods, the
    scaler, ``run_fallback_kernel``. Called under the dispatcher's lock: imports nothing."""
    cls = self._resolved.fake_mode_cls
    name = _targets.FAKE_MODE_DISPATCH.qualname.rsplit(".", 1)[1]
    dispatch = _sites.function_site(
        cls, name, self.dispatch, "in-place updates of real tensors inside the mode are not watched"
    )
    if dispatch is None:
        return []
    sites = [dispatch]
    if self._device is not None and found.entry:
        entry = _sites.function_site(
            cls, "__torch_dispatch__", self.entry, "prim.device takes the mode's entry"
        )
        if entry is not None:
            sites.append(entry)
    sites += method_sites(
        self._resolved,
        self.settings,
        lambda: self.observing,
        self._armer,
        self._errors,
        found.data,
        found.retain_grad,
    )
    scaler = self.born_inside.scaler_site(found.scaler)
    if scaler is not None:
        sites.append(scaler)
    if found.fallback and self._can_read_frames:
        fallback = _sites.function_site(
            self._resolved.fake_tensor_module,
            "run_fallback_kernel",
            self._fallback,
            "ops without a meta kernel keep the zeros' values",
        )
        if fallback is not None:
            sites.append(fallback)
    return sites
