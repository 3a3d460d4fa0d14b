"""One application of the patch: it builds the parts, puts their wrappers in place, follows the
settings, and takes everything off again at ``uninstall()``.

* ``convert.values.Values`` wraps ``FakeTensorConverter.from_real_tensor``: values kept right;
* ``dispatch.wrapper.Dispatcher`` wraps ``FakeTensorMode.dispatch``: propagation and the
  write-back watch;
* ``accumulate.arming.Arming`` wraps ``torch.autograd.backward``: leaves armed;
* ``accumulate.hooks.Hooks`` / ``Materializer``: the hook that writes ``.grad``;
* ``convert.fakeleaves.FakeLeaves``: ``from_tensor`` fake leaves (D4, opt-in mirroring).
"""

from __future__ import annotations

import importlib
from typing import Any

import wrapt

from ... import _config, trace
from ..convert import lending as _lending
from ..convert import unseen as _unseen
from ..state import warn_once
from ..touchpoints.targets import FROM_REAL_TENSOR
from .first_need import FirstNeed

_ATTR = FROM_REAL_TENSOR.qualname.rsplit(".", 1)[1]  # "from_real_tensor"


class _DynamoSkip:
    #: fakegrad_patch's frames registered with TorchDynamo's skip list (once per process)
    done = False


