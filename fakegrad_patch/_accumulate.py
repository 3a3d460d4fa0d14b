"""The materialize/accumulate rule: do with real values what AccumulateGrad does with real grads.

Called from the pre-hook we put on a real leaf's AccumulateGrad node when a FakeTensor gradient
arrives. We write the real ``.grad`` ourselves (with every dispatch mode disabled, because
AccumulateGrad runs with the fake mode still active) and hand AccumulateGrad an undefined gradient
so it does nothing more. AccumulateGrad still runs the leaf's post-accumulate hooks afterwards, so
they observe the real ``.grad``.

Real work runs under ``no_dispatch`` (every Python dispatch key excluded), so neither the fake
mode nor any other mode stacked with it (FlopCounterMode) sees it.

The rule, from ``torch/csrc/autograd/functions/accumulate_grad.h`` (``accumulateGrad``):

* no prior grad: take the new buffer over when nothing else references it and it obeys the layout
  contract (zero copies); otherwise copy it into a tensor shaped like the leaf (``empty_strided``
  with the leaf's strides when the leaf is non-overlapping and dense, contiguous otherwise);
* prior grad, grad mode off: add in place (the same tensor object stays in ``.grad``);
* prior grad, grad mode on (``create_graph=True``): ``prior + new`` out of place.
"""

from __future__ import annotations

import contextlib
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from . import _config, trace
from ._errors import FakeGradError, FakeGradPatchWarning
from ._targets import Resolved

#: ``Tensor._use_count()`` of a propagated buffer referenced only through its Python object (the
#: FakeTensor's ``real_tensor`` attribute): the TensorImpl reference the PyObject owns. Once a leaf
#: adopted it, the leaf's ``.grad`` holds a second one, so a buffer shared by two leaves (``a + b``
#: sends one gradient to both) is copied for the second. Measured on both checked builds.
_SOLE_OWNER_USE_COUNT = 1


_NO_CONTEXT = contextlib.nullcontext()


def is_non_overlapping_and_dense(t: torch.Tensor) -> bool:
    """Python port of c10's ``compute_non_overlapping_and_dense``."""
    if t.layout != torch.strided:
        return False
    sizes, strides = t.shape, t.stride()
    if t.dim() == 1:
        return sizes[0] < 2 or strides[0] == 1
    perm = sorted(range(t.dim()), key=lambda d: (strides[d], sizes[d]))
    expected = 1
    for d in perm:
        if sizes[d] == 1:
            continue
        if strides[d] != expected:
            return False
        expected *= sizes[d]
    return True


def obeys_layout_contract(grad: torch.Tensor, leaf: torch.Tensor) -> bool:
    """AccumulateGrad's ``obeys_layout_contract`` (strided tensors)."""
    if grad.layout != torch.strided or leaf.layout != torch.strided:
        return False
    if leaf.is_contiguous() and grad.is_contiguous() and 0 not in grad.stride():
        return True  # the common case, decided by two C calls (both dense, same strides)
    if is_non_overlapping_and_dense(leaf):
        leaf_strides = leaf.stride()
        for size, stride, leaf_stride in zip(grad.shape, grad.stride(), leaf_strides, strict=True):
            if size != 1:
                if stride != leaf_stride:
                    return False
            elif stride == 0:
                return False
        return True
    return grad.is_contiguous()


