"""What the patch does to FakeTensorMode's real-value propagation itself (issues 39, 41).

A propagating ``FakeTensorMode`` runs every op twice: the real kernel on the propagated values
(``real_out``) and the fake implementation (a meta kernel, a Python decomposition, a fake kernel
of a custom op, or the "unsafe fallback"), then checks one against the other and copies the real
outputs onto the fake ones. The patch copies those values into ``.grad``, so wherever upstream's
values are wrong, the user's gradient would be wrong; and the double run makes one propagating
pass cost more than the seed's two-pass workaround. Here, in modes that propagate real values and
have no ShapeEnv (a user's; torch.compile, export and the other tracers keep upstream's behaviour
exactly), by behaviour, never by version (docs/how-it-works.md, "Propagation itself"):

* **The fast path** (``propagation="fast"``, the default): an aten op that makes new tensors runs
  its real kernel once and its fake outputs are made from the real ones; a view op runs the real
  view and its fake view is ``as_strided`` over the aliased fake's storage. In-place, ``out=``
  and the ops of :data:`HIDDEN_WRITES` keep upstream's path.
* **In-place ops that FakeTensorMode decomposes** (``index_add_`` into ``index_put_``: the
  backward of an overlapping ``as_strided``, so ``stft``): a nested op that writes an argument of
  the outermost op, when that op ran for real, gets a shadow copy until the outer op returns
  (``propagation_repaired``, ``repair: "nested_write"``).
* **Ops without a meta kernel** (``fractional_max_pool3d_backward``; aten's CUDA-only fused
  kernels: ``_thnn_fused_gru_cell``; torchvision/torchaudio ops) take ``run_fallback_kernel``:
  the real kernel on zero-filled inputs, returned without the real kernel's values on one path.
  Their outputs get the real kernel's values, or lose the zeros' values where the op had none
  (then the gradients are reported, never copied) (``repair: "fallback_kernel"``).
* **Fake sides that refuse, disagree or raise** after the real kernel ran (data-dependent ops,
  ``.item()``, ``bool()``, ``aten.equal``, ops without a fake kernel, ``MetadataMismatchError``,
  propagation's own cross-check): the op's outputs are made from the real kernel's (what eager
  runs), a Python scalar as itself; a view or in-place op keeps its fake outputs with the real
  values where they agree in sizes, dtype and device (``propagation_rebuilt``). Upstream's schema
  checks of custom ops stand, but for its false mutation report on ``None`` optional arguments.

``propagation="repair"`` keeps upstream's propagation with the repairs; ``"upstream"`` turns all
of it off. This module owns the one wrapper of ``FakeTensorMode.dispatch`` (a
:class:`_sites.Site`: in place only while a propagating user mode lives or write-back is on) and
calls the write-back watch (:mod:`._writeback`) around every op: the outermost op of a mode per
thread is one :class:`_writeback.Frame`, shared by both.
"""

from __future__ import annotations

import re
import threading
from typing import Any

import torch

from .. import trace
from . import sites as _sites
from . import state as _state
from . import targets as _targets
from .dataattr import make_data_property
from .writeback import Frame, WriteBack, _op_arguments, _private_copy, _storage, _written_tensors


