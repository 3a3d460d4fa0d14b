"""Fake leaves made from real leaves (``FakeTensorMode.from_tensor``) and their real sources.

Three things live here, all driven from the converter wrapper in _patch:

* **Grad-copy fidelity.** Converting a real leaf that holds a ``.grad`` gives a fake leaf with a
  fake ``.grad`` whose ``real_tensor`` should be the source grad. Probe D4 (_probes.GRAD_COPY)
  checks that on the running build, by behaviour; only where it is broken do we rewrite the fake
  grad's real values from the source grad. Measured right on 2.13.0 and 2.14.1: no repair there.
* **Opt-in mirroring** (:func:`mirror_to_sources`). torch.compile and torch.export make fake
  leaves from real parameters on their own and must never write real ``.grad``s, so nothing is
  mirrored unless the user names the mode. Inside the switch, every fake leaf that mode converts
  from a real leaf gets a pre-hook on its AccumulateGrad node; when a fake gradient lands there the
  core Materializer writes its real values onto the *real source* (same rule: device, dtype,
  layout, in place, on_missing) and the fake leaf keeps its fake grad, as upstream gives it. A
  node pre-hook runs only when a gradient is accumulated (``backward``), never for
  ``torch.autograd.grad``, which accumulates nothing. The switch holds the armed nodes (and so
  the fake leaves) only while it is active; on exit every hook is removed and everything dropped.
* :func:`materialize`: real tensors out of a pytree of FakeTensors (e.g. ``autograd.grad``
  results on a fake graph), with the same on_missing policy.
"""

from __future__ import annotations

import contextlib
import copy as _copy
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from . import _config, _leaves, _targets, trace
from ._accumulate import (
    Materializer,
    empty_like_contract,
    is_non_overlapping_and_dense,
    obeys_layout_contract,
)
from ._errors import FakeGradError, FakeGradPatchWarning

_lock = threading.RLock()


# --- grad-copy fidelity ---------------------------------------------------------------------------


def repair_grad_copy(fake: Any, source: torch.Tensor, disable_current_modes: Any) -> bool:
    """Give ``fake.grad`` (a FakeTensor) the real values of ``source.grad``. Returns True when a
    repair was made. Only called on builds where probe D4 found the copy wrong."""
    fake_grad = getattr(fake, "grad", None)
    grad = source.grad
    if fake_grad is None or grad is None or fake_grad.shape != grad.shape:
        return False
    with disable_current_modes(), torch.no_grad():
        real = grad.detach().clone(memory_format=torch.preserve_format)
        fake_grad.real_tensor = real
    if trace.enabled(trace.INFO):
        trace.emit(
            "grad_copy_repaired",
            trace.INFO,
            leaf_id=id(source),
            shape=list(grad.shape),
            dtype=str(grad.dtype).removeprefix("torch."),
            device=str(grad.device),
            bytes=real.numel() * real.element_size(),
        )
    return True


# --- mirroring ------------------------------------------------------------------------------------


class _Mirror:
    """One active ``mirror_to_sources(mode)`` (nesting counted). Holds the armed AccumulateGrad
    nodes of the mode's fake leaves, which is what keeps their pre-hooks alive until a graph
    uses them; holds neither the mode nor any real leaf."""

    def __init__(self) -> None:
        self.depth = 0
        self.active = True
        #: fake leaf -> (its AccumulateGrad node, the RemovableHandle of our pre-hook)
        self.armed: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def close(self) -> int:
        self.active = False
        removed = 0
        for _node, handle in list(self.armed.values()):
            if handle.hooks_dict_ref() is not None:
                handle.remove()
                removed += 1
        self.armed.clear()
        return removed


#: FakeTensorMode -> its active _Mirror. Weak: a switch never keeps a mode alive.
_mirrors: WeakIdKeyDictionary = WeakIdKeyDictionary()


class _Active:
    """How many modes have an open switch: the converter's fast path reads this plain int
    (``bool(WeakIdKeyDictionary)`` costs ~0.5 us per conversion)."""

    count = 0


