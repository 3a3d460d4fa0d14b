"""The fast path (``propagation="fast"``): an op runs its real kernel once on the fakes' values,
and its fake outputs are made from the real ones.

Upstream runs every op twice in a propagating mode (its fake implementation and its real kernel,
then a cross-check), runs a decomposition's nested ops for real again, and caches nothing. Here:

* an op that **makes new tensors** runs its real kernel, and each fake output is a meta tensor of
  the real output's sizes, strides, offset, dtype and bits, on its device, holding it (made as
  upstream's constructor makes it, without its Python where the build allows:
  ``targets.FakeMaker``);
* a **view** runs the real view op, and each fake view is a meta tensor ``set_`` over the
  aliased fake's own storage with the real view's sizes, strides and offset (what ``as_strided``
  in the mode's kernel invocation gives, without its dispatch): the fakes alias exactly as the
  real tensors;
* an **in-place op** that changes only its first argument's values runs its real kernel on the
  fake's values and returns the fake, its metadata unchanged.

Real kernels run with the Conjugate, Negative and ZeroTensor keys on where a value needs them
(inside the mode they are excluded). ``NOT_FAST`` means upstream's path takes the op; it is
returned before anything ran, except where noted.
"""

from __future__ import annotations

from typing import Any

import torch

from ..convert import records as _records
from ..touchpoints import sites as _sites
from ..touchpoints import targets as _targets
from ..touchpoints.targets import Resolved
from .aliases import Aliases
from .frames import Frames
from .ops import OpFacts
from .stats import Stats
from .tensors import (
    CannotRebuild,
    aligned,
    convert_op_input,
    convertible,
    extent,
    has_fake,
    is_zero,
    map_tensors,
    needs_value_keys,
    same_metadata,
    set_conj,
    set_neg,
    storage_ptr,
    tensors_in,
)

NOT_FAST: Any = object()


def _reads_directly(frames: Frames, aliases: Aliases, mode: Any, t: Any) -> bool:
    """A real tensor without a graph (a parameter, a buffer, an input: ``grad_fn`` None) that an
    op of ``mode`` only reads: the real kernel reads it as eager reads it, and no fake is made
    of it (issue 46). Its fake's values would be a copy or a loan of the same bytes, read once by
    this kernel and dropped with the op: autograd, above the mode, saved the real tensor itself,
    and an output of an op that is not a view never aliases an argument. "Only reads": the
    thread's frame says the op writes nothing (its schema's writes and BatchNorm's hidden ones),
    or that the outermost op alone writes, only real tensors, none over ``t``'s storage
    (training BatchNorm's running statistics: its weight, bias and input are read directly).
    Converted as before: a view's base (its fake view aliases the base's fake), the arguments
    of an op that writes a fake or has nested ops writing (the update must reach a copy, and be
    reported), a non-leaf that requires grad (its retained gradient is armed at conversion),
    write-back's aliases."""
    if t.grad_fn is not None or aliases.enabled:
        return False
    frame = frames.top()
    if frame is None or frame.mode is not mode:
        return False
    if frame.writing:
        writes = frame.real_writes
        if writes is None or frame.writing != 1 or frame.depth or storage_ptr(t) in writes:
            return False
    return t.device.type != "meta" and not is_zero(t)


def _fake_maker(resolved: Resolved) -> Any:
    """FROM_META_AND_DEVICE, made lean where the build allows (``targets.FakeMaker``)."""
    from_meta = _targets.resolve_optional(_targets.FROM_META_AND_DEVICE)
    if from_meta is None:
        return None
    return _targets.FakeMaker(from_meta, resolved.fake_tensor_cls, resolved.fake_tensor_module)