class Propagation:
    """One installation's dispatch wrapper: the write-back watch and the propagation repairs."""

    def __init__(self, resolved: Any, applied: Any, write_back: WriteBack) -> None:
        self._r = resolved
        self._applied = applied
        self._wb = write_back
        self._is_fake = resolved.is_fake
        #: per thread: ``stack``, the outermost op of each mode being dispatched (Frames)
        self.tls = threading.local()
        self._lock = threading.Lock()
        #: ``FakeTensorMode.dispatch`` wrapped while needed (reports; write-back; repairs)
        self.observing = False
        #: the repairs are on (``propagation="fast"`` or ``"repair"``)
        self.repair = True
        #: new-tensor ops take the real kernel's outputs directly (``propagation="fast"``)
        self.fast = True
        self._sites: list[_sites.Site] = []
        self._policy = False
        # resolved once: every optional touch point may be absent on a build
        self._from_meta = _targets._resolve_optional(_targets.FROM_META_AND_DEVICE)
        self._in_kernel = _targets._resolve_optional(_targets.IN_KERNEL_INVOCATION)
        self._allow_numbers = _targets._resolve_optional(_targets.SHOULD_ALLOW_NUMBERS)
        self._can_read_frames = (
            _targets._resolve_optional(_targets.DISPATCH_IMPL_REAL_OUT) is not None
        )
        #: repairs made in this process, by kind (tests, ``status()``)
        self.counts: dict[str, int] = {}
        #: ops that took the fast path in this process (a statistic)
        self.fast_ops = 0
        #: ops the mode answers from metadata: handed straight on
        self._direct = _targets.direct_ops(resolved.fake_tensor_module)
        write_back.attach(self)

    # -- on / off --------------------------------------------------------------------------------

    def observe(self) -> bool:
        """Watch the ops of propagating user modes (idempotent, thread-safe): from now on
        ``FakeTensorMode.dispatch`` (and the fallback kernel) are wrapped while such a mode lives
        or write-back is on, and are torch's own functions otherwise (issue 28: a plain mode, a
        tracer's, pays nothing per op). False where ``dispatch`` is missing."""
        if self.observing:
            return True
        import wrapt

        # import first, then lock (issue 40): resolving a target may import
        if _targets._resolve_optional(_targets.FAKE_MODE_DISPATCH) is None:
            return False
        fallback_ok = _targets._resolve_optional(_targets.RUN_FALLBACK_KERNEL) is not None
        with self._lock:
            if self.observing:
                return True
            sites = self._sites
            if not sites:
                cls = self._r.fake_mode_cls
                name = _targets.FAKE_MODE_DISPATCH.qualname.rsplit(".", 1)[1]
                original = cls.__dict__.get(name)
                if not callable(original):
                    return False
                sites = [
                    _sites.Site(
                        cls,
                        name,
                        wrapt.FunctionWrapper(original, self.dispatch),
                        original,
                        registry=_sites.user_modes,
                        lost="in-place updates of real tensors inside the mode are not watched",
                    )
                ]
                if "data" not in torch.Tensor.__dict__:
                    sites.append(
                        _sites.Site(
                            torch.Tensor,
                            "data",
                            make_data_property(self._is_fake),
                            _sites.ABSENT,
                            registry=_sites.user_modes,
                            lost="`real.data = fake` inside the mode makes the tensor a meta one",
                        )
                    )
                scaler = self._wb.scaler_site()
                if scaler is not None:
                    sites.append(scaler)
                own = torch.Tensor.__dict__.get("retain_grad", _sites.ABSENT)
                retain = own if own is not _sites.ABSENT else _targets.tensor_retain_grad()
                if callable(retain):
                    sites.append(
                        _sites.Site(
                            torch.Tensor,
                            "retain_grad",
                            wrapt.FunctionWrapper(retain, self._retain_grad),
                            own,
                            registry=_sites.user_modes,
                            lost="retain_grad() after a tensor entered the mode keeps fake .grad",
                        )
                    )
                fake_cls = self._r.fake_tensor_cls
                sites.append(
                    _sites.Site(
                        fake_cls,
                        "tolist",
                        self._make_tolist(fake_cls.__dict__.get("tolist", _sites.ABSENT)),
                        fake_cls.__dict__.get("tolist", _sites.ABSENT),
                        registry=_sites.user_modes,
                        lost="tolist() of a fake keeps upstream's answer",
                    )
                )
                module = self._r.fake_tensor_module
                fallback = module.__dict__.get("run_fallback_kernel")
                if fallback_ok and self._can_read_frames and callable(fallback):
                    sites.append(
                        _sites.Site(
                            module,
                            "run_fallback_kernel",
                            wrapt.FunctionWrapper(fallback, self._fallback),
                            fallback,
                            registry=_sites.user_modes,
                            lost="ops without a meta kernel keep the zeros' values",
                        )
                    )
                for site in sites:
                    site.set_policy(self._policy)
                self._sites = sites
        # Started before ``observing`` is set: a thread that finds it set finds the wrappers in
        # place when a mode needs them. Outside our lock: starting may warn (somebody replaced
        # ``dispatch``); a site closed meanwhile (uninstall) stays closed.
        for site in sites:
            site.start()
        with self._lock:
            if self._sites is sites:
                self.observing = True
        return True

    def _retain_grad(self, wrapped: Any, t: Any, args: Any, kwargs: Any) -> Any:
        """``retain_grad()`` on a real non-leaf while a propagating user mode lives: its retained
        gradient may be a fake one (the tensor entered the mode before, or will); its hooks are
        armed now, as when a mode converts a retained tensor (they leave real gradients as
        they are)."""
        result = wrapped(*args, **kwargs)
        try:
            if self.repair and not self._is_fake(t) and t.grad_fn is not None and t.retains_grad:
                self._applied.arming.arm_retained(t)
        except Exception as exc:  # never break the host's program
            self._applied.internal_error("retain_grad", exc)
        return result

    def _make_tolist(self, original: Any) -> Any:
        """``FakeTensor.tolist`` in a propagating user mode: the propagated values' list, as
        ``.item()`` answers each element from the real kernel. Upstream's iterates the fake
        (``unbind``: an autograd view check eager does not make, 'Output 2 of Unbind is a view
        and its base ... has been modified inplace'), or on 2.4 has none ('NYI for higher dims')."""
        fallback = torch.Tensor.tolist if original is _sites.ABSENT else original
        real_of = self._r.real_of
        no_dispatch = self._r.no_dispatch
        propagation = self

        def tolist(fake: Any) -> Any:
            mode = getattr(fake, "fake_mode", None)
            if (
                propagation.repair
                and propagation.observing
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

    def set_policy(self, explicit: bool) -> None:
        """Wrapped whether or not a mode lives (write-back on)."""
        self._policy = explicit
        for site in self._sites:
            site.set_policy(explicit)

    def remove(self) -> None:
        """``uninstall()``: torch's functions back."""
        with self._lock:
            self.observing = False
            sites, self._sites = self._sites, []  # also those observe() is starting
        for site in sites:
            site.close()  # torch's back, unless somebody wrapped over ours (warned)

    # -- the dispatch wrapper -------------------------------------------------------------------

    def _stack(self) -> list[Frame]:
        stack: list[Frame] | None = getattr(self.tls, "stack", None)
        if stack is None:
            stack = self.tls.stack = []
        return stack

    def dispatch(
        self, wrapped: Any, mode: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        if (
            not self.observing
            or not getattr(mode, "propagate_real_tensors", False)
            or getattr(mode, "shape_env", None) is not None
            or (args and args[0] in self._direct)
        ):
            return wrapped(*args, **kwargs)
        stack = self._stack()
        frame = None
        for item in reversed(stack):
            if item.mode is mode:
                frame = item
                break
        wb = self._wb
        try:
            func = args[0] if args else kwargs["func"]
            written = wb.written_args(func)
            op_args, op_kwargs = _op_arguments(args, kwargs)
        except Exception as exc:  # never break the host's fake computation
            self._applied.internal_error("dispatch", exc)
            return wrapped(*args, **kwargs)
        if frame is None:
            frame = Frame(mode, (op_args, op_kwargs), func)
            if written:
                self._guarded(wb.enter, frame, written)
            stack.append(frame)
            ok = False
            result = None
            try:
                result = self._call(wrapped, args, kwargs, mode, func, frame.op)
                if (
                    frame.real_out is not None
                    and frame.real_out is not _targets.NO_REAL_OUT
                    and _fresh_outputs(func)
                ):
                    result = self._values_of_the_real_run(mode, func, result, frame.real_out)
                ok = True
                return result
            except Exception as exc:
                _name_the_op(exc, func)
                raise
            finally:
                stack.pop()
                if frame.swaps:
                    self._guarded(self._unshadow, frame)
                self._guarded(wb.returned, frame, func, result, ok)
        frame.depth += 1
        try:
            if written:
                # the watch first: it reads where the written arguments' values are before the
                # shadow replaces them
                self._guarded(wb.nested_write, frame, func, written, op_args, op_kwargs)
                if self.repair or wb.enabled:  # write-back needs it whatever the setting
                    self._guarded(self._shadow, frame, func, written, op_args, op_kwargs)
            if frame.depth == 1 and frame.real_out is None and self.repair:
                # a decomposed op: its real output, before the nested ops run (2.4's
                # decomposition path returns their values: another rounding, other strides,
                # another pattern of random draws (rrelu))
                frame.real_out = _targets.running_real_out(mode, depth=2, limit=40)
            if self.repair and _random(func) and self._outer_ran_for_real(frame):
                # the outer op drew its random numbers when it ran for real; its decomposition
                # (uniform_ -> prims.uniform) must not draw them again
                with _generators_kept(func, op_args, op_kwargs):
                    return self._call(wrapped, args, kwargs, mode, func, (op_args, op_kwargs))
            return self._call(wrapped, args, kwargs, mode, func, (op_args, op_kwargs))
        finally:
            frame.depth -= 1

    def _values_of_the_real_run(self, mode: Any, func: Any, result: Any, real_out: Any) -> Any:
        """An op whose fake outputs came back from its decomposition without the real run's
        values (2.4: the nested ops' values: another rounding, other strides, other random
        draws): the real run's values, where every output agrees in sizes, dtype and device;
        new tensors whose fakes' strides are not the real ones' are made from them."""
        fakes: list[Any] = []
        reals: list[Any] = []
        try:
            _pair(result, real_out, fakes, reals)
        except _CannotRebuild:
            return result
        if not fakes or all(
            getattr(f, "real_tensor", None) is r for f, r in zip(fakes, reals, strict=True)
        ):
            return result  # upstream propagated them (the build's decomposition path does)
        try:
            result = self._with_values(result, real_out)
        except _CannotRebuild:
            return result
        self._report(
            "decomposition_values",
            "propagation_repaired",
            func,
            repair="decomposition_values",
            values="real kernel",
        )
        return self._agreeing(mode, func, result)

    def _outer_ran_for_real(self, frame: Frame) -> bool:
        """Did the outermost op of ``frame`` run for real (every fake argument with values)?"""
        if not frame.scanned:
            self._wb.scan(frame)
        return frame.real_ok

    def _guarded(self, method: Any, *args: Any) -> None:
        try:
            method(*args)
        except Exception as exc:  # never break the host's fake computation
            self._applied.internal_error("dispatch", exc)

    def _call(self, wrapped: Any, args: Any, kwargs: Any, mode: Any, func: Any, op: Any) -> Any:
        """Upstream's dispatch; when its fake side fails after the real kernel ran (a fake
        kernel that refuses, disagrees, is missing or raises; propagation's own cross-check),
        the real kernel's outputs. Upstream's schema checks of custom ops (mutation, aliasing)
        stand, but for its false report on ``None`` optional arguments."""
        if self.repair and func in _SET_STORAGE:
            result = self._set_storage(mode, func, op)
            if result is not _NOT_FAST:
                return result
        if self.repair and _mutates_metadata(func) and mode.allow_non_fake_inputs:
            result = self._mutate_metadata(mode, func, op)
            if isinstance(result, _Converted):  # upstream's, on the converted arguments
                op = (result.args, result.kwargs)
                args, kwargs = (args[0], args[1], result.args, result.kwargs), {}
            elif result is not _NOT_FAST:
                return result
        if self.fast:
            kind = _KIND.get(func)
            if kind is None:
                kind = _KIND[func] = _kind(func, mode)
            if kind is not _OTHER:
                if kind is _NEW:
                    result = self._fast(mode, func, op)
                elif kind is _VIEW_OP:
                    result = self._view(wrapped, args, kwargs, mode, func, op)
                else:
                    result = self._in_place(mode, func, op)
                if result is not _NOT_FAST:
                    return result
        elif self.repair and func in _BIT_VIEWS:
            # upstream's conj of a 0-d tensor (its constant path) loses the bit, fake and values
            result = self._view(wrapped, args, kwargs, mode, func, op)
            if result is not _NOT_FAST:
                return result
        if not self.repair or not (
            _needs_value_keys(op[0]) or (op[1] and _needs_value_keys(op[1].values()))
        ):
            return self._upstream(wrapped, args, kwargs, mode, func, op)
        # complex values, or bits: upstream's real run reads plain values; an op that makes
        # new tensors runs (as its fake side's nested ops do) with the Conjugate, Negative and
        # ZeroTensor keys on (a composite kernel's own conj views: linalg.pinv). Not views or
        # writes: their fake side under those keys' fallbacks fails MathBitsFallback's
        # same-output assert (an empty conj view in linalg.inv's backward)
        plain = self._plain_values(mode, func, op)
        ok = False
        try:
            if _fresh_outputs(func):
                with self._r.value_keys():
                    result = self._upstream(wrapped, args, kwargs, mode, func, op)
            else:
                result = self._upstream(wrapped, args, kwargs, mode, func, op)
            ok = True
            return result
        finally:
            if plain is not None:
                self._restore_values(plain, ok)

    def _upstream(self, wrapped: Any, args: Any, kwargs: Any, mode: Any, func: Any, op: Any) -> Any:
        """Upstream's dispatch, and the recovery of its fake side's failures (:meth:`_call`)."""
        try:
            result = wrapped(*args, **kwargs)
        except Exception as exc:
            if not self.repair:
                raise
            # (no local holds the traceback: a frame -> traceback -> frame cycle would keep the
            # op's fakes for the garbage collector, which on 2.4 clears the __dict__ of a fake
            # that autograd still holds: "FakeTensor object has no attribute fake_mode")
            if _targets.raised_by_schema_check(exc.__traceback__) and not _false_mutation(
                exc, func, op
            ):
                raise
            result = self._recover(exc, mode, func)
            if result is _targets.NO_REAL_OUT:
                self._applied._mismatch.report(exc)  # a metadata mismatch, said plainly
                raise
            return result
        if self.repair:
            if _fresh_outputs(func):
                return self._agreeing(mode, func, result)
            written = _written_names(func)
            if written:
                self._guarded(self._restride, mode, func, op, written)
            elif _aliasing(func):
                _bits_of_real_views(result)
        return result

    def _restride(self, mode: Any, func: Any, op: Any, written: frozenset[str]) -> None:
        """After an ``out=`` or in-place op: a written fake whose real values were laid out
        otherwise by the real kernel (an empty ``out`` resized like a non-contiguous input;
        the meta kernel resizes it contiguous) gets their strides and offset, as eager has."""
        if self._in_kernel is None:
            return
        op_args, op_kwargs = op
        for index, argument in enumerate(func._schema.arguments):
            if argument.name not in written:
                continue
            value = op_args[index] if index < len(op_args) else op_kwargs.get(argument.name)
            for t in _flat_tensors((value,)):
                real = getattr(t, "real_tensor", None) if self._is_fake(t) else None
                if (
                    real is None
                    or t.layout != torch.strided
                    or real.layout != torch.strided
                    or t.shape != real.shape
                    or (t.stride() == real.stride() and t.storage_offset() == real.storage_offset())
                    or _extent(real) * real.element_size() > t.untyped_storage().nbytes()
                ):
                    continue
                with self._in_kernel(mode):
                    torch.ops.aten.as_strided_.default(
                        t, real.shape, real.stride(), real.storage_offset()
                    )
                self._report(
                    "restrided",
                    "propagation_rebuilt",
                    func,
                    reason="strides",
                    cause="a written fake's strides differ from its real values'",
                    outputs="fake",
                )

    def _plain_values(self, mode: Any, func: Any, op: Any) -> list[Any] | None:
        """Before upstream's real run of an op that is not a view: the arguments whose values
        carry a conjugate or negative bit or are a ZeroTensor get plain values for the op (the
        real kernel, called inside the mode, would read the raw storage; eager's Conjugate,
        Negative and ZeroTensor fallbacks materialize them first). None when there are none
        (the common case). Written arguments get the op's update copied back afterwards."""
        if _aliasing(func):
            return None
        written_names = _written_names(func)
        op_args, op_kwargs = op
        is_fake = self._is_fake
        swaps: list[Any] = []
        schema_args = func._schema.arguments
        for index, argument in enumerate(schema_args):
            value = op_args[index] if index < len(op_args) else op_kwargs.get(argument.name)
            tensors = (
                [value]
                if isinstance(value, torch.Tensor)
                else [v for v in value if isinstance(v, torch.Tensor)]
                if isinstance(value, list | tuple)
                else ()
            )
            for t in tensors:
                fake: Any
                if is_fake(t):
                    if getattr(t, "fake_mode", None) is not mode:
                        continue
                    fake = t
                elif _convertible(mode, t) and (_lazy_bits(t)):
                    # converted now: upstream's conversion returns the same fake (memo)
                    fake = mode.fake_tensor_converter.from_real_tensor(mode, t)
                else:
                    continue
                real = getattr(fake, "real_tensor", None)
                if real is None or fake.layout != torch.strided:
                    continue
                if not (_lazy_bits(fake) or _lazy_bits(real)):
                    continue
                written = argument.name in written_names
                if written and (_is_zero(fake) or _is_zero(real)):
                    continue  # immutable: upstream's (and eager's) error
                if any(item[0] is fake for item in swaps):
                    continue
                with self._r.no_dispatch():
                    shadow = _plain(fake, real)
                    fake.real_tensor = shadow
                swaps.append((fake, real, shadow, written))
        return swaps or None

    def _restore_values(self, swaps: list[Any], ok: bool) -> None:
        """After the op: written arguments get the op's update on their raw storage, read with
        their bits (``copy_`` applies them); every fake gets its own values back."""
        with self._r.no_dispatch():
            for fake, real, shadow, written in reversed(swaps):
                if written and ok:
                    view = torch.ops.aten.alias.default(real)
                    _set_conj(view, fake.is_conj())
                    _set_neg(view, fake.is_neg())
                    view.copy_(shadow)
                fake.real_tensor = real

    def _agreeing(self, mode: Any, func: Any, result: Any) -> Any:
        """Upstream's outputs of an op that makes new tensors, each fake agreeing with its own
        values in sizes, dtype and device: where a fake kernel disagrees and this build's
        propagation does not check it (2.4: no cross-check; a custom op's wrong fake kernel),
        the fake is made again from its values (``propagation_rebuilt``)."""
        outs = result if isinstance(result, tuple | list) else (result,)
        for t in outs:
            # the real storage each new fake's storage stands for (meta_utils' convention, as
            # the converter's and the fast path's fakes have it): set_() with it finds it
            real = getattr(t, "real_tensor", None) if isinstance(t, torch.Tensor) else None
            if (
                real is not None
                and real.layout == torch.strided
                and t.layout == torch.strided
                and not _is_zero(real)
            ):
                _targets.set_real_storage(t.untyped_storage(), real.untyped_storage())
        if not any(_disagrees(t) for t in outs):
            return result  # the common case
        try:
            rebuilt = _map_tensors(
                lambda t: self._fake_of(mode, t.real_tensor) if _disagrees(t) else t, result
            )
        except _CannotRebuild:
            return result
        self._report(
            "rebuilt",
            "propagation_rebuilt",
            func,
            reason="unchecked mismatch",
            cause="a fake output's sizes, dtype, device or strides differ from its real values",
            outputs="real",
        )
        return rebuilt

    def _recover(self, exc: BaseException, mode: Any, func: Any) -> Any:
        """The op's outputs after its fake side refused: made from the real kernel's (new
        tensors), or the fake kernel's with the real kernel's values (a view or an in-place
        op whose fake outputs agree in sizes, dtype and device); ``NO_REAL_OUT`` when neither
        is possible (upstream's error stands)."""
        real_out = _targets.raised_real_out(exc.__traceback__, mode)
        if real_out is _targets.NO_REAL_OUT:
            return real_out
        kept = "real"
        try:
            if _fresh_outputs(func):
                result = self._from_real(mode, real_out)
            else:
                fake_out = _targets.raised_fake_out(exc.__traceback__)
                if fake_out is _targets.NO_REAL_OUT:
                    return fake_out
                result = self._with_values(fake_out, real_out)
                kept = "fake"
        except _CannotRebuild:
            return _targets.NO_REAL_OUT
        self._report(
            "rebuilt",
            "propagation_rebuilt",
            func,
            reason=type(exc).__name__,
            cause=_first_line(exc),
            outputs=kept,
        )
        return result

    def _with_values(self, fake_out: Any, real_out: Any) -> Any:
        """``fake_out`` (a view or in-place op's fake outputs) holding ``real_out``'s values,
        where every pair agrees in sizes, dtype and device."""
        fakes: list[Any] = []
        reals: list[Any] = []
        _pair(fake_out, real_out, fakes, reals)
        for fake, real in zip(fakes, reals, strict=True):
            if not (
                self._is_fake(fake)
                and isinstance(real, torch.Tensor)
                and fake.shape == real.shape
                and fake.dtype == real.dtype
                and fake.device == real.device
            ):
                raise _CannotRebuild
        with self._r.no_dispatch():
            for fake, real in zip(fakes, reals, strict=True):
                fake.real_tensor = real
        return fake_out

    # -- the fast path -----------------------------------------------------------------------------

    def _fast(self, mode: Any, func: Any, op: Any) -> Any:
        """An op that makes new tensors from its arguments (no alias, no write in its schema),
        every fake argument this mode's with real values: the real kernel on those values, and
        fakes made from its outputs; upstream's fake implementation, the second real run of its
        decomposition and the cross-check are skipped (issue 41). ``_NOT_FAST`` otherwise (then
        nothing ran)."""
        if self._numbers_as_tensors(func) and not _has_fake(op, self._is_fake):
            return _NOT_FAST  # upstream runs it on the real arguments: a constant if small
        reals = self._real_arguments(mode, op)
        if reals is _NOT_FAST:
            return _NOT_FAST
        real_out = self._run(func, reals)
        try:
            result = self._from_real(mode, real_out)
        except _CannotRebuild:
            if not _random(func) and any(
                _is_zero(t)
                for t in _flat_tensors(
                    real_out if isinstance(real_out, tuple | list) else (real_out,)
                )
            ):
                # a ZeroTensor output (an op on a ZeroTensor, forward AD's zero tangents): its
                # fake needs the ZeroTensor key, which upstream's path gives it (the real run
                # had no side effect)
                return _NOT_FAST
            # a sparse or subclass output: the converter's own fakes (rare)
            result = _map_tensors(
                lambda t: mode.fake_tensor_converter.from_real_tensor(mode, t), real_out
            )
        self.fast_ops += 1
        if trace.enabled(trace.DEBUG):
            trace.emit("propagation_fast", trace.DEBUG, op=str(func))
        return result

    def _in_place(self, mode: Any, func: Any, op: Any) -> Any:
        """An in-place op that changes only its first argument's values (``add_``, ``relu_``,
        ``uniform_``, ``copy_``, ``index_add_``), every fake argument this mode's with values:
        the real kernel on the values (``self``'s are the fake's own, so the fake and every view
        of it see the update, as eager's views do), and ``self``'s fake returned, its metadata
        unchanged. Upstream runs the real kernel, then the fake side: a decomposition whose
        nested ops run for real again (``index_add_``, ``uniform_``'s second draw), and the
        Conjugate fallback's resolve-compute-copy-back on plain values instead of eager's own
        conj handling. What the write-back watch sees is the same (it reads the op's arguments
        around this call). ``_NOT_FAST``: a constant in the mode (upstream invalidates the
        constants a write reaches), ``self`` not a plain fake of its values."""
        if _targets.has_constants(mode.fake_tensor_converter):
            return _NOT_FAST
        op_args, op_kwargs = op
        first = op_args[0] if op_args else op_kwargs.get("self")
        if not isinstance(first, torch.Tensor):
            return _NOT_FAST
        if not self._is_fake(first):
            # a real tensor written: upstream's (all real: it runs on the tensor itself; else
            # the update reaches its copy, watched and reported, or written back)
            return _NOT_FAST
        fake = first
        if getattr(fake, "fake_mode", None) is not mode or fake.layout != torch.strided:
            return _NOT_FAST
        real = getattr(fake, "real_tensor", None)
        if real is None or _is_zero(real) or _is_zero(fake) or not _same_metadata(fake, real):
            return _NOT_FAST
        reals = self._real_arguments(mode, op, (0, self._real_value(mode, fake, self._is_fake)))
        if reals is _NOT_FAST or reals[0][0] is _NOT_FAST:
            return _NOT_FAST
        self._run(func, reals)
        self.fast_ops += 1
        if trace.enabled(trace.DEBUG):
            trace.emit("propagation_fast", trace.DEBUG, op=str(func))
        return fake

    def _view(self, wrapped: Any, args: Any, kwargs: Any, mode: Any, func: Any, op: Any) -> Any:
        """A view op (its returns alias an argument; it writes none), every fake argument this
        mode's with real values: the real view op on the arguments' values (what upstream's
        propagation computes, aliasing them), and for each real view the fake view of the same
        sizes, strides and offset over the aliased fake argument's storage (``as_strided`` on
        its meta representation: the fakes alias exactly as the real tensors do). Upstream's
        view (its meta kernels and decompositions, uncached in a propagating mode) is skipped.
        ``_NOT_FAST`` when the arguments do not allow it (nothing ran)."""
        if self._in_kernel is None or self._from_meta is None:
            return _NOT_FAST
        base_index = _VIEW_BASE.get(func)
        if base_index is None:
            base_index = _VIEW_BASE[func] = _view_base(func)
        op_args = op[0]
        if base_index < 0 or base_index >= len(op_args):
            return _NOT_FAST
        base = op_args[base_index]
        is_fake = self._is_fake
        if not isinstance(base, torch.Tensor):
            return _NOT_FAST
        if not is_fake(base):
            if not _convertible(mode, base):
                return _NOT_FAST
            base = _convert(mode, base)
        elif (
            getattr(base, "fake_mode", None) is not mode
            or base.layout != torch.strided
            or getattr(base, "constant", None) is not None
        ):
            return _NOT_FAST
        base_real = getattr(base, "real_tensor", None)
        if (
            base_real is None
            or _is_zero(base_real)
            or _is_zero(base)
            or not _same_metadata(base, base_real)
        ):
            return _NOT_FAST  # the fake's layout is not the real one's: upstream's view
        reals = self._real_arguments(mode, op, (base_index, base_real))
        if reals is _NOT_FAST:
            return _NOT_FAST
        real_out = self._run(func, reals)
        ptr = _storage(base_real)
        try:
            with self._in_kernel(mode):
                result = _map_tensors(
                    lambda r: self._view_of(mode, base, base_real, ptr, r), real_out
                )
        except _CannotRebuild:
            # not a view of the base (a copy), a view that changes the dtype or sets the
            # conjugate or negative bit, or out of the fake storage's bounds: upstream's view,
            # its own values (the real view had no side effect)
            return wrapped(*args, **kwargs)
        self.fast_ops += 1
        if trace.enabled(trace.DEBUG):
            trace.emit("propagation_fast", trace.DEBUG, op=str(func))
        return result

    def _set_storage(self, mode: Any, func: Any, op: Any) -> Any:
        """``fake.set_(storage, offset, size, stride)`` (and ``set_(source)``): upstream's real
        run gets a meta storage (a fake's), or its fake side a real one, and either refuses.
        The real tensor is set to the real storage and the fake to the meta one, each with the
        same offset, sizes and strides; a real storage (``fake.set_(t.untyped_storage())``) is
        converted first as an op input is (a copy of its values, or itself under write-back).
        ``_NOT_FAST`` where the storage's values are not known (upstream's path then)."""
        if self._in_kernel is None:
            return _NOT_FAST
        op_args, op_kwargs = op
        names = ("self", "source", "storage_offset", "size", "stride")
        params = dict(zip(names[: len(op_args)], op_args, strict=True))
        params.update(op_kwargs)
        t, source = params["self"], params["source"]
        converter = mode.fake_tensor_converter
        t_real = getattr(t, "real_tensor", None) if self._is_fake(t) else None
        if t_real is None or getattr(t, "fake_mode", None) is not mode:
            return _NOT_FAST
        fake: Any
        if isinstance(source, torch.Tensor):
            fake = source if self._is_fake(source) else None
        elif source.device.type == "meta":
            # a fake's storage: the real storage it stands for (meta_utils' convention)
            real_storage = _targets.real_storage_of(source)
            if real_storage is None:
                return _NOT_FAST
            with self._r.no_dispatch():
                meta = torch.empty(0, dtype=t.dtype, device="meta")
                meta.set_(source)
                base = torch.empty(0, dtype=t.dtype, device=real_storage.device)
                base.set_(real_storage)
            made = self._from_meta
            if made is None:
                return _NOT_FAST
            fake = made(converter, mode, meta, t.device)
            fake.real_tensor = base
        else:
            with self._r.no_dispatch():
                base = torch.empty(0, dtype=t.dtype, device=source.device)
                base.set_(source)
            fake = _convert(mode, base)
            # the real tensor over the storage lives as long as the fake set to it: updates
            # that reach only the copy are reported against it (the write-back watch holds
            # real tensors weakly)
            t._fakegrad_storage_owner = base
        real = getattr(fake, "real_tensor", None)
        if fake is None or real is None or getattr(fake, "fake_mode", None) is not mode:
            return _NOT_FAST
        if "size" in params:
            where = (params["storage_offset"], params["size"], params.get("stride") or [])
        else:  # set_(storage) / set_(tensor): the whole storage, or the tensor's view of it
            where = (
                (0, [real.untyped_storage().nbytes() // real.element_size()], [1])
                if not isinstance(source, torch.Tensor)
                else (real.storage_offset(), list(real.shape), list(real.stride()))
            )
        with self._r.no_dispatch():
            t_real.set_(real.untyped_storage(), *where)
        with self._in_kernel(mode):
            torch.ops.aten.set_.source_Storage_storage_offset(t, fake.untyped_storage(), *where)
        self._report(
            "set_storage", "propagation_rebuilt", func, reason="set_", cause="", outputs="fake"
        )
        return t

    def _mutate_metadata(self, mode: Any, func: Any, op: Any) -> Any:
        """An op that changes its first argument's sizes or strides (``resize_``, ``t_``,
        ``as_strided_``) with real tensors among its arguments: FakeTensorMode refuses every
        one ('Can't call metadata mutating ops on non-Fake Tensor inputs'). Eager changes the
        real tensor: every argument real, the op runs on them (every live converter forgets
        its fake of the changed tensor); the first argument a fake, the others are converted
        as op inputs are, for upstream's path (:class:`_Converted`). ``_NOT_FAST`` otherwise."""
        op_args, op_kwargs = op
        tensors = _flat_tensors((*op_args, *op_kwargs.values()))
        is_fake = self._is_fake
        if not tensors or not any(not is_fake(t) for t in tensors):
            return _NOT_FAST  # all fake: upstream's
        first = op_args[0] if op_args else None
        if not isinstance(first, torch.Tensor):
            return _NOT_FAST
        if not any(is_fake(t) for t in tensors):
            if not all(_convertible(mode, t) for t in tensors):
                return _NOT_FAST
            result = func(*op_args, **op_kwargs)
            for ref in list(_sites.modes.values()):
                live = ref()
                converter = getattr(live, "fake_tensor_converter", None)
                if converter is not None:
                    _targets.forget_conversion(converter, first)
            return result
        if not is_fake(first) or getattr(first, "fake_mode", None) is not mode:
            return _NOT_FAST

        def convert(v: Any) -> Any:
            if isinstance(v, torch.Tensor) and not is_fake(v) and _convertible(mode, v):
                return _convert(mode, v)
            return v

        args = tuple(convert(v) for v in op_args)
        kwargs = {k: convert(v) for k, v in op_kwargs.items()}
        if any(isinstance(v, torch.Tensor) and not is_fake(v) for v in (*args, *kwargs.values())):
            return _NOT_FAST
        return _Converted(args, kwargs)

    def _numbers_as_tensors(self, func: Any) -> bool:
        """Does FakeTensorMode run ``func`` on all-real arguments itself (numbers bound to
        tensors: ``torch.div(4, 4)``), making a small output a constant?"""
        allowed = _NUMBERS.get(func)
        if allowed is None:
            check = self._allow_numbers
            allowed = _NUMBERS[func] = bool(check is not None and check(func))
        return allowed

    def _run(self, func: Any, reals: Any) -> Any:
        """The real kernel on the real arguments, as eager runs it where values may carry a
        conjugate or negative bit or be a ZeroTensor (their keys' fallbacks on)."""
        args, kwargs = reals
        if _needs_value_keys(args) or (kwargs and _needs_value_keys(kwargs.values())):
            with self._r.value_keys():
                return func(*args, **kwargs)
        return func(*args, **kwargs)

    def _view_of(self, mode: Any, base: Any, base_real: Any, ptr: int | None, real: Any) -> Any:
        """Inside the mode's kernel invocation: the fake view of ``base`` with ``real``'s
        metadata, holding ``real``; its conjugate and negative bits are the base's, toggled
        where the view op toggled the real ones (``conj()``, ``_neg_view``)."""
        if (
            type(real) is not torch.Tensor
            or real.layout != torch.strided
            or real.dtype != base.dtype  # view_as_real/complex, .real/.imag, view(dtype)
            or _is_zero(real)
            or _storage(real) != ptr
        ):
            raise _CannotRebuild
        try:
            meta = torch.ops.aten.as_strided.default(
                base, real.shape, real.stride(), real.storage_offset()
            )
        except RuntimeError:
            raise _CannotRebuild from None
        fake = self._from_meta(mode.fake_tensor_converter, mode, meta, real.device)
        conj = base.is_conj() != (real.is_conj() != base_real.is_conj())
        neg = base.is_neg() != (real.is_neg() != base_real.is_neg())
        if conj != fake.is_conj():
            _set_conj(fake, conj)
        if neg != fake.is_neg():
            _set_neg(fake, neg)
        fake.real_tensor = real
        return fake

    def _real_arguments(self, mode: Any, op: Any, known: tuple[int, Any] | None = None) -> Any:
        """``(real args, real kwargs)`` of the op's arguments (:meth:`_real_value` each; the
        positional argument ``known[0]``'s value already found: ``known[1]``), or ``_NOT_FAST``."""
        op_args, op_kwargs = op
        is_fake = self._is_fake
        real_args: list[Any] = []
        for index, value in enumerate(op_args):
            if known is not None and index == known[0]:
                real = known[1]
            else:
                real = self._real_value(mode, value, is_fake)
                if real is _NOT_FAST:
                    return _NOT_FAST
            real_args.append(real)
        real_kwargs: dict[str, Any] = {}
        for name, value in op_kwargs.items():
            real = self._real_value(mode, value, is_fake)
            if real is _NOT_FAST:
                return _NOT_FAST
            real_kwargs[name] = real
        return real_args, real_kwargs

    def _real_value(self, mode: Any, value: Any, is_fake: Any) -> Any:
        """An argument's real value: a fake of ``mode`` with values, its values; a real tensor,
        its conversion's (the patch's conversion path: arming, D2, records), as upstream
        converts it; a list of tensors, each; anything else, itself. ``_NOT_FAST`` for what
        upstream must see (another mode's fake, no values, a subclass, not strided)."""
        if isinstance(value, torch.Tensor):
            if is_fake(value):
                if (
                    getattr(value, "fake_mode", None) is not mode
                    or value.layout != torch.strided
                    or getattr(value, "constant", None) is not None
                ):
                    return _NOT_FAST  # constants: upstream folds them and tracks their writes
                fake = value
            else:
                if not _convertible(mode, value):
                    return _NOT_FAST
                fake = _convert(mode, value)
            real = getattr(fake, "real_tensor", None)
            if real is None:
                return _NOT_FAST
            if fake.is_conj() != real.is_conj() or fake.is_neg() != real.is_neg():
                return _aligned(fake, real)
            return real
        if isinstance(value, list | tuple) and value and isinstance(value[0], torch.Tensor | None):
            out = []
            for item in value:
                real = self._real_value(mode, item, is_fake)
                if real is _NOT_FAST:
                    return _NOT_FAST
                out.append(real)
            return type(value)(out) if isinstance(value, tuple) else out
        return value

    # -- outputs made from the real kernel's ------------------------------------------------------

    def _from_real(self, mode: Any, real_out: Any) -> Any:
        """Fakes of ``mode`` for the real outputs: each over a meta tensor of the real output's
        sizes, strides, offset and dtype, on its device, holding it as its values; anything
        else (numbers, None) as it is."""
        if isinstance(real_out, torch.Tensor):
            return self._fake_of(mode, real_out)
        if isinstance(real_out, tuple | list):
            made = [self._from_real(mode, item) for item in real_out]
            if hasattr(real_out, "_fields"):  # a named tuple (torch.return_types)
                return type(real_out)(*made)
            return type(real_out)(made)
        return real_out

    def _fake_of(self, mode: Any, real: Any) -> Any:
        if (
            self._from_meta is None
            or type(real) is not torch.Tensor
            or real.layout != torch.strided
            or _is_zero(real)
            or self._is_fake(real)
        ):
            raise _CannotRebuild
        with self._r.no_dispatch():
            storage = real.untyped_storage()
            nbytes = storage.nbytes()
            if real.storage_offset() == 0 and nbytes == real.numel() * real.element_size():
                meta = torch.empty_strided(
                    real.shape, real.stride(), dtype=real.dtype, device="meta"
                )
            else:
                # the fake's storage as large as the real one (a kernel that resizes its output
                # down keeps the whole buffer: as_strided within it is valid in eager)
                size = max(nbytes // real.element_size(), _extent(real))
                meta = torch.empty(size, dtype=real.dtype, device="meta").as_strided(
                    real.shape, real.stride(), real.storage_offset()
                )
            fake = self._from_meta(mode.fake_tensor_converter, mode, meta, real.device)
            if real.is_conj() or real.is_neg():  # eager's output is a conj/neg view: so is the fake
                _set_conj(fake, real.is_conj())
                _set_neg(fake, real.is_neg())
            fake.real_tensor = real
            _targets.set_real_storage(meta.untyped_storage(), storage)
        return fake

    # -- the fallback kernel -------------------------------------------------------------------

    def _fallback(self, wrapped: Any, _instance: Any, args: Any, kwargs: Any) -> Any:
        """``run_fallback_kernel``: the real kernel ran on zeros; its outputs get the values of
        the real kernel run on the op's real values (``real_out``), or none."""
        result = wrapped(*args, **kwargs)
        mode = args[0] if args else kwargs.get("fake_mode")
        if (
            not self.repair
            or not getattr(mode, "propagate_real_tensors", False)
            or getattr(mode, "shape_env", None) is not None
        ):
            return result
        try:
            real_out = _targets.running_real_out(mode)
            repaired = self._refill(mode, result, real_out)
        except Exception as exc:  # never break the host's fake computation
            self._applied.internal_error("fallback", exc)
            return result
        func = args[1] if len(args) > 1 else kwargs.get("func")
        self._report(
            "fallback_kernel",
            "propagation_repaired",
            func,
            repair="fallback_kernel",
            values="real kernel" if real_out is not _targets.NO_REAL_OUT else "none",
        )
        return repaired

    def _refill(self, mode: Any, fake_out: Any, real_out: Any) -> Any:
        """``fake_out`` with the values of ``real_out`` (the same structure): a fake whose
        metadata agrees takes the real output as its values; one that does not is made again
        from it; with no real output, fakes lose the zeros' values (no values: reported)."""
        if self._is_fake(fake_out):
            if real_out is _targets.NO_REAL_OUT or not isinstance(real_out, torch.Tensor):
                with self._r.no_dispatch():
                    fake_out.real_tensor = None
                return fake_out
            if _same_metadata(fake_out, real_out):
                with self._r.no_dispatch():
                    fake_out.real_tensor = real_out
                return fake_out
            return self._fake_of(mode, real_out)
        if isinstance(fake_out, tuple | list):
            reals = (
                real_out
                if isinstance(real_out, tuple | list) and len(real_out) == len(fake_out)
                else [_targets.NO_REAL_OUT] * len(fake_out)
            )
            made = [self._refill(mode, f, r) for f, r in zip(fake_out, reals, strict=True)]
            if hasattr(fake_out, "_fields"):
                return type(fake_out)(*made)
            return type(fake_out)(made)
        return fake_out

    # -- nested writes ------------------------------------------------------------------------

    def _shadow(self, frame: Frame, func: Any, written: Any, op_args: Any, op_kwargs: Any) -> None:
        """A nested op (a decomposition or meta implementation that FakeTensorMode runs under
        the mode) writes an argument of the outer op. FakeTensorMode runs the nested op for real
        too: when the outer op already ran for real, that applies its update a second time
        (``index_add_`` into ``index_put_``; ``native_batch_norm``'s running statistics). Then
        the nested op gets a shadow copy until the outer op returns. When the outer op did not
        run for real, the nested op is the only one that updates: it writes the values once."""
        if not frame.scanned:
            self._wb.scan(frame)
        if not frame.arguments or not frame.real_ok:
            return
        no_dispatch = self._r.no_dispatch
        for t in _written_tensors(written, op_args, op_kwargs):
            if not self._is_fake(t):
                continue
            real = t.real_tensor
            ptr = _storage(real)
            if ptr is None or ptr not in frame.arguments:
                continue
            with no_dispatch(), torch.no_grad():
                shadow = _private_copy(real)
                t.real_tensor = shadow
            frame.swaps.append((t, real, shadow))
            self._report(
                "nested_write", "propagation_repaired", func, repair="nested_write", values="shadow"
            )

    def _unshadow(self, frame: Frame) -> None:
        with self._r.no_dispatch():
            for fake, before, _shadow in reversed(frame.swaps):
                fake.real_tensor = before

    def _count(self, kind: str) -> None:
        self.counts[kind] = self.counts.get(kind, 0) + 1  # a statistic: races are harmless

    def _report(self, kind: str, event: str, func: Any, **fields: Any) -> None:
        """A repair or rebuild done on ``func``: counted (``status()``) and traced at info."""
        self._count(kind)
        if trace.enabled(trace.INFO):
            trace.emit(event, trace.INFO, op=str(func), **fields)


_set_conj, _set_neg, _is_zero = _targets.value_bit_tools()
_NOT_FAST = object()
_PLAIN = (torch.Tensor, torch.nn.Parameter)
#: what the fast path does with an op: make new tensors, a view, or upstream's path
_NEW, _VIEW_OP, _OTHER = "new", "view", "other"
#: an in-place op the fast path runs on the real values itself (``_plain_in_place``)
_INPLACE = "in-place"
#: op -> its kind (decided at its first call)
_KIND: dict[Any, str] = {}
_TENSORS = ("Tensor", "Tensor?", "Tensor[]", "List[Tensor]", "Optional[Tensor]")
#: aten ops whose kernels write arguments their schemas do not mark written: BatchNorm's
#: running statistics (``Tensor? running_mean``), the RNNs' dropout state. Their writes are seen
#: through upstream's path (the decomposition's nested ``copy_``: write-back or the lost-update
#: report), so they never take the fast path. tests/test_propagation.py scans every aten schema
#: of the installed build for such arguments and checks that this list holds them all.
HIDDEN_WRITES = frozenset(
    {
        "native_batch_norm",
        "cudnn_batch_norm",
        "miopen_batch_norm",
        "batch_norm",  # composite (decomposed above the mode), unannotated on 2.4
        "_batch_norm_impl_index",
        "_cudnn_rnn",
        "miopen_rnn",
    }
)


#: aten ops whose outputs upstream's fakes represent with a dispatch key of their own: a fake
#: made from the real output's metadata would lose it (``_efficientzerotensor``: autograd's
#: zero gradients; without the ZeroTensor key on the fake, the next op reaches the mode and its
#: real kernel reads the real ZeroTensor's null data pointer)
UPSTREAM_FAKES = frozenset({"_efficientzerotensor"})


def _lazy_bits(t: Any) -> bool:
    """A conjugate or negative view bit, or a ZeroTensor (no storage): real kernels called
    inside a dispatch mode ignore the bits and read a ZeroTensor's null data pointer (the
    Conjugate, Negative and ZeroTensor keys are above the Python key, so excluded there), so
    such values go upstream's way, whose fakes carry the same keys."""
    return bool(t.is_conj() or t.is_neg() or _is_zero(t))


def _aligned(fake: Any, real: Any) -> Any:
    """``real``'s raw storage read with ``fake``'s conjugate and negative bits (an alias)."""
    view = torch.ops.aten.alias.default(real)
    _set_conj(view, fake.is_conj())
    _set_neg(view, fake.is_neg())
    return view


def _needs_value_keys(values: Any) -> bool:
    """Might a real kernel on these values meet a conjugate or negative bit or a ZeroTensor
    (a complex value: composite kernels make conjugate views of their own)?"""
    for value in values:
        if isinstance(value, torch.Tensor):
            if value.is_complex() or value.is_neg() or _is_zero(value):
                return True
        elif isinstance(value, list | tuple) and _needs_value_keys(value):
            return True
    return False


def _plain(fake: Any, real: Any) -> Any:
    """The values ``fake`` stands for, as a plain tensor a real kernel reads right inside the
    mode. Propagated values are the raw storage and the fake's own bits say how to read it
    (the converter gives a conjugate view's fake its bit and a copy of the raw storage without
    it; view ops set the bit on both), so the raw storage is read with the fake's bits and
    materialized by ``clone`` (``copy_`` applies the bits itself); a ZeroTensor is zeros."""
    if _is_zero(fake) or _is_zero(real):
        return torch.zeros(real.shape, dtype=real.dtype, device=real.device)
    return torch.ops.aten.clone.default(_aligned(fake, real))


def _convert(mode: Any, t: Any) -> Any:
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


def _convertible(mode: Any, t: Any) -> bool:
    """A real tensor the fast path converts as upstream would: a plain strided tensor (or
    Parameter), in a mode that allows real inputs (else upstream's error stands)."""
    return type(t) in _PLAIN and t.layout == torch.strided and bool(mode.allow_non_fake_inputs)


#: view op -> the index of the argument its returns alias (-1: none readable)
_VIEW_BASE: dict[Any, int] = {}


def _view_base(func: Any) -> int:
    schema = func._schema
    sets = [r.alias_info.before_set for r in schema.returns if r.alias_info is not None]
    for index, argument in enumerate(schema.arguments):
        info = argument.alias_info
        if info is not None and sets and all(info.before_set & s for s in sets):
            return index
    return -1


def _kind(func: Any, mode: Any) -> str:
    """How the fast path takes ``func``: ``_NEW``, an aten op whose schema writes no argument,
    aliases none in its returns, and returns only tensors; ``_VIEW_OP``, an aten op whose
    returns (tensors) all alias an argument and which writes none; ``_OTHER``, upstream's
    path (in-place and ``out=`` ops, ``inplace_view`` ops, constants' lift functions, ops that
    return numbers, other namespaces)."""
    schema = getattr(func, "_schema", None)
    if schema is None or getattr(func, "namespace", None) != "aten" or not schema.returns:
        return _OTHER
    if func in getattr(mode, "lift_fns", ()) or torch.Tag.inplace_view in func.tags:
        return _OTHER
    name = schema.name.partition("::")[2]
    if name in HIDDEN_WRITES or name in UPSTREAM_FAKES:
        return _OTHER
    written = [a for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    if written:
        return _INPLACE if _plain_in_place(schema, written, name) else _OTHER
    if any(str(r.type) not in _TENSORS for r in schema.returns):
        return _OTHER
    aliased = [r.alias_info is not None for r in schema.returns]
    if not any(aliased) and not any(a.alias_info is not None for a in schema.arguments):
        return _NEW
    if all(aliased) and _view_base(func) >= 0:
        return _VIEW_OP
    return _OTHER


def _plain_in_place(schema: Any, written: list[Any], name: str) -> bool:
    """An in-place op whose only effect is on its first argument's values: ``self`` is the one
    argument written, a tensor, the one return aliases it, no other argument aliases, and it
    keeps ``self``'s sizes and strides (not ``resize_``/``set_``, not ``inplace_view``)."""
    arguments = schema.arguments  # (a new list of new objects at every read on some builds)
    first = arguments[0] if arguments else None
    if (
        first is None
        or len(written) != 1
        or written[0].name != first.name
        or str(first.type) != "Tensor"
        or len(schema.returns) != 1
        or schema.returns[0].alias_info is None
        or "resize" in name
        or name.startswith("set_")
    ):
        return False
    same = schema.returns[0].alias_info.before_set == first.alias_info.before_set
    others = [a for a in arguments[1:] if a.alias_info is not None]
    return same and not others


#: op -> does it alias its arguments' storage without writing their values (a view, an
#: ``inplace_view`` op, ``set_``)? Their outputs must alias the raw storage itself.
_ALIASING: dict[Any, bool] = {}


def _aliasing(func: Any) -> bool:
    aliasing = _ALIASING.get(func)
    if aliasing is None:
        schema = getattr(func, "_schema", None)
        aliasing = (
            schema is None
            or torch.Tag.inplace_view in getattr(func, "tags", ())
            or schema.name.partition("::")[2].startswith("set_")
            or (any(r.alias_info is not None for r in schema.returns) and not _written_names(func))
        )
        _ALIASING[func] = aliasing
    return aliasing


#: the view ops that set a conjugate or negative bit (``conj()``, ``x.conj().imag``)
_BIT_VIEWS = _targets.bit_views()


def _bits_of_real_views(result: Any) -> None:
    """Upstream's fake of a view whose real kernel set a conjugate or negative bit can lack it
    (``conj`` of a 0-d tensor: FakeTensorMode's constant path): the real view's bits are
    eager's, so the fake takes them."""
    for t in result if isinstance(result, tuple | list) else (result,):
        real = getattr(t, "real_tensor", None) if isinstance(t, torch.Tensor) else None
        if real is None or (t.is_conj() == real.is_conj() and t.is_neg() == real.is_neg()):
            continue
        _set_conj(t, real.is_conj())
        _set_neg(t, real.is_neg())


_WRITTEN: dict[Any, frozenset[str]] = {}


def _written_names(func: Any) -> frozenset[str]:
    """The names of the arguments ``func``'s schema writes (not ``inplace_view`` ops: they
    write metadata, which upstream's fake side already follows)."""
    names = _WRITTEN.get(func)
    if names is None:
        schema = getattr(func, "_schema", None)
        names = (
            frozenset()
            if schema is None or torch.Tag.inplace_view in getattr(func, "tags", ())
            else frozenset(
                a.name
                for a in schema.arguments
                if a.alias_info is not None and a.alias_info.is_write
            )
        )
        _WRITTEN[func] = names
    return names


class _Converted:
    """An op's arguments with its real tensors converted (upstream's path takes them)."""

    __slots__ = ("args", "kwargs")

    def __init__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.args = args
        self.kwargs = kwargs


_METADATA_MUTATING: dict[Any, bool] = {}


def _mutates_metadata(func: Any) -> bool:
    """``inplace_view`` ops (``t_``, ``as_strided_``, ``squeeze_``) and ``resize_``."""
    mutates = _METADATA_MUTATING.get(func)
    if mutates is None:
        schema = getattr(func, "_schema", None)
        mutates = _METADATA_MUTATING[func] = torch.Tag.inplace_view in getattr(
            func, "tags", ()
        ) or (schema is not None and schema.name in ("aten::resize_", "aten::resize_as_"))
    return mutates


_SET_STORAGE = frozenset(
    {
        torch.ops.aten.set_.source_Storage,
        torch.ops.aten.set_.source_Storage_storage_offset,
        torch.ops.aten.set_.source_Tensor,
        torch.ops.aten.set_.source_Tensor_storage_offset,
    }
)


#: op -> does FakeTensorMode run it on all-real arguments itself (SHOULD_ALLOW_NUMBERS)
_NUMBERS: dict[Any, bool] = {}


def _has_fake(op: Any, is_fake: Any) -> bool:
    return any(is_fake(t) for t in _flat_tensors((*op[0], *op[1].values())))


_RANDOM: dict[Any, bool] = {}


def _random(func: Any) -> bool:
    """Does ``func`` draw from a generator (``nondeterministic_seeded``)?"""
    random = _RANDOM.get(func)
    if random is None:
        # the tag, or a generator argument (2.4's prims.uniform has no tag)
        random = _RANDOM[func] = torch.Tag.nondeterministic_seeded in getattr(
            func, "tags", ()
        ) or any(
            "Generator" in str(a.type)
            for a in getattr(getattr(func, "_schema", None), "arguments", ())
        )
    return random


class _generators_kept:
    """The generators an op draws from have the same state after it as before: its explicit
    ``generator`` argument, else the default generators of the devices it names or works on
    (CPU and CUDA; another device's default generator is not reachable by a public API and is
    left to draw)."""

    def __init__(self, func: Any, op_args: Any, op_kwargs: Any) -> None:
        self.kept: list[tuple[Any, Any]] = []
        generators = [v for v in (*op_args, *op_kwargs.values()) if isinstance(v, torch.Generator)]
        if not generators:
            devices = {t.device for t in _flat_tensors((*op_args, *op_kwargs.values()))}
            device = op_kwargs.get("device")
            if device is not None:
                devices.add(torch.device(device))
            if not devices:
                devices.add(torch.device("cpu"))
            for d in devices:
                if d.type == "cpu":
                    generators.append(torch.random.default_generator)
                elif d.type == "cuda" and torch.cuda.is_initialized():
                    index = d.index if d.index is not None else torch.cuda.current_device()
                    generators.append(torch.cuda.default_generators[index])
        self.kept = [(g, g.get_state()) for g in generators]

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        for generator, state in self.kept:
            generator.set_state(state)


def _flat_tensors(values: Any) -> list[Any]:
    out = []
    for value in values:
        if isinstance(value, torch.Tensor):
            out.append(value)
        elif isinstance(value, list | tuple):
            out.extend(v for v in value if isinstance(v, torch.Tensor))
    return out


def _map_tensors(fn: Any, value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, tuple | list):
        made = [_map_tensors(fn, v) for v in value]
        return type(value)(*made) if hasattr(value, "_fields") else type(value)(made)
    return value


class _CannotRebuild(Exception):
    """An output the patch cannot make a fake of (sparse, a subclass): upstream's error stands."""


_FRESH: dict[Any, bool] = {}


def _fresh_outputs(func: Any) -> bool:
    """Does every return of ``func``'s schema make a new tensor (no alias annotation)? Views,
    in-place and ``out=`` ops keep upstream's semantics."""
    fresh = _FRESH.get(func)
    if fresh is None:
        schema = getattr(func, "_schema", None)
        returns = getattr(schema, "returns", None)
        fresh = returns is not None and all(r.alias_info is None for r in returns)
        _FRESH[func] = fresh
    return fresh


def _pair(fake: Any, real: Any, fakes: list[Any], reals: list[Any]) -> None:
    """The tensors of two outputs of the same structure, side by side."""
    if isinstance(fake, tuple | list):
        if not isinstance(real, tuple | list) or len(real) != len(fake):
            raise _CannotRebuild
        for f, r in zip(fake, real, strict=True):
            _pair(f, r, fakes, reals)
    elif isinstance(fake, torch.Tensor):
        fakes.append(fake)
        reals.append(real)


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


def _disagrees(t: Any) -> bool:
    """A fake whose own real values have other sizes, dtype, device or strides (the real
    kernel's strides are eager's: a meta kernel's may differ, ``rrelu`` and training
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


def _same_metadata(fake: Any, real: Any) -> bool:
    return (
        fake.shape == real.shape
        and fake.dtype == real.dtype
        and fake.device == real.device
        and fake.layout == real.layout
        and (real.layout != torch.strided or fake.stride() == real.stride())
    )


def _extent(t: Any) -> int:
    """Elements of storage a strided tensor reaches (offset included)."""
    if t.numel() == 0:
        return t.storage_offset()
    return (
        t.storage_offset()
        + 1
        + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True) if n)
    )


def _name_the_op(exc: BaseException, func: Any) -> None:
    """An error out of a propagating mode's op names the op (Python 3.11+: a note), once."""
    add_note = getattr(exc, "add_note", None)
    if add_note is None:
        return
    note = f"fakegrad_patch: raised by {func} under a propagating FakeTensorMode"
    if note not in (getattr(exc, "__notes__", None) or ()):
        add_note(note)


def _first_line(exc: BaseException) -> str:
    text = str(getattr(exc, "reason", "") or exc).strip().splitlines()
    return text[0][:200] if text else type(exc).__name__
