"""The materialize/accumulate rule: do with real values what AccumulateGrad does with real grads.

Called from the pre-hook we put on a real leaf's AccumulateGrad node when a FakeTensor gradient
arrives. We write the real ``.grad`` ourselves (with every dispatch mode disabled, because
AccumulateGrad runs with the fake mode still active) and hand AccumulateGrad an undefined gradient
so it does nothing more. AccumulateGrad still runs the leaf's post-accumulate hooks afterwards, so
they observe the real ``.grad``.

Real work runs under ``no_dispatch`` (every Python dispatch key excluded), so neither the fake
mode nor any other mode stacked with it (FlopCounterMode) sees it. The zero-copy set path runs no
op at all (attribute reads, reference counts, the ``.grad`` setter) and is taken before the guard.

The rule, from ``torch/csrc/autograd/functions/accumulate_grad.h`` (``accumulateGrad``):

* no prior grad: take the new buffer over when nothing else references it and it obeys the layout
  contract (zero copies); otherwise copy it into a tensor shaped like the leaf (``empty_strided``
  with the leaf's strides when the leaf is non-overlapping and dense, contiguous otherwise);
* prior grad, grad mode off: add in place (the same tensor object stays in ``.grad``);
* prior grad, grad mode on (``create_graph=True``): ``prior + new`` out of place.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ... import _config, trace
from ..._errors import FakeGradError, FakeGradPatchWarning
from ..convert import leaves as _leaves
from ..convert import lending as _lending
from ..state import warn_once
from ..touchpoints.targets import Resolved
from ..typing import InternalErrors
from ..weak import WeakIdTable
from . import profiling as _profiling


def is_non_overlapping_and_dense(t: torch.Tensor) -> bool:
    """Python port of c10's ``compute_non_overlapping_and_dense``."""
    if t.layout != torch.strided:
        return False
    sizes, strides = t.shape, t.stride()
    if t.dim() == 1:
        return sizes[0] < 2 or strides[0] == 1
    # c10 sorts the dimensions by stride, those of size 0 or 1 last, and answers true at the
    # first of those: only the dimensions of size 2 or more are checked (an empty tensor too)
    expected = 1
    for d in sorted((d for d in range(t.dim()) if sizes[d] >= 2), key=lambda d: strides[d]):
        if strides[d] != expected:
            return False
        expected *= sizes[d]
    return True


def obeys_layout_contract(grad: torch.Tensor, leaf: torch.Tensor) -> bool:
    """AccumulateGrad's ``obeys_layout_contract`` (strided tensors)."""
    if grad.layout != torch.strided or leaf.layout != torch.strided:
        return False
    if leaf.is_contiguous() and grad.is_contiguous() and 0 not in grad.stride() and grad.numel():
        # the common case, decided by two C calls (both dense, same strides); an empty tensor
        # is contiguous whatever its strides, which the contract still compares
        return True
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
    source: str  # "propagated" | "real" | "zeros" | "meta" | "none"
    zero_copy: bool = False
    bytes_copied: int = 0


#: the set path's outcomes, made once (a frozen dataclass costs ~1 us to build per gradient)
_ZERO_COPY = {
    source: Outcome("set", source, zero_copy=True) for source in ("propagated", "zeros", "meta")
}


@dataclass(frozen=True)
class AdoptBaseline:
    """Reference counts seen on the zero-copy test for a gradient that provably nobody else
    holds: the fake gradient autograd hands to AccumulateGrad (TensorImpl uses, Python references)
    and its propagated buffer (TensorImpl uses, Python references). Measured by a calibration probe
    through the real hook path on the running build and Python (``FirstNeed._calibrate``), never
    assumed: anything above these means someone else can see the gradient or the buffer, and we
    copy. Like AccumulateGrad (``is_tensor_stealable``), storage shared by a view is not a reason
    to copy: the propagated computation aliases exactly where the eager one does."""

    fake_uses: int
    fake_refs: int
    real_uses: int
    real_refs: int

    def admits(self, counts: tuple[int, int, int, int]) -> bool:
        return (
            counts[0] <= self.fake_uses
            and counts[1] <= self.fake_refs
            and counts[2] <= self.real_uses
            and counts[3] <= self.real_refs
        )


