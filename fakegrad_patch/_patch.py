"""install() / uninstall(): the wrapt patch, applied lazily once torch is imported.

This module imports neither torch nor the torch-dependent modules at import time: ``import
fakegrad_patch`` before ``import torch`` registers wrapt post-import hooks and returns. The patch
is applied when ``torch`` has finished importing and ``torch._subclasses.fake_tensor`` is loaded.
"""

from __future__ import annotations

import sys
import threading
import warnings
from typing import Any

import wrapt

from . import trace
from ._errors import FakeGradError, FakeGradPatchWarning
from ._targets import FAKE_TENSOR_MODULE, FROM_REAL_TENSOR, MissingTargetError

_ATTR = FROM_REAL_TENSOR.qualname.rsplit(".", 1)[1]  # "from_real_tensor"


class _State:
    def __init__(self) -> None:
        self.wanted = False  # install() called, uninstall() not since
        self.hooks_registered = False  # wrapt post-import hooks (once per process)
        self.applied: _Applied | None = None
        self.skipped_reason: str | None = None
        self.warned: set[str] = set()


_state = _State()
_lock = threading.RLock()


def warn_once(key: str, message: str) -> None:
    """One FakeGradPatchWarning per ``key`` per process."""
    with _lock:
        if key in _state.warned:
            return
        _state.warned.add(key)
    warnings.warn(message, FakeGradPatchWarning, stacklevel=3)


def _torch_ready() -> bool:
    torch_mod = sys.modules.get("torch")
    if torch_mod is None or FAKE_TENSOR_MODULE not in sys.modules:
        return False
    spec = getattr(torch_mod, "__spec__", None)
    return not getattr(spec, "_initializing", False)


def install() -> bool:
    """Install the patch (idempotent). Returns True when it is applied now, False when it waits
    for torch to be imported or could not apply (see :func:`status`)."""
    with _lock:
        _state.wanted = True
        if _state.applied is not None:
            return True
        if _torch_ready():
            _apply_now()
        elif not _state.hooks_registered:
            _state.hooks_registered = True
            wrapt.register_post_import_hook(_on_torch_imported, "torch")
        return _state.applied is not None


def _on_torch_imported(_module: Any) -> None:
    # torch has finished importing; the fake tensor module is normally loaded by now, and if a
    # future torch stops importing it eagerly, this fires when it is imported.
    wrapt.register_post_import_hook(_on_fake_tensor_imported, FAKE_TENSOR_MODULE)


def _on_fake_tensor_imported(_module: Any) -> None:
    with _lock:
        if _state.wanted and _state.applied is None:
            _apply_now()


def _apply_now() -> None:
    """Apply, or record why not. Never raises: the host program must keep running."""
    import torch

    try:
        _state.applied = _Applied()
        _state.skipped_reason = None
    except MissingTargetError as exc:
        _skip(f"torch internals changed ({exc})", torch.__version__)
    except Exception as exc:  # never break the host
        _skip(f"unexpected {type(exc).__name__}: {exc}", torch.__version__)
    else:
        if trace.enabled(trace.INFO):
            trace.emit(
                "patch_installed",
                trace.INFO,
                torch=torch.__version__,
                target=FROM_REAL_TENSOR.dotted,
                defects=_state.applied.probes.known(),
            )


def _skip(reason: str, torch_version: str) -> None:
    _state.skipped_reason = reason
    warn_once(
        "skip",
        f"fakegrad_patch: not patching torch {torch_version}: {reason}. Upstream behaviour "
        "is unchanged (fake gradients can still reach real leaves).",
    )
    if trace.enabled(trace.WARNING):
        trace.emit("patch_skipped", trace.WARNING, torch=torch_version, reason=reason)


def uninstall() -> bool:
    """Restore the original torch function and remove every hook the patch added.

    Returns True when something was uninstalled."""
    with _lock:
        _state.wanted = False
        applied, _state.applied = _state.applied, None
    if applied is None:
        return False
    removed = applied.remove()
    if trace.enabled(trace.INFO):
        trace.emit("patch_uninstalled", trace.INFO, hooks_removed=removed)
    return True


def is_installed() -> bool:
    """True when the patch is applied to torch in this process."""
    return _state.applied is not None


def status() -> dict[str, Any]:
    """A snapshot for ``doctor`` and tests."""
    applied = _state.applied
    return {
        "wanted": _state.wanted,
        "installed": applied is not None,
        "waiting_for_torch": _state.wanted and applied is None and not _torch_ready(),
        "skipped_reason": _state.skipped_reason,
        "armed_leaves": applied.registry.armed_count() if applied else 0,
        "defects": applied.probes.known() if applied else {},
    }


