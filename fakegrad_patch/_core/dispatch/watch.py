"""The write-back watch: what each outermost op writes, and whether the update reached the real
tensor (reported when it did not; written back when write-back is on).

The dispatch wrapper calls it around the outermost op of a mode (``enter``, ``returned``) and at
every nested op that writes (``nested_write``); the converter wrapper calls ``op_input`` for every
real tensor a propagating mode converts as an op input. The per-op decisions:

* **Ops FakeTensorMode already ran for real** (no fake argument): the update is upstream's and
  happened once; the live copies of the written real tensors follow at once (``refresh``).
* **Decomposed ops**: FakeTensorMode runs an op for real, then its decomposition under the mode,
  whose nested writes run for real again (``native_batch_norm`` updates the running statistics
  twice). With write-back on, the nested writes of an aliased argument go to a shadow copy (the
  dispatch path's shadows) and the update reaches the real tensor once.
* **A write that reaches only a private copy** (a stand-in's storage): reported when the op
  returns (``update_lost``); with write-back on, a copy the outer op wrote through a view of it is
  copied back, and a parameter written under ``no_grad`` by an op that takes it is aliased for
  that op only.
"""

from __future__ import annotations

from typing import Any

import torch

from ... import trace
from .. import state as _state
from ..convert import leaves as _leaves
from ..convert import lending as _lending
from ..touchpoints.targets import Resolved
from ..typing import CopyRefresher
from .aliases import Aliases
from .frames import Frame, Frames
from .ops import facts
from .standins import StandIns, report_lost
from .tensors import PLAIN_TYPES, argument_tensors, storage_ptr, written_tensors


