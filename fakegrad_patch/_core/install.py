"""install() / uninstall() / configure() / patched(): the wrapt patch, applied lazily once torch
is imported, and the settings it follows.

This module imports neither torch nor the torch-dependent modules at import time: ``import
fakegrad_patch`` before ``import torch`` registers wrapt post-import hooks and returns. The patch
is applied when ``torch`` has finished importing and ``torch._subclasses.fake_tensor`` is loaded.
Without wrapt (a required dependency) it still imports: ``install()`` warns once, traces why and
leaves torch untouched, so ``doctor`` can say so and the trace reader works.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import weakref
from collections.abc import Iterator
from typing import Any

try:
    import wrapt
except ModuleNotFoundError as _exc:  # never break the host: refuse to patch, say why
    if _exc.name != "wrapt":
        raise
    wrapt = None  # type: ignore[assignment]
    _WRAPT_MISSING: ModuleNotFoundError | None = _exc
else:
    _WRAPT_MISSING = None

from .. import _config, trace
from .state import set_current, warn_once
from .touchpoints.targets import FAKE_TENSOR_MODULE, FROM_REAL_TENSOR, MissingTargetError

_ATTR = FROM_REAL_TENSOR.qualname.rsplit(".", 1)[1]  # "from_real_tensor"


class _State:
    def __init__(self) -> None:
        self.wanted = False  # install() called, uninstall() not since
        self.hooks_registered = False  # wrapt post-import hooks (once per process)
        self.applied: _Applied | None = None
        self.skipped_reason: str | None = None
        #: (arming, post-accumulate hooks skipped, zero-copy baseline): measured at first need,
        #: once per process (a build's behaviour does not change between installations)
        self.prepared: tuple[bool, bool, Any] | None = None
        #: fakegrad_patch's frames registered with TorchDynamo's skip list (once per process)
        self.dynamo_skip = False
        #: the thread applying or removing the patch now (one at a time: :func:`_converge`)
        self.busy: int | None = None
        #: the fake tensor module's post-import hook fired: the patch may be applied although
        #: torch's own import may still be under way
        self.fake_tensor_loaded = False
        #: installations removed so far (uninstall() says whether its call removed one)
        self.removals = 0


_state = _State()
#: Guards the fields of ``_state``, and only them: held to read or publish them, never while
#: importing, resolving a target, wrapping or calling out (issue 40). The work itself runs
#: under ``_state.busy`` (a token, not a lock): post-import hooks never wait for it.
_lock = threading.RLock()
_idle = threading.Condition(_lock)  # notified when ``busy`` is given back


def _torch_ready() -> bool:
    torch_mod = sys.modules.get("torch")
    if torch_mod is None or FAKE_TENSOR_MODULE not in sys.modules:
        return False
    spec = getattr(torch_mod, "__spec__", None)
    return not getattr(spec, "_initializing", False)


_NO_WRAPT = "wrapt is not installed; not patching"


def install() -> bool:
    """Install the patch (idempotent). Returns True when it is applied now, False when it waits
    for torch to be imported or could not apply (see :func:`status`)."""
    if wrapt is None:
        return _refuse_without_wrapt()
    with _lock:
        _state.wanted = True
        if _state.applied is not None and _state.busy is None:
            return True
        register = not _state.hooks_registered and not _torch_ready()
        _state.hooks_registered = _state.hooks_registered or register
    if register:
        # outside our lock: wrapt calls the hook at once when torch is imported (or importing)
        wrapt.register_post_import_hook(_on_torch_imported, "torch")
    _converge(wait=True)
    return _state.applied is not None


def _refuse_without_wrapt() -> bool:
    with _lock:
        _state.wanted = True
        first = _state.skipped_reason is None
        _state.skipped_reason = _NO_WRAPT
    if first:
        torch_mod = sys.modules.get("torch")
        version = str(getattr(torch_mod, "__version__", "not imported"))
        warn_once(
            "skip",
            f"fakegrad_patch: {_NO_WRAPT} ({_WRAPT_MISSING}). Upstream behaviour is unchanged "
            "(fake gradients can still reach real leaves); pip install wrapt.",
            stacklevel=4,
        )
        if trace.enabled(trace.WARNING):
            trace.emit("patch_skipped", trace.WARNING, torch=version, reason=_NO_WRAPT)
    return False


def _on_torch_imported(_module: Any) -> None:
    # torch has finished importing; the fake tensor module is normally loaded by now, and if a
    # future torch stops importing it eagerly, this fires when it is imported.
    wrapt.register_post_import_hook(_on_fake_tensor_imported, FAKE_TENSOR_MODULE)


def _on_fake_tensor_imported(_module: Any) -> None:
    # A post-import hook: it runs inside an import, holding that module's import lock (and
    # torch's while torch itself imports). It never waits for a thread applying or removing
    # the patch (which may be waiting for that very import): that thread re-reads the state
    # before it stops, and applies the patch then.
    with _lock:
        _state.fake_tensor_loaded = True
    _converge(wait=False)


def _converge(*, wait: bool) -> None:
    """Bring the patch in line with ``_state.wanted``: apply it or remove it. Raises only what
    the work lets through (a warning made an error by ``-W error``).

    One thread at a time does the work (``_state.busy``), outside ``_lock``: applying imports
    torch's modules and resolves targets, and may wait for another thread's import of one of
    them, so no lock of ours may be held then. A thread that finds the work taken waits for it
    (``wait``: ``install()``/``uninstall()``, holding no lock of ours) or leaves it to that
    thread (post-import hooks: they hold the import locks of their module), which re-reads
    ``wanted`` before it stops: two concurrent ``install()`` calls apply once, and no request
    is lost."""
    me = threading.get_ident()
    with _lock:
        while _state.busy is not None:
            if not wait or _state.busy == me:
                return  # the busy thread (maybe this one, further up) re-reads the state
            _idle.wait()
        _state.busy = me
    failed = False
    try:
        while True:
            removing = None
            with _lock:
                if not _state.wanted and _state.applied is not None:
                    removing, _state.applied = _state.applied, None
                    set_current(None)
                elif not (
                    _state.wanted
                    and _state.applied is None
                    and not failed
                    and (_state.fake_tensor_loaded or _torch_ready())
                ):
                    _state.busy = None
                    _idle.notify_all()
                    return
            if removing is not None:
                _remove(removing)
            else:
                failed = not _apply()
    except BaseException:
        with _lock:
            _state.busy = None
            _idle.notify_all()
        raise


def _apply() -> bool:
    """Apply, publish and trace; or record why not. Never raises: the host program must keep
    running. Called by the busy thread, holding no lock of ours (the work imports)."""
    import torch

    version = torch.__version__
    try:
        applied = _Applied()
    except MissingTargetError as exc:
        _skip(_why_missing(exc, version), version)
        return False
    except Exception as exc:  # never break the host
        _skip(f"unexpected {type(exc).__name__}: {exc}", version)
        return False
    with _lock:
        _state.applied = applied
        set_current(applied)
        _state.skipped_reason = None
    if trace.enabled(trace.INFO):
        trace.emit(
            "patch_installed",
            trace.INFO,
            torch=version,
            target=FROM_REAL_TENSOR.dotted,
            defects=applied.probes.known(),
        )
    return True


def _remove(applied: _Applied) -> None:
    """Take an installation off (already unpublished) and trace it. Called by the busy
    thread, holding no lock of ours."""
    left = applied.remove()
    with _lock:
        _state.removals += 1
    if trace.enabled(trace.INFO):
        trace.emit("patch_uninstalled", trace.INFO, hooks_removed=0, hooks_left=left)


def _why_missing(exc: MissingTargetError, torch_version: str) -> str:
    """Builds older than the oldest supported one lack propagation altogether: say that, not
    "internals changed"."""
    from .touchpoints.targets import PROPAGATE_CONFIG, TESTED_TORCH

    release = tuple(int(p) for p in torch_version.split("+")[0].split(".")[:2] if p.isdigit())
    oldest = tuple(int(p) for p in TESTED_TORCH[0].split(".")[:2])
    if exc.target is PROPAGATE_CONFIG or (len(release) == 2 and release < oldest):
        return (
            f"torch {torch_version} is older than {TESTED_TORCH[0]}, the oldest supported (no "
            f"real-value propagation: {exc})"
        )
    return f"torch internals changed ({exc})"


def _skip(reason: str, torch_version: str) -> None:
    with _lock:
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
        had = _state.applied is not None
        removals = _state.removals
    _converge(wait=True)
    return had or _state.removals > removals


def release_hooks() -> int:
    """Remove every hook of the patch still on a live AccumulateGrad node; return how many.

    Hooks are armed for one backward call and removed when it returns, so normally there is
    nothing to release. What can remain: hooks armed by ``uninstall()`` for graphs built while
    the patch was installed (they die with their graph), and the hooks of backward calls running
    in other threads right now (those then finish with upstream behaviour)."""
    arming = sys.modules.get(__package__ + ".accumulate.arming")
    removed = arming.release_all() if arming is not None else 0
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
        "waiting_for_torch": (
            _state.wanted and applied is None and wrapt is not None and not _torch_ready()
        ),
        "skipped_reason": _state.skipped_reason,
        "armed_leaves": _armed_count(),
        "defects": applied.probes.known() if applied else {},
        # None until first need (probe D1); False: upstream is fixed, the patch stands aside
        "arming": applied._arming if applied else None,
        "zero_copy": bool(applied and applied.materializer.baseline is not None),
        # buffers="write_back" in force (FakeTensorMode.dispatch wrapped)
        "write_back": bool(applied and applied.dispatch.aliases.enabled),
        # in-place updates of real tensors that reached only a fake copy (update_lost events)
        "updates_lost": _lost_count(),
        # torch.autograd.backward is our wrapper now (only while a propagating mode lives or a
        # policy is set explicitly; torch's own function otherwise)
        "backward_wrapped": bool(applied and applied.backward_site.in_place()),
        # what the patch did to propagation itself in this process (issues 39, 41): ops that
        # took the fast path, ops made from the real kernel's outputs, values repaired
        "propagation": _propagation_counts(applied),
    }


def _propagation_counts(applied: _Applied | None) -> dict[str, Any]:
    dispatch = getattr(applied, "dispatch", None)
    if dispatch is None:
        return {"fast_ops": 0, "rebuilt": 0, "repaired": {}}
    counts = dict(dispatch.stats.counts)
    return {
        "fast_ops": dispatch.stats.fast_ops,
        "rebuilt": counts.pop("rebuilt", 0),
        "repaired": counts,
    }


def _lost_count() -> int:
    standins = sys.modules.get(__package__ + ".dispatch.standins")
    return standins.lost_count() if standins is not None else 0


def _armed_count() -> int:
    """Hooks of the patch on live nodes, armed by this or an earlier installation."""
    arming = sys.modules.get(__package__ + ".accumulate.arming")
    return arming.armed_count() if arming is not None else 0


def current() -> _Applied | None:
    return _state.applied


def settings_changed() -> None:
    """configure()/patched() changed the settings: let the applied patch follow them."""
    applied = _state.applied
    if applied is not None:
        applied.apply_settings()


def configure(
    *, on_missing: Any = None, buffers: Any = None, propagation: Any = None
) -> _config.Settings:
    """``fakegrad_patch.configure`` (see its docstring): change settings for the whole process and
    return the previous ones."""
    previous = _config.update(on_missing=on_missing, buffers=buffers, propagation=propagation)
    settings_changed()
    return previous


def settings() -> _config.Settings:
    """The settings in force."""
    return _config.current()


@contextlib.contextmanager
def patched(
    *, on_missing: Any = None, buffers: Any = None, propagation: Any = None
) -> Iterator[None]:
    """``fakegrad_patch.patched`` (see its docstring): installed, with these settings, inside the
    block; the previous state exactly afterwards."""
    was_installed = is_installed()
    previous = _config.update(on_missing=on_missing, buffers=buffers, propagation=propagation)
    install()
    settings_changed()
    try:
        yield
    finally:
        _config.restore(previous)
        settings_changed()
        if not was_installed:
            uninstall()


class _Applied:
    """One application of the patch: the two wrappers and the objects they drive.

    * _values.Values wraps ``FakeTensorConverter.from_real_tensor``: where values are kept right.
    * _arming.Arming wraps ``torch.autograd.backward``: where leaves are armed.
    * _accumulate.Hooks / Materializer: the hook that writes.
    * _fakeleaves.FakeLeaves: ``from_tensor`` fake leaves (D4, opt-in mirroring).
    """

    def __init__(self) -> None:
        import torch

        from .accumulate import arming as _arming
        from .accumulate import hooks as _accumulate
        from .convert import fakeleaves as _fakeleaves
        from .convert import records as _records
        from .convert import values as _values
        from .dispatch import mismatch as _mismatch
        from .dispatch.wrapper import Dispatcher
        from .touchpoints import probes as _probes
        from .touchpoints import sites as _sites
        from .touchpoints import targets as _targets

        self._torch = torch
        self.resolved = _targets.resolve_all()
        self.probes = _probes.Probes(self.resolved)
        self.mismatch = _mismatch.Mismatch(self)
        self.arming: Any = None  # below: it needs the hooks
        self.dispatch = Dispatcher(
            self.resolved,
            errors=self,
            mismatch=self.mismatch,
            copies=_records.Copies(self.resolved.no_dispatch),
            armer=self,
        )
        self.values = _values.Values(self.resolved, self.probes, self)
        self.materializer = _accumulate.Materializer(
            self.resolved,
            note_grads=True,
            # the mode's conversions are checked once per generation: a forward that straddles
            # uninstall() (hooks that outlive it) is caught here too, not only at arming
            untrusted=self._untrusted,
        )
        self.hooks = _accumulate.Hooks(self.resolved, self.materializer, self)
        self._values_mod = _values
        #: (weak reference to the last mode found trusted, generation then, taints then)
        self._trusted: tuple[Any, int, int] | None = None
        self.arming = _arming.Arming(self.resolved, self.hooks.prehooks_for, self)
        self._bypass = _probes._bypass
        self._bypassed = _probes.bypassed
        self._active = True
        #: None until first need; then whether upstream has D1 (True: arm leaves).
        self._arming: bool | None = None
        self._ready_lock = threading.Lock()
        self.fake_leaves = _fakeleaves.FakeLeaves(self)

        # torch.autograd.backward is wrapped only while needed (issue 28): while a propagating
        # mode lives (registered when built, FakeTensorMode.__init__ wrapped, or when it
        # converts) or a policy is set explicitly; torch's own function object otherwise.
        autograd = torch.autograd
        self._autograd = autograd
        original = autograd.__dict__["backward"]
        self._backward_wrapper: Any = _arming.BackwardWrapper(original, self.arming.backward)
        _targets.register_script_builtin(self._backward_wrapper, original)
        self.backward_site = _sites.Site(
            autograd,
            "backward",
            self._backward_wrapper,
            original,
            events=("backward_wrapper_installed", "backward_wrapper_removed"),
            lost="fake gradients into real graphs keep upstream behaviour",
        )
        self._mode_init_wrapper: Any = None
        mode_cls = self.resolved.fake_mode_cls
        if "__init__" in mode_cls.__dict__ and _targets._resolve_optional(_targets.FAKE_MODE_INIT):
            wrapt.wrap_function_wrapper(mode_cls, "__init__", self._mode_built)
            self._mode_init_wrapper = mode_cls.__dict__["__init__"]
        #: modes cannot be seen being built: the interception is in place for good
        self._always = self._mode_init_wrapper is None

        cls = self.resolved.converter_cls
        self._cls = cls
        self._had_own_attr = _ATTR in cls.__dict__
        wrapt.wrap_function_wrapper(cls, _ATTR, self.values.from_real_tensor)
        self._wrapper: Any = cls.__dict__[_ATTR]
        self._original: Any = self._wrapper.__wrapped__

        from .accumulate import ddp as _ddp

        self._ddp = _ddp
        _ddp.install(self.resolved)  # never raises; DDP left to upstream when it returns False
        self._mismatch_wrapper: Any = None
        error_cls = _targets._resolve_optional(_targets.METADATA_MISMATCH_ERROR)
        if isinstance(error_cls, type) and "__init__" in error_cls.__dict__:
            self._mismatch_cls = error_cls
            wrapt.wrap_function_wrapper(error_cls, "__init__", self.mismatch.init)
            self._mismatch_wrapper = error_cls.__dict__["__init__"]
        self.apply_settings()
        self.backward_site.start()  # last: a failed installation never leaves it in place
        if not _state.dynamo_skip:
            _state.dynamo_skip = True
            # dynamo never compiles the patch's frames, nor those of wrapt's import finder (it
            # sees every import once a post-import hook is registered)
            _targets.skip_in_dynamo(__package__.partition(".")[0], "wrapt")

    def _untrusted(self, grad: Any) -> bool:
        """Was ``grad`` computed from values the patch could not repair? Installed: the arming
        already checked its mode (a dict read here); after ``uninstall()`` (hooks that outlive
        it), a Parameter its mode converted while uninstalled taints it."""
        mode = getattr(grad, "fake_mode", None)
        if not self._active:
            return self.values.check_mode(mode, definite_only=True)
        # Per gradient, the mode is nearly always the one the last gradient had: its answer
        # holds until the next generation (uninstall) or a new taint (issue 27: the hook's cost).
        values = self._values_mod
        trusted = self._trusted
        if (
            trusted is not None
            and trusted[0]() is mode
            and trusted[1] == values._Generation.value
            and trusted[2] == len(values._tainted)
        ):
            return False
        if self.values.check_mode(mode):
            return True
        if mode is not None:
            self._trusted = (weakref.ref(mode), values._Generation.value, len(values._tainted))
        return False

    # -- first need: probes D1 and P1, zero-copy calibration ------------------------------------

    def ready(self) -> bool:
        """Whether leaves are armed on this build (probe D1 at first need: the first backward
        from a propagating user mode, never inside torch's own tracing)."""
        arming = self._arming
        if arming is None:
            with self._ready_lock:
                if self._arming is None:
                    prepared = _state.prepared
                    if prepared is None:
                        prepared = _state.prepared = self._prepare()
                    self.hooks.post_hooks_skipped = prepared[1]
                    self.materializer.baseline = prepared[2]
                    self._arming = prepared[0]
                arming = self._arming
        return arming

    def _prepare(self) -> tuple[bool, bool, Any]:
        from .touchpoints.probes import D1, POST_HOOKS

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
        from .accumulate.hooks import AdoptBaseline

        torch = self._torch
        r = self.resolved
        arming = self.arming
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
                token = arming.arm(*arming.collect([out]))
                try:
                    with self.materializer.calibrating() as exclusive:
                        out.backward()
                finally:
                    arming.disarm(token)
                leaf.grad = None
                held = torch.ones(4)
                out = leaf.clone()
                token = arming.arm(*arming.collect([out]))
                try:
                    with self.materializer.calibrating() as shared:
                        out.backward(held)
                finally:
                    arming.disarm(token)
            del out, held
        if len(exclusive) != 1 or len(shared) != 1:
            return None
        baseline = AdoptBaseline(*exclusive[0])
        return None if baseline.admits(shared[0]) else baseline

    def _mode_built(
        self, wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """``FakeTensorMode.__init__`` wrapper: a propagating mode keeps the backward
        interception in place while it lives; one without a ShapeEnv (a user's, not a tracer's)
        has its ops watched from the first one (in-place updates of real tensors: issue 25)."""
        result = wrapped(*args, **kwargs)
        if (
            getattr(instance, "propagate_real_tensors", False)
            and self._active
            and not self._bypassed()
        ):
            try:
                self.backward_site.need_mode(instance)
                if not self.dispatch.observing and getattr(instance, "shape_env", None) is None:
                    self.dispatch.observe()
            except Exception as exc:  # never break the host
                self.internal_error("mode", exc)
        return result

    def apply_settings(self) -> None:
        """Follow the settings that need wrappers: ``buffers="write_back"`` wraps
        ``FakeTensorMode.dispatch`` while it is on; an explicit ``on_missing`` keeps the backward
        interception in place (arming applies to modes without real values then). Never
        raises."""
        settings = _config.current()
        want = settings.buffers == "write_back"
        try:
            self.dispatch.settings.repair = settings.propagation != "upstream"
            self.dispatch.settings.fast = settings.propagation == "fast"
            self.values.plain_policy = settings.on_missing_explicit
            if self._active:
                self.backward_site.set_policy(settings.on_missing_explicit or self._always)
            if want and not self.dispatch.aliases.enabled:
                if not self.dispatch.write_back(True):
                    reason = "FakeTensorMode.dispatch not found on this build"
                    warn_once(
                        "write_back:unavailable",
                        f"fakegrad_patch: buffers='write_back' is not available ({reason}); "
                        "buffers keep upstream semantics.",
                    )
                    if trace.enabled(trace.WARNING):
                        trace.emit("write_back_unavailable", trace.WARNING, reason=reason)
            elif not want and self.dispatch.aliases.enabled:
                self.dispatch.write_back(False)
        except Exception as exc:  # never break the host
            self.internal_error("settings", exc)

    def arm_retained(self, t: Any) -> None:
        """A real non-leaf retained after it entered a propagating mode (the dispatch path's
        ``retain_grad`` site): its hooks, from the arming."""
        self.arming.arm_retained(t)

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
        """Unwrap both functions. Graphs built while installed still finish with real gradients:
        backward calls running now keep their hooks until they return, and the leaves of every
        live propagating converter's records get hooks that last until their node dies. Returns
        how many hooks are left to finish."""
        from .convert import records as _records
        from .convert import values as _values

        self._active = False
        self.values.active = False
        self.arming.active = False
        self._ddp.remove()
        try:
            self.dispatch.write_back(False)
            self.dispatch.remove()
        except Exception as exc:  # never break the host
            self.internal_error("uninstall", exc)
        self._unwrap(self._cls, _ATTR, self._wrapper, self._original, self._had_own_attr)
        self.backward_site.close()
        if self._mode_init_wrapper is not None:
            self._unwrap(
                self.resolved.fake_mode_cls, "__init__", self._mode_init_wrapper, None, True
            )
        self.mismatch.active = False
        if self._mismatch_wrapper is not None:
            self._unwrap(self._mismatch_cls, "__init__", self._mismatch_wrapper, None, True)
        try:
            leaves = _recorded_leaves(_records.records(), self.resolved)
            if leaves and self.ready():
                self.arming.arm_lasting(leaves)
        except Exception as exc:  # never break the host
            self.internal_error("uninstall", exc)
        _values.new_generation()
        return _armed_count()

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


def _recorded_leaves(records: Any, resolved: Any) -> list[Any]:
    """Real tensors that require grad in the converters' records (leaves, or non-leaves whose
    real graph leads to leaves)."""
    out: list[Any] = []
    is_fake = resolved.is_fake
    for _conv, table in records:
        for root, _entry in table.items():
            if root.requires_grad and not is_fake(root):
                out.append(root)
    return out
