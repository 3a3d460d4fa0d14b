"""Tensor helpers the parts of the dispatch path share: where a tensor's values are, how a fake's
values are read, how an op's arguments and outputs are walked.

A fake's propagated values (``real_tensor``) are its raw storage, read with the fake's own
conjugate and negative bits (the converter's convention for views, which the patch keeps for
every fake it makes or repairs).
"""

from __future__ import annotations

from typing import Any

import torch

from .. import state as _state
from ..convert import lending as _lending
from ..touchpoints import targets as _targets

set_conj, set_neg, is_zero = _targets.value_bit_tools()
#: the tensor types the fast path converts itself (a subclass keeps upstream's path)
PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)


class CannotRebuild(Exception):
    """An output the patch cannot make a fake of (sparse, a subclass): upstream's way stands."""


# -- where values are ------------------------------------------------------------------------------


def storage_ptr(t: Any) -> int | None:
    """The data pointer of a real strided tensor's storage (None: no tensor, not strided, meta),
    computed from the tensor's own pointer (``untyped_storage()`` costs microseconds)."""
    if t is None or t.layout != torch.strided or t.is_meta:  # is_meta: no device object made
        return None
    return int(t.data_ptr() - t.storage_offset() * t.element_size())


def private_copy(real: Any) -> Any:
    """A copy of ``real`` over a copy of its whole storage (same sizes, strides, offset)."""
    copy = torch.empty(0, dtype=real.dtype, device=real.device)
    copy.set_(real.untyped_storage().clone(), real.storage_offset(), real.shape, real.stride())
    return copy


def extent(t: Any) -> int:
    """Elements of storage a strided tensor reaches (offset included)."""
    if t.numel() == 0:
        return t.storage_offset()
    return (
        t.storage_offset()
        + 1
        + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True) if n)
    )


def same_metadata(fake: Any, real: Any) -> bool:
    return (
        fake.shape == real.shape
        and fake.dtype == real.dtype
        and fake.device == real.device
        and fake.layout == real.layout
        and (real.layout != torch.strided or fake.stride() == real.stride())
    )


def disagrees(t: Any) -> bool:
    """A fake whose own real values have other sizes, dtype, device or strides (the real
    kernel's strides are eager's; a meta kernel's may differ: ``rrelu`` and training
    ``batch_norm`` on a non-contiguous input)."""
    real = getattr(t, "real_tensor", None) if isinstance(t, torch.Tensor) else None
    return real is not None and (
        t.shape != real.shape
        or t.dtype != real.dtype
        or t.device != real.device
        or (
            t.layout == torch.strided
            and real.layout == torch.strided
            and (t.stride() != real.stride() or t.storage_offset() != real.storage_offset())
        )
    )


# -- conjugate and negative bits, ZeroTensors -----------------------------------------------------


def special_bits(t: Any) -> bool:
    """A conjugate or negative view bit, or a ZeroTensor (no storage): a real kernel called
    inside a dispatch mode ignores the bits and reads a ZeroTensor's null data pointer (their
    keys are above the Python key, so excluded there)."""
    return bool(t.is_conj() or t.is_neg() or is_zero(t))


def aligned(fake: Any, real: Any) -> Any:
    """``real``'s raw storage read with ``fake``'s conjugate and negative bits (an alias)."""
    view = torch.ops.aten.alias.default(real)
    set_conj(view, fake.is_conj())
    set_neg(view, fake.is_neg())
    return view


def plain(fake: Any, real: Any) -> Any:
    """The values ``fake`` stands for, as a plain tensor a real kernel reads right inside the
    mode (``clone`` materializes: ``copy_`` applies the bits itself); a ZeroTensor is zeros."""
    if is_zero(fake) or is_zero(real):
        return torch.zeros(real.shape, dtype=real.dtype, device=real.device)
    return torch.ops.aten.clone.default(aligned(fake, real))


def needs_value_keys(values: Any) -> bool:
    """Might a real kernel on these values meet a conjugate or negative bit or a ZeroTensor
    (a complex value: composite kernels make conjugate views of their own)?"""
    for value in values:
        if isinstance(value, torch.Tensor):
            if value.is_complex() or value.is_neg() or is_zero(value):
                return True
        elif isinstance(value, list | tuple) and needs_value_keys(value):
            return True
    return False


