"""``buffers="write_back"``: the fakes of real op inputs whose values are the real tensors.

By default (upstream's semantics) a real tensor converted by a propagating mode as an op input
gets a fake whose values are a private copy: an in-place update inside the mode changes the
copy, and the real tensor stays as it was (the watch reports it). With write-back on, the fake's
values *are* the real tensor (a ``detach()`` of it: same storage and version counter, never its
autograd identity), so every update the mode applies to it for real happens to the real tensor,
exactly once:

* only the outermost op's own arguments are aliased, only when converted as op inputs, never in
  a mode with a ShapeEnv, never by ``from_tensor`` (tracers keep their no-mutation rule), never
  a tensor that requires grad (a parameter written under ``no_grad`` is aliased for that op only,
  by the watch), never a fake, a meta, non-strided or subclass tensor;
* never an op FakeTensorMode already ran for real (all arguments real: it updated the tensor
  itself).

Turning write-back off gives every aliased fake a private copy again.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch

from ... import trace
from .. import state as _state
from ..touchpoints.targets import Resolved
from ..typing import DispatchSwitch
from ..weak import WeakIdTable
from .frames import Frame, Frames
from .tensors import PLAIN_TYPES, private_copy, storage_ptr


class Aliases:
    """One installation's write-back aliasing."""

    def __init__(self, resolved: Resolved, frames: Frames, switch: DispatchSwitch) -> None:
        self._resolved = resolved
        self._frames = frames
        self._switch = switch
        self._lock = threading.Lock()
        #: write-back semantics on (``buffers="write_back"``)
        self.enabled = False
        #: fake -> the real tensor its propagated values alias
        self._aliases: WeakIdTable[Any] = WeakIdTable()
        #: fakes made (or returned) by ``from_tensor``: never aliased
        self._refused: WeakIdTable[bool] = WeakIdTable()
        #: aliased storage data pointer -> weak reference to the real tensor that owns it
        self._storages: dict[int, Any] = {}

    # -- on / off ---------------------------------------------------------------------------------

    def enable(self) -> bool:
        """Write-back on; False (unavailable) where ``FakeTensorMode.dispatch`` is missing."""
        if not self._switch.observe():
            return False
        with self._lock:
            if self.enabled:
                return True
            self.enabled = True
        self._switch.set_policy(True)  # wrapped while write-back is on, modes or not
        if trace.enabled(trace.INFO):
            trace.emit("write_back_enabled", trace.INFO)
        return True

    def disable(self) -> int:
        """Write-back off: every aliased fake gets a private copy again. Returns how many."""
        with self._lock:
            if not self.enabled:
                return 0
            self.enabled = False
            aliased = list(self._aliases.items())
            self._aliases.clear()
            self._storages.clear()
        self._switch.set_policy(False)
        count = sum(self._unalias(fake, real) for fake, real in aliased)
        if trace.enabled(trace.INFO):
            trace.emit("write_back_disabled", trace.INFO, unaliased=count)
        return count

    # -- conversions --------------------------------------------------------------------------

    def convert(self, mode: Any, t: Any, fake: Any, op_input: bool) -> bool:
        """A real tensor that does not require grad was converted by a propagating mode: as an
        op input, maybe alias it; by ``from_tensor`` (a fake the caller holds and may update in
        place, expecting upstream's semantics), never alias that fake, now or later (the
        converter's memo returns it for later op inputs too). True when the fake aliases ``t``."""
        if op_input:
            return fake not in self._refused and self._alias(mode, t, fake)
        self._refused.set(fake, True)
        real = self._aliases.pop(fake)
        if real is not None:
            self._unalias(fake, real)
        return False

    def owner(self, ptr: int) -> Any:
        """The real tensor whose storage an aliased fake's values are over, or None."""
        if not self._storages:
            return None
        ref = self._storages.get(ptr)
        owner = None if ref is None else ref()
        if owner is None or storage_ptr(owner) != ptr:
            return None
        return owner

    def _alias(self, mode: Any, t: Any, fake: Any) -> bool:
        """``t`` was just converted as an op input: alias the fake's propagated values to it
        when this is the outermost op of ``mode`` and the op was not already run for real."""
        frame = self._frames.top()
        if frame is None or frame.mode is not mode or frame.depth != 0:
            return False
        real = fake.real_tensor
        ptr = storage_ptr(t)
        if ptr is None or real is None or real.layout != torch.strided:
            return False
        if storage_ptr(real) == ptr:
            _noted(frame, ptr, t)
            return True  # aliased before (the converter's memo returned the same fake)
        if (
            type(t) not in PLAIN_TYPES
            or real.dtype != t.dtype
            or real.shape != t.shape
            or real.stride() != t.stride()
            or real.storage_offset() != t.storage_offset()
        ):
            return False
        if _state.op_ran_for_real(self._resolved) is not False:
            return False  # upstream already applied this op to t for real (or cannot tell)
        root = t._base if t._base is not None else t
        fake_root = fake._base if fake._base is not None else fake
        with self._resolved.no_dispatch():
            if fake_root is not fake:
                root_real = getattr(fake_root, "real_tensor", None)
                if (
                    root_real is not None
                    and storage_ptr(root_real) != ptr
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
        _noted(frame, ptr, t)
        return True

    def _unalias(self, fake: Any, real: Any) -> bool:
        """Give ``fake`` a private copy of ``real`` again if it still aliases it."""
        if getattr(fake, "real_tensor", None) is not real:
            return False
        with self._resolved.no_dispatch(), torch.no_grad():
            fake.real_tensor = private_copy(real)
        return True

    def _own(self, ptr: int, root: Any) -> None:
        def forget(ref: Any, ptr: int = ptr, storages: dict[int, Any] = self._storages) -> None:
            if storages.get(ptr) is ref:
                del storages[ptr]

        self._storages[ptr] = weakref.ref(root, forget)


def _noted(frame: Frame, ptr: int, t: Any) -> None:
    frame.aliased[ptr] = t