_UNTRUSTED_MESSAGE = (
    "fakegrad_patch: fake gradients computed from propagated values the patch could not repair "
    "reached real leaves (their FakeTensorMode converted nn.Parameters while the patch was not "
    "installed, on a torch with defect D2: those values are uninitialised memory); they were "
    "handled as gradients without real values (on_missing) instead of being written. Install "
    "the patch before the mode converts anything, or use a fresh mode. Shown once per process; "
    "every case is a trace event with source='untrusted'."
)

_DROP_MESSAGE = (
    "fakegrad_patch: FakeTensor gradients without real values reached real leaves; they were "
    "dropped (on_missing='drop') and the leaves keep their previous .grad. Turn on "
    "torch._functorch.config.fake_tensor_propagate_real_tensors to get real gradients. Shown once "
    "per process; every drop is a fake_grad_drop trace event."
)


class Materializer:
    """Applies the rule. One instance per installation, holding the resolved touch points.

    ``adopt=False`` turns the zero-copy set path off (every new ``.grad`` is a copy), for callers
    whose propagated buffers stay referenced elsewhere (mirroring onto real sources).
    ``note_grads=True``: every real ``.grad`` written is noted in the managed-gradient registry
    (:func:`_leaves.note_grad`: the grads it manages stay in sync with in-place changes made
    inside the mode).
    """

    def __init__(
        self,
        resolved: Resolved,
        *,
        adopt: bool = True,
        note_grads: bool = False,
        untrusted: Any = None,
    ) -> None:
        self._resolved = resolved
        self._adopt = adopt
        self._note_grads = note_grads
        #: ``untrusted(grad)``: True when the fake gradient was computed from propagated values
        #: the patch could not vouch for (see convert/unseen.py); None: never.
        self._untrusted = untrusted
        #: None until calibrated (and forever if calibration failed): the set path then copies.
        self.baseline: AdoptBaseline | None = None
        self._use_count = resolved.tensor_use_count
        self._calibration = threading.local()

    # -- calibration (see AdoptBaseline) -------------------------------------------------------

    @contextlib.contextmanager
    def calibrating(self) -> Iterator[list[tuple[int, int, int, int]]]:
        """Inside the block (this thread), the zero-copy test records its counts into the yielded
        list and refuses (so the probe's gradients are copies) and nothing is traced."""
        seen: list[tuple[int, int, int, int]] = []
        self._calibration.seen = seen
        try:
            yield seen
        finally:
            self._calibration.seen = None

    # -- entry point from the AccumulateGrad pre-hook ------------------------------------------

    def on_fake_grad(self, leaf: torch.Tensor, grad: Any) -> tuple[None] | None:
        """Handle a FakeTensor ``grad`` about to be accumulated into real ``leaf``.

        Returns ``(None,)`` when we wrote ``leaf.grad`` ourselves (AccumulateGrad then sees an
        undefined gradient and leaves ``.grad`` alone) and ``None`` to let AccumulateGrad run as
        upstream does (policy ``keep``).
        """
        start = time.perf_counter()
        if not self._resolved.is_fake(grad):
            # A real gradient (a real ``grad_tensors`` passed on unchanged: ``(x + y).backward(g)``
            # inside the ``with`` block) while a fake mode is on the stack: AccumulateGrad's own
            # clone (or in-place add into a prior .grad) would be dispatched to that mode, giving
            # a FakeTensor ``.grad`` (or adding into a fake copy). Written as AccumulateGrad would
            # with no mode: its values, copied.
            outcome = self._write(leaf, grad, None, grad.dtype, "real")
        elif leaf.is_meta:
            # Shape-only analysis: a meta leaf has no data, so its gradient needs none either.
            # Upstream gives it a (fake) meta gradient; eager on meta gives a real meta one.
            with self._resolved.no_dispatch(), torch.no_grad():
                value = _empty_grad_for(leaf, grad)
            outcome = self._write(leaf, value, None, grad.dtype, "meta", fresh=True)
        else:
            real = self._resolved.real_of(grad)
            if real is None:
                if left_to_upstream(grad):
                    return None  # no real values exist in this mode: upstream's
                outcome = self._missing(leaf, grad, start, "none")
            elif self._untrusted is not None and self._untrusted(grad):
                outcome = self._missing(leaf, grad, start, "untrusted")
            else:
                outcome = self._write(leaf, real, grad, grad.dtype, "propagated")
        self._emit(leaf, outcome, start)
        if outcome.action == "drop":
            # after the event: a user's ``-W error`` turns the warning into an exception, which
            # must not lose the record
            if outcome.source == "untrusted":
                warn_once("untrusted", _UNTRUSTED_MESSAGE)
            else:
                warn_once("drop", _DROP_MESSAGE)
        return None if outcome.action == "keep" else (None,)

    def _missing(self, leaf: torch.Tensor, grad: Any, start: float, why: str) -> Outcome:
        """No real values to write (``why="none"``), or values the patch cannot vouch for
        (``"untrusted"``): the ``on_missing`` policy."""
        policy = _config.current().on_missing
        if policy == "keep":
            return Outcome("keep", why)
        if policy == "zeros":
            with self._resolved.no_dispatch(), torch.no_grad():
                zeros = _empty_grad_for(leaf, grad).zero_()
            return self._write(leaf, zeros, None, grad.dtype, "zeros", fresh=True)
        if policy == "error":
            self._emit(leaf, Outcome("error", why), start)
            if why == "untrusted":
                raise FakeGradError(
                    f"fakegrad_patch: the fake gradient of real leaf {describe(leaf)} was "
                    "computed from propagated values the patch could not repair (its mode "
                    "converted parameters while the patch was not installed, on a torch with "
                    "defect D2); the leaf keeps its previous .grad. Install the patch before "
                    "the FakeTensorMode converts anything, or use a fresh mode."
                )
            raise FakeGradError(
                "fakegrad_patch: a FakeTensor gradient without real values reached a real "
                f"leaf {describe(leaf)}; the leaf keeps its previous .grad. Enable real-value "
                "propagation (torch._functorch.config.fake_tensor_propagate_real_tensors = "
                "True) before creating the FakeTensorMode, or choose another on_missing "
                "policy (fakegrad_patch.configure(on_missing=...) / FAKEGRAD_ON_MISSING)."
            )
        return Outcome("drop", why)  # traced, then warned once per process, by the caller

    # -- the rule -----------------------------------------------------------------------------

    def _write(
        self,
        leaf: torch.Tensor,
        value: torch.Tensor,
        grad: Any,
        grad_dtype: torch.dtype,
        source: str,
        *,
        fresh: bool = False,
    ) -> Outcome:
        # The common case, a first gradient nobody else holds (the set path's cost):
        # the test and the assignment run no op (attribute reads, reference counts, the
        # ``.grad`` setter's own checks), so neither the dispatch guard nor no_grad is needed.
        # This is the only place the zero-copy test runs: the calibration probe takes this same
        # path, so the reference counts it measured are the ones seen here (one frame deeper,
        # every count is one higher and the baseline means nothing). When it refuses, the
        # guarded path below copies.
        if (
            self._adopt
            and grad is not None
            and leaf.grad is None
            and self._can_adopt(value, leaf, grad_dtype, grad)
        ):
            leaf.grad = value
            if self._note_grads:
                _leaves.note_written(leaf, value)
            return _ZERO_COPY.get(source) or Outcome("set", source, zero_copy=True)
        # Grad mode is on inside backward only with create_graph=True; then our own ops must not
        # be recorded (AccumulateGrad records ``prior + new`` only, which we do below).
        if torch.is_grad_enabled():
            with self._resolved.no_dispatch(), torch.no_grad():
                outcome = self._write_unguarded(leaf, value, grad_dtype, source, fresh, True)
        else:
            with self._resolved.no_dispatch():
                outcome = self._write_unguarded(leaf, value, grad_dtype, source, fresh, False)
        if self._note_grads:
            _leaves.note_grad(leaf)
        return outcome

    def _write_unguarded(
        self,
        leaf: torch.Tensor,
        value: torch.Tensor,
        grad_dtype: torch.dtype,
        source: str,
        fresh: bool,
        create_graph: bool,
    ) -> Outcome:
        prior = leaf.grad
        if prior is not None and self._resolved.is_fake(prior):
            # Left by policy "keep" or by an unpatched run: its real values (if any) count.
            prior_real = self._resolved.real_of(prior)
            prior = None
            leaf.grad = None
            if prior_real is not None:
                leaf.grad = _fresh_copy(prior_real, leaf, grad_dtype)
                prior = leaf.grad
        sparse = value.layout != torch.strided
        if prior is None:
            if sparse:
                # AccumulateGrad clones sparse gradients unless it can prove its indices and
                # values unshared; a clone is always right.
                leaf.grad = value.to(device=leaf.device, dtype=grad_dtype, copy=True)
                return Outcome("set", source, bytes_copied=_nbytes(value))
            if fresh:  # a buffer made for this leaf (zeros, meta): nobody else holds it
                leaf.grad = value
                return _ZERO_COPY.get(source) or Outcome("set", source, zero_copy=True)
            leaf.grad = _fresh_copy(value, leaf, grad_dtype)
            return Outcome("set", source, bytes_copied=_nbytes(value))
        copied = 0
        if value.device != prior.device or value.dtype != prior.dtype:
            value = value.to(device=prior.device, dtype=prior.dtype)
            copied = _nbytes(value)
        if create_graph or (prior.layout != torch.strided and not sparse):
            # out of place: double backward, or a sparse prior meeting a dense gradient
            leaf.grad = value + prior if prior.layout != torch.strided else prior + value
        else:
            prior.add_(value)
        return Outcome("accumulate", source, bytes_copied=copied)

    def _can_adopt(
        self, value: torch.Tensor, leaf: torch.Tensor, dtype: torch.dtype, grad: Any
    ) -> bool:
        """May ``value`` become ``leaf.grad`` as is? AccumulateGrad's own test
        (``is_tensor_stealable`` on the gradient it is handed) applied to the fake gradient *and*
        to its propagated buffer: device, dtype and layout contract already match, and nobody but
        the fake gradient autograd hands us holds either (reference counts no higher than the
        calibrated baseline). Anything unproven: copy."""
        if not (
            type(value) is torch.Tensor
            and value.device == leaf.device
            and value.dtype == dtype
            and value.shape == leaf.shape
            and not value.requires_grad
            and obeys_layout_contract(value, leaf)
        ):
            return False
        if _lending.any_lent() and _lending.is_lent(value.untyped_storage()):
            return False  # a parameter's own bytes, lent (convert/lending.py): never adopted
        seen = getattr(self._calibration, "seen", None)
        baseline = self.baseline
        if baseline is None and seen is None:
            return False
        use_count = self._use_count
        if seen is not None:
            seen.append(
                (use_count(grad), sys.getrefcount(grad), use_count(value), sys.getrefcount(value))
            )
            return False
        assert baseline is not None
        return (
            use_count(grad) <= baseline.fake_uses
            and sys.getrefcount(grad) <= baseline.fake_refs
            and use_count(value) <= baseline.real_uses
            and sys.getrefcount(value) <= baseline.real_refs
        )

    # -- reporting ----------------------------------------------------------------------------

    def _emit(self, leaf: torch.Tensor, outcome: Outcome, start: float) -> None:
        level = trace.WARNING if outcome.action in ("drop", "error") else trace.INFO
        if not trace.enabled(level):
            return
        # the interception's own time: describing it (below) is the trace's cost (P13), not its
        duration_us = round((time.perf_counter() - start) * 1e6, 1)
        if getattr(self._calibration, "seen", None) is not None:
            return  # the calibration probe's own leaf
        fields = _leaves.leaf_fields(leaf)
        fields["backward_id"] = self.backward_id()
        fields["source"] = outcome.source
        fields["action"] = outcome.action
        fields["zero_copy"] = outcome.zero_copy
        fields["bytes"] = outcome.bytes_copied
        fields["duration_us"] = duration_us
        trace.emit_fields("fake_grad_" + outcome.action, level, fields, owned=True)

    def backward_id(self) -> int | None:
        getter = self._resolved.graph_task_id
        if getter is None:
            return None
        task = getter()
        return task if task >= 0 else None