class FakeLeaves:
    """Per-installation driver, called by the converter wrapper for every conversion."""

    def __init__(self, applied: Any) -> None:
        from . import _probes

        self._applied = applied
        self._resolved: _targets.Resolved = applied.resolved
        self._probes = applied.probes
        self._grad_copy = _probes.GRAD_COPY
        self._grad_copy_broken: bool | None = None  # probed on the first conversion that matters
        self._checked: WeakIdKeyDictionary = WeakIdKeyDictionary()
        # No zero-copy set path: the fake leaf keeps its fake grad, whose ``real_tensor`` is the
        # propagated buffer; adopting it as the source's ``.grad`` would make the two alias, and
        # the next fake accumulation (an in-place add that propagation also runs on
        # ``real_tensor``) would add into the real ``.grad`` a second time.
        self.materializer = Materializer(applied.resolved, adopt=False)
        self._is_fake = applied.resolved.is_fake
        self._real_of = applied.resolved.real_of

    @staticmethod
    def mirroring() -> bool:
        """Is any ``mirror_to_sources`` switch open (one int test)?"""
        return _Active.count > 0

    def on_convert(self, mode: Any, source: torch.Tensor, fake: Any) -> None:
        """``fake`` was just made by ``mode``'s converter from real ``source``."""
        if self._grad_copy_broken is not False:
            self._check_grad_copy(source, fake)
        if _Active.count and source.requires_grad and source.grad_fn is None:
            mirror = _mirrors.get(mode)
            if mirror is not None and mirror.active:
                self._arm(mirror, source, fake)

    def _check_grad_copy(self, source: torch.Tensor, fake: Any) -> None:
        if self._real_of(fake) is None or source.grad_fn is not None:
            return
        if source.grad is None or fake in self._checked:
            return
        if self._grad_copy_broken is None:
            self._grad_copy_broken = self._probes.has(self._grad_copy)
        if self._grad_copy_broken:
            repair_grad_copy(fake, source, self._resolved.disable_current_modes)
        self._checked[fake] = None

    def _arm(self, mirror: _Mirror, source: torch.Tensor, fake: Any) -> None:
        if not (self._is_fake(fake) and fake.requires_grad and fake.grad_fn is None):
            return
        with _lock:
            entry = mirror.armed.get(fake)
            if entry is not None and entry[1].hooks_dict_ref() is not None:
                return
            node = self._resolved.grad_accumulator(fake)
            handle = node.register_prehook(
                self._make_prehook(weakref.ref(source), weakref.ref(mirror), id(fake))
            )
            mirror.armed[fake] = (node, handle)

    def _make_prehook(
        self, source_ref: weakref.ref[torch.Tensor], mirror_ref: weakref.ref[_Mirror], fake_id: int
    ) -> Any:
        is_fake, real_of = self._is_fake, self._real_of
        applied = self._applied

        def fakegrad_mirror_prehook(grad_outputs: tuple[Any, ...]) -> None:
            grad = grad_outputs[0]
            mirror = mirror_ref()
            if mirror is None or not mirror.active or not is_fake(grad):
                return None
            source = source_ref()
            if source is None or not applied._active:
                return None
            if trace.enabled(trace.INFO):
                propagated = real_of(grad) is not None
                _emit_mirrored(source, fake_id, propagated, self.materializer.backward_id())
            try:
                with _leaves.leaf_lock(source):  # as the real leaf's own pre-hook
                    self.materializer.on_fake_grad(source, grad)
            except (FakeGradError, FakeGradPatchWarning):
                raise  # on_missing="error", or the user's warnings filter (-W error)
            except Exception as exc:  # never break the host's backward
                applied.internal_error("mirror", exc)
            return None  # the fake leaf accumulates its fake grad as upstream does

        return fakegrad_mirror_prehook


def _emit_mirrored(
    source: torch.Tensor, fake_id: int, propagated: bool, backward_id: int | None
) -> None:
    trace.emit(
        "mirrored",
        trace.INFO,
        backward_id=backward_id,
        **_leaves.leaf_fields(source),
        fake_id=fake_id,
        source="propagated" if propagated else "none",
    )


@contextlib.contextmanager
def mirror_to_sources(mode: Any) -> Iterator[None]:
    """Mirror gradients of ``mode``'s fake leaves onto their real source leaves (see module doc).

    Counts: fake leaves that ``mode``'s converter makes from real leaves (``requires_grad``, no
    ``grad_fn``) while the block runs, including memo hits (converting an already converted leaf
    again inside the block arms the same fake), and gradients accumulated into them before the
    block ends.
    """
    from . import _patch

    applied = _patch.current()
    if applied is None:
        _patch.warn_once(
            "mirror-uninstalled",
            "fakegrad_patch.mirror_to_sources: the patch is not installed, nothing is mirrored "
            "(call fakegrad_patch.install()).",
        )
    fake_mode_cls = _targets.resolve(_targets.FAKE_TENSOR_MODE)
    if not isinstance(mode, fake_mode_cls):
        raise TypeError(f"mirror_to_sources expects a FakeTensorMode, got {type(mode).__name__}")
    with _lock:
        mirror = _mirrors.get(mode)
        if mirror is None:
            mirror = _mirrors[mode] = _Mirror()
            _Active.count += 1
        mirror.depth += 1
    try:
        yield
    finally:
        with _lock:
            mirror.depth -= 1
            last = mirror.depth == 0
            if last and _mirrors.get(mode) is mirror:
                del _mirrors[mode]
                _Active.count -= 1
        if last:
            mirror.close()


