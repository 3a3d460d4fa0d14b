"""Upstream's path (``FakeTensorMode.dispatch`` itself), and the repairs of what it gets wrong.

Upstream runs an op's real kernel on the propagated values, then its fake implementation (a meta
kernel, a decomposition, a custom op's fake kernel, the unsafe fallback), cross-checks them and
copies the real outputs onto the fakes. With the repairs on (``propagation="fast"`` or
``"repair"``):

* **fake sides that refuse, disagree or raise** after the real kernel ran (data-dependent ops,
  ``.item()``, ops without a fake kernel, ``MetadataMismatchError``, the cross-check): the outputs
  are made from the real kernel's (what eager runs), a Python scalar as itself; a view or in-place
  op keeps its fake outputs with the real values where they agree (``propagation_rebuilt``).
  Upstream's schema checks of custom ops stand, but for its false mutation report on ``None``;
* **new tensors whose fake disagrees with its values** (sizes, dtype, device, strides) are made
  from them; **written fakes** the real kernel laid out otherwise get its strides;
* **values with conjugate/negative bits or ZeroTensors**: an op that is not a view runs with the
  Conjugate, Negative and ZeroTensor keys on, as eager runs it (the fallbacks where eager's run,
  a kernel's own reading of a bit where eager's kernel reads it; a composite kernel's own
  conjugate views); a write into an empty tensor with a bit reads plain values (written
  arguments get the update back through their bits).
"""

from __future__ import annotations

import re
from typing import Any

import torch

from ..touchpoints import targets as _targets
from ..touchpoints.targets import Resolved
from ..typing import MismatchReporter
from .fast import FastPath
from .ops import OpFacts
from .stats import Settings, Stats
from .tensors import (
    CannotRebuild,
    aligned,
    convertible,
    disagrees,
    extent,
    is_zero,
    map_tensors,
    needs_value_keys,
    pair,
    plain,
    set_conj,
    set_neg,
    special_bits,
    take_real_bits,
    tensors_in,
)