def _fresh_copy(value: torch.Tensor, leaf: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A new gradient for ``leaf`` with ``value``'s values, laid out as AccumulateGrad would."""
    if value.layout != torch.strided or leaf.layout != torch.strided:
        return value.to(device=leaf.device, dtype=dtype, copy=True)
    out = empty_like_contract(leaf, dtype)
    out.copy_(value)
    return out


class Hooks:
    """The AccumulateGrad pre-hook and the retained-non-leaf fix of one installation."""

    def __init__(
        self, resolved: Resolved, materializer: Materializer, errors: InternalErrors
    ) -> None:
        self._resolved = resolved
        self._materializer = materializer
        self._errors = errors
        #: real non-leaves with retain_grad() whose hooks are in place
        self._retained: WeakIdTable[bool] = WeakIdTable()
        #: set at first need (probe P1): run post-accumulate hooks ourselves
        self.post_hooks_skipped = False
        #: leaf -> its pre-hook, made at the leaf's first arming and reused by every later one
        #: (no closure, weak reference or lock lookup per leaf per backward)
        self._prehooks: WeakIdTable[Any] = WeakIdTable()

    def prehooks_for(self, leaves: list[torch.Tensor]) -> list[Any]:
        """Each leaf's pre-hook: the same function object for every backward call that arms it
        (held weakly by the leaf's entry, so it goes with the leaf). One call per armed backward
        (no Python frame per leaf)."""
        hooks = self._prehooks.get_many(leaves)
        for i, hook in enumerate(hooks):
            if hook is None:
                leaf = leaves[i]
                hooks[i] = hook = self.make_prehook(leaf)
                self._prehooks.set(leaf, hook)
        return hooks

    def make_prehook(self, leaf: torch.Tensor) -> Any:
        """The pre-hook for ``leaf``'s AccumulateGrad node. It holds the leaf weakly and writes
        under the leaf's own lock (as ``AccumulateGrad::apply`` holds its node's mutex)."""
        is_fake = self._resolved.is_fake
        tracing = self._resolved.torch_is_tracing
        fake_mode = self._resolved.current_fake_mode
        materializer, errors = self._materializer, self._errors
        leaf_ref = weakref.ref(leaf)
        lock = _leaves.leaf_lock(leaf)

        def fakegrad_prehook(grad_outputs: tuple[Any, ...]) -> Any:
            grad = grad_outputs[0]
            if grad is None:
                return None
            if not is_fake(grad) and (fake_mode is None or fake_mode() is None):
                return None  # real gradients, no fake mode on the stack: AccumulateGrad's own
            leaf = leaf_ref()
            if leaf is None or not leaf.requires_grad:
                return None  # AccumulateGrad skips a leaf that no longer requires grad
            if tracing():
                return None  # a compiled-autograd trace or a functorch transform: torch's own
            # a torch.profiler range while one records (one ~0.03 us check otherwise)
            span = (
                _profiling.begin(_profiling.materialize_name(_leaves.name_of(leaf)))
                if _profiling.recording()
                else None
            )
            try:
                try:
                    with lock:
                        result = materializer.on_fake_grad(leaf, grad)
                except (FakeGradError, FakeGradPatchWarning):
                    raise  # on_missing="error", or the user's warnings filter (-W error)
                except Exception as exc:
                    # Keep what the leaf had (never a FakeTensor), say so, keep backward running.
                    errors.internal_error("materialize", exc)
                    return (None,)
                if result is not None and self.post_hooks_skipped:
                    hooks = self._resolved.post_accumulate_hooks(leaf)
                    if hooks:  # probe P1: this build skips them once our pre-hook returned (None,)
                        for hook in tuple(hooks.values()):
                            hook(leaf)
                return result
            finally:
                if span is not None:
                    _profiling.end(span)

        return fakegrad_prehook

    def arm_retained(self, t: torch.Tensor) -> None:
        """A real non-leaf with ``retain_grad()`` feeding the mode: its retain hook stores
        ``grad.clone()`` (or ``prior + grad``) computed on a fake gradient. A tensor hook (runs
        before it) remembers the prior real ``.grad``; a pre-hook on the same node (runs after it)
        replaces the fake ``.grad`` by its real values, or applies ``on_missing``. They live as
        long as the tensor's node."""
        if t in self._retained:
            return
        self._retained.set(t, True)
        t_ref = weakref.ref(t)
        box: dict[str, Any] = {}
        fix = self.fix_retained

        def remember_prior(_grad: Any) -> None:
            tensor = t_ref()
            box["prior"] = None if tensor is None else tensor.grad

        def fix_retained(_grads: tuple[Any, ...]) -> None:
            tensor = t_ref()
            if tensor is not None:
                fix(tensor, box.pop("prior", None))

        t.register_hook(remember_prior)
        t.grad_fn.register_prehook(fix_retained)  # type: ignore[union-attr]

    def fix_retained(self, tensor: torch.Tensor, prior: Any) -> None:
        """After a real non-leaf's retain hook stored a fake ``.grad``: its real values, or the
        ``on_missing`` policy (``prior``: the real ``.grad`` it had before)."""
        try:
            with _leaves.leaf_lock(tensor):
                self._fix_retained(tensor, prior)
        except FakeGradError:
            raise
        except Exception as exc:
            self._errors.internal_error("retain_grad", exc)

    def _fix_retained(self, tensor: torch.Tensor, prior: Any) -> None:
        grad = tensor.grad
        if grad is None or not self._resolved.is_fake(grad):
            return
        real = self._resolved.real_of(grad)
        if real is None and left_to_upstream(grad):
            return  # upstream's behaviour where no real values exist
        with self._resolved.no_dispatch(), torch.no_grad():
            if real is not None:
                tensor.grad = real  # a fresh clone (or sum) the retain hook made: ours alone
                return
            policy = _config.current().on_missing
            if policy == "keep":
                return
            if policy == "error":
                tensor.grad = prior
                raise FakeGradError(
                    "fakegrad_patch: a FakeTensor gradient without real values reached a real "
                    "non-leaf with retain_grad(); it keeps its previous .grad."
                )
            if policy == "zeros":
                zeros = torch.zeros(grad.shape, dtype=grad.dtype, device=tensor.device)
                tensor.grad = zeros if prior is None else prior + zeros
            else:
                tensor.grad = prior
                warn_once("drop", _DROP_MESSAGE)


def left_to_upstream(grad: Any) -> bool:
    """A fake gradient without real values is upstream's (never touched) when its mode does not
    propagate real values and ``on_missing`` was not set explicitly."""
    if _config.current().on_missing_explicit:
        return False
    return not getattr(getattr(grad, "fake_mode", None), "propagate_real_tensors", False)


def _empty_grad_for(leaf: torch.Tensor, grad: Any) -> torch.Tensor:
    """An uninitialised gradient buffer for ``leaf`` on its device, in the gradient's dtype:
    obeying the layout contract when both are strided, else of the gradient's shape."""
    if grad.layout == torch.strided and leaf.layout == torch.strided:
        return empty_like_contract(leaf, grad.dtype)
    return torch.empty(grad.shape, dtype=grad.dtype, device=leaf.device)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def describe(leaf: torch.Tensor) -> str:
    """``name (shape, dtype, device)`` of a leaf, for messages."""
    from ..convert import leaves as _leaves

    name = _leaves.name_of(leaf)
    prefix = f"{name!r} " if name else ""
    return (
        f"{prefix}(shape={tuple(leaf.shape)}, dtype={str(leaf.dtype).removeprefix('torch.')}, "
        f"device={leaf.device})"
    )
