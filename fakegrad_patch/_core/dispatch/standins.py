"""Updates that do not reach a real tensor, said plainly; and the records that know them.

A real tensor converted by a propagating mode gets a fake whose values are a private copy (the
default, upstream's semantics): an in-place update inside the mode reaches the copy only. A
:class:`StandIn` records which storage stands in for which real tensor, so a write to it (or to
a view of it) is reported as a lost update of that tensor: one ``update_lost`` trace event
(warning) per tensor and op, one ``FakeGradPatchWarning`` per process naming the fix.
"""

from __future__ import annotations

import weakref
from typing import Any

from ... import trace
from ..convert import leaves as _leaves
from ..state import warn_once
from .frames import Frame
from .tensors import storage_ptr


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


class StandIn:
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
            entry: StandIn | None = me()
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
            if holder is not None and storage_ptr(getattr(holder, "real_tensor", None)) == ptr:
                return holder
        return None

    def real(self, ptr: int) -> Any:
        """The real tensor, while a holder still has its values over ``ptr``; else None."""
        root = self.root()
        if root is None:
            return None
        for ref in list(self.holders.values()):
            holder = ref()
            if holder is not None and storage_ptr(getattr(holder, "real_tensor", None)) == ptr:
                return root
        return None


class StandIns:
    """One installation's stand-ins, by the data pointer of their storage: a write to any fake
    over such a storage (the converted tensor, a view of it, a nested op's argument) is an
    update that reaches only the copy."""

    def __init__(self, is_fake: Any) -> None:
        self._is_fake = is_fake
        self._by_ptr: dict[int, StandIn] = {}

    def __bool__(self) -> bool:
        return bool(self._by_ptr)

    def remember(self, t: Any, fake: Any) -> None:
        """``fake`` (converted from the real op input ``t``) holds a private copy: remember its
        storage, so writes to it (or to views of it) are known as lost updates of ``t``."""
        fake_root = fake._base if fake._base is not None else fake
        copy_root = getattr(fake_root, "real_tensor", None)
        ptr = storage_ptr(copy_root) if copy_root is not None else None
        if ptr is None:
            return
        entry = self._by_ptr.get(ptr)
        root = t._base if t._base is not None else t
        if entry is None or entry.real(ptr) is not root:
            entry = self._by_ptr[ptr] = StandIn(root, ptr, self._by_ptr)
        entry.hold(fake_root)

    def moved(self, old: int, new: int) -> None:
        """Lent values over ``old`` (a parameter's bytes, which every lent fake of it shares)
        got their own at ``new``: the fakes now over ``new`` are a stand-in of their own."""
        entry = self._by_ptr.get(old)
        root = entry.root() if entry is not None else None
        if entry is None or root is None:
            return
        moved = StandIn(root, new, self._by_ptr)
        for ref in list(entry.holders.values()):
            holder = ref()
            if holder is not None and storage_ptr(getattr(holder, "real_tensor", None)) == new:
                moved.hold(holder)
        if moved.holders:
            self._by_ptr[new] = moved

    def hold_views(self, result: Any) -> None:
        """A view op (or ``set_``) returned fakes over a stand-in's storage (``w.detach()``,
        ``g[0]``): they keep the record alive (the converted fake itself may die first)."""
        for out in result if isinstance(result, list | tuple) else (result,):
            if self._is_fake(out):
                ptr = storage_ptr(getattr(out, "real_tensor", None))
                if ptr is None:
                    continue
                entry = self._by_ptr.get(ptr)
                if entry is not None and entry.real(ptr) is not None:
                    entry.hold(out)

    def written(self, frame: Frame, ptr: int, via: str, write_back: bool) -> None:
        """A fake over storage ``ptr`` is written: when that is a real tensor's private copy,
        the update is lost (reported when the outer op returns)."""
        entry = self._by_ptr.get(ptr)
        real_root = entry.real(ptr) if entry is not None else None
        if real_root is None:
            return
        if write_back and not via and frame.depth == 0:
            # the outer op writes a view of the copy (``nn.Embedding(max_norm=...)``'s
            # ``weight.detach()``): its real run updates the copy once; copied back on return
            if ptr not in frame.copy_back and id(real_root) not in frame.lost:
                frame.copy_back[ptr] = (real_root, entry)
            return
        if ptr in frame.copy_back:
            del frame.copy_back[ptr]  # a nested op writes it too: not provably once
        if id(real_root) not in frame.lost:
            frame.lost[id(real_root)] = (real_root, via)
