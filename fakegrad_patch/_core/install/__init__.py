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
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

try:
    import wrapt
except ModuleNotFoundError as _exc:  # never break the host: refuse to patch, say why
    if _exc.name != "wrapt":
        raise
    wrapt = None  # type: ignore[assignment]
    _WRAPT_MISSING: ModuleNotFoundError | None = _exc
else:
    _WRAPT_MISSING = None

from ... import _config, trace
from ..state import set_current, warn_once
from ..touchpoints.targets import (
    FAKE_MODE_INIT,
    FAKE_TENSOR_MODULE,
    FROM_REAL_TENSOR,
    MissingTargetError,
    resolve,
)

if TYPE_CHECKING:
    from .applied import Applied

_CORE = __package__.rpartition(".")[0]  # fakegrad_patch._core


class _State:
    def __init__(self) -> None:
        self.wanted = False  # install() called, uninstall() not since
        self.hooks_registered = False  # wrapt post-import hooks (once per process)
        self.applied: Applied | None = None
        self.skipped_reason: str | None = None
        #: the thread applying or removing the patch now (one at a time: :func:`_converge`)
        self.busy: int | None = None
        #: the fake tensor module's post-import hook fired: the patch may be applied although
        #: torch's own import may still be under way
        self.fake_tensor_loaded = False
        #: installations removed so far (uninstall() says whether its call removed one)
        self.removals = 0
        #: applying waits for a module of this package that was importing when torch finished
        #: (it imported torch at its top): (FakeTensorMode, its ``__init__``, the one-shot
        #: ``__init__`` that applies the patch first), and why, for status()
        self.deferred: tuple[Any, Any, Any] | None = None
        self.deferred_reason: str | None = None


_state = _State()
#: Guards the fields of ``_state``, and only them: held to read or publish them, never while
#: importing, resolving a target, wrapping or calling out. The work itself runs
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
    deferred = _state.deferred
    try:
        from .applied import Applied

        # waiting: the one-shot stays in FakeTensorMode.__init__ until the patch's wrapper of
        # torch's own replaces it (a thread building a mode meanwhile waits in the one-shot)
        applied = Applied() if deferred is None else Applied(mode_init=deferred[1])
    except MissingTargetError as exc:
        _undefer()
        _skip(_why_missing(exc, version), version)
        return False
    except Exception as exc:  # never break the host
        # a module of ours half-made (ImportError, or AttributeError from ``module.name``):
        # retried at the first mode; a failure of another cause is reported then
        importing = _ours_importing()
        if not (importing and _defer(importing, version)):
            _undefer()
            _skip(f"unexpected {type(exc).__name__}: {exc}", version)
        return False
    _undefer()  # the one-shot is gone from the class (replaced by the wrapper): forget it
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


def _ours_importing() -> list[str]:
    """The modules of this package (not the package itself) whose import is under way: one of
    them imported torch at its top (a private module imported before torch), and applying now
    would import it half-made."""
    package = _CORE.rpartition(".")[0] + "."
    return sorted(
        name
        for name, module in list(sys.modules.items())
        if name.startswith(package)
        and getattr(getattr(module, "__spec__", None), "_initializing", False)
    )


def _defer(importing: list[str], version: str) -> bool:
    """Apply at the first ``FakeTensorMode`` built (or the next ``install()``) instead of now:
    ``importing`` must finish first. A one-shot ``FakeTensorMode.__init__`` of ours applies the
    patch (whose wrapper of torch's own then replaces the one-shot: ``Applied(mode_init=...)``)
    and builds the mode through whatever is in place then. False where the class cannot be
    found (the caller then warns, as for any failure)."""
    try:
        cls = resolve(FAKE_MODE_INIT, owner_only=True)  # loaded: its post-import hook ran
    except MissingTargetError:
        return False
    original = cls.__dict__.get("__init__")
    if original is None:
        return False

    def first_mode(self: Any, *args: Any, **kwargs: Any) -> None:
        _converge(wait=True)  # applies, or waits for the thread applying
        if cls.__dict__.get("__init__") is first_mode:
            # still here: this thread is the one applying (a mode built on the way), or an
            # uninstall() has not yet put torch's back
            original(self, *args, **kwargs)
        else:  # the patch's wrapper; torch's own where nothing was applied (put back)
            cls.__init__(self, *args, **kwargs)

    reason = f"waiting for {', '.join(importing)} to finish importing (it imported torch)"
    with _lock:
        if _state.deferred is None:
            _state.deferred = (cls, original, first_mode)
            cls.__init__ = first_mode
        _state.deferred_reason = reason
    if trace.enabled(trace.INFO):
        trace.emit("patch_deferred", trace.INFO, torch=version, reason=reason)
    return True


def _undefer() -> None:
    """Torch's ``FakeTensorMode.__init__`` back where the one-shot still is (once); the
    deferral forgotten."""
    with _lock:
        deferred, _state.deferred = _state.deferred, None
        _state.deferred_reason = None
    if deferred is not None:
        cls, original, first_mode = deferred
        if cls.__dict__.get("__init__") is first_mode:
            cls.__init__ = original


def _remove(applied: Applied) -> None:
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
    from ..touchpoints.targets import PROPAGATE_CONFIG, TESTED_TORCH

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
    _undefer()  # waiting to apply (a module of ours was importing): torch's __init__ back now
    return had or _state.removals > removals


def release_hooks() -> int:
    """Remove every hook of the patch still on a live AccumulateGrad node; return how many.

    Hooks are armed for one backward call and removed when it returns, so normally there is
    nothing to release. What can remain: hooks armed by ``uninstall()`` for graphs built while
    the patch was installed (they die with their graph), and the hooks of backward calls running
    in other threads right now (those then finish with upstream behaviour)."""
    arming = sys.modules.get(_CORE + ".accumulate.arming")
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
        # applied at the first FakeTensorMode built (a module of ours imported torch)
        "deferred": _state.deferred_reason,
        "armed_leaves": _armed_count(),
        "defects": applied.probes.known() if applied else {},
        # None until first need (probe D1); False: upstream is fixed, the patch stands aside
        "arming": applied.first_need.arms_leaves if applied else None,
        "zero_copy": bool(applied and applied.materializer.baseline is not None),
        # buffers="write_back" in force (FakeTensorMode.dispatch wrapped)
        "write_back": bool(applied and applied.dispatch.aliases.enabled),
        # in-place updates of real tensors that reached only a fake copy (update_lost events)
        "updates_lost": _lost_count(),
        # torch.autograd.backward is our wrapper now (only while a propagating mode lives or a
        # policy is set explicitly; torch's own function otherwise)
        "backward_wrapped": bool(applied and applied.backward_site.in_place()),
        # what the patch did to propagation itself in this process: ops that
        # took the fast path, ops made from the real kernel's outputs, values repaired
        "propagation": _propagation_counts(applied),
    }


def _propagation_counts(applied: Applied | None) -> dict[str, Any]:
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
    standins = sys.modules.get(_CORE + ".dispatch.standins")
    return standins.lost_count() if standins is not None else 0


def _armed_count() -> int:
    """Hooks of the patch on live nodes, armed by this or an earlier installation."""
    arming = sys.modules.get(_CORE + ".accumulate.arming")
    return arming.armed_count() if arming is not None else 0


def current() -> Applied | None:
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
