"""What the installation measures at first need, not at import: whether upstream still needs
the fix (probe D1: the first backward from a propagating user mode, never inside torch's own
tracing), whether a build skips post-accumulate hooks (P1), the zero-copy test's reference counts
(calibration); and whether a fake gradient's mode can be trusted (D2 builds)."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

from ... import trace
from ..accumulate.arming import Arming
from ..accumulate.hooks import Hooks, Materializer
from ..touchpoints.probes import Probes
from ..touchpoints.targets import Resolved
from ..typing import InternalErrors, ModeTrust


class _Prepared:
    #: (arming, post-accumulate hooks skipped, zero-copy baseline): measured at first need,
    #: once per process (a later installation reuses it)
    value: tuple[bool, bool, Any] | None = None


class FirstNeed:
    """One installation's first-need preparation and the trust check of fake gradients."""

    def __init__(
        self,
        resolved: Resolved,
        probes: Probes,
        *,
        arming: Arming,
        hooks: Hooks,
        materializer: Materializer,
        trust: ModeTrust,
        installed: Callable[[], bool],
        errors: InternalErrors,
    ) -> None:
        self._resolved = resolved
        self._probes = probes
        self._arming = arming
        self._hooks = hooks
        self._materializer = materializer
        self._trust = trust
        self._installed = installed
        self._errors = errors
        self._lock = threading.Lock()
        #: None until first need; then whether upstream has D1 (True: leaves are armed)
        self.arms_leaves: bool | None = None
        #: (weak reference to the last mode found trusted, generation then, taints then)
        self._trusted: tuple[Any, int, int] | None = None

    def untrusted(self, grad: Any) -> bool:
        """Was ``grad`` computed from values the patch could not repair? Installed: the arming
        already checked its mode (a dict read here); after ``uninstall()`` (hooks that outlive
        it), a Parameter its mode converted while uninstalled taints it."""
        mode = getattr(grad, "fake_mode", None)
        if not self._installed():
            return self._trust.check_mode(mode, definite_only=True)
        # Per gradient, the mode is nearly always the one the last gradient had: its answer
        # holds until the next generation (uninstall) or a new taint (the hook's cost).
        from ..convert import unseen

        trusted = self._trusted
        if (
            trusted is not None
            and trusted[0]() is mode
            and trusted[1] == unseen.generation()
            and trusted[2] == unseen.taint_count()
        ):
            return False
        if self._trust.check_mode(mode):
            return True
        if mode is not None:
            self._trusted = (weakref.ref(mode), unseen.generation(), unseen.taint_count())
        return False

    def ready(self) -> bool:
        """Whether leaves are armed on this build (probe D1 at first need: the first backward
        from a propagating user mode, never inside torch's own tracing)."""
        arms = self.arms_leaves
        if arms is None:
            with self._lock:
                if self.arms_leaves is None:
                    prepared = _Prepared.value
                    if prepared is None:
                        prepared = _Prepared.value = self._prepare()
                    self._hooks.post_hooks_skipped = prepared[1]
                    self._materializer.baseline = prepared[2]
                    self.arms_leaves = prepared[0]
                arms = self.arms_leaves
        return arms

    def _prepare(self) -> tuple[bool, bool, Any]:
        from ..touchpoints.probes import D1, POST_HOOKS

        if not self._probes.has(D1):
            if trace.enabled(trace.INFO):
                trace.emit("standing_aside", trace.INFO, defect=D1.key)
            return (False, False, None)
        post_hooks_skipped = self._probes.has(POST_HOOKS)
        baseline = None
        try:
            baseline = self._calibrate()
        except Exception as exc:  # zero-copy stays off: every new .grad is a copy
            self._errors.internal_error("calibrate", exc)
        if trace.enabled(trace.INFO):
            trace.emit("zero_copy_calibrated", trace.INFO, enabled=baseline is not None)
        return (True, post_hooks_skipped, baseline)

    def _calibrate(self) -> Any:
        """Measure the zero-copy test's reference counts through the real hook path: once for a
        gradient nobody else holds (``(w * w).sum()``), once for one the caller keeps and autograd
        hands on unchanged (``w.clone().backward(g)``). The first is the baseline; when the second
        is not told apart from it, zero-copy stays off."""
        import torch

        from ..accumulate.hooks import AdoptBaseline
        from ..touchpoints.probes import bypass

        r = self._resolved
        arming = self._arming
        materializer = self._materializer
        with (
            r.ordinary_dispatch(),
            torch.inference_mode(False),
            r.disable_current_modes(),
            torch.enable_grad(),
            r.functorch_config.patch(fake_tensor_propagate_real_tensors=True),
            bypass(),
        ):
            leaf = torch.zeros(4, requires_grad=True)
            with r.fake_mode_cls(allow_non_fake_inputs=True):
                out = (leaf * leaf).sum()
                token = arming.arm(*arming.collect([out]))
                try:
                    with materializer.calibrating() as exclusive:
                        out.backward()
                finally:
                    arming.disarm(token)
                leaf.grad = None
                held = torch.ones(4)
                out = leaf.clone()
                token = arming.arm(*arming.collect([out]))
                try:
                    with materializer.calibrating() as shared:
                        out.backward(held)
                finally:
                    arming.disarm(token)
            del out, held
        if len(exclusive) != 1 or len(shared) != 1:
            return None
        baseline = AdoptBaseline(*exclusive[0])
        return None if baseline.admits(shared[0]) else baseline