# --- materialize() --------------------------------------------------------------------------------


class _Touch:
    """Resolved lazily so materialize() works whether or not the patch is installed."""

    fake_cls: Any = None
    disable_current_modes: Any = None

    @classmethod
    def get(cls) -> type[_Touch]:
        if cls.fake_cls is None:
            cls.disable_current_modes = _targets.resolve(_targets.DISABLE_CURRENT_MODES)
            cls.fake_cls = _targets.resolve(_targets.FAKE_TENSOR)
        return cls


class _Counts:
    def __init__(self) -> None:
        self.fakes = 0
        self.by_action = {"propagated": 0, "zeros": 0, "drop": 0, "keep": 0}
        self.bytes = 0
        self.missing: list[str] = []


def materialize(
    tree: Any,
    like: Any = None,
    *,
    on_missing: str | None = None,
    copy: bool = False,
) -> Any:
    """Replace every FakeTensor in ``tree`` with a real tensor made from its propagated values.

    tree: a tensor, or nested tuples (namedtuples too), lists and dicts of them; anything else
        (real tensors, numbers, None, other objects) passes through unchanged.
    like: where the results go. ``None``: each fake's own device and dtype. A ``torch.device``
        or device string, or a single tensor when ``tree`` is a container: that device for every
        result (dtypes kept). A pytree with the structure of ``tree`` (a tensor, when ``tree`` is
        a tensor): each result takes the device and dtype of its counterpart
        tensor, and its layout too when the shapes match (AccumulateGrad's layout contract, so
        ``materialize(grads, like=params)`` gives what ``.grad`` would hold); ``None`` in a
        position means "own".
    on_missing: for fakes without real values (propagation off or an op that could not
        propagate); default: the configured policy. ``drop``: ``None`` in that position;
        ``zeros``: real zeros of the fake's shape (and the target device/dtype); ``error``: raise
        FakeGradError naming every missing position; ``keep``: the FakeTensor stays.
    copy: when False (default) a result may share memory with the fake's ``real_tensor`` (no
        copy when device, dtype and layout already fit); True always gives fresh storage.

    Containers are rebuilt only where something changed. Runs with every dispatch mode disabled,
    so it may be called inside the FakeTensorMode.
    """
    policy = _config.validate_on_missing(
        on_missing if on_missing is not None else _config.current().on_missing
    )
    touch = _Touch.get()
    start = time.perf_counter()
    counts = _Counts()
    # A tensor `like` for a tensor `tree` is its counterpart (matching tree); for a container it
    # only names the device.
    per_leaf_like = like is not None and (
        not isinstance(like, (torch.Tensor, torch.device, str))
        or (isinstance(like, torch.Tensor) and isinstance(tree, torch.Tensor))
    )
    if not per_leaf_like and like is not None:
        device = like.device if isinstance(like, torch.Tensor) else torch.device(like)
        like = _SameDevice(device)
    with touch.disable_current_modes(), torch.no_grad():
        result = _map(tree, like, "", policy, copy, counts, touch.fake_cls, per_leaf_like)
    if counts.missing and policy == "error":
        _emit_materialized(counts, policy, start, level=trace.ERROR)
        shown = ", ".join(p or "<root>" for p in counts.missing[:10])
        more = f" and {len(counts.missing) - 10} more" if len(counts.missing) > 10 else ""
        raise FakeGradError(
            f"fakegrad_patch.materialize: {len(counts.missing)} FakeTensor(s) without real values "
            f"at {shown}{more}. Enable real-value propagation (torch._functorch.config."
            "fake_tensor_propagate_real_tensors = True) before creating the FakeTensorMode, or "
            "pass another on_missing policy."
        )
    _emit_materialized(counts, policy, start)
    return result


class _SameDevice:
    """``like`` given as one device for every result."""

    def __init__(self, device: torch.device) -> None:
        self.device = device


