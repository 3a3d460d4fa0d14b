"""Tensor methods that do not reach ``FakeTensorMode.dispatch`` and differ from eager inside a
propagating mode. While a propagating user mode lives each is a :class:`Site` of ours over
torch's (torch's own otherwise):

* ``t.data = fake`` (``Tensor.data``'s setter, ``set_data``) made a real tensor's implementation
  the fake's: a real Parameter reported device meta and was garbage after the mode. The real
  tensor gets the fake's propagated values (aliased, as eager aliases the new tensor), and every
  live converter forgets its fake of the old tensor; a fake given another fake's data takes its
  values too (a Python attribute ``set_data`` does not carry). A fake without values is refused.
* ``retain_grad()`` on a real non-leaf after it entered the mode: its retained gradient was a
  FakeTensor; its hooks are armed at once.
* ``FakeTensor.tolist`` iterated the fake (``unbind``: autograd refused a multi-output view whose
  sibling was written, where eager reads; 2.4 has none: "NYI for higher dims"): the propagated
  values' list, as ``.item()`` answers each element from the real kernel.
"""

from __future__ import annotations

from typing import Any

import torch
import wrapt

from ..touchpoints import sites as _sites
from ..touchpoints import targets as _targets
from ..touchpoints.targets import Resolved
from ..typing import InternalErrors, RetainedArmer
from .stats import Settings


def data_property(is_fake: Any, descriptor: Any) -> property:
    """A property over torch's ``Tensor.data`` descriptor (``targets.TENSOR_DATA``, resolved by
    the caller) whose setter takes a propagating fake's values into a real tensor."""
    get, put = descriptor.__get__, descriptor.__set__

    def data(self: Any) -> Any:
        return get(self, type(self))

    def set_data(self: Any, value: Any) -> None:
        if not is_fake(value):
            put(self, value)
            return
        if is_fake(self):
            put(self, value)
            if getattr(getattr(self, "fake_mode", None), "propagate_real_tensors", False):
                self.real_tensor = getattr(value, "real_tensor", None)
            return
        if not getattr(getattr(value, "fake_mode", None), "propagate_real_tensors", False):
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
            converter = getattr(ref(), "fake_tensor_converter", None)
            if converter is not None:
                _targets.forget_conversion(converter, self)

    return property(data, set_data, doc="torch's Tensor.data (fakegrad_patch: methods.py)")


class RetainGrad:
    """``retain_grad()`` on a real non-leaf while a propagating user mode lives: its hooks are
    armed now, as when a mode converts a retained tensor (they leave real gradients alone)."""

    def __init__(
        self, is_fake: Any, settings: Settings, armer: RetainedArmer, errors: InternalErrors
    ) -> None:
        self._is_fake = is_fake
        self._settings = settings
        self._armer = armer
        self._errors = errors

    def __call__(self, wrapped: Any, t: Any, args: Any, kwargs: Any) -> Any:
        result = wrapped(*args, **kwargs)
        try:
            if (
                self._settings.repair
                and not self._is_fake(t)
                and t.grad_fn is not None
                and t.retains_grad
            ):
                self._armer.arm_retained(t)
        except Exception as exc:  # never break the host's program
            self._errors.internal_error("retain_grad", exc)
        return result


def tolist_method(resolved: Resolved, settings: Settings, observing: Any, original: Any) -> Any:
    """``FakeTensor.tolist`` in a propagating user mode: the propagated values' list."""
    fallback = torch.Tensor.tolist if original is _sites.ABSENT else original
    real_of = resolved.real_of
    no_dispatch = resolved.no_dispatch

    def tolist(fake: Any) -> Any:
        mode = getattr(fake, "fake_mode", None)
        if (
            settings.repair
            and observing()
            and getattr(mode, "propagate_real_tensors", False)
            and getattr(mode, "shape_env", None) is None
            and fake.layout == torch.strided
        ):
            real = real_of(fake)
            if real is not None:
                with no_dispatch():
                    return real.tolist()
        return fallback(fake)

    return tolist


def tensor_data_descriptor() -> Any:
    """torch's ``Tensor.data`` descriptor where :func:`method_sites` wraps it (``Tensor`` does not
    define ``data`` itself), else None. May import: call it before taking a lock."""
    if "data" in torch.Tensor.__dict__:
        return None
    return _targets.resolve(_targets.TENSOR_DATA)


def method_sites(
    resolved: Resolved,
    settings: Settings,
    observing: Any,
    armer: RetainedArmer,
    errors: InternalErrors,
    tensor_data: Any,
    tensor_retain_grad: Any,
) -> list[_sites.Site]:
    """The Sites of ``Tensor.data``, ``Tensor.retain_grad`` and ``FakeTensor.tolist``
    (``tensor_data``, ``tensor_retain_grad``: ``targets.TENSOR_DATA`` and
    ``targets.tensor_retain_grad()``, found before the caller's lock). Imports nothing (wrapt is
    imported with this module)."""
    sites = []
    if tensor_data is not None:  # Tensor does not define ``data`` itself
        sites.append(
            _sites.Site(
                torch.Tensor,
                "data",
                data_property(resolved.is_fake, tensor_data),
                _sites.ABSENT,
                registry=_sites.user_modes,
                lost="`real.data = fake` inside the mode makes the tensor a meta one",
            )
        )
    own = torch.Tensor.__dict__.get("retain_grad", _sites.ABSENT)
    retain = own if own is not _sites.ABSENT else tensor_retain_grad
    if callable(retain):
        sites.append(
            _sites.Site(
                torch.Tensor,
                "retain_grad",
                wrapt.FunctionWrapper(
                    retain, RetainGrad(resolved.is_fake, settings, armer, errors)
                ),
                own,
                registry=_sites.user_modes,
                lost="retain_grad() after a tensor entered the mode keeps fake .grad",
            )
        )
    fake_cls = resolved.fake_tensor_cls
    original = fake_cls.__dict__.get("tolist", _sites.ABSENT)
    sites.append(
        _sites.Site(
            fake_cls,
            "tolist",
            tolist_method(resolved, settings, observing, original),
            original,
            registry=_sites.user_modes,
            lost="tolist() of a fake keeps upstream's answer",
        )
    )
    return sites
