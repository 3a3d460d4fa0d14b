"""State an object keeps for later steps, created inside a propagating mode: FakeTensors.

An optimizer step inside the mode creates its state there (SGD's momentum buffer, Adam's
moments); a GradScaler first used inside the mode creates its scale and growth tracker there.
The object keeps them for every later step, inside the mode or not. With write-back on their
propagated values become real tensors (``optimizer_state_materialized``); a GradScaler's is
reported otherwise (an optimizer's shows as the lost update of its parameters).

The optimizer hook is registered from the first propagating user mode on, not when write-back
is turned on: TorchDynamo calls every global step post-hook where it traces an optimizer step,
and a function of ours (on its skip list) there is a graph break inside the hooks' loop, which
fails the whole frame (one frame fewer compiled under compiled autograd with optimizers stepped
in post-accumulate-grad hooks). Optimizer state is only born fake inside such a mode, which is
seen (built or converting) before that step's post-hooks run.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from ... import trace
from ..convert import leaves as _leaves
from ..touchpoints import sites as _sites
from ..touchpoints.targets import Resolved
from ..typing import InternalErrors
from .standins import report_fake_state, report_lost
from .tensors import private_copy


class BornInside:
    """One installation's handling of state objects created inside the mode."""

    def __init__(self, resolved: Resolved, errors: InternalErrors) -> None:
        self._resolved = resolved
        self._is_fake = resolved.is_fake
        self._errors = errors
        self._lock = threading.Lock()
        #: write-back on: state is made real
        self.enabled = False
        self._step_hook: Any = None

    def follow(self, enabled: bool) -> None:
        """Write-back turned on or off: the optimizer hook follows (a HookSite)."""
        register = _step_hook_registrar() if enabled else None  # import first, then lock
        with self._lock:
            if enabled == self.enabled:
                return
            self.enabled = enabled
            site, self._step_hook = self._step_hook, None
            if enabled and register is not None:
                site = self._step_hook = _sites.HookSite(register, self._after_optimizer_step)
        if site is not None:
            if enabled:
                site.start()  # outside our lock: registers now where a propagating mode lives
            else:
                site.close()

    def _after_optimizer_step(self, optimizer: Any, _args: Any, _kwargs: Any) -> None:
        """Write-back: an optimizer step made inside a propagating mode creates its state there
        (SGD's momentum buffer, Adam's moments): FakeTensors. Their propagated values become
        real tensors in the optimizer's state, so later steps (inside the mode or not) update
        real state, as in eager mode. A fake without values stays, and is reported."""
        try:
            state = optimizer.state
            for param, entries in list(state.items()):
                for key, value in list(entries.items()):
                    if not self._is_fake(value):
                        continue
                    mode = getattr(value, "fake_mode", None)
                    if not getattr(mode, "propagate_real_tensors", False):
                        continue
                    real = value.real_tensor
                    if real is None:
                        report_lost(param, f"optimizer state {key!r}", "no real values", True)
                        continue
                    with self._resolved.no_dispatch(), torch.no_grad():
                        entries[key] = private_copy(real)
                    if trace.enabled(trace.INFO):
                        trace.emit(
                            "optimizer_state_materialized",
                            trace.INFO,
                            **_leaves.leaf_fields(param),
                            key=str(key),
                            bytes=real.numel() * real.element_size(),
                        )
        except Exception as exc:  # never break the host's training step
            self._errors.internal_error("write_back", exc)

    def scaler_site(self, scaler_cls: Any) -> _sites.Site | None:
        """A :class:`_sites.Site` for ``scaler_cls.update`` (:func:`grad_scaler_class`; in place
        while a propagating user mode lives), or None where the class is absent. Imports
        nothing: called under the dispatcher's lock."""
        if scaler_cls is None:
            return None
        return _sites.function_site(
            scaler_cls,
            "update",
            self._after_scaler_update,
            "a GradScaler whose state is created inside the mode keeps FakeTensors",
        )

    def _after_scaler_update(self, wrapped: Any, scaler: Any, args: Any, kwargs: Any) -> Any:
        """``GradScaler.update``: a scaler first used inside a propagating mode created its
        scale and growth tracker there (``torch.full`` in ``scale()``): FakeTensors, which the
        scaler keeps for every later step, inside the mode or not. With write-back their
        propagated values become real tensors (``optimizer_state_materialized``, key
        ``GradScaler._scale``); otherwise the first is reported with the fix."""
        result = wrapped(*args, **kwargs)
        try:
            for key in ("_scale", "_growth_tracker"):
                value = getattr(scaler, key, None)
                if value is None or not self._is_fake(value):
                    continue
                mode = getattr(value, "fake_mode", None)
                if not getattr(mode, "propagate_real_tensors", False):
                    continue
                real = value.real_tensor
                if not self.enabled or real is None:
                    report_fake_state(f"GradScaler.{key}", value, real)
                    continue
                with self._resolved.no_dispatch(), torch.no_grad():
                    made = private_copy(real)
                setattr(scaler, key, made)
                if trace.enabled(trace.INFO):
                    trace.emit(
                        "optimizer_state_materialized",
                        trace.INFO,
                        **_leaves.leaf_fields(made),
                        key=f"GradScaler.{key}",
                        bytes=real.numel() * real.element_size(),
                    )
        except Exception as exc:  # never break the host's training step
            self._errors.internal_error("write_back", exc)
        return result


def grad_scaler_class() -> Any:
    """``torch.amp.GradScaler`` (public), or None where absent. May import: call it before
    taking a lock."""
    try:
        from torch.amp.grad_scaler import GradScaler
    except ImportError:
        return None
    return GradScaler


def _step_hook_registrar() -> Any:
    """``torch.optim.optimizer.register_optimizer_step_post_hook`` (public; every optimizer),
    or None where absent."""
    try:
        from torch.optim.optimizer import register_optimizer_step_post_hook
    except ImportError:
        return None
    return register_optimizer_step_post_hook