class Upstream:
    def __init__(
        self,
        resolved: Resolved,
        settings: Settings,
        stats: Stats,
        fast: FastPath,
        mismatch: MismatchReporter,
    ) -> None:
        self._resolved = resolved
        self._is_fake = resolved.is_fake
        self._settings = settings
        self._stats = stats
        self._fast = fast
        self._mismatch = mismatch
        self._in_kernel = _targets.resolve_optional(_targets.IN_KERNEL_INVOCATION)

    def call(
        self, wrapped: Any, args: Any, kwargs: Any, mode: Any, func: Any, op: Any, facts: OpFacts
    ) -> Any:
        """Upstream's dispatch of the op, repaired."""
        if not self._settings.repair or not (
            needs_value_keys(op[0]) or (op[1] and needs_value_keys(op[1].values()))
        ):
            return self._dispatch(wrapped, args, kwargs, mode, func, op, facts)
        # complex values, or bits. An op that is not a view runs with the Conjugate, Negative
        # and ZeroTensor keys on, as eager does (the mode turns them off): a kernel that reads a
        # bit itself (mm's BLAS call) reads it, the values eager's to the bit (plain values
        # rounded otherwise, which svd_lowrank's backward amplified to 2e-5), and a composite
        # kernel's own conjugate views are read right. A view runs with the keys off, as
        # before; a write into an empty tensor with a bit too, on plain values: its fake side
        # under their fallbacks fails MathBitsFallback's assert (linalg.inv of an empty batch)
        found = _valued(self._is_fake, mode, func, op, facts)
        keys_on = facts.fresh_outputs or not (
            facts.aliasing or any(w and f.numel() == 0 for f, _, w in found)
        )
        swaps = self._plain_values(found, keys_on) if found else None
        ok = False
        try:
            if keys_on:
                with self._resolved.value_keys():
                    result = self._dispatch(wrapped, args, kwargs, mode, func, op, facts)
            else:
                result = self._dispatch(wrapped, args, kwargs, mode, func, op, facts)
            ok = True
            return result
        finally:
            if swaps is not None:
                self._restore_values(swaps, ok)

    def _dispatch(
        self, wrapped: Any, args: Any, kwargs: Any, mode: Any, func: Any, op: Any, facts: OpFacts
    ) -> Any:
        try:
            result = wrapped(*args, **kwargs)
        except Exception as exc:
            if not self._settings.repair:
                raise
            # (no local holds the traceback: a frame -> traceback -> frame cycle would keep the
            # op's fakes for the garbage collector, which on 2.4 clears the __dict__ of a fake
            # that autograd still holds: "FakeTensor object has no attribute fake_mode")
            if _targets.raised_by_schema_check(exc.__traceback__) and not _false_mutation(
                exc, func, op
            ):
                raise
            result = self._recover(exc, mode, func, facts)
            if result is _targets.NO_REAL_OUT:
                self._mismatch.report(exc)  # a metadata mismatch, said plainly
                raise
            return result
        if self._settings.repair:
            if facts.fresh_outputs:
                return self.agreeing(mode, func, result)
            if facts.written_names:
                self._restride(mode, func, op, facts.written_names)
            elif facts.aliasing:
                take_real_bits(result)
        return result

    # -- outputs made from, or given, the real kernel's -----------------------------------------

    def agreeing(self, mode: Any, func: Any, result: Any) -> Any:
        """Upstream's new outputs, each fake agreeing with its own values in sizes, dtype,
        device and strides: where a fake kernel disagrees and this build's propagation does not
        check it (2.4: no cross-check; a custom op's wrong fake kernel; a meta kernel's
        strides), the fake is made again from its values (``propagation_rebuilt``)."""
        outs = result if isinstance(result, tuple | list) else (result,)
        for t in outs:
            # the real storage each new fake's storage stands for (meta_utils' convention, as
            # the converter's and the fast path's fakes have it): set_() with it finds it
            real = getattr(t, "real_tensor", None) if isinstance(t, torch.Tensor) else None
            if (
                real is not None
                and real.layout == torch.strided
                and t.layout == torch.strided
                and not is_zero(real)
            ):
                _targets.set_real_storage(t.untyped_storage(), real.untyped_storage())
        if not any(disagrees(t) for t in outs):
            return result  # the common case
        try:
            rebuilt = map_tensors(
                lambda t: self._fast.fake_of(mode, t.real_tensor) if disagrees(t) else t, result
            )
        except CannotRebuild:
            return result
        self._stats.report(
            "rebuilt",
            "propagation_rebuilt",
            func,
            reason="unchecked mismatch",
            cause="a fake output's sizes, dtype, device or strides differ from its real values",
            outputs="real",
        )
        return rebuilt

    def with_values(self, fake_out: Any, real_out: Any) -> Any:
        """``fake_out`` holding ``real_out``'s values, where every pair agrees in sizes, dtype
        and device (else ``CannotRebuild``)."""
        fakes: list[Any] = []
        reals: list[Any] = []
        pair(fake_out, real_out, fakes, reals)
        for fake, real in zip(fakes, reals, strict=True):
            if not (
                self._is_fake(fake)
                and isinstance(real, torch.Tensor)
                and fake.shape == real.shape
                and fake.dtype == real.dtype
                and fake.device == real.device
            ):
                raise CannotRebuild
        with self._resolved.no_dispatch():
            for fake, real in zip(fakes, reals, strict=True):
                fake.real_tensor = real
        return fake_out

    def _recover(self, exc: BaseException, mode: Any, func: Any, facts: OpFacts) -> Any:
        """The op's outputs after its fake side refused: made from the real kernel's (new
        tensors), or the fake kernel's with the real kernel's values (a view or an in-place
        op); ``NO_REAL_OUT`` when neither is possible (upstream's error stands)."""
        real_out = _targets.raised_real_out(exc.__traceback__, mode)
        if real_out is _targets.NO_REAL_OUT:
            return real_out
        kept = "real"
        try:
            if facts.fresh_outputs:
                result = self._fast.from_real(mode, real_out)
            else:
                fake_out = _targets.raised_fake_out(exc.__traceback__)
                if fake_out is _targets.NO_REAL_OUT:
                    return fake_out
                result = self.with_values(fake_out, real_out)
                kept = "fake"
        except CannotRebuild:
            return _targets.NO_REAL_OUT
        self._stats.report(
            "rebuilt",
            "propagation_rebuilt",
            func,
            reason=type(exc).__name__,
            cause=first_line(exc),
            outputs=kept,
        )
        return result

    def _restride(self, mode: Any, func: Any, op: Any, written: frozenset[str]) -> None:
        """After an ``out=`` or in-place op: a written fake whose real values the real kernel
        laid out otherwise (an empty ``out`` resized like a non-contiguous input; the meta
        kernel resizes it contiguous) gets their strides and offset, as eager has."""
        if self._in_kernel is None:
            return
        op_args, op_kwargs = op
        for index, argument in enumerate(func._schema.arguments):
            if argument.name not in written:
                continue
            value = op_args[index] if index < len(op_args) else op_kwargs.get(argument.name)
            for t in tensors_in((value,)):
                real = getattr(t, "real_tensor", None) if self._is_fake(t) else None
                if (
                    real is None
                    or t.layout != torch.strided
                    or real.layout != torch.strided
                    or t.shape != real.shape
                    or (t.stride() == real.stride() and t.storage_offset() == real.storage_offset())
                    or extent(real) * real.element_size() > t.untyped_storage().nbytes()
                ):
                    continue
                with self._in_kernel(mode):
                    torch.ops.aten.as_strided_.default(
                        t, real.shape, real.stride(), real.storage_offset()
                    )
                self._stats.report(
                    "restrided",
                    "propagation_rebuilt",
                    func,
                    reason="strides",
                    cause="a written fake's strides differ from its real values'",
                    outputs="fake",
                )

    # -- plain values for the real run ----------------------------------------------------------

    def _plain_values(self, found: list[Any], keys_on: bool) -> list[Any] | None:
        """Before the real run: ``found`` (:func:`_valued`) get plain values for the op (the
        real kernel, called inside the mode where those keys are off, would read the raw
        storage; eager's fallbacks materialize them first). With the keys on (``keys_on``) only
        a ZeroTensor on either side (zeros) and values whose bits are not the fake's (an alias
        with the fake's bits) are replaced. None when there are none (the common case)."""
        swaps: list[Any] = []
        for fake, real, written in found:
            zero = is_zero(fake) or is_zero(real)
            if written and zero:
                continue  # immutable: upstream's (and eager's) error
            alias = keys_on and not zero
            if alias and (real.is_conj(), real.is_neg()) == (fake.is_conj(), fake.is_neg()):
                continue  # read with the keys on as eager reads it
            with self._resolved.no_dispatch():
                shadow = aligned(fake, real) if alias else plain(fake, real)
                fake.real_tensor = shadow
            # an alias's writes reach the real storage themselves
            swaps.append((fake, real, shadow, written and not alias))
        return swaps or None

    def _restore_values(self, swaps: list[Any], ok: bool) -> None:
        """After the op: written arguments get the op's update on their raw storage, read with
        their bits (``copy_`` applies them); every fake gets its own values back."""
        with self._resolved.no_dispatch():
            for fake, real, shadow, written in reversed(swaps):
                if written and ok:
                    view = torch.ops.aten.alias.default(real)
                    set_conj(view, fake.is_conj())
                    set_neg(view, fake.is_neg())
                    view.copy_(shadow)
                fake.real_tensor = real