class FastPath:
    def __init__(self, resolved: Resolved, stats: Stats, frames: Frames, aliases: Aliases) -> None:
        self._resolved = resolved
        self._is_fake = resolved.is_fake
        self._stats = stats
        self._frames = frames
        self._aliases = aliases
        # optional touch points: absent on a build, the fast path stands aside
        self._from_meta = self.fake_maker = _fake_maker(resolved)

    # -- the three kinds ---------------------------------------------------------------------

    def new(self, mode: Any, func: Any, op: Any, facts: OpFacts) -> Any:
        """An op that makes new tensors, every fake argument this mode's with values: the real
        kernel on those values, and fakes made from its outputs."""
        if facts.numbers_as_tensors and not has_fake(op, self._is_fake):
            return NOT_FAST  # upstream runs it on the real arguments: a constant if small
        reals = self.real_arguments(mode, op)
        if reals is NOT_FAST:
            return NOT_FAST
        real_out = self.run(func, reals)
        try:
            result = self.from_real(mode, real_out)
        except CannotRebuild:
            outs = real_out if isinstance(real_out, tuple | list) else (real_out,)
            if not facts.random and any(is_zero(t) for t in tensors_in(outs)):
                # a ZeroTensor output (an op on one, forward AD's zero tangents): its fake needs
                # the ZeroTensor key, which upstream's path gives it (the real run had no effect)
                return NOT_FAST
            # a sparse COO output (an Embedding's sparse gradient): a fake as the converter
            # makes one; a subclass or another layout: the converter's own fakes (rare)
            result = map_tensors(lambda t: _other_fake(self, mode, t), real_out)
        self._stats.fast(func)
        return result

    def in_place(self, mode: Any, func: Any, op: Any) -> Any:
        """An in-place op that changes only its first argument's values (``add_``, ``relu_``,
        ``uniform_``, ``copy_``, ``index_add_``) on a fake of this mode: the real kernel on the
        values (the fake's own, so it and every view of it see the update, as eager's views do),
        and the fake returned. Upstream would also run the fake side: a decomposition whose
        nested ops run for real again (``index_add_``, ``uniform_``'s second draw), and the
        Conjugate fallback's resolve-compute-copy-back where eager's kernel handles the bit.
        Upstream's path: a real tensor written (upstream runs an all-real op on the tensor
        itself, else the watch reports the copy's update), a constant in the mode (upstream
        invalidates the constants a write reaches)."""
        if _targets.has_constants(mode.fake_tensor_converter):
            return NOT_FAST
        op_args, op_kwargs = op
        fake = op_args[0] if op_args else op_kwargs.get("self")
        if (
            not isinstance(fake, torch.Tensor)
            or not self._is_fake(fake)
            or getattr(fake, "fake_mode", None) is not mode
            or fake.layout != torch.strided
        ):
            return NOT_FAST
        real = getattr(fake, "real_tensor", None)
        if real is None or is_zero(real) or is_zero(fake) or not same_metadata(fake, real):
            return NOT_FAST
        reals = self.real_arguments(mode, op, (0, self.real_value(mode, fake)))
        if reals is NOT_FAST or reals[0][0] is NOT_FAST:
            return NOT_FAST
        self.run(func, reals)
        self._stats.fast(func)
        return fake

    def view(self, mode: Any, func: Any, op: Any, facts: OpFacts) -> Any:
        """A view op, every fake argument this mode's with values: the real view op on the
        values (aliasing them), and for each real view the fake view of the same sizes,
        strides, offset and bits over the aliased fake argument's storage. ``CannotRebuild``
        after the real view ran (a copy, a dtype-changing view, out of the fake storage's
        bounds): upstream's view then, with its own values (the real view had no effect)."""
        if self._from_meta is None:
            return NOT_FAST
        op_args = op[0]
        index = facts.view_base
        if index < 0 or index >= len(op_args) or not isinstance(op_args[index], torch.Tensor):
            return NOT_FAST
        base = op_args[index]
        if not self._is_fake(base):
            if not convertible(mode, base):
                return NOT_FAST
            base = convert_op_input(mode, base)
        elif (
            getattr(base, "fake_mode", None) is not mode
            or base.layout != torch.strided
            or getattr(base, "constant", None) is not None
        ):
            return NOT_FAST
        base_real = getattr(base, "real_tensor", None)
        if (
            base_real is None
            or is_zero(base_real)
            or is_zero(base)
            or not same_metadata(base, base_real)
        ):
            return NOT_FAST  # the fake's layout is not the real one's: upstream's view
        reals = self.real_arguments(mode, op, (index, base_real))
        if reals is NOT_FAST:
            return NOT_FAST
        real_out = self.run(func, reals)
        ptr = storage_ptr(base_real)
        storage = base.untyped_storage()  # the base fake's (meta) storage
        # every real view lies within the real base's storage: within the fake's if it is as large
        fits = storage.nbytes() >= base_real.untyped_storage().nbytes()
        with self._resolved.no_dispatch():
            result = map_tensors(
                lambda r: _view_of(self, mode, base, base_real, ptr, storage, fits, r), real_out
            )
        self._stats.fast(func)
        return result

    # -- the real side ------------------------------------------------------------------------

    def run(self, func: Any, reals: Any) -> Any:
        """The real kernel on the real arguments, as eager runs it where values may carry a
        conjugate or negative bit or be a ZeroTensor (their keys' fallbacks on)."""
        args, kwargs = reals
        if needs_value_keys(args) or (kwargs and needs_value_keys(kwargs.values())):
            with self._resolved.value_keys():
                return func(*args, **kwargs)
        return func(*args, **kwargs)

    def real_arguments(self, mode: Any, op: Any, known: tuple[int, Any] | None = None) -> Any:
        """``(real args, real kwargs)``: :meth:`real_value` of each argument (the positional
        argument ``known[0]``'s already found: ``known[1]``), or ``NOT_FAST``."""
        op_args, op_kwargs = op
        real_args: list[Any] = []
        for index, value in enumerate(op_args):
            if known is not None and index == known[0]:
                real = known[1]
            else:
                real = self.real_value(mode, value)
                if real is NOT_FAST:
                    return NOT_FAST
            real_args.append(real)
        real_kwargs: dict[str, Any] = {}
        for name, value in op_kwargs.items():
            real = self.real_value(mode, value)
            if real is NOT_FAST:
                return NOT_FAST
            real_kwargs[name] = real
        return real_args, real_kwargs

    def real_value(self, mode: Any, value: Any) -> Any:
        """An argument's real value: a fake of ``mode`` with values, its values (read with its
        bits); a real tensor, its conversion's (the patch's conversion path: arming, D2,
        records), as upstream converts it; a list of tensors, each; anything else, itself.
        ``NOT_FAST`` for what upstream must see (another mode's fake, no values, a constant, a
        subclass, not strided)."""
        if isinstance(value, torch.Tensor):
            if self._is_fake(value):
                if (
                    getattr(value, "fake_mode", None) is not mode
                    or value.layout != torch.strided
                    or getattr(value, "constant", None) is not None
                ):
                    return NOT_FAST  # constants: upstream folds them and tracks their writes
                fake = value
            else:
                if not convertible(mode, value):
                    return NOT_FAST
                if _reads_directly(self._frames, self._aliases, mode, value):
                    _sites.need_mode(mode)  # what its conversion would have said
                    if value.requires_grad:  # uninstall() arms it, as a converted one
                        _records.note_read(mode.fake_tensor_converter, value)
                    return value.detach()
                fake = convert_op_input(mode, value)
            real = getattr(fake, "real_tensor", None)
            if real is None:
                return NOT_FAST
            if fake.is_conj() != real.is_conj() or fake.is_neg() != real.is_neg():
                return aligned(fake, real)
            return real
        if isinstance(value, list | tuple) and value and isinstance(value[0], torch.Tensor | None):
            out = []
            for item in value:
                real = self.real_value(mode, item)
                if real is NOT_FAST:
                    return NOT_FAST
                out.append(real)
            return type(value)(out) if isinstance(value, tuple) else out
        return value

    # -- fakes made from real outputs -----------------------------------------------------------

    def from_real(self, mode: Any, real_out: Any) -> Any:
        """Fakes of ``mode`` for the real outputs (:meth:`fake_of`); numbers, None as they are."""
        if isinstance(real_out, torch.Tensor):
            return self.fake_of(mode, real_out)
        if isinstance(real_out, tuple | list):
            made = [self.from_real(mode, item) for item in real_out]
            if hasattr(real_out, "_fields"):  # a named tuple (torch.return_types)
                return type(real_out)(*made)
            return type(real_out)(made)
        return real_out

    def fake_of(self, mode: Any, real: Any) -> Any:
        """A fake of ``mode`` over a meta tensor of ``real``'s sizes, strides, offset, dtype and
        bits, on its device, holding ``real`` as its values; its storage as large as the real
        one's (a kernel that resizes its output down keeps the whole buffer) and carrying the
        real storage (meta_utils' ``real_storage`` convention: ``set_`` finds it)."""
        if (
            self._from_meta is None
            or type(real) is not torch.Tensor
            or real.layout != torch.strided
            or is_zero(real)
            or self._is_fake(real)
        ):
            raise CannotRebuild
        with self._resolved.no_dispatch():
            storage = real.untyped_storage()
            nbytes = storage.nbytes()
            if real.storage_offset() == 0 and nbytes == real.numel() * real.element_size():
                meta = torch.empty_strided(
                    real.shape, real.stride(), dtype=real.dtype, device="meta"
                )
            else:
                size = max(nbytes // real.element_size(), extent(real))
                meta = torch.empty(size, dtype=real.dtype, device="meta").as_strided(
                    real.shape, real.stride(), real.storage_offset()
                )
            fake = self._from_meta(mode.fake_tensor_converter, mode, meta, real.device)
            if real.is_conj() or real.is_neg():  # eager's output is a conj/neg view: so is it
                set_conj(fake, real.is_conj())
                set_neg(fake, real.is_neg())
            fake.real_tensor = real
            _targets.set_real_storage(meta.untyped_storage(), storage)
        return fake

    def fake_over(self, mode: Any, meta: Any, device: Any) -> Any:
        """A fake of ``mode`` over ``meta`` (``FakeTensorConverter.from_meta_and_device``)."""
        if self._from_meta is None:
            raise CannotRebuild
        return self._from_meta(mode.fake_tensor_converter, mode, meta, device)


def _view_of(
    path: FastPath,
    mode: Any,
    base: Any,
    base_real: Any,
    ptr: int | None,
    storage: Any,
    fits: bool,
    real: Any,
) -> Any:
    """For :meth:`FastPath.view`, dispatch off: the fake view of ``base`` with ``real``'s
    metadata, holding ``real``: a meta tensor ``set_`` over the base fake's own storage (what
    ``as_strided`` on the base gives inside the mode's kernel invocation, without the
    dispatch); its bits are the base's, toggled where the view op toggled the real ones
    (``conj()``, ``_neg_view``). ``fits``: the base fake's storage is as large as the real
    base's (else the view is checked against it: ``set_`` would grow it)."""
    if (
        type(real) is not torch.Tensor
        or real.layout != torch.strided
        or real.dtype != base.dtype  # view_as_real/complex, .real/.imag, view(dtype)
        or is_zero(real)
        or storage_ptr(real) != ptr
        or (not fits and extent(real) * real.element_size() > storage.nbytes())
    ):
        raise CannotRebuild
    inference = base.is_inference()  # a view is an inference tensor iff its base is
    if inference != torch.is_inference_mode_enabled():
        with torch.inference_mode(inference):
            meta = torch.empty(0, dtype=real.dtype, device="meta")
    else:
        meta = torch.empty(0, dtype=real.dtype, device="meta")
    try:
        meta.set_(storage, real.storage_offset(), real.shape, real.stride())
    except RuntimeError:
        raise CannotRebuild from None
    fake = path.fake_over(mode, meta, real.device)
    conj = base.is_conj() != (real.is_conj() != base_real.is_conj())
    neg = base.is_neg() != (real.is_neg() != base_real.is_neg())
    if conj != fake.is_conj():
        set_conj(fake, conj)
    if neg != fake.is_neg():
        set_neg(fake, neg)
    fake.real_tensor = real
    return fake


def _other_fake(path: FastPath, mode: Any, real: Any) -> Any:
    """A fake of ``mode`` for a real output :meth:`FastPath.fake_of` cannot make. Sparse COO: what
    the converter makes of a real sparse tensor (meta_utils: a meta sparse tensor of its
    sparse and dense dims, sizes, dtype and coalesced flag, no indices or values; the
    propagated values hold them), holding ``real`` itself (a fresh output: the converter's
    clone of it would only be a copy); anything else: the converter's fake."""
    if (
        type(real) is torch.Tensor
        and real.layout == torch.sparse_coo
        and path._from_meta is not None
        and not path._is_fake(real)
    ):
        with path._resolved.no_dispatch():
            meta = _targets.sparse_meta_like(real)
            fake = path._from_meta(mode.fake_tensor_converter, mode, meta, real.device)
            fake.real_tensor = real
        return fake
    return mode.fake_tensor_converter.from_real_tensor(mode, real)
