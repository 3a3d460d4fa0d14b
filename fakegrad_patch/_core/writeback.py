"""``buffers="write_back"`` (opt-in): in-place updates of real op inputs reach the real tensors.

By default (upstream semantics) a real tensor converted by a propagating mode as an op input gets
a fake whose propagated values are a private *copy*: an in-place update applied inside the mode
(BatchNorm's ``running_mean``/``running_var``, spectral_norm's ``_u``/``_v``, an EMA of frozen
weights, optimizer state) changes the copy and the real tensor stays as it was, while updates
FakeTensorMode runs for real on all-real arguments (``num_batches_tracked += 1``) do reach it.

With write-back on, the fake's propagated values *are* the real tensor (a ``detach()`` of it:
same storage, same version counter, never its autograd identity), so every in-place update the
mode applies to it for real happens to the real tensor, as in eager mode. Exactly once:

* **Ops FakeTensorMode already ran for real** (no fake argument, numbers allowed as tensors: the
  constant-propagation branch, which converts the arguments afterwards): never aliased, the
  update is upstream's and happened once (``_targets.op_ran_for_real``).
* **Decomposed ops.** FakeTensorMode runs an op for real on the propagated values, then runs its
  Python decomposition / meta implementation *under the mode*, whose inner in-place ops are run
  for real again (``native_batch_norm`` updates the running statistics twice: measured on
  2.13.0 and 2.14.1; with private copies only the copy is wrong, with an alias the buffer would
  be). This module wraps ``FakeTensorMode.dispatch`` while write-back is on and tracks, per
  thread and mode, the outermost op: a nested op that writes an argument aliased to a real tensor
  works on a shadow copy; when the outermost op returns the alias is put back, and the shadow's
  result is written to the real tensor only if the outer op did not write it for real itself.
* **Only the outermost op's own arguments are aliased**, only when converted as op inputs
  (``validate_and_convert_non_fake_tensors``: positional ``(mode, t)``), never in a mode with a
  ShapeEnv, never by ``from_tensor`` (tracers' fakification: torch.compile and export keep their
  no-mutation rule), never a tensor that requires grad (parameters keep the value machinery of
  ``_values``; a parameter updated in place inside the mode is reported, not written back), never
  a FakeTensor, a meta tensor, a non-strided or subclass tensor.

Every write-back is traced (``buffer_written_back``, with bytes). Turning write-back off (or
``uninstall()``) gives every aliased fake a private copy again and unwraps ``dispatch``. Off,
nothing here runs: ``dispatch`` is not wrapped.

Registries: WeakIdTables (O(1), never keeping a tensor alive) and a per-thread frame stack.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch

from .. import trace
from . import leaves as _leaves
from . import targets as _targets
from .state import warn_once
from .weak import WeakIdTable

_NO_WRITES: tuple[tuple[int, str], ...] = ()


class _Frame:
    """The outermost op of one mode on one thread."""

    __slots__ = (
        "aliased",
        "arguments",
        "depth",
        "mode",
        "nested",
        "op",
        "real_ok",
        "scanned",
        "swaps",
        "written",
    )

    def __init__(self, mode: Any, op: tuple[Any, Any]) -> None:
        self.mode = mode
        #: the op's (args, kwargs)
        self.op = op
        #: whether :meth:`WriteBack._scan` ran (only when the op or a nested op writes)
        self.scanned = False
        #: nesting below the outermost op (0: the outermost op itself)
        self.depth = 0
        #: storage data pointer -> the real tensor over it, for every argument of the op whose
        #: fake aliases a real tensor
        self.aliased: dict[int, Any] = {}
        #: storage data pointers the op writes (its schema, or a nested op writing the argument)
        self.written: set[int] = set()
        #: the subset nested ops wrote directly (the op itself did not run for real)
        self.nested: set[int] = set()
        #: storage data pointers of the values of the op's own tensor arguments
        self.arguments: set[int] = set()
        #: whether FakeTensorMode runs the op for real: every fake argument has real values
        #: (the modes this module acts on have no ShapeEnv, so that is upstream's whole test)
        self.real_ok = True
        #: (fake, its propagated values before, the shadow given to nested ops)
        self.swaps: list[tuple[Any, Any, Any]] = []


class WriteBack:
    """One installation's write-back machinery (inactive until :meth:`enable`)."""

    def __init__(self, resolved: Any, applied: Any) -> None:
        self._r = resolved
        self._applied = applied
        self._is_fake = resolved.is_fake
        self._tls = threading.local()
        self._lock = threading.Lock()
        #: op -> its written arguments ((position, name), ...) from the schema
        self._written: dict[Any, tuple[tuple[int, str], ...]] = {}
        #: fake -> the real tensor its propagated values alias
        self._aliases: WeakIdTable[Any] = WeakIdTable()
        #: fakes made (or returned) by ``from_tensor``: never aliased
        self._refused: WeakIdTable[bool] = WeakIdTable()
        #: aliased storage data pointer -> weak reference to the real tensor that owns it
        self._storages: dict[int, Any] = {}
        self.enabled = False
        self._wrapper: Any = None

    # -- on / off --------------------------------------------------------------------------------

    def enable(self) -> bool:
        """Wrap ``FakeTensorMode.dispatch``; False (write-back unavailable) when it is missing."""
        import wrapt

        with self._lock:
            if self.enabled:
                return True
            cls = self._r.fake_mode_cls
            name = _targets.FAKE_MODE_DISPATCH.qualname.rsplit(".", 1)[1]
            if _targets._resolve_optional(_targets.FAKE_MODE_DISPATCH) is None or not callable(
                cls.__dict__.get(name)
            ):
                return False
            wrapt.wrap_function_wrapper(cls, name, self.dispatch)
            self._wrapper = cls.__dict__[name]
            self.enabled = True
        if trace.enabled(trace.INFO):
            trace.emit("write_back_enabled", trace.INFO)
        return True

    def disable(self) -> int:
        """Unwrap ``dispatch`` and give every aliased fake a private copy again (upstream
        semantics from now on). Returns how many fakes were un-aliased."""
        with self._lock:
            if not self.enabled:
                return 0
            self.enabled = False
            wrapper, self._wrapper = self._wrapper, None
            name = _targets.FAKE_MODE_DISPATCH.qualname.rsplit(".", 1)[1]
            # the patch's one unwrap rule: put upstream's back, unless somebody wrapped over us
            self._applied._unwrap(self._r.fake_mode_cls, name, wrapper, None, True)
            aliased = list(self._aliases.items())
            self._aliases.clear()
            self._storages.clear()
        count = sum(self._unalias(fake, real) for fake, real in aliased)
        if trace.enabled(trace.INFO):
            trace.emit("write_back_disabled", trace.INFO, unaliased=count)
        return count

    # -- the dispatch wrapper -------------------------------------------------------------------

    def _stack(self) -> list[_Frame]:
        stack: list[_Frame] | None = getattr(self._tls, "stack", None)
        if stack is None:
            stack = self._tls.stack = []
        return stack

    def dispatch(
        self, wrapped: Any, mode: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        if (
            not self.enabled
            or not getattr(mode, "propagate_real_tensors", False)
            or getattr(mode, "shape_env", None) is not None
        ):
            return wrapped(*args, **kwargs)
        stack = self._stack()
        frame = None
        for item in reversed(stack):
            if item.mode is mode:
                frame = item
                break
        try:
            func = args[0] if args else kwargs["func"]
            written = self._written_args(func)
            op_args, op_kwargs = _op_arguments(args, kwargs)
        except Exception as exc:  # never break the host's fake computation
            self._applied.internal_error("write_back", exc)
            return wrapped(*args, **kwargs)
        if frame is None:
            frame = _Frame(mode, (op_args, op_kwargs))
            if written:
                self._guarded(self._enter, frame, written)
            stack.append(frame)
            try:
                return wrapped(*args, **kwargs)
            finally:
                stack.pop()
                if frame.written or frame.swaps:
                    self._guarded(self._finish, frame)
        frame.depth += 1
        try:
            if written:
                self._guarded(self._shadow, frame, written, op_args, op_kwargs)
            return wrapped(*args, **kwargs)
        finally:
            frame.depth -= 1

    def _guarded(self, method: Any, *args: Any) -> None:
        try:
            method(*args)
        except Exception as exc:  # never break the host's fake computation
            self._applied.internal_error("write_back", exc)

    def _written_args(self, func: Any) -> tuple[tuple[int, str], ...]:
        written = self._written.get(func)
        if written is None:
            schema = getattr(func, "_schema", None)
            found = []
            for index, argument in enumerate(getattr(schema, "arguments", ())):
                info = argument.alias_info
                if info is not None and info.is_write:
                    found.append((index, argument.name))
            written = self._written[func] = tuple(found) or _NO_WRITES
        return written

    def _scan(self, frame: _Frame) -> None:
        """The outermost op's arguments (once, when the op or a nested op writes): will it run
        for real, where are its arguments' values, which fake arguments alias real tensors
        already (real ones are noted when converted)."""
        frame.scanned = True
        for t in _tensor_arguments(*frame.op):
            if self._is_fake(t):
                real = t.real_tensor
                if real is None:
                    frame.real_ok = False
                    continue
                ptr = _storage(real)
                if ptr is not None and self._storages and self._owner(ptr) is not None:
                    frame.aliased[ptr] = real
            else:
                ptr = _storage(t)
            if ptr is not None:
                frame.arguments.add(ptr)

    def _enter(self, frame: _Frame, written: Any) -> None:
        """The outermost op's schema writes arguments: note them (a parameter is reported)."""
        self._scan(frame)
        for t in _written_tensors(written, *frame.op):
            if self._is_fake(t):
                ptr = _storage(t.real_tensor)
            elif t.requires_grad:
                self._parameter_written(t)
                ptr = None
            else:
                ptr = _storage(t)
            if ptr is not None:
                frame.written.add(ptr)

    def _shadow(self, frame: _Frame, written: Any, op_args: Any, op_kwargs: Any) -> None:
        """A nested op (a decomposition or meta implementation that FakeTensorMode runs under
        the mode) writes an argument of the outer op. FakeTensorMode runs the nested op for real
        too: when the outer op already ran for real, that applies its update a second time
        (``native_batch_norm``'s running statistics: twice). Then the nested op gets a shadow
        copy until the outer op returns. When the outer op did not run for real, the nested op
        is the only one that updates: it writes the alias directly, once."""
        if not frame.scanned:
            self._scan(frame)
        if not frame.arguments:
            return
        no_dispatch = self._r.no_dispatch
        for t in _written_tensors(written, op_args, op_kwargs):
            if not self._is_fake(t):
                continue
            real = t.real_tensor
            ptr = _storage(real)
            if ptr is None or ptr not in frame.arguments:
                continue
            if ptr in frame.aliased:
                frame.written.add(ptr)
            if not frame.real_ok:
                frame.nested.add(ptr)
                continue
            with no_dispatch(), torch.no_grad():
                shadow = _private_copy(real)
                t.real_tensor = shadow
            frame.swaps.append((t, real, shadow))

    def _finish(self, frame: _Frame) -> None:
        """The outermost op returned: put the arguments' values back, trace every write-back.

        (Version counters cannot tell what was written: the real run of an op bumps the alias's
        version, as eager does, only where the op's schema marks the argument written, and
        ``native_batch_norm``'s does not mark its running statistics.)"""
        if frame.swaps:
            with self._r.no_dispatch():
                for fake, before, _shadow in reversed(frame.swaps):
                    fake.real_tensor = before
        for ptr in frame.written:
            real = frame.aliased.get(ptr)
            if real is None:
                continue
            owner = self._owner(ptr)
            described = owner if owner is not None else real
            if frame.real_ok or ptr in frame.nested:
                if trace.enabled(trace.INFO):
                    trace.emit(
                        "buffer_written_back",
                        trace.INFO,
                        **_leaves.leaf_fields(described),
                        bytes=real.numel() * real.element_size(),
                        via="op" if frame.real_ok else "decomposition",
                    )
            elif trace.enabled(trace.WARNING):
                trace.emit(
                    "buffer_not_written_back",
                    trace.WARNING,
                    **_leaves.leaf_fields(described),
                    reason="the op had no real values (an argument without propagated values)",
                )

    def _parameter_written(self, t: Any) -> None:
        if trace.enabled(trace.WARNING):
            trace.emit(
                "buffer_not_written_back",
                trace.WARNING,
                **_leaves.leaf_fields(t),
                reason="requires grad (a parameter updated in place inside the mode)",
            )
        warn_once(
            "write_back:parameter",
            "fakegrad_patch: buffers='write_back': a tensor that requires grad (a parameter) was "
            "updated in place inside a propagating FakeTensorMode; only its fake copy changed "
            "(parameters are never aliased). Step optimizers outside the mode, as in "
            "docs/configuration.md.",
        )

    # -- conversions (called by _values for op inputs of a propagating mode) --------------------

    def convert(self, mode: Any, t: Any, fake: Any, op_input: bool) -> bool:
        """A real tensor that does not require grad was converted by a propagating mode: as an
        op input, maybe alias it (:meth:`on_convert`); by ``from_tensor`` (a fake the caller
        holds and may update in place, expecting upstream's semantics), never alias that fake,
        now or later (the converter's memo returns it for later op inputs too)."""
        if op_input:
            return fake not in self._refused and self.on_convert(mode, t, fake)
        self._refused.set(fake, True)
        real = self._aliases.pop(fake)
        if real is not None:
            self._unalias(fake, real)
        return False

    def _unalias(self, fake: Any, real: Any) -> bool:
        """Give ``fake`` a private copy of ``real`` again if it still aliases it."""
        if getattr(fake, "real_tensor", None) is not real:
            return False
        with self._r.no_dispatch(), torch.no_grad():
            fake.real_tensor = _private_copy(real)
        return True

    def on_convert(self, mode: Any, t: Any, fake: Any) -> bool:
        """``t`` (real, does not require grad) was just converted as an op input: alias the
        fake's propagated values to it when this is the outermost op of ``mode`` and the op was
        not already run for real. True when the fake aliases ``t`` (now or from before)."""
        stack: list[_Frame] | None = getattr(self._tls, "stack", None)
        if not stack:
            return False
        frame = stack[-1]
        if frame.mode is not mode or frame.depth != 0:
            return False
        real = fake.real_tensor
        ptr = _storage(t)
        if ptr is None or real is None or real.layout != torch.strided:
            return False
        if _storage(real) == ptr:
            self._noted(frame, ptr, t)
            return True  # aliased before (the converter's memo returned the same fake)
        if (
            type(t) not in (torch.Tensor, torch.nn.Parameter)
            or real.dtype != t.dtype
            or real.shape != t.shape
            or real.stride() != t.stride()
            or real.storage_offset() != t.storage_offset()
        ):
            return False
        if self._r.op_ran_for_real() is not False:
            return False  # upstream already applied this op to t for real (or cannot tell)
        root = t._base if t._base is not None else t
        fake_root = fake._base if fake._base is not None else fake
        with self._r.no_dispatch():
            if fake_root is not fake:
                root_real = getattr(fake_root, "real_tensor", None)
                if (
                    root_real is not None
                    and _storage(root_real) != ptr
                    and root_real.shape == root.shape
                    and root_real.stride() == root.stride()
                    and root_real.storage_offset() == root.storage_offset()
                    and root_real.dtype == root.dtype
                ):
                    root_alias = root.detach()
                    fake_root.real_tensor = root_alias
                    self._aliases.set(fake_root, root_alias)
            alias = t.detach()
            fake.real_tensor = alias
        self._aliases.set(fake, alias)
        self._own(ptr, root)
        self._noted(frame, ptr, t)
        return True

    @staticmethod
    def _noted(frame: _Frame, ptr: int, t: Any) -> None:
        frame.aliased[ptr] = t

    def _own(self, ptr: int, root: Any) -> None:
        def forget(ref: Any, ptr: int = ptr, storages: dict[int, Any] = self._storages) -> None:
            if storages.get(ptr) is ref:
                del storages[ptr]

        self._storages[ptr] = weakref.ref(root, forget)

    def _owner(self, ptr: int) -> Any:
        ref = self._storages.get(ptr)
        owner = None if ref is None else ref()
        if owner is None or _storage(owner) != ptr:
            return None
        return owner


def _op_arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """``dispatch(func, types, args=(), kwargs={})``'s op arguments."""
    op_args = args[2] if len(args) > 2 else kwargs.get("args", ())
    op_kwargs = args[3] if len(args) > 3 else kwargs.get("kwargs")
    return op_args, op_kwargs or {}


def _storage(t: Any) -> int | None:
    """The data pointer of a real strided tensor's storage (None: no tensor, not strided, meta):
    computed from the tensor's own pointer (``untyped_storage()`` costs microseconds)."""
    if t is None or t.layout != torch.strided or t.device.type == "meta":
        return None
    return int(t.data_ptr() - t.storage_offset() * t.element_size())


def _tensors(values: Any) -> list[Any]:
    """The tensors among aten arguments: tensors, and the tensors of ``Tensor[]`` lists."""
    out = []
    for value in values:
        if isinstance(value, torch.Tensor):
            out.append(value)
        elif isinstance(value, list | tuple):
            out.extend(v for v in value if isinstance(v, torch.Tensor))
    return out


def _tensor_arguments(op_args: Any, op_kwargs: Any) -> list[Any]:
    return _tensors((*op_args, *op_kwargs.values()))


def _written_tensors(written: Any, op_args: Any, op_kwargs: Any) -> list[Any]:
    return _tensors(
        op_args[index] if index < len(op_args) else op_kwargs.get(name) for index, name in written
    )


def _private_copy(real: Any) -> Any:
    """A copy of ``real`` over a copy of its whole storage (same sizes, strides, offset)."""
    copy = torch.empty(0, dtype=real.dtype, device=real.device)
    copy.set_(real.untyped_storage().clone(), real.storage_offset(), real.shape, real.stride())
    return copy