def empty_like_contract(leaf: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised gradient buffer for ``leaf`` that obeys the layout contract."""
    if is_non_overlapping_and_dense(leaf):
        return torch.empty_strided(leaf.shape, leaf.stride(), dtype=dtype, device=leaf.device)
    return torch.empty(leaf.shape, dtype=dtype, device=leaf.device)


@dataclass(frozen=True)
class Outcome:
    """What one interception did (also the payload of the trace event)."""

    action: str  # "set" | "accumulate" | "drop" | "error" | "keep"
    source: str  # "propagated" | "zeros" | "none"
    zero_copy: bool = False
    bytes_copied: int = 0


class Materializer:
    """Applies the rule. One instance per installation, holding the resolved touch points.

    ``adopt=False`` turns the zero-copy set path off (every new ``.grad`` is a copy), for callers
    whose propagated buffers stay referenced elsewhere (mirroring onto real sources).
    """

    def __init__(self, resolved: Resolved, *, adopt: bool = True) -> None:
        self._r = resolved
        self._adopt = adopt
        self._warned_drop = False
        self._warn_lock = threading.Lock()

    # -- entry point from the AccumulateGrad pre-hook ------------------------------------------

    def on_fake_grad(self, leaf: torch.Tensor, grad: Any) -> tuple[None] | None:
        """Handle a FakeTensor ``grad`` about to be accumulated into real ``leaf``.

        Returns ``(None,)`` when we wrote ``leaf.grad`` ourselves (AccumulateGrad then sees an
        undefined gradient and leaves ``.grad`` alone) and ``None`` to let AccumulateGrad run as
        upstream does (policy ``keep``).
        """
        start = time.perf_counter()
        real = getattr(grad, "real_tensor", None)
        if real is not None:
            outcome = self._write(leaf, real, grad.dtype, "propagated")
        else:
            policy = _config.current().on_missing
            if policy == "keep":
                outcome = Outcome("keep", "none")
            elif policy == "zeros":
                with self._r.no_dispatch(), torch.no_grad():
                    zeros = empty_like_contract(leaf, grad.dtype).zero_()
                outcome = self._write(leaf, zeros, grad.dtype, "zeros", fresh=True)
            elif policy == "error":
                self._emit(leaf, Outcome("error", "none"), start)
                raise FakeGradError(
                    "fakegrad_patch: a FakeTensor gradient without real values reached a real "
                    f"leaf {describe(leaf)}; the leaf keeps its previous .grad. Enable real-value "
                    "propagation (torch._functorch.config.fake_tensor_propagate_real_tensors = "
                    "True) before creating the FakeTensorMode, or choose another on_missing "
                    "policy (fakegrad_patch.configure(on_missing=...) / FAKEGRAD_ON_MISSING)."
                )
            else:
                outcome = Outcome("drop", "none")
                self._warn_drop_once(leaf)
        self._emit(leaf, outcome, start)
        return None if outcome.action == "keep" else (None,)

    # -- the rule -----------------------------------------------------------------------------

    def _write(
        self,
        leaf: torch.Tensor,
        value: torch.Tensor,
        grad_dtype: torch.dtype,
        source: str,
        *,
        fresh: bool = False,
    ) -> Outcome:
        # Grad mode is on inside backward only with create_graph=True; then our own ops must not
        # be recorded (AccumulateGrad records ``prior + new`` only, which we do below).
        create_graph = torch.is_grad_enabled()
        with self._r.no_dispatch(), torch.no_grad() if create_graph else _NO_CONTEXT:
            prior = leaf.grad
            if prior is not None and isinstance(prior, self._r.fake_tensor_cls):
                # Left by policy "keep" or by an unpatched run: its real values (if any) count.
                prior_real = getattr(prior, "real_tensor", None)
                prior = None
                if prior_real is not None:
                    leaf.grad = self._copy_obeying_contract(prior_real, leaf, grad_dtype)
                    prior = leaf.grad
            if prior is None:
                if fresh or (self._adopt and self._can_adopt(value, leaf, grad_dtype)):
                    leaf.grad = value
                    return Outcome("set", source, zero_copy=True)
                leaf.grad = self._copy_obeying_contract(value, leaf, grad_dtype)
                return Outcome("set", source, bytes_copied=_nbytes(value))
            copied = 0
            if value.device != prior.device or value.dtype != prior.dtype:
                value = value.to(device=prior.device, dtype=prior.dtype)
                copied = _nbytes(value)
            if create_graph:
                leaf.grad = prior + value
            else:
                prior.add_(value)
            return Outcome("accumulate", source, bytes_copied=copied)

    def _can_adopt(self, value: torch.Tensor, leaf: torch.Tensor, dtype: torch.dtype) -> bool:
        """May ``value`` become ``leaf.grad`` as is? AccumulateGrad's own test
        (``is_tensor_stealable``): device, dtype and layout contract already match and nothing
        else holds the tensor (``use_count``); we also refuse views."""
        return (
            type(value) is torch.Tensor
            and value.device == leaf.device
            and value.dtype == dtype
            and value.shape == leaf.shape
            and not value.requires_grad
            and value._base is None
            and obeys_layout_contract(value, leaf)
            and self._r.tensor_use_count(value) <= _SOLE_OWNER_USE_COUNT
        )

    @staticmethod
    def _copy_obeying_contract(
        value: torch.Tensor, leaf: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor:
        out = empty_like_contract(leaf, dtype)
        out.copy_(value)
        return out

    # -- reporting ----------------------------------------------------------------------------

    def _warn_drop_once(self, leaf: torch.Tensor) -> None:
        with self._warn_lock:
            if self._warned_drop:
                return
            self._warned_drop = True
        warnings.warn(
            "fakegrad_patch: a FakeTensor gradient without real values reached real leaf "
            f"{describe(leaf)}; it was dropped (on_missing='drop'), the leaf keeps its previous "
            ".grad. Turn on torch._functorch.config.fake_tensor_propagate_real_tensors to get "
            "real gradients. This warning is shown once; see the trace for every drop.",
            FakeGradPatchWarning,
            stacklevel=2,
        )

    def _emit(self, leaf: torch.Tensor, outcome: Outcome, start: float) -> None:
        level = trace.WARNING if outcome.action in ("drop", "error") else trace.INFO
        if not trace.enabled(level):
            return
        from . import _leaves

        trace.emit(
            "fake_grad_" + outcome.action,
            level,
            backward_id=self.backward_id(),
            **_leaves.leaf_fields(leaf),
            source=outcome.source,
            action=outcome.action,
            zero_copy=outcome.zero_copy,
            bytes=outcome.bytes_copied,
            duration_us=round((time.perf_counter() - start) * 1e6, 1),
        )

    def backward_id(self) -> int | None:
        getter = self._r.graph_task_id
        if getter is None:
            return None
        task = getter()
        return task if task >= 0 else None


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def describe(leaf: torch.Tensor) -> str:
    """``name (shape, dtype, device)`` of a leaf, for messages."""
    from . import _leaves

    name = _leaves.name_of(leaf)
    prefix = f"{name!r} " if name else ""
    return (
        f"{prefix}(shape={tuple(leaf.shape)}, dtype={str(leaf.dtype).removeprefix('torch.')}, "
        f"device={leaf.device})"
    )