class Applied:
    """One application of the patch."""

    def __init__(self, mode_init: Any = None) -> None:
        import torch

        from ..accumulate import arming as arming_module
        from ..accumulate import hooks as _accumulate
        from ..convert import fakeleaves as _fakeleaves
        from ..convert import records as _records
        from ..convert import values as _values
        from ..dispatch import mismatch as _mismatch
        from ..dispatch.wrapper import Dispatcher
        from ..touchpoints import probes as _probes
        from ..touchpoints import sites as _sites
        from ..touchpoints import targets as _targets

        self.resolved = _targets.resolve_all()
        self.probes = _probes.Probes(self.resolved)
        self.active = True
        # Each part gets the narrow collaborators it uses (_core/typing.py); where that is this
        # installation (errors, the retained-non-leaf arming), it is typed as that capability.
        self.mismatch = _mismatch.Mismatch(errors=self, repairing=self._repairing)
        self.dispatch = Dispatcher(
            self.resolved,
            errors=self,
            mismatch=self.mismatch,
            copies=_records.Copies(self.resolved.no_dispatch),
            armer=self,
        )
        self.fake_leaves = _fakeleaves.FakeLeaves(
            self.resolved, self.probes, installed=self._installed, errors=self
        )
        self.values = _values.Values(
            self.resolved,
            self.probes,
            dispatch=self.dispatch,
            fake_leaves=self.fake_leaves,
            armer=self,
            errors=self,
            lean=_lean_conversion(self.dispatch.fake_maker),
        )
        self.materializer = _accumulate.Materializer(
            self.resolved,
            note_grads=True,
            # the mode's conversions are checked once per generation: a forward that straddles
            # uninstall() (hooks that outlive it) is caught here too, not only at arming
            untrusted=self._untrusted,
        )
        self.hooks = _accumulate.Hooks(self.resolved, self.materializer, errors=self)
        from ..accumulate import ddp as _ddp

        self.ddp = _ddp
        self.arming = arming_module.Arming(
            self.resolved,
            self.hooks.prehooks_for,
            retained=self.hooks,
            trust=self.values.unseen,
            ready=self.ready,
            scopes=_ddp,
            errors=self,
        )
        self._bypassed = _probes.bypassed
        self.first_need = FirstNeed(
            self.resolved,
            self.probes,
            arming=self.arming,
            hooks=self.hooks,
            materializer=self.materializer,
            trust=self.values.unseen,
            installed=self._installed,
            errors=self,
        )

        # torch.autograd.backward is wrapped only while needed: while a propagating
        # mode lives (registered when built, FakeTensorMode.__init__ wrapped, or when it
        # converts) or a policy is set explicitly; torch's own function object otherwise.
        autograd = torch.autograd
        self._autograd = autograd
        original = autograd.__dict__["backward"]
        self._backward_wrapper: Any = arming_module.BackwardWrapper(original, self.arming.backward)
        _targets.register_script_builtin(self._backward_wrapper, original)
        self.backward_site = _sites.Site(
            autograd,
            "backward",
            self._backward_wrapper,
            original,
            events=("backward_wrapper_installed", "backward_wrapper_removed"),
            lost="fake gradients into real graphs keep upstream behaviour",
        )
        mode_cls = self.resolved.fake_mode_cls
        self._mode_init_wrapper: Any = _wrap_mode_init(mode_cls, mode_init, self._mode_built)
        #: modes cannot be seen being built: the interception is in place for good
        self._always = self._mode_init_wrapper is None

        cls = self.resolved.converter_cls
        self._cls = cls
        self._had_own_attr = _ATTR in cls.__dict__
        wrapt.wrap_function_wrapper(cls, _ATTR, self.values.from_real_tensor)
        self._wrapper: Any = cls.__dict__[_ATTR]
        self._original: Any = self._wrapper.__wrapped__
        _unseen.new_generation()  # every conversion seen from here: a generation of its own

        self._lending_site = _lend(self.resolved, self.dispatch.watch.owned)
        _ddp.install(self.resolved)  # never raises; DDP left to upstream when it returns False
        self._mismatch_wrapper: Any = None
        error_cls = _targets.resolve_optional(_targets.METADATA_MISMATCH_ERROR)
        if isinstance(error_cls, type) and "__init__" in error_cls.__dict__:
            self._mismatch_cls = error_cls
            wrapt.wrap_function_wrapper(error_cls, "__init__", self.mismatch.init)
            self._mismatch_wrapper = error_cls.__dict__["__init__"]
        self.apply_settings()
        self.backward_site.start()  # last: a failed installation never leaves it in place
        if not _DynamoSkip.done:
            _DynamoSkip.done = True
            # dynamo never compiles the patch's frames, nor those of wrapt's import finder (it
            # sees every import once a post-import hook is registered)
            _targets.skip_in_dynamo(__package__.partition(".")[0], "wrapt")

    def ready(self) -> bool:
        """Whether leaves are armed on this build (probe D1 at first need)."""
        return self.first_need.ready()

    def _installed(self) -> bool:
        return self.active

    def _repairing(self) -> bool:
        """Whether the dispatch path rebuilds refused ops from the real kernel's outputs."""
        dispatch = getattr(self, "dispatch", None)  # None while this installation is built
        return dispatch is not None and bool(dispatch.settings.repair)

    def _untrusted(self, grad: Any) -> bool:
        return self.first_need.untrusted(grad)

    def _mode_built(
        self, wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """``FakeTensorMode.__init__`` wrapper: a propagating mode keeps the backward
        interception in place while it lives; one without a ShapeEnv (a user's, not a tracer's)
        has its ops watched from the first one (in-place updates of real tensors)."""
        result = wrapped(*args, **kwargs)
        if (
            getattr(instance, "propagate_real_tensors", False)
            and self.active
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
            _lending.set_enabled(self.active and settings.propagation != "upstream" and not want)
            self.values.plain_policy = settings.on_missing_explicit
            if self.active:
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
        ``retain_grad`` site): its hooks."""
        self.hooks.arm_retained(t)

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

    def remove(self) -> int:
        """Unwrap both functions. Graphs built while installed still finish with real gradients:
        backward calls running now keep their hooks until they return, and the leaves of every
        live propagating converter's records get hooks that last until their node dies. Returns
        how many hooks are left to finish."""
        from ..convert import records as _records

        self.active = False
        self.values.active = False
        self.arming.active = False
        self.ddp.remove()
        try:
            self.dispatch.write_back(False)
            self.dispatch.remove()
        except Exception as exc:  # never break the host
            self.internal_error("uninstall", exc)
        self._unwrap(self._cls, _ATTR, self._wrapper, self._original, self._had_own_attr)
        _lending.set_enabled(False)  # every lent value owned: the write checks leave with us
        if self._lending_site is not None:
            self._unwrap(*self._lending_site)
        self.backward_site.close()
        if self._mode_init_wrapper is not None:
            self._unwrap(
                self.resolved.fake_mode_cls, "__init__", self._mode_init_wrapper, None, True
            )
        self.mismatch.active = False
        if self._mismatch_wrapper is not None:
            self._unwrap(self._mismatch_cls, "__init__", self._mismatch_wrapper, None, True)
        try:
            leaves = _recorded_leaves(_records.records(), _records.read_leaves(), self.resolved)
            if leaves and self.ready():
                self.arming.arm_lasting(leaves)
        except Exception as exc:  # never break the host
            self.internal_error("uninstall", exc)
        _unseen.new_generation()
        from ..accumulate import arming as arming_module

        return arming_module.armed_count()

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


def _wrap_mode_init(mode_cls: Any, mode_init: Any, handler: Any) -> Any:
    """``FakeTensorMode.__init__`` wrapped (the wrapper; None where the class has none, or the
    build lacks FAKE_MODE_INIT). ``mode_init``: torch's own, where the class holds the
    installation's one-shot instead (it waited for a module of ours): the wrapper of torch's own
    takes the one-shot's place in one assignment, so no thread finds torch's own meanwhile."""
    from ..touchpoints import targets as _targets

    init = mode_init if mode_init is not None else mode_cls.__dict__.get("__init__")
    if init is None or not _targets.resolve_optional(_targets.FAKE_MODE_INIT):
        return None
    wrapper = wrapt.FunctionWrapper(init, handler)
    setattr(mode_cls, "__init__", wrapper)  # noqa: B010 (mypy: __init__ of an instance)
    return wrapper


def _recorded_leaves(records: Any, read: list[Any], resolved: Any) -> list[Any]:
    """Real tensors that require grad in the converters' records (leaves, or non-leaves whose
    real graph leads to leaves) and among those their modes read directly (``read``), each
    once (a parameter converted for a view and read directly, or by two live modes)."""
    out: dict[int, Any] = {}
    is_fake = resolved.is_fake
    roots = [root for _conv, table in records for root, _entry in table.items()]
    for t in roots + read:
        if t.requires_grad and not is_fake(t):
            out.setdefault(id(t), t)
    return list(out.values())


def _lend(resolved: Any, owned: Any) -> tuple[Any, str, Any, Any, bool] | None:
    """Lending (convert/lending.py) where the build's primitives work: probed, the stand-ins told
    of owned values (``owned``), upstream's storage clone wrapped where it has one (2.14+).
    Returns what ``uninstall()`` unwraps, or None."""
    from ..touchpoints import targets as _targets

    construct = _targets.resolve_optional(_targets.CONSTRUCT_STORAGE)
    swap = _targets.resolve_optional(_targets.SWAP_STORAGE_DATA)
    if not _lending.configure(construct, swap, resolved.no_dispatch):
        return None
    _lending.set_on_owned(owned)
    clone = _targets.resolve_optional(_targets.CLONE_REAL_STORAGE)
    if clone is None:
        return None
    module = importlib.import_module(_targets.CLONE_REAL_STORAGE.module)
    attr = _targets.CLONE_REAL_STORAGE.qualname
    wrapt.wrap_function_wrapper(module, attr, _lending.clone_real_storage)
    return module, attr, module.__dict__[attr], clone, True


def _lean_conversion(fake_maker: Any) -> Any:
    """The converter's lean conversions of the fast path's op inputs (``targets.LeanConversion``),
    or None where the build lacks what they need."""
    from ..touchpoints import targets as _targets

    if fake_maker is None:
        return None
    lean = _targets.LeanConversion(fake_maker)
    return lean if lean.usable else None
