"""The fake floor (P19, P20): the least a FakeTensorMode with real values can do per aten op.

``FakeFloor`` is a ``FakeTensorMode`` whose ``__torch_dispatch__`` runs the op's real kernel on
its arguments' values (a FakeTensor's ``real_tensor``; a real tensor as it is) and wraps each
output in a fresh FakeTensor over a meta tensor of its sizes and strides, holding it. Nothing
else: no conversion of real tensors, no aliasing between fakes, no fake kernel, no check, no
cache, no accumulation (a real leaf's ``.grad`` ends a FakeTensor, as unpatched). It is a
reference, not a mode anyone should use: any correct propagating mode does at least this per op
(one Python-level mode call, one FakeTensor per output), so ``patched / fake floor`` is the part
of the step the patch and FakeTensorMode's own bookkeeping add, and a goal below the floor's own
ratio cannot be met by a mode that makes FakeTensors.

Private torch names, benchmark-only (the library's live in fakegrad_patch/_core/touchpoints/
targets.py): ``torch._subclasses.fake_tensor.FakeTensor`` / ``FakeTensorMode``,
``FakeTensorConverter.from_meta_and_device`` (once per device, to learn a fake's attributes),
``torch.Tensor._make_subclass`` with ``dispatch_device`` / ``device_for_backend_keys``,
``torch._C._DisableTorchDispatch``, ``torch.ops.prim.device``. Checked on torch 2.13.0 and
2.14.1 (the bench env's builds); where one is missing :func:`available` says why and the floor
rows are skipped.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

#: device -> the attributes (all but the mode) of a fake made by upstream's constructor
_ATTRS: dict[Any, dict[str, Any]] = {}


@functools.cache
def available(device: str = "cpu") -> str | None:
    """None where the floor can be built on this torch and ``device``, else why not."""
    try:
        ones = torch.ones(2, device=device)
        with FakeFloor() as mode:
            out = ones + 1
        if type(out) is not FakeTensor or out.fake_mode is not mode:
            return "the floor mode did not return its own FakeTensor"
        if out.device != ones.device or not torch.equal(
            out.real_tensor.cpu(), torch.full((2,), 2.0)
        ):
            return "the floor mode's device or values are wrong"
    except Exception as exc:  # a private name moved: no floor rows on this build
        return f"the floor mode cannot run here: {type(exc).__name__}: {exc}"
    return None


class FakeFloor(FakeTensorMode):
    """See the module docstring."""

    def __init__(self) -> None:
        super().__init__(allow_non_fake_inputs=True)
        self._device_op = torch.ops.prim.device.default

    def __torch_dispatch__(  # type: ignore[override]
        self, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        if func is self._device_op:
            return args[0].fake_device
        out = func(*_values(args), **{k: _values(v) for k, v in (kwargs or {}).items()})
        if isinstance(out, torch.Tensor):
            return self._fake(out, args)
        if isinstance(out, tuple | list):
            made = [self._fake(o, args) if isinstance(o, torch.Tensor) else o for o in out]
            return type(out)(*made) if hasattr(out, "_fields") else type(out)(made)
        return out

    def _fake(self, real: torch.Tensor, args: Any) -> Any:
        for arg in args:  # an in-place op returns its argument: the same fake
            if type(arg) is FakeTensor and arg.real_tensor is real:
                return arg
        if real.layout != torch.strided:  # (a sparse gradient) upstream's conversion
            return self.fake_tensor_converter.from_real_tensor(self, real)
        with torch._C._DisableTorchDispatch():
            meta = torch.empty_strided(real.shape, real.stride(), dtype=real.dtype, device="meta")
        fake = torch.Tensor._make_subclass(
            FakeTensor,
            meta,
            real.requires_grad,
            dispatch_device=True,
            device_for_backend_keys=real.device,
        )
        attrs = _ATTRS.get(real.device)
        if attrs is None:
            with torch._C._DisableTorchDispatch():
                one = torch.empty(1, device="meta")
            made = self.fake_tensor_converter.from_meta_and_device(self, one, real.device)
            attrs = {k: v for k, v in made.__dict__.items() if k != "fake_mode"}
            _ATTRS[real.device] = attrs
        fake.__dict__.update(attrs)
        fake.fake_mode = self
        fake.real_tensor = real
        return fake


def _values(value: Any) -> Any:
    if type(value) is FakeTensor:
        return value.real_tensor
    if isinstance(value, list | tuple) and any(type(v) is FakeTensor for v in value):
        return type(value)(_values(v) for v in value)
    return value