def take_real_bits(result: Any) -> None:
    """A view's fake whose real view carries a conjugate or negative bit the fake lacks (the
    real view kernel's bits are eager's) takes them."""
    for t in result if isinstance(result, tuple | list) else (result,):
        real = getattr(t, "real_tensor", None) if isinstance(t, torch.Tensor) else None
        if real is None or (t.is_conj() == real.is_conj() and t.is_neg() == real.is_neg()):
            continue
        set_conj(t, real.is_conj())
        set_neg(t, real.is_neg())


# -- an op's arguments and outputs ---------------------------------------------------------------


def op_arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """``dispatch(func, types, args=(), kwargs={})``'s op arguments."""
    op_args = args[2] if len(args) > 2 else kwargs.get("args", ())
    op_kwargs = args[3] if len(args) > 3 else kwargs.get("kwargs")
    return op_args, op_kwargs or {}


def tensors_in(values: Any) -> list[Any]:
    """The tensors among aten arguments: tensors, and the tensors of ``Tensor[]`` lists."""
    out = []
    for value in values:
        if isinstance(value, torch.Tensor):
            out.append(value)
        elif isinstance(value, list | tuple):
            out.extend(v for v in value if isinstance(v, torch.Tensor))
    return out


def argument_tensors(op_args: Any, op_kwargs: Any) -> list[Any]:
    return tensors_in((*op_args, *op_kwargs.values()))


def written_tensors(written: Any, op_args: Any, op_kwargs: Any) -> list[Any]:
    """The tensors of the arguments ``written`` names (``(position, name)`` pairs)."""
    return tensors_in(
        op_args[index] if index < len(op_args) else op_kwargs.get(name) for index, name in written
    )


def real_write_ptrs(
    written: Any, op_args: Any, op_kwargs: Any, is_fake: Any
) -> frozenset[int] | None:
    """The storage data pointers of the tensors ``written`` names, where all are real and
    strided; None where one is a fake (its values may be a real tensor's, lent or copied)."""
    ptrs = set()
    for t in written_tensors(written, op_args, op_kwargs):
        ptr = None if is_fake(t) else storage_ptr(t)
        if ptr is None:
            return None
        ptrs.add(ptr)
    return frozenset(ptrs)


def has_fake(op: Any, is_fake: Any) -> bool:
    return any(is_fake(t) for t in tensors_in((*op[0], *op[1].values())))


def map_tensors(fn: Any, value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, tuple | list):
        made = [map_tensors(fn, v) for v in value]
        return type(value)(*made) if hasattr(value, "_fields") else type(value)(made)
    return value


def pair(fake: Any, real: Any, fakes: list[Any], reals: list[Any]) -> None:
    """The tensors of two outputs of the same structure, side by side."""
    if isinstance(fake, tuple | list):
        if not isinstance(real, tuple | list) or len(real) != len(fake):
            raise CannotRebuild
        for f, r in zip(fake, real, strict=True):
            pair(f, r, fakes, reals)
    elif isinstance(fake, torch.Tensor):
        fakes.append(fake)
        reals.append(real)


# -- real tensors entering the mode -------------------------------------------------------------


def convertible(mode: Any, t: Any) -> bool:
    """A real tensor the fast path converts as upstream would: a plain strided tensor (or
    Parameter), in a mode that allows real inputs (else upstream's error stands)."""
    return type(t) in PLAIN_TYPES and t.layout == torch.strided and bool(mode.allow_non_fake_inputs)


def convert_op_input(mode: Any, t: Any) -> Any:
    """``t``'s fake, converted as upstream converts an op input (the patch's conversion path:
    arming, values, write-back), known not to have run for real (the fast path runs it once,
    after)."""
    converting = _state.converting
    before = getattr(converting, "fast", False)
    converting.fast = True
    try:
        return mode.fake_tensor_converter.from_real_tensor(mode, t)
    finally:
        converting.fast = before


def own_written(written: Any, op_args: Any, op_kwargs: Any) -> None:
    """Before an op that writes ``written`` (its facts): every fake among them whose values are
    lent gets its own (convert/lending.py). Raises what the copy raises: the op must not run."""
    if _lending.any_lent():
        for t in written_tensors(written, op_args, op_kwargs or {}):
            _lending.own_tensor(t)
