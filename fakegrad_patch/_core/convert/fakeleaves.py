"""Fake leaves made from real leaves (``FakeTensorMode.from_tensor``) and their real sources.

Three things live here, all driven from the converter wrapper in _patch:

* **Grad-copy fidelity.** Converting a real leaf that holds a ``.grad`` gives a fake leaf with a
  fake ``.grad`` whose ``real_tensor`` should be the source grad. Probe D4 (_probes.GRAD_COPY)
  checks that on the running build, by behaviour; only where it is broken do we rewrite the fake
  grad's real values from the source grad. Measured right on 2.13.0 and 2.14.1: no repair there.
* **Opt-in mirroring** (:func:`mirror_to_sources`). torch.compile and torch.export make fake
  leaves from real parameters on their own and must never write real ``.grad``s, so nothing is
  mirrored unless the user names the mode. Inside the switch, every fake leaf that mode converts
  from a real leaf gets a pre-hook on its AccumulateGrad node; when a fake gradient lands there the
  core Materializer writes its real values onto the *real source* (same rule: device, dtype,
  layout, in place, on_missing) and the fake leaf keeps its fake grad, as upstream gives it. A
  node pre-hook runs only when a gradient is accumulated (``backward``), never for
  ``torch.autograd.grad``, which accumulates nothing. The switch holds the armed nodes (and so
  the fake leaves) only while it is active; on exit every hook is removed and everything dropped.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ... import trace
from ..._errors import FakeGradError, FakeGradPatchWarning
from ..accumulate.hooks import (
    Materializer,
)
from ..touchpoints import targets as _targets
from ..touchpoints.probes import Probes
from ..typing import InternalErrors
from . import leaves as _leaves

_lock = threading.RLock()


# --- grad-copy fidelity ---------------------------------------------------------------------------


def repair_grad_copy(fake: Any, source: torch.Tensor, disable_current_modes: Any) -> bool:
    """Give ``fake.grad`` (a FakeTensor) the real values of ``source.grad``. Returns True when a
    repair was made. Only called on builds where probe D4 found the copy wrong."""
    fake_grad = getattr(fake, "grad", None)
    grad = source.grad
    if fake_grad is None or grad is None or fake_grad.shape != grad.shape:
        return False
    with disable_current_modes(), torch.no_grad():
        real = grad.detach().clone(memory_format=torch.preserve_format)
        fake_grad.real_tensor = real
    if trace.enabled(trace.INFO):
        trace.emit(
            "grad_copy_repaired",
            trace.INFO,
            leaf_id=id(source),
            shape=list(grad.shape),
            dtype=str(grad.dtype).removeprefix("torch."),
            device=str(grad.device),
            bytes=real.numel() * real.element_size(),
        )
    return True


# --- mirroring ------------------------------------------------------------------------------------


class _Mirror:
    """One active ``mirror_to_sources(mode)`` (nesting counted). Holds the armed AccumulateGrad
    nodes of the mode's fake leaves, which is what keeps their pre-hooks alive until a graph
    uses them; holds neither the mode nor any real leaf."""

    def __init__(self) -> None:
        self.depth = 0
        self.active = True
        #: fake leaf -> (its AccumulateGrad node, the RemovableHandle of our pre-hook)
        self.armed: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def close(self) -> int:
        self.active = False
        removed = 0
        for _node, handle in list(self.armed.values()):
            if handle.hooks_dict_ref() is not None:
                handle.remove()
                removed += 1
        self.armed.clear()
        return removed


#: FakeTensorMode -> its active _Mirror. Weak: a switch never keeps a mode alive.
_mirrors: WeakIdKeyDictionary = WeakIdKeyDictionary()


class _Active:
    """How many modes have an open switch: the converter's fast path reads this plain int
    (``bool(WeakIdKeyDictionary)`` costs ~0.5 us per conversion)."""

    count = 0


class FakeLeaves:
    """Per-installation driver, called by the converter wrapper for every conversion."""

    def __init__(
        self,
        resolved: _targets.Resolved,
        probes: Probes,
        *,
        installed: Callable[[], bool],
        errors: InternalErrors,
    ) -> None:
        from ..touchpoints import probes as _probes

        self._resolved = resolved
        self._probes = probes
        #: whether the installation is in force (a mirror's hook that outlived it does nothing)
        self._installed = installed
        self._errors = errors
        self._grad_copy = _probes.GRAD_COPY
        self._grad_copy_broken: bool | None = None  # probed on the first conversion that matters
        self._checked: WeakIdKeyDictionary = WeakIdKeyDictionary()
        # No zero-copy set path: the fake leaf keeps its fake grad, whose ``real_tensor`` is the
        # propagated buffer; adopting it as the source's ``.grad`` would make the two alias, and
        # the next fake accumulation (an in-place add that propagation also runs on
        # ``real_tensor``) would add into the real ``.grad`` a second time.
        self.materializer = Materializer(resolved, adopt=False)
        self._is_fake = resolved.is_fake
        self._real_of = resolved.real_of

    @staticmethod
    def mirroring() -> bool:
        """Is any ``mirror_to_sources`` switch open (one int test)?"""
        return _Active.count > 0

    def on_convert(self, mode: Any, source: torch.Tensor, fake: Any) -> None:
        """``fake`` was just made by ``mode``'s converter from real ``source``."""
        if self._grad_copy_broken is not False:
            self._check_grad_copy(source, fake)
        if _Active.count and source.requires_grad and source.grad_fn is None:
            mirror = _mirrors.get(mode)
            if mirror is not None and mirror.active:
                self._arm(mirror, source, fake)

    def _check_grad_copy(self, source: torch.Tensor, fake: Any) -> None:
        if self._real_of(fake) is None or source.grad_fn is not None:
            return
        if source.grad is None or fake in self._checked:
            return
        if self._grad_copy_broken is None:
            self._grad_copy_broken = self._probes.has(self._grad_copy)
        if self._grad_copy_broken:
            repair_grad_copy(fake, source, self._resolved.disable_current_modes)
        self._checked[fake] = None

    def _arm(self, mirror: _Mirror, source: torch.Tensor, fake: Any) -> None:
        if not (self._is_fake(fake) and fake.requires_grad and fake.grad_fn is None):
            return
        entry = mirror.armed.get(fake)
        if entry is not None and entry[1].hooks_dict_ref() is not None:
            return
        # torch's work first (the fake leaf's node: an op under forced dispatch keys), then the
        # lock, only to register the hook once
        node = self._resolved.grad_accumulator(fake)
        hook = self._make_prehook(weakref.ref(source), weakref.ref(mirror), id(fake))
        with _lock:
            entry = mirror.armed.get(fake)
            if entry is not None and entry[1].hooks_dict_ref() is not None:
                return
            mirror.armed[fake] = (node, node.register_prehook(hook))

    def _make_prehook(
        self, source_ref: weakref.ref[torch.Tensor], mirror_ref: weakref.ref[_Mirror], fake_id: int
    ) -> Any:
        is_fake, real_of = self._is_fake, self._real_of
        installed, errors = self._installed, self._errors

        def fakegrad_mirror_prehook(grad_outputs: tuple[Any, ...]) -> None:
            grad = grad_outputs[0]
            mirror = mirror_ref()
            if mirror is None or not mirror.active or not is_fake(grad):
                return None
            source = source_ref()
            if source is None or not installed():
                return None
            if trace.enabled(trace.INFO):
                propagated = real_of(grad) is not None
                _emit_mirrored(source, fake_id, propagated, self.materializer.backward_id())
            try:
                with _leaves.leaf_lock(source):  # as the real leaf's own pre-hook
                    self.materializer.on_fake_grad(source, grad)
            except (FakeGradError, FakeGradPatchWarning):
                raise  # on_missing="error", or the user's warnings filter (-W error)
            except Exception as exc:  # never break the host's backward
                errors.internal_error("mirror", exc)
            return None  # the fake leaf accumulates its fake grad as upstream does

        return fakegrad_mirror_prehook


