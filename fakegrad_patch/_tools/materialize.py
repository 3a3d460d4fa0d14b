"""``fakegrad_patch.materialize``: real tensors out of a pytree of FakeTensors (e.g. the results
of ``torch.autograd.grad`` on a fake graph), built from their propagated values, with the
``on_missing`` policy for fakes without any. See docs/fake-leaves.md.
"""

from __future__ import annotations

import copy as _copy
import time
from typing import Any

import torch

from .. import _config, trace
from .._core.accumulate.hooks import (
    empty_like_contract,
    is_non_overlapping_and_dense,
    obeys_layout_contract,
)
from .._core.touchpoints import targets as _targets
from .._errors import FakeGradError


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


__all__ = ["materialize"]
