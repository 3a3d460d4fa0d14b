"""``buffers="write_back"`` (opt-in): in-place updates of real op inputs reach the real tensors.

By default (upstream semantics) a real tensor converted by a propagating mode as an op input gets
a fake whose propagated values are a private *copy*: an in-place update applied inside the mode
(BatchNorm's ``running_mean``/``running_var``, spectral_norm's ``_u``/``_v``, an EMA of frozen
weights, optimizer state) changes the copy and the real tensor stays as it was, while updates
FakeTensorMode runs for real on all-real arguments (``num_batches_tracked += 1``) do reach it.

With write-back on, the fake's propagated values *are* the real tensor (a ``detach()`` of it:
same storage, same version counter, never its autograd identity), so every in-place update the
mode applies to it for real happens to the real tensor, as in eager mode. Exactly once:

* **Ops FakeTensorMode already ran for real** (no fake argument, numbers allowed as tensors: the
  constant-propagation branch, which converts the arguments afterwards): never aliased, the
  update is upstream's and happened once (``_targets.op_ran_for_real``).
* **Decomposed ops.** FakeTensorMode runs an op for real on the propagated values, then runs its
  Python decomposition / meta implementation *under the mode*, whose inner in-place ops are run
  for real again (``native_batch_norm`` updates the running statistics twice: measured on
  2.13.0 and 2.14.1; with private copies only the copy is wrong, with an alias the buffer would
  be). This module wraps ``FakeTensorMode.dispatch`` while write-back is on and tracks, per
  thread and mode, the outermost op: a nested op that writes an argument aliased to a real tensor
  works on a shadow copy; when the outermost op returns the alias is put back, and the shadow's
  result is written to the real tensor only if the outer op did not write it for real itself.
* **Only the outermost op's own arguments are aliased**, only when converted as op inputs
  (``validate_and_convert_non_fake_tensors``: positional ``(mode, t)``), never in a mode with a
  ShapeEnv, never by ``from_tensor`` (tracers' fakification: torch.compile and export keep their
  no-mutation rule), never a tensor that requires grad (parameters keep the value machinery of
  ``_values``; a parameter updated in place inside the mode is reported, not written back), never
  a FakeTensor, a meta tensor, a non-strided or subclass tensor.

Every write-back is traced (``buffer_written_back``, with bytes). Turning write-back off (or
``uninstall()``) gives every aliased fake a private copy again. ``dispatch`` is wrapped only
while a propagating user mode lives or write-back is on (a :class:`_sites.Site`): with no such
mode, nothing here runs and ``dispatch`` is torch's own function. The global optimizer step
post-hook that makes optimizer state born inside the mode real is registered only from the
first propagating user mode on (a :class:`_sites.HookSite`): a process that never builds one,
torch.compile included, keeps torch's hooks as they were.

Registries: WeakIdTables (O(1), never keeping a tensor alive) and a per-thread frame stack.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch

from .. import trace
from . import leaves as _leaves
from . import sites as _sites
from . import state as _state
from .state import warn_once
from .weak import WeakIdTable

_NO_WRITES: tuple[tuple[int, str], ...] = ()


class Frame:
    """The outermost op of one mode on one thread."""

    __slots__ = (
        "aliased",
        "arguments",
        "copy_back",
        "depth",
        "direct",
        "func",
        "keep",
        "lost",
        "mode",
        "nested",
        "op",
        "param_swaps",
        "real_ok",
        "real_out",
        "scanned",
        "swaps",
        "written",
    )

    def __init__(self, mode: Any, op: tuple[Any, Any], func: Any = None) -> None:
        self.mode = mode
        #: the op
        self.func = func
        #: a random op's real output, read from upstream's frame at its first nested op (builds
        #: whose decomposition path drops it); ``None`` until then
        self.real_out: Any = None
        #: the op's (args, kwargs)
        self.op = op
        #: whether :meth:`WriteBack.scan` ran (only when the op or a nested op writes)
        self.scanned = False
        #: nesting below the outermost op (0: the outermost op itself)
        self.depth = 0
        #: storage data pointer -> the real tensor over it, for every argument of the op whose
        #: fake aliases a real tensor
        self.aliased: dict[int, Any] = {}
        #: storage data pointers the op writes (its schema, or a nested op writing the argument)
        self.written: set[int] = set()
        #: the subset nested ops wrote directly (the op itself did not run for real)
        self.nested: set[int] = set()
        #: storage data pointers of the values of the op's own tensor arguments
        self.arguments: set[int] = set()
        #: whether FakeTensorMode runs the op for real: every fake argument has real values
        #: (the modes this module acts on have no ShapeEnv, so that is upstream's whole test)
        self.real_ok = True
        #: (fake, its propagated values before, the shadow given to nested ops)
        self.swaps: list[tuple[Any, Any, Any]] = []
        #: id -> real tensor, for the real tensors the op's schema writes (the op's own
        #: arguments: ``p.grad.zero_()``, ``param.add_(...)``, ``out=``, ``Tensor(a!)[]`` lists)
        self.direct: dict[int, Any] = {}
        #: id -> (real tensor, the op that wrote only its fake copy): reported when the op returns
        self.lost: dict[int, tuple[Any, str]] = {}
        #: write-back: storage data pointer of a private copy the op itself wrote through a view
        #: (``weight.detach()``) -> (the real root, the copy's storage); copied to the real root
        #: when the op returns, unless a nested op wrote that storage too (then it is reported)
        self.copy_back: dict[int, tuple[Any, Any]] = {}
        #: the converted fakes of this op's real arguments that hold private copies, alive until
        #: the op returns (its view outputs then keep the stand-in records)
        self.keep: list[Any] = []
        #: (fake, its propagated values before): parameters aliased for this op only
        self.param_swaps: list[tuple[Any, Any]] = []


class WriteBack:
    """One installation's in-place machinery: reports (always) and write-back (opt-in).

    ``FakeTensorMode.dispatch`` is watched from the first need on (:meth:`observe`: when a
    propagating user mode is built, install's ``FakeTensorMode.__init__`` wrapper, at the first
    op input such a mode converts, or when write-back is turned on), and wrapped only while such
    a mode lives or write-back is on; otherwise nothing here runs. Wrapped, it returns at once
    for modes without real values or with a ShapeEnv (a tracer's, alive beside a user's)."""

    def __init__(self, resolved: Any, applied: Any) -> None:
        self._r = resolved
        self._applied = applied
        self._is_fake = resolved.is_fake
        self._tls = threading.local()
        self._lock = threading.Lock()
        #: op -> its written arguments ((position, name), ...) from the schema
        self._written: dict[Any, tuple[tuple[int, str], ...]] = {}
        #: fake -> the real tensor its propagated values alias
        self._aliases: WeakIdTable[Any] = WeakIdTable()
        #: fakes made (or returned) by ``from_tensor``: never aliased
        self._refused: WeakIdTable[bool] = WeakIdTable()
        #: aliased storage data pointer -> weak reference to the real tensor that owns it
        self._storages: dict[int, Any] = {}
        #: storage data pointer of a propagated private copy -> (weak ref to the fake root
        #: that owns it, weak ref to the real root it stands in for): a write to any fake over
        #: that storage (the converted tensor, a view of it, a nested op's argument) is an
        #: update that reaches only the copy
        self._stand_ins: dict[int, _StandIn] = {}
        #: write-back semantics on (``buffers="write_back"``)
        self.enabled = False
        #: the owner of the ``FakeTensorMode.dispatch`` wrapper (``_propagation.Propagation``),
        #: which calls this watch around every op of a propagating user mode
        self._dispatcher: Any = None
        self._step_hook: Any = None

    # -- on / off --------------------------------------------------------------------------------

    def attach(self, dispatcher: Any) -> None:
        """``dispatcher`` (``_propagation.Propagation``) owns the ``dispatch`` wrapper and the
        per-thread stack of outermost ops (``dispatcher.tls.stack``), which conversions read."""
        self._dispatcher = dispatcher
        self._tls = dispatcher.tls

    @property
    def observing(self) -> bool:
        """``FakeTensorMode.dispatch`` is watched (reports; write-back when enabled)."""
        return self._dispatcher is not None and self._dispatcher.observing

    def observe(self) -> bool:
        """Watch the ops of propagating user modes (idempotent, thread-safe): see
        ``Propagation.observe``. False where ``dispatch`` is missing (then in-place updates are
        reported only where the converter sees them)."""
        return self._dispatcher is not None and self._dispatcher.observe()

    def enable(self) -> bool:
        """Write-back on; False (write-back unavailable) when ``dispatch`` is missing."""
        if not self.observe():
            return False
        register = _step_hook_registrar()  # import first, then lock (issue 40)
        with self._lock:
            if self.enabled:
                return True
            self.enabled = True
            # Registered from the first propagating user mode on, not now: TorchDynamo calls
            # every global step post-hook where it traces an optimizer step, and a function of
            # ours (on its skip list) there is a graph break inside the hooks' loop, which fails
            # the whole frame (one frame fewer compiled under compiled autograd with optimizers
            # stepped in post-accumulate-grad hooks). Optimizer state is only born fake inside
            # such a mode, which is seen (built or converting) before that step's post-hooks run.
            site = _sites.HookSite(register, self._after_optimizer_step) if register else None
            self._step_hook = site
        if site is not None:
            site.start()  # outside our lock: registers now where a propagating user mode lives
        self._dispatcher.set_policy(True)  # wrapped while write-back is on, modes or not
        if trace.enabled(trace.INFO):
            trace.emit("write_back_enabled", trace.INFO)
        return True

    def disable(self) -> int:
        """Write-back off: every aliased fake gets a private copy again (upstream semantics from
        now on; ``dispatch`` stays wrapped while a propagating user mode lives, for the
        reports). Returns how many fakes were un-aliased."""
        with self._lock:
            if not self.enabled:
                return 0
            self.enabled = False
            hook, self._step_hook = self._step_hook, None
            aliased = list(self._aliases.items())
            self._aliases.clear()
            self._storages.clear()
        if self._dispatcher is not None:
            self._dispatcher.set_policy(False)
        if hook is not None:
            hook.close()
        count = sum(self._unalias(fake, real) for fake, real in aliased)
        if trace.enabled(trace.INFO):
            trace.emit("write_back_disabled", trace.INFO, unaliased=count)
        return count

    # -- the watch, called by the dispatch wrapper (``_propagation.Propagation.dispatch``) -------

    def written_args(self, func: Any) -> tuple[tuple[int, str], ...]:
        written = self._written.get(func)
        if written is None:
            schema = getattr(func, "_schema", None)
            found = []
            for index, argument in enumerate(getattr(schema, "arguments", ())):
                info = argument.alias_info
                if info is not None and info.is_write:
                    found.append((index, argument.name))
            written = self._written[func] = tuple(found) or _NO_WRITES
        return written

    def scan(self, frame: Frame) -> None:
        """The outermost op's arguments (once, when the op or a nested op writes): will it run
        for real, where are its arguments' values, which fake arguments alias real tensors
        already (real ones are noted when converted)."""
        frame.scanned = True
        for t in _tensor_arguments(*frame.op):
            if self._is_fake(t):
                real = t.real_tensor
                if real is None:
                    frame.real_ok = False
                    continue
                ptr = _storage(real)
                if ptr is not None and self._storages and self._owner(ptr) is not None:
                    frame.aliased[ptr] = real
            else:
                ptr = _storage(t)
            if ptr is not None:
                frame.arguments.add(ptr)

    def enter(self, frame: Frame, written: Any) -> None:
        """The outermost op's schema writes arguments: the real ones are noted (their
        conversion decides whether the update reaches them); with write-back on, where their
        values are (for the shadows and the trace)."""
        if self.enabled:
            self.scan(frame)
        for t in _written_tensors(written, *frame.op):
            if self._is_fake(t):
                ptr = _storage(t.real_tensor)
                if ptr is None:
                    continue
                if self.enabled:
                    frame.written.add(ptr)
                if self._stand_ins:
                    self._fake_written(frame, ptr, "")
            elif t.layout == torch.strided and t.device.type != "meta":
                frame.direct[id(t)] = t
                ptr = _storage(t)
                if self.enabled and ptr is not None and not t.requires_grad:
                    frame.written.add(ptr)

    def nested_write(
        self, frame: Frame, func: Any, written: Any, op_args: Any, op_kwargs: Any
    ) -> None:
        """A nested op (a decomposition or meta implementation that FakeTensorMode runs under
        the mode) writes tensors. One over the propagated copy of a real tensor is an update of
        that real tensor (``native_batch_norm``'s running statistics: its schema does not mark
        them written): with write-back on, an aliased argument of the outer op is written (by
        the outer op's real run, or by this one when the outer op had no real values: the
        propagation repairs shadow the nested write otherwise); a copy's update is lost, and
        reported."""
        if self.enabled and not frame.scanned:
            self.scan(frame)
        if self.enabled and frame.arguments:
            for t in _written_tensors(written, op_args, op_kwargs):
                if not self._is_fake(t):
                    continue
                ptr = _storage(t.real_tensor)
                if ptr is None or ptr not in frame.arguments:
                    continue
                if ptr in frame.aliased:
                    frame.written.add(ptr)
                if not frame.real_ok:
                    frame.nested.add(ptr)
        if not self._stand_ins:
            return
        for t in _written_tensors(written, op_args, op_kwargs):
            if self._is_fake(t):
                ptr = _storage(t.real_tensor)
                if ptr is not None:
                    self._fake_written(frame, ptr, str(func))

    def returned(self, frame: Frame, func: Any, result: Any, ok: bool) -> None:
        """The outermost op returned (``ok``) or raised: parameters aliased for it get their
        own values back, write-backs are traced, copies written through a view are copied back,
        lost updates reported; a view of a stand-in keeps its record."""
        if ok and self._stand_ins and _is_view_op(func):
            self._views_of_stand_ins(func, result)
        if frame.written or frame.param_swaps:
            self._finish(frame)
        if ok and frame.copy_back:
            self._copy_back(frame)
        if ok and frame.lost:
            self._report_lost(frame, func)
        if ok and frame.direct:
            # real tensors the op wrote for real: their copies follow
            for t in frame.direct.values():
                if id(t) not in frame.lost:
                    self._applied.values.refresh(t)

    def _fake_written(self, frame: Frame, ptr: int, via: str) -> None:
        """A fake over storage ``ptr`` is written: when that is a real tensor's private copy,
        the update is lost (reported when the outer op returns)."""
        entry = self._stand_ins.get(ptr)
        real_root = entry.real(ptr) if entry is not None else None
        if real_root is None:
            return
        if self.enabled and not via and frame.depth == 0:
            # the outer op writes a view of the copy (``nn.Embedding(max_norm=...)``'s
            # ``weight.detach()``): its real run updates the copy once; copied back on return
            if ptr not in frame.copy_back and id(real_root) not in frame.lost:
                frame.copy_back[ptr] = (real_root, entry)
            return
        if ptr in frame.copy_back:
            del frame.copy_back[ptr]  # a nested op writes it too: not provably once
        if id(real_root) not in frame.lost:
            frame.lost[id(real_root)] = (real_root, via)

    def _stand_in(self, t: Any, fake: Any, real: Any) -> None:
        """``fake`` (converted from the real op input ``t``) holds a private copy: remember its
        storage, so writes to it (or to views of it) are known as lost updates of ``t``."""
        fake_root = fake._base if fake._base is not None else fake
        copy_root = getattr(fake_root, "real_tensor", None)
        ptr = _storage(copy_root) if copy_root is not None else None
        if ptr is None:
            return
        entry = self._stand_ins.get(ptr)
        root = t._base if t._base is not None else t
        if entry is None or entry.real(ptr) is not root:
            entry = self._stand_ins[ptr] = _StandIn(root, ptr, self._stand_ins)
        entry.hold(fake_root)

    def _views_of_stand_ins(self, func: Any, result: Any) -> None:
        """A view op returned fakes over a stand-in's storage (``w.detach()``, ``g[0]``): they
        keep the record alive (the converted fake itself may die first)."""
        for out in result if isinstance(result, list | tuple) else (result,):
            if self._is_fake(out):
                ptr = _storage(getattr(out, "real_tensor", None))
                if ptr is None:
                    continue
                entry = self._stand_ins.get(ptr)
                if entry is not None and entry.real(ptr) is not None:
                    entry.hold(out)

    def _finish(self, frame: Frame) -> None:
        """The outermost op returned: parameters aliased for this op get their own values
        back, every write-back is traced.

        (Version counters cannot tell what was written: the real run of an op bumps the alias's
        version, as eager does, only where the op's schema marks the argument written, and
        ``native_batch_norm``'s does not mark its running statistics.)"""
        if frame.param_swaps:
            with self._r.no_dispatch():
                # A parameter's fake goes back to its own copy: the values machinery re-syncs
                # it from the real parameter (whose version moved) at its next conversion.
                for fake, before in reversed(frame.param_swaps):
                    fake.real_tensor = before
        for ptr in frame.written:
            real = frame.aliased.get(ptr)
            if real is None:
                continue
            owner = self._owner(ptr)
            described = owner if owner is not None else real
            if frame.real_ok or ptr in frame.nested:
                if trace.enabled(trace.INFO):
                    trace.emit(
                        "buffer_written_back",
                        trace.INFO,
                        **_leaves.leaf_fields(described),
                        bytes=real.numel() * real.element_size(),
                        via="op" if frame.real_ok else "decomposition",
                    )
            elif trace.enabled(trace.WARNING):
                trace.emit(
                    "buffer_not_written_back",
                    trace.WARNING,
                    **_leaves.leaf_fields(described),
                    reason="the op had no real values (an argument without propagated values)",
                )

    def _copy_back(self, frame: Frame) -> None:
        """Write-back: the outer op updated a real tensor's private copy through a view of it,
        once: the copy's storage becomes the real tensor's values (through a ``detach()`` of
        it, so its version moves as eager's does). Where the layouts differ it is reported."""
        for ptr, (root, entry) in frame.copy_back.items():
            holder = entry.holder(ptr)
            copy = getattr(holder, "real_tensor", None) if holder is not None else None
            if copy is None:
                frame.lost[id(root)] = (root, "")
                continue
            storage = copy.untyped_storage()
            target = root.detach()
            if (
                storage.nbytes() != target.untyped_storage().nbytes()
                or root.layout != torch.strided
            ):
                frame.lost[id(root)] = (root, "")
                continue
            with self._r.no_dispatch(), torch.no_grad():
                values = torch.empty(0, dtype=root.dtype, device=root.device)
                values.set_(storage, root.storage_offset(), root.shape, root.stride())
                target.copy_(values)
            if trace.enabled(trace.INFO):
                trace.emit(
                    "buffer_written_back",
                    trace.INFO,
                    **_leaves.leaf_fields(root),
                    bytes=root.numel() * root.element_size(),
                    via="view",
                )

    # -- reports: updates that did not reach the real tensor ------------------------------------

    def _report_lost(self, frame: Frame, func: Any) -> None:
        """The outer op returned having updated only fake copies of these real tensors."""
        op = str(func)
        for real, via in frame.lost.values():
            report_lost(real, op, via, self.enabled)

    # -- conversions (called by _values for op inputs of a propagating mode) --------------------

    def op_input(self, mode: Any, t: Any, fake: Any) -> None:
        """``t`` (real) was converted as an op input of ``mode`` (propagating) and the values
        machinery has decided what its fake holds. When the op being dispatched writes ``t``
        (its schema says so) and the fake's values are not ``t`` itself, the update would reach
        only the copy: with write-back on, a parameter updated under ``no_grad`` (an optimizer
        step, a max-norm renormalisation) is aliased for this op; otherwise it is lost and
        reported when the op returns."""
        real = fake.real_tensor
        if real is None or real.layout != torch.strided or t.layout != torch.strided:
            return
        if _storage(real) == _storage(t):
            return  # aliased (write-back, a managed .grad): updates reach t
        self._stand_in(t, fake, real)
        stack: list[Frame] | None = getattr(self._tls, "stack", None)
        frame = stack[-1] if stack else None
        if frame is None or frame.mode is not mode:
            self._unobserved_op_input(mode, t, fake)
            return
        frame.keep.append(fake)
        if frame.depth != 0 or id(t) not in frame.direct:
            return
        if _state.op_ran_for_real(self._r):
            return  # upstream ran the op on the real arguments first (constant propagation)
        if (
            self.enabled
            and t.requires_grad
            and not torch.is_grad_enabled()
            and self._alias_parameter(frame, t, fake, real)
        ):
            return
        frame.lost[id(t)] = (t, "")

    def _unobserved_op_input(self, mode: Any, t: Any, fake: Any) -> None:
        """No frame of ``mode`` on this thread: the op started before ``dispatch`` was wrapped
        (the very first op of the first propagating mode). The converting frame tells the op."""
        found = self._r.dispatching_op()
        if found is None:
            return
        func, op_args, op_kwargs = found
        written = self.written_args(func)
        if not written:
            return
        if any(
            w is t for w in _written_tensors(written, op_args, op_kwargs or {})
        ) and not _state.op_ran_for_real(self._r):
            report_lost(t, str(func), "", self.enabled)

    def _alias_parameter(self, frame: Frame, t: Any, fake: Any, real: Any) -> bool:
        """Write-back: a tensor that requires grad, written by this op under ``no_grad``: its
        fake's values are ``t`` itself for this op only (then its own copy again, re-synced at
        its next conversion), so the update reaches ``t`` once, as in eager mode."""
        if (
            type(t) not in (torch.Tensor, torch.nn.Parameter)
            or t._base is not None
            or real.layout != torch.strided
            or real.dtype != t.dtype
            or real.shape != t.shape
            or real.stride() != t.stride()
            or real.storage_offset() != t.storage_offset()
        ):
            return False
        ptr = _storage(t)
        if ptr is None:
            return False
        with self._r.no_dispatch():
            fake.real_tensor = t.detach()
        frame.param_swaps.append((fake, real))
        if not frame.scanned:
            self.scan(frame)
        frame.arguments.add(ptr)
        frame.aliased[ptr] = t
        frame.written.add(ptr)
        return True

    def convert(self, mode: Any, t: Any, fake: Any, op_input: bool) -> bool:
        """A real tensor that does not require grad was converted by a propagating mode: as an
        op input, maybe alias it (:meth:`on_convert`); by ``from_tensor`` (a fake the caller
        holds and may update in place, expecting upstream's semantics), never alias that fake,
        now or later (the converter's memo returns it for later op inputs too)."""
        if op_input:
            return fake not in self._refused and self.on_convert(mode, t, fake)
        self._refused.set(fake, True)
        real = self._aliases.pop(fake)
        if real is not None:
            self._unalias(fake, real)
        return False

    def _unalias(self, fake: Any, real: Any) -> bool:
        """Give ``fake`` a private copy of ``real`` again if it still aliases it."""
        if getattr(fake, "real_tensor", None) is not real:
            return False
        with self._r.no_dispatch(), torch.no_grad():
            fake.real_tensor = _private_copy(real)
        return True

    def on_convert(self, mode: Any, t: Any, fake: Any) -> bool:
        """``t`` (real, does not require grad) was just converted as an op input: alias the
        fake's propagated values to it when this is the outermost op of ``mode`` and the op was
        not already run for real. True when the fake aliases ``t`` (now or from before)."""
        stack: list[Frame] | None = getattr(self._tls, "stack", None)
        if not stack:
            return False
        frame = stack[-1]
        if frame.mode is not mode or frame.depth != 0:
            return False
        real = fake.real_tensor
        ptr = _storage(t)
        if ptr is None or real is None or real.layout != torch.strided:
            return False
        if _storage(real) == ptr:
            self._noted(frame, ptr, t)
            return True  # aliased before (the converter's memo returned the same fake)
        if (
            type(t) not in (torch.Tensor, torch.nn.Parameter)
            or real.dtype != t.dtype
            or real.shape != t.shape
            or real.stride() != t.stride()
            or real.storage_offset() != t.storage_offset()
        ):
            return False
        if _state.op_ran_for_real(self._r) is not False:
            return False  # upstream already applied this op to t for real (or cannot tell)
        root = t._base if t._base is not None else t
        fake_root = fake._base if fake._base is not None else fake
        with self._r.no_dispatch():
            if fake_root is not fake:
                root_real = getattr(fake_root, "real_tensor", None)
                if (
                    root_real is not None
                    and _storage(root_real) != ptr
                    and root_real.shape == root.shape
                    and root_real.stride() == root.stride()
                    and root_real.storage_offset() == root.storage_offset()
                    and root_real.dtype == root.dtype
                ):
                    root_alias = root.detach()
                    fake_root.real_tensor = root_alias
                    self._aliases.set(fake_root, root_alias)
            alias = t.detach()
            fake.real_tensor = alias
        self._aliases.set(fake, alias)
        self._own(ptr, root)
        self._noted(frame, ptr, t)
        return True

    @staticmethod
    def _noted(frame: Frame, ptr: int, t: Any) -> None:
        frame.aliased[ptr] = t

    def _own(self, ptr: int, root: Any) -> None:
        def forget(ref: Any, ptr: int = ptr, storages: dict[int, Any] = self._storages) -> None:
            if storages.get(ptr) is ref:
                del storages[ptr]

        self._storages[ptr] = weakref.ref(root, forget)

    def _owner(self, ptr: int) -> Any:
        ref = self._storages.get(ptr)
        owner = None if ref is None else ref()
        if owner is None or _storage(owner) != ptr:
            return None
        return owner

    # -- optimizer state created inside the mode ------------------------------------------------

    def _after_optimizer_step(self, optimizer: Any, _args: Any, _kwargs: Any) -> None:
        """Write-back: an optimizer step made inside a propagating mode creates its state there
        (SGD's momentum buffer, Adam's moments): FakeTensors. Their propagated values become
        real tensors in the optimizer's state, so later steps (inside the mode or not) update
        real state, as in eager mode. A fake without values stays, and is reported."""
        try:
            state = optimizer.state
            for param, entries in list(state.items()):
                for key, value in list(entries.items()):
                    if not self._is_fake(value):
                        continue
                    mode = getattr(value, "fake_mode", None)
                    if not getattr(mode, "propagate_real_tensors", False):
                        continue
                    real = value.real_tensor
                    if real is None:
                        report_lost(param, f"optimizer state {key!r}", "no real values", True)
                        continue
                    with self._r.no_dispatch(), torch.no_grad():
                        entries[key] = _private_copy(real)
                    if trace.enabled(trace.INFO):
                        trace.emit(
                            "optimizer_state_materialized",
                            trace.INFO,
                            **_leaves.leaf_fields(param),
                            key=str(key),
                            bytes=real.numel() * real.element_size(),
                        )
        except Exception as exc:  # never break the host's training step
            self._applied.internal_error("write_back", exc)

    # -- GradScaler state created inside the mode ----------------------------------------------

    def scaler_site(self) -> _sites.Site | None:
        """A :class:`_sites.Site` for ``torch.amp.GradScaler.update`` (in place while a
        propagating user mode lives), or None where the class is absent."""
        import wrapt

        try:
            from torch.amp.grad_scaler import GradScaler
        except ImportError:
            return None
        original = GradScaler.__dict__.get("update")
        if not callable(original):
            return None
        return _sites.Site(
            GradScaler,
            "update",
            wrapt.FunctionWrapper(original, self._after_scaler_update),
            original,
            registry=_sites.user_modes,
            lost="a GradScaler whose state is created inside the mode keeps FakeTensors",
        )

    def _after_scaler_update(self, wrapped: Any, scaler: Any, args: Any, kwargs: Any) -> Any:
        """``GradScaler.update``: a scaler first used inside a propagating mode created its
        scale and growth tracker there (``torch.full`` in ``scale()``): FakeTensors, which the
        scaler keeps for every later step, inside the mode or not. With write-back their
        propagated values become real tensors (``optimizer_state_materialized``, key
        ``GradScaler._scale``); otherwise the first is reported with the fix."""
        result = wrapped(*args, **kwargs)
        try:
            for key in ("_scale", "_growth_tracker"):
                value = getattr(scaler, key, None)
                if value is None or not self._is_fake(value):
                    continue
                mode = getattr(value, "fake_mode", None)
                if not getattr(mode, "propagate_real_tensors", False):
                    continue
                real = value.real_tensor
                if not self.enabled or real is None:
                    report_fake_state(f"GradScaler.{key}", value, real)
                    continue
                with self._r.no_dispatch(), torch.no_grad():
                    made = _private_copy(real)
                setattr(scaler, key, made)
                if trace.enabled(trace.INFO):
                    trace.emit(
                        "optimizer_state_materialized",
                        trace.INFO,
                        **_leaves.leaf_fields(made),
                        key=f"GradScaler.{key}",
                        bytes=real.numel() * real.element_size(),
                    )
        except Exception as exc:  # never break the host's training step
            self._applied.internal_error("write_back", exc)
        return result


def report_fake_state(what: str, fake: Any, real: Any) -> None:
    """State an object keeps for later steps (a GradScaler's scale) was created inside a
    propagating mode: a FakeTensor. One ``update_lost`` event (warning), one warning per
    process."""
    _Lost.count += 1
    fix = (
        "buffers='write_back' makes such state real after the step; or create it outside the "
        "mode (one `scaler.scale(loss)` before the `with FakeTensorMode(...)` block)"
    )
    if trace.enabled(trace.WARNING):
        fields = _leaves.leaf_fields(real if real is not None else fake)
        fields.update(kind="tensor", op=what, bytes=0, fix=fix, via="created inside the mode")
        trace.emit_fields("update_lost", trace.WARNING, fields)
    warn_once(
        "fake_state",
        f"fakegrad_patch: {what} was created inside a propagating FakeTensorMode and is a "
        "FakeTensor, which every later step (inside the mode or not) goes on using. "
        f"Fix: {fix}. Traced as `update_lost`.",
    )


def _step_hook_registrar() -> Any:
    """``torch.optim.optimizer.register_optimizer_step_post_hook`` (public; every optimizer),
    or None where absent."""
    try:
        from torch.optim.optimizer import register_optimizer_step_post_hook
    except ImportError:
        return None
    return register_optimizer_step_post_hook


def kind_of(t: Any) -> str:
    """How a report names what was lost: ``parameter`` (requires grad), ``gradient`` (a real
    ``.grad`` the patch knows), ``buffer`` (named by ``name_parameters``), else ``tensor``."""
    if t.requires_grad:
        return "parameter"
    if _leaves.has_managed_grads() and _leaves.managed_grad(t):
        return "gradient"
    if _leaves.name_of(t) is not None:
        return "buffer"
    return "tensor"


_FIX = {
    "parameter": (
        "buffers='write_back' writes in-place updates of a parameter made under "
        "torch.no_grad() by an op that takes the parameter itself (optimizer steps) to the real "
        "parameter; or step the optimizer after the `with FakeTensorMode(...)` block"
    ),
    "other": (
        "buffers='write_back' (fakegrad_patch.configure, FAKEGRAD_BUFFERS=write_back) writes "
        "in-place updates of real tensors that do not require grad (buffers, .grad, optimizer "
        "and scaler state) back; or make the update outside the mode"
    ),
    "write_back": (
        "make this update outside the `with FakeTensorMode(...)` block (write-back covers "
        "tensors that do not require grad, parameters updated under torch.no_grad() by an op "
        "that takes the parameter itself, and writes through a view made by the op itself; "
        "not a GradScaler scale created inside the mode, nor a write a decomposition repeats)"
    ),
}


class _Lost:
    """How many updates were reported lost in this process (``status()["updates_lost"]``)."""

    count = 0


def lost_count() -> int:
    return _Lost.count


def report_lost(real: Any, op: str, via: str, write_back: bool) -> None:
    """One ``update_lost`` event (warning) and one warning per process."""
    _Lost.count += 1  # a statistic: a lost increment under threads is harmless
    kind = kind_of(real)
    fix = _FIX["write_back" if write_back else "parameter" if kind == "parameter" else "other"]
    if trace.enabled(trace.WARNING):
        fields = _leaves.leaf_fields(real)
        fields.update(
            kind=kind,
            op=op,
            bytes=real.numel() * real.element_size(),
            fix=fix,
        )
        if via:
            fields["via"] = via
        trace.emit_fields("update_lost", trace.WARNING, fields)
    name = _leaves.name_of(real)
    what = f"{kind} {name!r}" if name else f"a real {kind} of shape {list(real.shape)}"
    warn_once(
        "update_lost",
        f"fakegrad_patch: an in-place update of {what} ({op}) inside a propagating "
        "FakeTensorMode reached only its fake copy: the real tensor kept its old value. "
        f"Fix: {fix}. Every such update is traced (`update_lost`; `python -m fakegrad_patch "
        "trace`).",
    )


class _StandIn:
    """The fakes (a converted fake, views of it) whose propagated values are one private copy of
    a real tensor: weakly held (a dict by id: O(1) per view op at any number of views); the
    record dies with the last of them."""

    __slots__ = ("__weakref__", "holders", "ptr", "root", "table")

    def __init__(self, root: Any, ptr: int, table: dict[int, Any]) -> None:
        self.root = weakref.ref(root)
        self.ptr = ptr
        self.table = table
        #: id(fake) -> weak reference to it
        self.holders: dict[int, Any] = {}

    def hold(self, fake: Any) -> None:
        key = id(fake)
        ref = self.holders.get(key)
        if ref is not None and ref() is fake:
            return
        me = weakref.ref(self)

        def forget(dead: Any, key: int = key) -> None:
            entry: _StandIn | None = me()
            if entry is None:
                return
            holders, table, ptr = entry.holders, entry.table, entry.ptr
            if holders.get(key) is not dead:
                return
            del holders[key]
            if not holders and table.get(ptr) is entry:
                del table[ptr]

        self.holders[key] = weakref.ref(fake, forget)

    def holder(self, ptr: int) -> Any:
        """A live fake whose values are over ``ptr`` (None when none is left)."""
        for ref in list(self.holders.values()):
            holder = ref()
            if holder is not None and _storage(getattr(holder, "real_tensor", None)) == ptr:
                return holder
        return None

    def real(self, ptr: int) -> Any:
        """The real tensor, while a holder still has its values over ``ptr``; else None."""
        root = self.root()
        if root is None:
            return None
        for ref in list(self.holders.values()):
            holder = ref()
            if holder is not None and _storage(getattr(holder, "real_tensor", None)) == ptr:
                return root
        return None


_VIEW_OPS: dict[Any, bool] = {}


def _is_view_op(func: Any) -> bool:
    """A view op, or ``set_`` (its output takes another tensor's storage)."""
    view = _VIEW_OPS.get(func)
    if view is None:
        schema = getattr(func, "_schema", None)
        view = _VIEW_OPS[func] = bool(getattr(func, "is_view", False)) or (
            schema is not None and schema.name == "aten::set_"
        )
    return view


def _op_arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """``dispatch(func, types, args=(), kwargs={})``'s op arguments."""
    op_args = args[2] if len(args) > 2 else kwargs.get("args", ())
    op_kwargs = args[3] if len(args) > 3 else kwargs.get("kwargs")
    return op_args, op_kwargs or {}


def _storage(t: Any) -> int | None:
    """The data pointer of a real strided tensor's storage (None: no tensor, not strided, meta):
    computed from the tensor's own pointer (``untyped_storage()`` costs microseconds)."""
    if t is None or t.layout != torch.strided or t.device.type == "meta":
        return None
    return int(t.data_ptr() - t.storage_offset() * t.element_size())


def _tensors(values: Any) -> list[Any]:
    """The tensors among aten arguments: tensors, and the tensors of ``Tensor[]`` lists."""
    out = []
    for value in values:
        if isinstance(value, torch.Tensor):
            out.append(value)
        elif isinstance(value, list | tuple):
            out.extend(v for v in value if isinstance(v, torch.Tensor))
    return out


def _tensor_arguments(op_args: Any, op_kwargs: Any) -> list[Any]:
    return _tensors((*op_args, *op_kwargs.values()))


def _written_tensors(written: Any, op_args: Any, op_kwargs: Any) -> list[Any]:
    return _tensors(
        op_args[index] if index < len(op_args) else op_kwargs.get(name) for index, name in written
    )


def _private_copy(real: Any) -> Any:
    """A copy of ``real`` over a copy of its whole storage (same sizes, strides, offset)."""
    copy = torch.empty(0, dtype=real.dtype, device=real.device)
    copy.set_(real.untyped_storage().clone(), real.storage_offset(), real.shape, real.stride())
    return copy
