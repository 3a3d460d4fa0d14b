"""``t.data = fake`` inside a propagating mode: ``t`` gets the fake's values.

``Tensor.data``'s setter (``set_data``) makes the real tensor's implementation the fake's: a
real Parameter then reports device meta, every later op on it fails, and after the mode it is
garbage. Eager gives the tensor the new tensor's storage; here the new tensor is a fake whose
propagated values are exactly that, so the real tensor gets them (aliased, as eager aliases),
and every live converter forgets the fake it made of the old tensor. A fake without values is
refused, loudly. A fake given another fake's data takes its propagated values too (a Python
attribute ``set_data`` does not carry). While a propagating user mode lives,
``torch.Tensor.data`` is this property (a :class:`_sites.Site`); otherwise torch's own
descriptor is inherited, untouched.
"""

from __future__ import annotations

from typing import Any

from . import sites as _sites
from . import targets as _targets


def make_data_property(is_fake: Any) -> property:
    """A property over torch's ``Tensor.data`` descriptor whose setter takes a propagating
    fake's values into a real tensor."""
    descriptor = _targets.resolve(_targets.TENSOR_DATA)
    get, put = descriptor.__get__, descriptor.__set__

    def data(self: Any) -> Any:
        return get(self, type(self))

    def set_data(self: Any, value: Any) -> None:
        if not is_fake(value):
            put(self, value)
            return
        if is_fake(self):
            # a fake's values are a Python attribute that set_data does not carry over
            put(self, value)
            if getattr(getattr(self, "fake_mode", None), "propagate_real_tensors", False):
                self.real_tensor = getattr(value, "real_tensor", None)
            return
        mode = getattr(value, "fake_mode", None)
        if not getattr(mode, "propagate_real_tensors", False):
            put(self, value)  # upstream's (no values to give)
            return
        real = getattr(value, "real_tensor", None)
        if real is None or value.is_conj() != real.is_conj() or value.is_neg() != real.is_neg():
            raise RuntimeError(
                "fakegrad_patch: `tensor.data = fake` inside a propagating FakeTensorMode, for a "
                "real tensor, with a fake that has no propagated values (or reads them through "
                "a conjugate or negative bit): the real tensor would become a meta tensor. "
                "Assign .data outside the `with FakeTensorMode(...)` block, or update in "
                "place: `with torch.no_grad(): t.copy_(new)`."
            )
        put(self, real)
        for ref in list(_sites.modes.values()):
            live = ref()
            converter = getattr(live, "fake_tensor_converter", None)
            if converter is not None:
                _targets.forget_conversion(converter, self)

    return property(data, set_data, doc="torch's Tensor.data (fakegrad_patch: see dataattr)")
