"""Where values are kept right: the wrapper around ``FakeTensorConverter.from_real_tensor``.

Every real tensor that enters a fake computation is converted here (op inputs under
``allow_non_fake_inputs``, ``mode.from_tensor``, a FakeTensor of another mode). In a mode that
does not propagate real values the wrapper returns at once (one attribute test): nothing is
armed, probed or recorded there, so PyTorch's own fake-tensor users (torch.compile, export,
make_fx, estimators) meet upstream's converter. In a propagating mode it keeps the fake's
propagated values equal to the real source's, **per converter**:

* **D2** (probe): on builds where a converted ``nn.Parameter`` (or any tensor whose type is not
  exactly ``torch.Tensor``, and every view of one: converted through its base) gets an
  uninitialised ``real_tensor``, the whole storage is copied from the source, for each
  converter that converts it.
* **Foreign fakes**: a FakeTensor of mode A converted by mode B (a module shared by models run in
  two modes, a loss summed across modes) gets A's propagated values; where A has none, B's copy
  gets none either (never uninitialised memory), so its gradients follow ``on_missing``.
* **Stale copies**: a converter returns the fake of its first conversion (memo) even after the
  real tensor changed (an optimizer step between two graphs of one mode): re-synced when the
  source's version counter moved since this converter last synced it.
* **Managed gradients**: a real ``.grad`` the patch wrote, converted inside the mode
  (``zero_grad(set_to_none=False)``, ``clip_grad_norm_``): the fake's propagated values are the
  real gradient itself, so in-place changes reach it once, as in eager mode.
* **Write-back** (``buffers="write_back"``, opt-in): a real op input that does not
  require grad, converted by the outermost op of a propagating mode, gets propagated values
  that *are* the real tensor, so in-place updates reach it exactly once (dispatch/aliases.py).
* **Conversions the patch did not see**: on builds with D2, the first time a converter
  is met after the patch was applied (again), the tensors it converted before are compared with
  this module's records; a Parameter converted while the patch was not installed had
  uninitialised values, so everything its mode computed is untrusted: real gradients are not
  written for that mode (trace, warning, ``on_missing``), never silently wrong ones.

Records are :class:`~fakegrad_patch._core.weak.WeakIdTable` s: O(1) per conversion at any size, and
they outlive ``uninstall()`` (a later installation reads them). No value is ever compared.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch

from ... import _config, trace
from .. import state as _state
from ..touchpoints import sites as _sites
from ..touchpoints.probes import D2, FOREIGN_FAKE, Probes, bypassed
from ..touchpoints.targets import Resolved
from ..typing import FakeLeafMirror, InternalErrors, RetainedArmer
from . import leaves as _leaves
from . import lending as _lending
from . import records as _records
from .unseen import Unseen


def _values_are_the_constant(fake: Any) -> None:
    """A constant (``torch.tensor([2.5])``, what FakeTensorMode folds from constants) keeps two
    copies of its values: ``constant``, which upstream's constant folding updates (an in-place
    op on a constant runs on it), and the propagated copy, which it never updates (``t.zero_()``
    left 2.5 for every later read). The propagated values become the constant itself (the mode
    owns it: upstream cloned it), so both always agree; views of constants alias as theirs do."""
    constant = getattr(fake, "constant", None)
    real = getattr(fake, "real_tensor", None)
    if (
        constant is not None
        and real is not None
        and type(constant) is torch.Tensor
        and constant.layout == torch.strided
        and constant.shape == real.shape
        and constant.dtype == real.dtype
        and constant.device == real.device
    ):
        fake.real_tensor = constant


def _op_input(
    is_fake: Any, dispatch: Any, mode: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """A real op input of a propagating mode without a ShapeEnv, write-back off: the dispatch
    wrapper's frame of the op converting it, else None. Its fake may be made lean
    (``targets.LeanConversion``); where the frame says the op writes nothing, its values may
    be lent (lending.py: else the op's writes must reach a copy)."""
    if kwargs or len(args) != 2:
        return None
    if is_fake(args[1]) or not getattr(mode, "propagate_real_tensors", False):
        return None
    if getattr(mode, "shape_env", None) is not None or dispatch.aliases.enabled:
        return None
    frame = dispatch.frames.top()
    return frame if frame is not None and frame.mode is mode else None


def _lean_kind(lean: Any, frame: Any, converter: Any, t: Any) -> Any:
    """For the fast path's op input ``t`` (``frame``: :func:`_op_input`'s), its kind in
    ``converter`` where a lean conversion may make its fake (``LeanConversion.when``), else None
    (upstream's conversion; the memo's fake where it lives)."""
    if lean is None or frame is None or not getattr(_state.converting, "fast", False):
        return None
    kind = lean.kind(t)
    return None if kind is None else lean.when(converter, t, kind)


def _lent(real: Any, values: Any, source: Any, reason: str, may_lend: bool) -> str | None:
    """Before a copy into ``real``'s storage: lent values over the source's bytes need none
    (they are the source's), other lent values get their own first; the D2 repair lends
    where it may (lending.py). The reason left to copy for, or None."""
    storage = real.untyped_storage()
    if _lending.is_lent(storage):
        if _lending.lent_from(storage, values.untyped_storage()):
            return None
        _lending.own(storage)
        return reason
    if (
        may_lend
        and reason == "d2"
        and real.storage_offset() == values.storage_offset()
        and real.stride() == values.stride()
        and _lending.lend_into(storage, values.untyped_storage())
    ):
        _trace_values(reason, source, 0)
        return None
    return reason


def _trace_values(reason: str, source: Any, nbytes: int) -> None:
    """``d2_repaired`` or ``propagated_values_resynced`` for ``source`` (``nbytes`` copied)."""
    if trace.enabled(trace.INFO):
        event = "d2_repaired" if reason == "d2" else "propagated_values_resynced"
        fields = _leaves.leaf_fields(source)
        fields["bytes"] = nbytes
        trace.emit_fields(event, trace.INFO, fields, owned=True)


def _bits_on_values(resolved: Resolved, fake: Any, t: Any) -> None:
    """A conjugate or negative tensor that is not a view (a kernel's output): the converter
    copies its values (``copy_`` resolves the bit) and gives only the fake the bit. The
    propagated values get the bit too, over a copy of the raw values, so a fake's values
    are always read with its own bits (as for views, whose copy is the raw storage)."""
    real = getattr(fake, "real_tensor", None)
    if real is None or real.layout != torch.strided or t.layout != torch.strided:
        return
    if real.is_conj() == fake.is_conj() and real.is_neg() == fake.is_neg():
        return
    with resolved.no_dispatch(), torch.no_grad():
        copy = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
        resolved.set_bits(copy, t.is_conj(), t.is_neg())
        with resolved.value_keys():
            copy.copy_(t)
        fake.real_tensor = copy


def _lean_values(resolved: Resolved, t: Any, may_lend: bool, d2: bool) -> Any:
    """The values upstream's conversion gives the fake of ``t`` (a plain dense leaf), before
    ``Values._sync``: where D2 applies (``d2``), a fresh uninitialised buffer (the D2 repair
    fills it, lending where it may); where upstream clones the storage, a loan where ``t`` may
    lend (as lending.clone_real_storage makes on 2.14+), else a copy."""
    with resolved.no_dispatch(), torch.no_grad():
        if may_lend and not d2:
            lent = _lending.lend(t.untyped_storage())
            return torch.empty(0, dtype=t.dtype, device=t.device).set_(lent, 0, t.shape, t.stride())
        real = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
        if not d2:
            real.copy_(t)
        return real


def _lean_values_of(values: Values, may_lend: bool) -> Callable[[Any], Any]:
    """:func:`_lean_values` for a tensor that ``values`` converts."""
    return lambda t: _lean_values(values._resolved, t, may_lend, values._d2_applies(t, False))


class Values:
    """One installation's converter wrapper."""

    def __init__(
        self,
        resolved: Resolved,
        probes: Probes,
        *,
        dispatch: Any,
        fake_leaves: FakeLeafMirror,
        armer: RetainedArmer,
        errors: InternalErrors,
        lean: Any = None,
    ) -> None:
        self._resolved = resolved
        self._probes = probes
        self._fake_leaves = fake_leaves
        self._armer = armer
        self._errors = errors
        self._is_fake = resolved.is_fake
        self._real_of = resolved.real_of
        self.active = True
        #: ``on_missing`` set explicitly: conversions by modes without real values matter too
        #: (kept by ``Applied.apply_settings``; the early exit reads it)
        self.plain_policy = False
        #: conversions the patch did not see (D2 builds): which modes cannot be trusted
        self.unseen = self._unseen = Unseen(resolved, probes)
        #: the dispatch path: its switch, write-back's aliasing and the watch of op inputs
        self._dispatch = dispatch
        #: the fast path's op inputs converted lean where checked (None: always upstream's)
        self._lean = lean

    # -- the wrapper ---------------------------------------------------------------------------

    def from_real_tensor(
        self, wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        # Early exit first: a mode without real values, no explicit policy, no
        # mirroring switch open: torch's converter, before any other work of ours.
        mode = args[0] if args else kwargs.get("fake_mode")
        if (
            not getattr(mode, "propagate_real_tensors", False)
            and not self.plain_policy
            and not self._fake_leaves.mirroring()
        ):
            return wrapped(*args, **kwargs)
        if not self.active or bypassed():
            return wrapped(*args, **kwargs)
        frame = _op_input(self._is_fake, self._dispatch, mode, args, kwargs)
        may_lend = frame is not None and not frame.writing and _lending.may_lend(args[1])
        lean = self._lean
        kind = _lean_kind(lean, frame, instance, args[1])
        fake = None
        if kind is not None:  # the fast path's op input: made lean where its kind was checked
            fake = lean.convert(instance, mode, args[1], kind, _lean_values_of(self, may_lend))
        if fake is None:
            if may_lend:
                with _lending.Converting(args[1]):  # 2.14+: upstream's copy of it is a loan
                    fake = wrapped(*args, **kwargs)
            else:
                fake = wrapped(*args, **kwargs)
            if kind is not None:
                lean.learn(instance, mode, args[1], kind, fake)
        try:
            if getattr(mode, "propagate_real_tensors", False):
                if kwargs.get("make_constant"):
                    _values_are_the_constant(fake)
                _sites.need_mode(mode)
                t = args[1] if len(args) > 1 else kwargs["t"]
                if kwargs and (
                    kwargs.get("source") is not None or getattr(mode, "shape_env", None) is not None
                ):
                    self._tracer_owned(instance, mode, t, fake)
                else:
                    op_input = len(args) == 2 and not kwargs
                    self._propagating(instance, mode, t, fake, op_input, may_lend)
            else:
                self._not_propagating(instance, mode, args, kwargs, fake)
        except Exception as exc:  # never break the host's fake computation
            self._errors.internal_error("convert", exc)
        return fake

    def _not_propagating(
        self, conv: Any, mode: Any, args: tuple[Any, ...], kwargs: dict[str, Any], fake: Any
    ) -> None:
        """No real values: upstream's behaviour unless the user asked for a policy (then the
        op-input leaves are noted for uninstall and retained non-leaves get their hooks), or a
        ``mirror_to_sources`` switch is open."""
        fake_leaves = self._fake_leaves
        if fake_leaves.mirroring():
            fake_leaves.on_convert(mode, args[1] if len(args) > 1 else kwargs["t"], fake)
        if not _config.current().on_missing_explicit or len(args) != 2 or kwargs:
            return
        t = args[1]
        if t.requires_grad:
            self._note(conv, t)
            if t.grad_fn is not None and t.retains_grad:
                self._armer.arm_retained(t)

    def _tracer_owned(self, conv: Any, mode: Any, t: Any, fake: Any) -> None:
        """A ``from_tensor`` that names a ``source``, or into a mode with a ShapeEnv, is a
        tracer's own fakification (dynamo, export, draft_export, which propagates real values):
        upstream's values and semantics, no probe, no repair. It is recorded as seen, so it never
        makes the mode untrusted. (Op inputs converted under ``allow_non_fake_inputs`` are never
        tracer-owned: they carry no keyword arguments.)"""
        real = self._real_of(fake)
        if real is not None and not self._is_fake(t):
            self._record_seen(conv, t, fake, real)
        self._unseen.note_made(conv)
        fake_leaves = self._fake_leaves
        if fake_leaves.mirroring():
            fake_leaves.on_convert(mode, t, fake)

    def _propagating(
        self, conv: Any, mode: Any, t: Any, fake: Any, op_input: bool, may_lend: bool = False
    ) -> None:
        if (fake.is_conj() or fake.is_neg()) and not self._is_fake(t) and t._base is None:
            _bits_on_values(self._resolved, fake, t)
        dispatch = self._dispatch
        if not dispatch.observing:
            dispatch.observe()  # first need: in-place updates of real tensors are watched
        if _lending.any_lent() and not may_lend:
            frame = dispatch.frames.top()
            if frame is not None and frame.writing:
                _lending.own_tensor(fake)  # the memo's lent fake, converted by an op that writes
        self._unseen.first_contact(conv, mode, t)
        self._unseen.note_made(conv)
        if self._is_fake(t):
            self._sync(conv, fake, t, foreign=True)
        elif t.requires_grad:
            self._sync(conv, fake, t, may_lend=may_lend)
            if op_input and t.grad_fn is not None and t.retains_grad:
                self._armer.arm_retained(t)
        elif _leaves.has_managed_grads() and _leaves.managed_grad(t):
            self._alias_grad(fake, t)
        elif dispatch.aliases.enabled and dispatch.aliases.convert(mode, t, fake, op_input):
            self._record_seen(conv, t, fake, fake.real_tensor)  # write-back: fake aliases t
        else:
            self._sync(conv, fake, t)
        if op_input and not self._is_fake(t):
            # an op that writes t: does the update reach it (alias), or only the copy (report)?
            dispatch.watch.op_input(mode, t, fake)
        # grad-copy fidelity (probe D4) and mirror_to_sources
        self._fake_leaves.on_convert(mode, t, fake)

    # -- records ---------------------------------------------------------------------------------

    def _record_seen(self, conv: Any, t: Any, fake: Any, real: Any) -> None:
        """Record ``conv``'s conversion of ``t`` as seen, without syncing anything (values that
        are upstream's, or an alias of ``t``): the untrusted-mode check then trusts it."""
        root = t._base if t._base is not None else t
        fake_root = fake._base if fake._base is not None else fake
        data = real.untyped_storage().data_ptr() if real.layout == torch.strided else 0
        _records.table_of(conv).set(root, (weakref.ref(fake_root), data, t._version))

    def _note(self, conv: Any, t: Any) -> None:
        table = _records.table_of(conv)
        if t not in table:
            table.set(t, (None, 0, -1))

    # -- D2, foreign fakes, stale copies ---------------------------------------------------------

    def _sync(
        self, conv: Any, fake: Any, source: Any, *, foreign: bool = False, may_lend: bool = False
    ) -> None:
        real = self._real_of(fake)
        if real is None or real.layout != torch.strided or source.layout != torch.strided:
            return  # no values, or no storage to repair (sparse: upstream's values)
        root = source._base if source._base is not None else source
        if foreign:
            values = self._real_of(source)
            if values is None:
                # Mode A had no real values for it: B's copy would be uninitialised memory.
                with self._resolved.no_dispatch():
                    fake.real_tensor = None
                return
            version = values._version
        else:
            if root.device.type == "meta":
                return
            values = source
            version = source._version
        table = _records.table_of(conv)
        fake_root = fake._base if fake._base is not None else fake
        data = real.untyped_storage().data_ptr()
        entry = table.get(root)
        reason: str | None = None
        if entry is not None and entry[1] == data:
            # The same fake (tensor memo), or a new fake over the buffer we synced before (2.14's
            # storage memo keeps it while a kept graph's saved views hold it; or the allocator
            # reused a freed buffer's address: then a copy costs one pass and is still right).
            same_fake = entry[0] is not None and entry[0]() is fake_root
            if same_fake and entry[2] == version:
                return  # the common case: a memo hit, nothing changed
            if not same_fake and self._d2_applies(root, foreign):
                reason = "d2"  # maybe a fresh copy at a reused address: uninitialised
            elif entry[2] != version:
                reason = "stale"
        elif self._d2_applies(root, foreign):
            reason = "d2"  # upstream just made this copy, uninitialised on builds with D2
        elif entry is not None and entry[2] != version:
            # a buffer never synced here, and the source changed since its last sync: the
            # converter's storage memo hands a new fake the copy of an earlier conversion (the
            # fake that aliased the source under write-back died meanwhile)
            reason = "stale"
        if (reason is not None and _lending.any_lent()) or (may_lend and reason == "d2"):
            reason = _lent(real, values, source, reason, may_lend)
            data = real.untyped_storage().data_ptr()  # moved where values were lent or owned
        if reason is not None:
            self._copy_values(real, values, source, reason)
        table.set(root, (weakref.ref(fake_root), data, version))
        if not foreign:
            _records.note_copy(root, real)

    def _d2_applies(self, root: Any, foreign: bool) -> bool:
        if foreign:
            return self._probes.has(FOREIGN_FAKE)
        return type(root) is not torch.Tensor and self._probes.has(D2)

    def _copy_values(self, real: Any, values: Any, source: Any, reason: str) -> None:
        with self._resolved.no_dispatch(), torch.no_grad():
            src_storage = values.untyped_storage()
            dst_storage = real.untyped_storage()
            if (
                src_storage.nbytes() == dst_storage.nbytes()
                and real.storage_offset() == values.storage_offset()
                and real.stride() == values.stride()
            ):
                dst_storage.copy_(src_storage)  # every alias of the source at once
                nbytes = src_storage.nbytes()
            else:
                real.copy_(values.detach())
                nbytes = real.numel() * real.element_size()
        _trace_values(reason, source, nbytes)

    # -- managed gradients -----------------------------------------------------------------------

    def _alias_grad(self, fake: Any, grad: Any) -> None:
        """``grad`` is the real ``.grad`` of a leaf the patch manages, converted by a propagating
        mode: make its fake's propagated values the real gradient itself, so in-place changes
        made in the mode reach it as they would in eager mode (and reads see its current
        values)."""
        if self._real_of(fake) is None or fake.shape != grad.shape:
            return
        if fake.stride() != grad.stride() or fake.dtype != grad.dtype:
            return
        if _state.op_ran_for_real(self._resolved) is not False:
            # ``p.grad.mul_(3)`` with all-real arguments: FakeTensorMode already ran it on the
            # real grad (upstream's constant propagation); an alias would apply it twice. Or we
            # cannot tell. Upstream semantics for this op: the fake works on a copy (a fresh one
            # if an earlier op of this mode made the alias: the converter memo returns that fake).
            if fake.real_tensor is grad:
                with self._resolved.no_dispatch():
                    fake.real_tensor = grad.clone()
            return
        if fake.real_tensor is not grad:
            fake.real_tensor = grad