class Watch:
    """One installation's write-back watch."""

    def __init__(
        self, resolved: Resolved, frames: Frames, aliases: Aliases, copies: CopyRefresher
    ) -> None:
        self._resolved = resolved
        self._is_fake = resolved.is_fake
        self._frames = frames
        self._aliases = aliases
        self._copies = copies
        #: the private copies that stand in for real tensors (a write to one is a lost update)
        self._stand_ins = StandIns(resolved.is_fake)

    # -- around the outermost op ----------------------------------------------------------------

    def scan(self, frame: Frame) -> None:
        """The outermost op's arguments (once, when the op or a nested op writes): will it run
        for real, where are its arguments' values, which fake arguments alias real tensors
        already (real ones are noted when converted)."""
        frame.scanned = True
        for t in argument_tensors(*frame.op):
            if self._is_fake(t):
                real = t.real_tensor
                if real is None:
                    frame.real_ok = False
                    continue
                ptr = storage_ptr(real)
                if ptr is not None and self._aliases.owner(ptr) is not None:
                    frame.aliased[ptr] = real
            else:
                ptr = storage_ptr(t)
            if ptr is not None:
                frame.arguments.add(ptr)

    def enter(self, frame: Frame, written: Any) -> None:
        """The outermost op's schema writes arguments: the real ones are noted (their
        conversion decides whether the update reaches them); with write-back on, where their
        values are (for the shadows and the trace)."""
        enabled = self._aliases.enabled
        if enabled:
            self.scan(frame)
        for t in written_tensors(written, *frame.op):
            if self._is_fake(t):
                ptr = storage_ptr(t.real_tensor)
                if ptr is None:
                    continue
                if enabled:
                    frame.written.add(ptr)
                if self._stand_ins:
                    self._stand_ins.written(frame, ptr, "", self._aliases.enabled)
            elif t.layout == torch.strided and t.device.type != "meta":
                frame.direct[id(t)] = t
                ptr = storage_ptr(t)
                if enabled and ptr is not None and not t.requires_grad:
                    frame.written.add(ptr)

    def nested_write(
        self, frame: Frame, func: Any, written: Any, op_args: Any, op_kwargs: Any
    ) -> None:
        """A nested op (a decomposition or meta implementation run under the mode) writes
        tensors. One over the propagated copy of a real tensor is an update of that tensor
        (``native_batch_norm``'s running statistics: its schema does not mark them written):
        with write-back on, an aliased argument of the outer op is written (by the outer op's
        real run, or by this one when the outer op had no real values); a copy's update is
        lost, and reported."""
        enabled = self._aliases.enabled
        if enabled and not frame.scanned:
            self.scan(frame)
        if enabled and frame.arguments:
            for t in written_tensors(written, op_args, op_kwargs):
                if not self._is_fake(t):
                    continue
                ptr = storage_ptr(t.real_tensor)
                if ptr is None or ptr not in frame.arguments:
                    continue
                if ptr in frame.aliased:
                    frame.written.add(ptr)
                if not frame.real_ok:
                    frame.nested.add(ptr)
        if not self._stand_ins:
            return
        for t in written_tensors(written, op_args, op_kwargs):
            if self._is_fake(t):
                ptr = storage_ptr(t.real_tensor)
                if ptr is not None:
                    self._stand_ins.written(frame, ptr, str(func), self._aliases.enabled)

    def returned(self, frame: Frame, func: Any, result: Any, ok: bool) -> None:
        """The outermost op returned (``ok``) or raised: parameters aliased for it get their
        own values back, write-backs are traced, copies written through a view are copied back,
        lost updates reported, real tensors it wrote for real refresh their copies; a view of a
        stand-in keeps its record."""
        if ok and self._stand_ins and facts(func).is_view:
            self._stand_ins.hold_views(result)
        if frame.written or frame.param_swaps:
            self._finish(frame)
        if ok and frame.copy_back:
            self._copy_back(frame)
        if ok and frame.lost:
            op = str(func)
            for real, via in frame.lost.values():
                report_lost(real, op, via, self._aliases.enabled)
        if ok and frame.direct:
            for t in frame.direct.values():
                if id(t) not in frame.lost:
                    self._copies.refresh(t)

    # -- real tensors converted as op inputs --------------------------------------------------

    def op_input(self, mode: Any, t: Any, fake: Any) -> None:
        """``t`` (real) was converted as an op input of ``mode`` and the values machinery has
        decided what its fake holds. When the op being dispatched writes ``t`` and the fake's
        values are not ``t`` itself, the update would reach only the copy: with write-back on,
        a parameter updated under ``no_grad`` (an optimizer step, a max-norm renormalisation) is
        aliased for this op; otherwise it is lost and reported when the op returns."""
        real = fake.real_tensor
        if real is None or real.layout != torch.strided or t.layout != torch.strided:
            return
        if storage_ptr(real) == storage_ptr(t) and not _lending.is_lent(real.untyped_storage()):
            return  # aliased (write-back, a managed .grad): updates reach t
        self._stand_ins.remember(t, fake)  # lent values too: copied before any write
        frame = self._frames.top()
        if frame is None or frame.mode is not mode:
            self._unobserved_op_input(t)
            return
        frame.keep.append(fake)
        if frame.depth != 0 or id(t) not in frame.direct:
            return
        if _state.op_ran_for_real(self._resolved):
            return  # upstream ran the op on the real arguments first (constant propagation)
        if (
            self._aliases.enabled
            and t.requires_grad
            and not torch.is_grad_enabled()
            and self._alias_parameter(frame, t, fake, real)
        ):
            return
        frame.lost[id(t)] = (t, "")

    def owned(self, old: int, new: int) -> None:
        """Lent values over ``old`` got their own copy at ``new`` (convert/lending.py): the
        stand-in records follow them."""
        self._stand_ins.moved(old, new)

    def _unobserved_op_input(self, t: Any) -> None:
        """No frame of the mode on this thread: the op started before ``dispatch`` was wrapped
        (the very first op of the first propagating mode). The converting frame tells the op."""
        found = self._resolved.dispatching_op()
        if found is None:
            return
        func, op_args, op_kwargs = found
        written = facts(func).written
        if not written:
            return
        if any(
            w is t for w in written_tensors(written, op_args, op_kwargs or {})
        ) and not _state.op_ran_for_real(self._resolved):
            report_lost(t, str(func), "", self._aliases.enabled)

    def _alias_parameter(self, frame: Frame, t: Any, fake: Any, real: Any) -> bool:
        """Write-back: a tensor that requires grad, written by this op under ``no_grad``: its
        fake's values are ``t`` itself for this op only (then its own copy again, re-synced at
        its next conversion), so the update reaches ``t`` once, as in eager mode."""
        if (
            type(t) not in PLAIN_TYPES
            or t._base is not None
            or real.layout != torch.strided
            or real.dtype != t.dtype
            or real.shape != t.shape
            or real.stride() != t.stride()
            or real.storage_offset() != t.storage_offset()
        ):
            return False
        ptr = storage_ptr(t)
        if ptr is None:
            return False
        with self._resolved.no_dispatch():
            fake.real_tensor = t.detach()
        frame.param_swaps.append((fake, real))
        if not frame.scanned:
            self.scan(frame)
        frame.arguments.add(ptr)
        frame.aliased[ptr] = t
        frame.written.add(ptr)
        return True

    # -- when the outermost op returns ----------------------------------------------------------

    def _finish(self, frame: Frame) -> None:
        """Parameters aliased for this op get their own values back; every write-back is
        traced. (Version counters cannot tell what was written: ``native_batch_norm``'s schema
        does not mark its running statistics.)"""
        if frame.param_swaps:
            with self._resolved.no_dispatch():
                # the parameter's fake goes back to its own copy, which the values machinery
                # refreshes from the real parameter
                for fake, before in reversed(frame.param_swaps):
                    fake.real_tensor = before
        for ptr in frame.written:
            real = frame.aliased.get(ptr)
            if real is None:
                continue
            owner = self._aliases.owner(ptr)
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
            with self._resolved.no_dispatch(), torch.no_grad():
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
