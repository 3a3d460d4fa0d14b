"""Ops eager runs and FakeTensorMode refuses or gets wrong with real tensors or storages among
their arguments: ``set_()`` with a storage, and the ops that change a tensor's metadata
(``resize_``, ``t_``, ``as_strided_``: "Can't call metadata mutating ops on non-Fake Tensor
inputs").
"""

from __future__ import annotations

from typing import Any

import torch

from ..touchpoints import sites as _sites
from ..touchpoints import targets as _targets
from ..touchpoints.targets import Resolved
from .fast import NOT_FAST, FastPath
from .stats import Stats
from .tensors import CannotRebuild, convert_op_input, convertible, tensors_in


class Converted:
    """An op's arguments with its real tensors converted (upstream's path takes them)."""

    __slots__ = ("args", "kwargs")

    def __init__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.args = args
        self.kwargs = kwargs


class Refused:
    def __init__(self, resolved: Resolved, stats: Stats, fast: FastPath) -> None:
        self._resolved = resolved
        self._is_fake = resolved.is_fake
        self._stats = stats
        self._fast = fast
        self._in_kernel = _targets.resolve_optional(_targets.IN_KERNEL_INVOCATION)

    def set_storage(self, mode: Any, func: Any, op: Any) -> Any:
        """``fake.set_(storage, offset, size, stride)`` (and ``set_(source)``): upstream's real
        run gets a meta storage (a fake's), or its fake side a real one, and either refuses.
        The real tensor is set to the real storage and the fake to the meta one, each with the
        same offset, sizes and strides; a real storage is converted first as an op input is (a
        copy of its values, or itself under write-back). ``NOT_FAST`` where the storage's values
        are not known (upstream's path then)."""
        if self._in_kernel is None:
            return NOT_FAST
        op_args, op_kwargs = op
        names = ("self", "source", "storage_offset", "size", "stride")
        params = dict(zip(names[: len(op_args)], op_args, strict=True))
        params.update(op_kwargs)
        t, source = params["self"], params["source"]
        t_real = getattr(t, "real_tensor", None) if self._is_fake(t) else None
        if t_real is None or getattr(t, "fake_mode", None) is not mode:
            return NOT_FAST
        fake: Any
        if isinstance(source, torch.Tensor):
            fake = source if self._is_fake(source) else None
        elif source.device.type == "meta":
            # a fake's storage: the real storage it stands for (meta_utils' convention)
            real_storage = _targets.real_storage_of(source)
            if real_storage is None:
                return NOT_FAST
            with self._resolved.no_dispatch():
                meta = torch.empty(0, dtype=t.dtype, device="meta")
                meta.set_(source)
                base = torch.empty(0, dtype=t.dtype, device=real_storage.device)
                base.set_(real_storage)
            try:
                fake = self._fast.fake_over(mode, meta, t.device)
            except CannotRebuild:
                return NOT_FAST
            fake.real_tensor = base
        else:
            with self._resolved.no_dispatch():
                base = torch.empty(0, dtype=t.dtype, device=source.device)
                base.set_(source)
            fake = convert_op_input(mode, base)
            # the real tensor over the storage lives as long as the fake set to it: updates
            # that reach only the copy are reported against it (the watch holds them weakly)
            t._fakegrad_storage_owner = base
        real = getattr(fake, "real_tensor", None)
        if fake is None or real is None or getattr(fake, "fake_mode", None) is not mode:
            return NOT_FAST
        if "size" in params:
            where = (params["storage_offset"], params["size"], params.get("stride") or [])
        else:  # set_(storage) / set_(tensor): the whole storage, or the tensor's view of it
            where = (
                (0, [real.untyped_storage().nbytes() // real.element_size()], [1])
                if not isinstance(source, torch.Tensor)
                else (real.storage_offset(), list(real.shape), list(real.stride()))
            )
        with self._resolved.no_dispatch():
            t_real.set_(real.untyped_storage(), *where)
        with self._in_kernel(mode):
            torch.ops.aten.set_.source_Storage_storage_offset(t, fake.untyped_storage(), *where)
        self._stats.report(
            "set_storage", "propagation_rebuilt", func, reason="set_", cause="", outputs="fake"
        )
        return t

    def mutate_metadata(self, mode: Any, func: Any, op: Any) -> Any:
        """An op that changes its first argument's sizes or strides with real tensors among its
        arguments. Every argument real: the op runs on them, as eager (every live converter
        forgets its fake of the changed tensor); the first argument a fake: the others are
        converted as op inputs are, for upstream's path (:class:`Converted`). ``NOT_FAST``
        otherwise."""
        op_args, op_kwargs = op
        tensors = tensors_in((*op_args, *op_kwargs.values()))
        is_fake = self._is_fake
        if not tensors or not any(not is_fake(t) for t in tensors):
            return NOT_FAST  # all fake: upstream's
        first = op_args[0] if op_args else None
        if not isinstance(first, torch.Tensor):
            return NOT_FAST
        if not any(is_fake(t) for t in tensors):
            if not all(convertible(mode, t) for t in tensors):
                return NOT_FAST
            result = func(*op_args, **op_kwargs)
            for ref in list(_sites.modes.values()):
                converter = getattr(ref(), "fake_tensor_converter", None)
                if converter is not None:
                    _targets.forget_conversion(converter, first)
            return result
        if not is_fake(first) or getattr(first, "fake_mode", None) is not mode:
            return NOT_FAST

        def convert(v: Any) -> Any:
            if isinstance(v, torch.Tensor) and not is_fake(v) and convertible(mode, v):
                return convert_op_input(mode, v)
            return v

        args = tuple(convert(v) for v in op_args)
        kwargs = {k: convert(v) for k, v in op_kwargs.items()}
        if any(isinstance(v, torch.Tensor) and not is_fake(v) for v in (*args, *kwargs.values())):
            return NOT_FAST
        return Converted(args, kwargs)