def current() -> _Applied | None:
    return _state.applied


class _Applied:
    """One application of the patch: the wrapper on the converter and the objects it drives."""

    def __init__(self) -> None:
        import torch

        from . import _accumulate, _fakeleaves, _leaves, _probes, _targets

        self._torch = torch
        self.resolved = _targets.resolve_all()
        self.materializer = _accumulate.Materializer(self.resolved)
        self.probes = _probes.Probes(self.resolved)
        self.registry = _leaves.Registry(self._make_prehook, self.resolved.grad_accumulator)
        self._bypassed = _probes.bypassed
        self._d2 = _probes.D2
        self._repaired = torch.utils.weak.WeakIdKeyDictionary()
        self._fake_cls = self.resolved.fake_tensor_cls
        self._active = True
        self.fake_leaves = _fakeleaves.FakeLeaves(self)

        cls = self.resolved.converter_cls
        self._cls = cls
        self._had_own_attr = _ATTR in cls.__dict__
        wrapt.wrap_function_wrapper(cls, _ATTR, self._from_real_tensor)
        self._wrapper: Any = cls.__dict__[_ATTR]
        self._original: Any = self._wrapper.__wrapped__

    # -- the wrapper around FakeTensorConverter.from_real_tensor --------------------------------

    def _from_real_tensor(
        self, wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        fake = wrapped(*args, **kwargs)
        if not self._active or self._bypassed():
            return fake
        try:
            t = args[1] if len(args) > 1 else kwargs["t"]
            if t.requires_grad:
                self.registry.arm_tensor(t)
            if type(t) is not self._torch.Tensor:
                self._repair_d2(fake, t)
            # grad-copy fidelity (probe D4) and mirror_to_sources (issue 7)
            self.fake_leaves.on_convert(args[0] if args else kwargs["fake_mode"], t, fake)
        except Exception as exc:  # never break the host's fake computation
            self.internal_error("convert", exc)
        return fake

    def _repair_d2(self, fake: Any, source: Any) -> None:
        real = getattr(fake, "real_tensor", None)
        if real is None or fake in self._repaired:
            return
        torch = self._torch
        if not isinstance(source, torch.nn.Parameter) or source.device.type == "meta":
            return
        if self.probes.has(self._d2):
            with self.resolved.no_dispatch(), torch.no_grad():
                real.copy_(source.detach())
            if trace.enabled(trace.INFO):
                from ._leaves import leaf_fields

                trace.emit(
                    "d2_repaired",
                    trace.INFO,
                    **leaf_fields(source),
                    bytes=real.numel() * real.element_size(),
                )
        self._repaired[fake] = None

    # -- the AccumulateGrad pre-hook ------------------------------------------------------------

    def _make_prehook(self, leaf_ref: Any) -> Any:
        fake_cls = self._fake_cls

        def fakegrad_prehook(grad_outputs: tuple[Any, ...]) -> Any:
            grad = grad_outputs[0]
            if not isinstance(grad, fake_cls):
                return None  # real gradients: AccumulateGrad as usual
            leaf = leaf_ref()
            if leaf is None or not self._active:
                return None
            try:
                return self.materializer.on_fake_grad(leaf, grad)
            except FakeGradError:
                raise
            except Exception as exc:
                # Keep what the leaf had (never a FakeTensor), say so, keep backward running.
                self.internal_error("materialize", exc)
                return (None,)

        return fakegrad_prehook

    def internal_error(self, where: str, exc: BaseException) -> None:
        warn_once(
            f"internal:{where}",
            f"fakegrad_patch: internal error while handling a fake gradient ({where}): "
            f"{type(exc).__name__}: {exc}. The leaf keeps its previous gradient. Please report "
            "this with `python -m fakegrad_patch doctor` output.",
        )
        if trace.enabled(trace.ERROR):
            trace.emit(
                "internal_error", trace.ERROR, where=where, error=f"{type(exc).__name__}: {exc}"
            )

    # -- removal -------------------------------------------------------------------------------

    def remove(self) -> int:
        self._active = False
        current = self._cls.__dict__.get(_ATTR)
        if current is self._wrapper:
            if self._had_own_attr:
                setattr(self._cls, _ATTR, self._original)
            else:
                delattr(self._cls, _ATTR)
        else:
            # Somebody wrapped over us; unwinding would drop their wrapper. Ours is now inert.
            warn_once(
                "rewrapped",
                f"fakegrad_patch: {FROM_REAL_TENSOR.dotted} was re-wrapped by someone else after "
                "fakegrad_patch; leaving it in place (the fakegrad_patch layer is now inactive).",
            )
        return self.registry.disarm_all()
