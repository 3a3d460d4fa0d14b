"""install() / uninstall(): the wrapt patch, applied lazily once torch is imported.

This module imports neither torch nor the torch-dependent modules at import time: ``import
fakegrad_patch`` before ``import torch`` registers wrapt post-import hooks and returns. The patch
is applied when ``torch`` has finished importing and ``torch._subclasses.fake_tensor`` is loaded.
"""

from __future__ import annotations

import sys
import threading
import warnings
import weakref
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
        #: (arming, post-accumulate hooks skipped, zero-copy baseline): measured at first need,
        #: once per process (a build's behaviour does not change between installations)
        self.prepared: tuple[bool, bool, Any] | None = None


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
        _skip(_why_missing(exc, torch.__version__), torch.__version__)
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


def _why_missing(exc: MissingTargetError, torch_version: str) -> str:
    """Builds older than the oldest supported one lack propagation altogether: say that, not
    "internals changed"."""
    from ._targets import PROPAGATE_CONFIG, TESTED_TORCH

    release = tuple(int(p) for p in torch_version.split("+")[0].split(".")[:2] if p.isdigit())
    oldest = tuple(int(p) for p in TESTED_TORCH[0].split(".")[:2])
    if exc.target is PROPAGATE_CONFIG or (len(release) == 2 and release < oldest):
        return (
            f"torch {torch_version} is older than {TESTED_TORCH[0]}, the oldest supported (no "
            f"real-value propagation: {exc})"
        )
    return f"torch internals changed ({exc})"


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
    left = applied.remove()
    if trace.enabled(trace.INFO):
        trace.emit("patch_uninstalled", trace.INFO, hooks_removed=0, hooks_left=left)
    return True


def release_hooks() -> int:
    """Remove every armed pre-hook now (all installations); return how many were removed.

    For programs where something keeps AccumulateGrad nodes alive after the fake session
    (DistributedDataParallel holds every parameter's node for its lifetime): afterwards real
    backward passes call no code of the patch. Graphs armed before the call and backwarded after
    it get upstream behaviour (FakeTensor gradients); new graphs are armed as usual."""
    leaves = _leaves_if_loaded()
    removed = leaves.Registry.disarm_all() if leaves is not None else 0
    if trace.enabled(trace.INFO):
        trace.emit("hooks_released", trace.INFO, hooks_removed=removed)
    return removed


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
        "armed_leaves": _armed_count(),
        "defects": applied.probes.known() if applied else {},
        # None until first need (probe D1); False: upstream is fixed, the patch stands aside
        "arming": applied._arming if applied else None,
        "zero_copy": bool(applied and applied.materializer.baseline is not None),
    }


def _leaves_if_loaded() -> Any:
    """The leaf registry module, or None before any installation imported it (and torch)."""
    return sys.modules.get(__package__ + "._leaves")


def _armed_count() -> int:
    """Hooks on live AccumulateGrad nodes, armed by this or an earlier installation."""
    leaves = _leaves_if_loaded()
    return leaves.Registry.armed_count() if leaves is not None else 0


def current() -> _Applied | None:
    return _state.applied