def _map(
    node: Any,
    like: Any,
    path: str,
    policy: str,
    copy: bool,
    counts: _Counts,
    fake_cls: Any,
    per_leaf: bool,
) -> Any:
    if isinstance(node, torch.Tensor):
        if not isinstance(node, fake_cls):
            return node
        return _one(node, like, path, policy, copy, counts)
    if isinstance(node, (tuple, list)):
        likes = _children(like, len(node), path) if per_leaf else [like] * len(node)
        items = [
            _map(child, child_like, f"{path}[{i}]", policy, copy, counts, fake_cls, per_leaf)
            for i, (child, child_like) in enumerate(zip(node, likes, strict=True))
        ]
        if all(a is b for a, b in zip(items, node, strict=True)):
            return node
        if isinstance(node, list):
            return type(node)(items) if type(node) is not list else items
        if hasattr(node, "_fields"):  # namedtuple
            return type(node)(*items)
        return tuple(items) if type(node) is tuple else type(node)(items)
    if isinstance(node, dict):
        out = None
        for key, child in node.items():
            child_like = _child_of(like, key, path) if per_leaf else like
            new = _map(
                child, child_like, f"{path}[{key!r}]", policy, copy, counts, fake_cls, per_leaf
            )
            if new is not child:
                if out is None:
                    out = _copy.copy(node)
                out[key] = new
        return node if out is None else out
    return node


def _children(like: Any, n: int, path: str) -> list[Any]:
    if like is None:
        return [None] * n
    if not isinstance(like, (tuple, list)) or len(like) != n:
        raise ValueError(
            f"materialize: like does not match tree at {path or '<root>'}: expected a sequence of "
            f"{n}, got {type(like).__name__}"
        )
    return list(like)


def _child_of(like: Any, key: Any, path: str) -> Any:
    if like is None:
        return None
    if not isinstance(like, dict) or key not in like:
        raise ValueError(
            f"materialize: like does not match tree at {path or '<root>'}: no key {key!r}"
        )
    return like[key]


def _one(
    fake: Any, like: Any, path: str, policy: str, copy: bool, counts: _Counts
) -> torch.Tensor | None:
    counts.fakes += 1
    if isinstance(like, _SameDevice):
        device, dtype, layout_of = like.device, fake.dtype, None
    elif isinstance(like, torch.Tensor):
        device, dtype = like.device, like.dtype
        layout_of = like if like.shape == fake.shape else None
    elif like is None:
        device, dtype, layout_of = fake.device, fake.dtype, None
    else:
        raise ValueError(
            f"materialize: like at {path or '<root>'} must be a tensor or None, "
            f"got {type(like).__name__}"
        )
    real = getattr(fake, "real_tensor", None)
    if real is None:
        if policy == "keep":
            counts.by_action["keep"] += 1
            return fake
        if policy == "drop":
            counts.by_action["drop"] += 1
            return None
        if policy == "error":
            counts.missing.append(path)
            return None
        counts.by_action["zeros"] += 1
        out = _empty_for(fake, layout_of, device, dtype).zero_()
        counts.bytes += out.numel() * out.element_size()
        return out
    counts.by_action["propagated"] += 1
    real = real.detach()
    fits = real.device == device and real.dtype == dtype
    if layout_of is not None:
        fits = fits and obeys_layout_contract(real, layout_of)
    if fits and not copy:
        return real
    out = _empty_for(real, layout_of, device, dtype)
    out.copy_(real)
    counts.bytes += out.numel() * out.element_size()
    return out


def _empty_for(
    t: torch.Tensor, layout_of: torch.Tensor | None, device: torch.device, dtype: torch.dtype
) -> torch.Tensor:
    """Uninitialised storage for a result: the counterpart's layout contract when given, else
    ``t``'s strides when they are non-overlapping and dense (``preserve_format``), else
    contiguous."""
    if layout_of is not None:  # same device as layout_of: it is the `like` counterpart
        return empty_like_contract(layout_of, dtype)
    if is_non_overlapping_and_dense(t):
        return torch.empty_strided(t.shape, t.stride(), dtype=dtype, device=device)
    return torch.empty(t.shape, dtype=dtype, device=device)


def _emit_materialized(counts: _Counts, policy: str, start: float, level: int = trace.INFO) -> None:
    if not trace.enabled(level):
        return
    trace.emit(
        "materialized",
        level,
        fakes=counts.fakes,
        propagated=counts.by_action["propagated"],
        zeros=counts.by_action["zeros"],
        dropped=counts.by_action["drop"],
        kept=counts.by_action["keep"],
        missing=len(counts.missing),
        policy=policy,
        bytes=counts.bytes,
        duration_us=round((time.perf_counter() - start) * 1e6, 1),
    )


__all__ = ["FakeLeaves", "materialize", "mirror_to_sources", "repair_grad_copy"]