def _valued(is_fake: Any, mode: Any, func: Any, op: Any, facts: OpFacts) -> list[Any]:
    """For :meth:`Upstream.call`: the arguments of an op that is not a view whose fake or values
    carry a conjugate or negative bit or are a ZeroTensor: ``(fake, values, written)``, each
    fake once."""
    if facts.aliasing:
        return []
    op_args, op_kwargs = op
    found: list[Any] = []
    for index, argument in enumerate(func._schema.arguments):
        name = argument.name
        value = op_args[index] if index < len(op_args) else op_kwargs.get(name)
        for t in tensors_in((value,)):
            fake: Any
            if is_fake(t):
                if getattr(t, "fake_mode", None) is not mode:
                    continue
                fake = t
            elif convertible(mode, t) and special_bits(t):
                # converted now: upstream's conversion returns the same fake (memo)
                fake = mode.fake_tensor_converter.from_real_tensor(mode, t)
            else:
                continue
            real = getattr(fake, "real_tensor", None)
            if real is None or fake.layout != torch.strided:
                continue
            if (special_bits(fake) or special_bits(real)) and all(f is not fake for f, *_ in found):
                found.append((fake, real, name in facts.written_names))
    return found


_MUTATION = re.compile(
    r"for argument '(\w+)': the operator's schema .* specified that the operator does not mutate"
)


def _false_mutation(exc: BaseException, func: Any, op: Any) -> bool:
    """Upstream's mutation check of a custom op (``torch._library.utils.MutationChecker``, run
    on the real kernel's arguments under propagation) compares a ``None`` optional argument's
    "not mutated" with ``None`` and refuses every call that passes ``None`` for a ``Tensor?``
    argument (2.13.0, 2.14.1: ``linear_cross_entropy``'s chunked kernels without a bias). A
    refusal naming an argument that is ``None`` is that defect, not a mutation."""
    found = _MUTATION.search(str(exc))
    if found is None:
        return False
    name = found.group(1)
    op_args, op_kwargs = op
    for index, argument in enumerate(getattr(getattr(func, "_schema", None), "arguments", ())):
        if argument.name == name:
            if index < len(op_args):
                return op_args[index] is None
            return op_kwargs.get(name) is None
    return False


def first_line(exc: BaseException) -> str:
    text = str(getattr(exc, "reason", "") or exc).strip().splitlines()
    return text[0][:200] if text else type(exc).__name__


def name_the_op(exc: BaseException, func: Any) -> None:
    """An error out of a propagating mode's op names the op (Python 3.11+: a note), once."""
    add_note = getattr(exc, "add_note", None)
    if add_note is None:
        return
    note = f"fakegrad_patch: raised by {func} under a propagating FakeTensorMode"
    if note not in (getattr(exc, "__notes__", None) or ()):
        add_note(note)