class _Applied:
    """One application of the patch: the wrappers (converter, ``torch.autograd.backward``) and the
    objects they drive."""

    def __init__(self) -> None:
        import torch

        from . import _accumulate, _fakeleaves, _leaves, _probes, _targets

        self._torch = torch
        self.resolved = _targets.resolve_all()
        self._leaves = _leaves
        self.materializer = _accumulate.Materializer(self.resolved, on_written=_leaves.note_grad)
        self.probes = _probes.Probes(self.resolved)
        self.registry = _leaves.Registry(self._make_prehook, self.resolved.grad_accumulator)
        self._bypassed = _probes.bypassed
        self._bypass = _probes._bypass
        self._probe_defs = _probes
        #: id(real source root) -> (weak refs to it and to the fake root last seen for it, data
        #: pointer of that fake's propagated copy, source version when it was last synced): D2
        #: repair and re-sync of stale copies.
        self._synced: dict[int, tuple[Any, Any, int, int]] = {}
        self._retained: dict[int, Any] = {}
        self._is_fake = self.resolved.is_fake
        self._real_of = self.resolved.real_of
        self._active = True
        #: None until first need; then whether upstream has D1 (True: arm leaves).
        self._arming: bool | None = None
        self._post_hooks_skipped = False
        self._ready_lock = threading.Lock()
        self.fake_leaves = _fakeleaves.FakeLeaves(self)

        cls = self.resolved.converter_cls
        self._cls = cls
        self._had_own_attr = _ATTR in cls.__dict__
        wrapt.wrap_function_wrapper(cls, _ATTR, self._from_real_tensor)
        self._wrapper: Any = cls.__dict__[_ATTR]
        self._original: Any = self._wrapper.__wrapped__

        autograd = torch.autograd
        self._autograd = autograd
        wrapt.wrap_function_wrapper(autograd, "backward", self._backward)
        self._backward_wrapper: Any = autograd.backward

        from . import _ddp

        self._ddp = _ddp
        _ddp.install(self.resolved)  # never raises; DDP left to upstream when it returns False

    # -- first need: probes D1 and P1, zero-copy calibration ------------------------------------

    def arming(self) -> bool:
        """Whether leaves are armed on this build (probe D1 at first need)."""
        arming = self._arming
        if arming is None:
            with self._ready_lock:
                if self._arming is None:
                    prepared = _state.prepared
                    if prepared is None:
                        prepared = _state.prepared = self._prepare()
                    self._post_hooks_skipped = prepared[1]
                    self.materializer.baseline = prepared[2]
                    self._arming = prepared[0]
                arming = self._arming
        return arming

    def _prepare(self) -> tuple[bool, bool, Any]:
        from ._probes import D1, POST_HOOKS

        if not self.probes.has(D1):
            if trace.enabled(trace.INFO):
                trace.emit("standing_aside", trace.INFO, defect=D1.key)
            return (False, False, None)
        post_hooks_skipped = self.probes.has(POST_HOOKS)
        baseline = None
        try:
            baseline = self._calibrate()
        except Exception as exc:  # zero-copy stays off: every new .grad is a copy
            self.internal_error("calibrate", exc)
        if trace.enabled(trace.INFO):
            trace.emit("zero_copy_calibrated", trace.INFO, enabled=baseline is not None)
        return (True, post_hooks_skipped, baseline)

    def _calibrate(self) -> Any:
        """Measure the zero-copy test's reference counts through the real hook path: once for a
        gradient nobody else holds (``(w * w).sum()``), once for one the caller keeps and autograd
        hands on unchanged (``w.clone().backward(g)``). The first is the baseline; when the second
        is not told apart from it, zero-copy stays off."""
        from ._accumulate import AdoptBaseline

        torch = self._torch
        r = self.resolved
        with (
            r.ordinary_dispatch(),
            torch.inference_mode(False),
            r.disable_current_modes(),
            torch.enable_grad(),
            r.functorch_config.patch(fake_tensor_propagate_real_tensors=True),
            self._bypass(),
        ):
            leaf = torch.zeros(4, requires_grad=True)
            with r.fake_mode_cls(allow_non_fake_inputs=True):
                out = (leaf * leaf).sum()
                self.registry.arm_leaf(leaf)
                with self.materializer.calibrating() as exclusive:
                    out.backward()
                leaf.grad = None
                held = torch.ones(4)
                out = leaf.clone()
                self.registry.arm_leaf(leaf)
                with self.materializer.calibrating() as shared:
                    out.backward(held)
            del out, held
        if len(exclusive) != 1 or len(shared) != 1:
            return None
        baseline = AdoptBaseline(*exclusive[0])
        return None if baseline.admits(shared[0]) else baseline

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
                if self._arming if self._arming is not None else self.arming():
                    self.registry.arm_tensor(t)
                    if t.grad_fn is not None and t.retains_grad:
                        self._arm_retained(t)
                self._sync_values(fake, t)
            elif type(t) is not self._torch.Tensor or t._base is not None:
                self._sync_values(fake, t)  # frozen Parameters and views of Parameters (D2)
            elif self._leaves._grads and self._leaves.managed_grad(t):
                self._alias_grad(fake, t)
            # grad-copy fidelity (probe D4) and mirror_to_sources (issue 7)
            self.fake_leaves.on_convert(args[0] if args else kwargs["fake_mode"], t, fake)
        except Exception as exc:  # never break the host's fake computation
            self.internal_error("convert", exc)
        return fake

    def _sync_values(self, fake: Any, source: Any) -> None:
        """Keep the fake's propagated values equal to its real source's where upstream does not:
        on builds with D2 a converted ``nn.Parameter`` (or any view of one: it is converted
        through its base) gets uninitialised values, repaired here for the whole storage at once;
        and on every build a converter keeps the propagated copy of its first conversion (in its
        tensor memo on 2.13, through its storage memo for a new fake on 2.14: a kept graph's saved
        ``weight.t()`` holds the old buffer) even after the real tensor changed (an optimizer step
        between two graphs of one mode): re-synced when the buffer is one we synced before and the
        source's version counter moved since. No value is ever compared: O(1) per conversion
        unless a copy is due."""
        real = self._real_of(fake)
        if real is None:
            return
        root = source._base if source._base is not None else source
        if root.device.type == "meta":
            return
        key = id(root)
        fake_root = fake._base if fake._base is not None else fake
        data = real.untyped_storage().data_ptr()
        version = source._version
        entry = self._synced.get(key)
        reason: str | None = None
        if entry is not None and entry[0]() is root and entry[2] == data:
            # The same fake (tensor memo), or a new fake over the buffer we synced before (2.14's
            # storage memo keeps it while a kept graph's saved views hold it; or the allocator
            # reused a freed buffer's address: then a copy costs one pass and is still right).
            same_fake = entry[1]() is fake_root
            if same_fake and entry[3] == version:
                return  # the common case: a memo hit, nothing changed
            if not same_fake and self._d2_applies(root):
                reason = "d2"  # maybe a fresh copy at a reused address: uninitialised
            elif entry[3] != version:
                reason = "stale"
        elif self._d2_applies(root):
            reason = "d2"  # upstream just made this copy, uninitialised on builds with D2
        if reason is not None:
            self._copy_source_values(real, source, reason)
        if len(self._synced) > 4096:
            self._synced = {k: v for k, v in self._synced.items() if v[0]() is not None}
        self._synced[key] = (weakref.ref(root), weakref.ref(fake_root), data, version)

    def _d2_applies(self, root: Any) -> bool:
        return type(root) is not self._torch.Tensor and self.probes.has(self._probe_defs.D2)

    def _copy_source_values(self, real: Any, source: Any, reason: str) -> None:
        torch = self._torch
        with self.resolved.no_dispatch(), torch.no_grad():
            src_storage = source.untyped_storage()
            dst_storage = real.untyped_storage()
            if (
                src_storage.nbytes() == dst_storage.nbytes()
                and real.storage_offset() == source.storage_offset()
                and real.stride() == source.stride()
            ):
                dst_storage.copy_(src_storage)  # every alias of the source at once
            else:
                real.copy_(source.detach())
            nbytes = src_storage.nbytes()
        if trace.enabled(trace.INFO):
            from ._leaves import leaf_fields

            event = "d2_repaired" if reason == "d2" else "propagated_values_resynced"
            trace.emit(event, trace.INFO, **leaf_fields(source), bytes=nbytes)

    def _alias_grad(self, fake: Any, grad: Any) -> None:
        """``grad`` is the real ``.grad`` of a leaf the patch manages, converted by a propagating
        mode (``p.grad.zero_()``, ``clip_grad_norm_`` inside the mode): make its fake's propagated
        values the real gradient itself, so in-place changes made in the mode reach it as they
        would in eager mode (and reads see its current values)."""
        if self._real_of(fake) is None or fake.shape != grad.shape:
            return
        if fake.stride() != grad.stride() or fake.dtype != grad.dtype:
            return
        if self.resolved.op_ran_for_real() is not False:
            # ``p.grad.mul_(3)`` with all-real arguments: FakeTensorMode already ran it on the
            # real grad (upstream's constant propagation); an alias would apply it twice. Or we
            # cannot tell. Upstream semantics for this op: the fake works on a copy (a fresh one
            # if an earlier op of this mode made the alias: the converter memo returns that fake).
            if fake.real_tensor is grad:
                with self.resolved.no_dispatch():
                    fake.real_tensor = grad.clone()
            return
        if fake.real_tensor is not grad:
            fake.real_tensor = grad

    # -- real non-leaves with retain_grad() ----------------------------------------------------

    def _arm_retained(self, t: Any) -> None:
        """A real non-leaf with ``retain_grad()`` feeding the mode: its retain hook stores
        ``grad.clone()`` (or ``prior + grad``) computed on a fake gradient. A tensor hook (runs
        before it) remembers the prior real ``.grad``; a pre-hook on the same node (runs after it)
        replaces the fake ``.grad`` by its real values, or applies ``on_missing``."""
        key = id(t)
        entry = self._retained.get(key)
        if entry is not None and entry() is t:
            return
        t_ref = weakref.ref(t)
        if len(self._retained) > 4096:
            self._retained = {k: r for k, r in self._retained.items() if r() is not None}
        self._retained[key] = t_ref
        box: dict[str, Any] = {}

        def remember_prior(_grad: Any) -> None:
            tensor = t_ref()
            box["prior"] = None if tensor is None else tensor.grad

        def fix_retained(_grads: tuple[Any, ...]) -> None:
            tensor = t_ref()
            if tensor is None:
                return
            try:
                self._fix_retained(tensor, box.pop("prior", None))
            except FakeGradError:
                raise
            except Exception as exc:
                self.internal_error("retain_grad", exc)

        t.register_hook(remember_prior)
        t.grad_fn.register_prehook(fix_retained)

    def _fix_retained(self, tensor: Any, prior: Any) -> None:
        from . import _config

        grad = tensor.grad
        if grad is None or not self._is_fake(grad):
            return
        real = self._real_of(grad)
        torch = self._torch
        with self.resolved.no_dispatch(), torch.no_grad():
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
                warn_once("drop", _drop_message())

    # -- the wrapper around torch.autograd.backward ---------------------------------------------

    def _backward(
        self, wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        grad_tensors = args[1] if len(args) > 1 else kwargs.get("grad_tensors")
        if grad_tensors is None or not self._active or self._bypassed():
            with self._ddp.backward_scope():  # DDP inside a fake mode (see _ddp)
                return wrapped(*args, **kwargs)  # the common case: no gradient given
        keep: list[Any] = []
        try:
            tensors = args[0] if args else kwargs.get("tensors")
            keep = self._arm_for_fake_gradients(tensors, grad_tensors)
        except Exception as exc:  # never break the host's backward
            self.internal_error("backward", exc)
        try:
            with self._ddp.backward_scope():
                return wrapped(*args, **kwargs)
        finally:
            del keep

    def _arm_for_fake_gradients(self, tensors: Any, grad_tensors: Any) -> list[Any]:
        """Real tensors receiving fake gradients (``out.backward(fake)``,
        ``torch.autograd.backward(real, fake_grads)``): arm the leaves of their real graphs.
        Returns the AccumulateGrad nodes of leaves given directly (``leaf.backward(fake)``), which
        nothing else holds until the engine makes its graph root."""
        torch = self._torch
        grads = [grad_tensors] if isinstance(grad_tensors, torch.Tensor) else list(grad_tensors)
        if not any(g is not None and self._is_fake(g) for g in grads):
            return []
        if not self.arming():
            return []
        outs = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        keep: list[Any] = []
        for t in outs:
            if not isinstance(t, torch.Tensor) or self._is_fake(t) or not t.requires_grad:
                continue
            if t.grad_fn is None:
                node = self.resolved.grad_accumulator(t)
                if node is not None:
                    keep.append(node)
                    self.registry.arm_leaf(t, node)
            else:
                self.registry.arm_tensor(t)
                if t.retains_grad:
                    self._arm_retained(t)
        return keep

    # -- the AccumulateGrad pre-hook ------------------------------------------------------------

    def _make_prehook(self, leaf_ref: Any) -> Any:
        is_fake = self._is_fake

        def fakegrad_prehook(grad_outputs: tuple[Any, ...]) -> Any:
            grad = grad_outputs[0]
            if grad is None or not is_fake(grad):
                return None  # real gradients: AccumulateGrad as usual
            leaf = leaf_ref()
            if leaf is None or not leaf.requires_grad:
                return None  # AccumulateGrad skips a leaf that no longer requires grad
            try:
                result = self.materializer.on_fake_grad(leaf, grad)
            except (FakeGradError, FakeGradPatchWarning):
                raise  # on_missing="error", or the user's warnings filter (-W error)
            except Exception as exc:
                # Keep what the leaf had (never a FakeTensor), say so, keep backward running.
                self.internal_error("materialize", exc)
                return (None,)
            if result is not None and self._post_hooks_skipped:
                self._run_post_accumulate_hooks(leaf)
            return result

        return fakegrad_prehook

    def _run_post_accumulate_hooks(self, leaf: Any) -> None:
        """Probe P1 found that this build skips them once our pre-hook returned ``(None,)``."""
        hooks = self.resolved.post_accumulate_hooks(leaf)
        if hooks:
            for hook in tuple(hooks.values()):
                hook(leaf)

    def internal_error(self, where: str, exc: BaseException) -> None:
        if trace.enabled(trace.ERROR):
            trace.emit(
                "internal_error", trace.ERROR, where=where, error=f"{type(exc).__name__}: {exc}"
            )
        warn_once(
            f"internal:{where}",
            f"fakegrad_patch: internal error while handling a fake gradient ({where}): "
            f"{type(exc).__name__}: {exc}. The leaf keeps its previous gradient. Please report "
            "this with `python -m fakegrad_patch doctor` output.",
        )

    # -- removal -------------------------------------------------------------------------------

    def remove(self) -> int:
        """Unwrap both functions. Hooks already armed stay: their graphs finish with real
        gradients (see _leaves). Returns how many armed hooks are left to finish."""
        self._active = False
        self._ddp.remove()
        self._unwrap(self._cls, _ATTR, self._wrapper, self._original, self._had_own_attr)
        self._unwrap(self._autograd, "backward", self._backward_wrapper, None, True)
        return self.registry.armed_count()

    def _unwrap(self, owner: Any, attr: str, wrapper: Any, original: Any, had_own: bool) -> None:
        current = owner.__dict__.get(attr)
        if current is wrapper:
            if original is None:
                original = wrapper.__wrapped__
            if had_own:
                setattr(owner, attr, original)
            else:
                delattr(owner, attr)
        else:
            # Somebody wrapped over us; unwinding would drop their wrapper. Ours is now inert.
            warn_once(
                f"rewrapped:{attr}",
                f"fakegrad_patch: {getattr(owner, '__name__', owner)}.{attr} was re-wrapped by "
                "someone else after fakegrad_patch; leaving it in place (the fakegrad_patch "
                "layer is now inactive).",
            )


def _drop_message() -> str:
    from ._accumulate import _DROP_MESSAGE

    return _DROP_MESSAGE