def _emit_mirrored(
    source: torch.Tensor, fake_id: int, propagated: bool, backward_id: int | None
) -> None:
    trace.emit(
        "mirrored",
        trace.INFO,
        backward_id=backward_id,
        **_leaves.leaf_fields(source),
        fake_id=fake_id,
        source="propagated" if propagated else "none",
    )


@contextlib.contextmanager
def mirror_to_sources(mode: Any) -> Iterator[None]:
    """Mirror gradients of ``mode``'s fake leaves onto their real source leaves (see module doc).

    Counts: fake leaves that ``mode``'s converter makes from real leaves (``requires_grad``, no
    ``grad_fn``) while the block runs, including memo hits (converting an already converted leaf
    again inside the block arms the same fake), and gradients accumulated into them before the
    block ends.
    """
    from ..state import current, warn_once

    applied = current()
    if applied is None:
        warn_once(
            "mirror-uninstalled",
            "fakegrad_patch.mirror_to_sources: the patch is not installed, nothing is mirrored "
            "(call fakegrad_patch.install()).",
        )
    fake_mode_cls = _targets.resolve(_targets.FAKE_TENSOR_MODE)
    if not isinstance(mode, fake_mode_cls):
        raise TypeError(f"mirror_to_sources expects a FakeTensorMode, got {type(mode).__name__}")
    with _lock:
        mirror = _mirrors.get(mode)
        if mirror is None:
            mirror = _mirrors[mode] = _Mirror()
            _Active.count += 1
        mirror.depth += 1
    try:
        yield
    finally:
        with _lock:
            mirror.depth -= 1
            last = mirror.depth == 0
            if last and _mirrors.get(mode) is mirror:
                del _mirrors[mode]
                _Active.count -= 1
        if last:
            mirror.close()


__all__ = ["FakeLeaves", "mirror_to_sources", "repair_grad_copy"]
