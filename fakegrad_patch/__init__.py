"""fakegrad_patch: real gradients for real leaves under FakeTensorMode.

``import fakegrad_patch`` installs the patch (lazily: torch is not imported by this module; the
patch applies once torch is imported). See README.md and docs/ for the full story.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

from ._config import (
    BUFFERS_VALUES,
    ON_MISSING_VALUES,
    PROPAGATION_VALUES,
    Buffers,
    OnMissing,
    Propagation,
    Settings,
)
from ._core import install as _install
from ._core.install import install, is_installed, release_hooks, status, uninstall
from ._errors import FakeGradError, FakeGradPatchWarning

if TYPE_CHECKING:
    import torch

    from . import trace as trace

__all__ = [
    "BUFFERS_VALUES",
    "ON_MISSING_VALUES",
    "PROPAGATION_VALUES",
    "Buffers",
    "FakeGradError",
    "FakeGradPatchWarning",
    "OnMissing",
    "Propagation",
    "Settings",
    "VerifyError",
    "VerifyReport",
    "configure",
    "install",
    "is_installed",
    "materialize",
    "mirror_to_sources",
    "name_parameters",
    "patched",
    "release_hooks",
    "settings",
    "status",
    "uninstall",
    "verify",
]

__version__ = "0.3.0"


def configure(
    *,
    on_missing: OnMissing | None = None,
    buffers: Buffers | None = None,
    propagation: Propagation | None = None,
) -> Settings:
    """Change settings for the whole process; return the previous ones (pass their fields back,
    or use :func:`patched`, to restore).

    on_missing: ``"drop"`` (default), ``"zeros"``, ``"error"`` or ``"keep"``; see
    docs/configuration.md. Giving it makes it explicit (``Settings.on_missing_explicit``).
    buffers: ``"upstream"`` (default) or ``"write_back"``: in-place updates a propagating mode
    applies to real tensors that do not require grad (BatchNorm running statistics,
    spectral_norm's vectors) reach them exactly once, as in eager mode; see
    docs/configuration.md. propagation: ``"fast"`` (default), ``"repair"`` or ``"upstream"``:
    in a propagating mode without a ShapeEnv, ``"fast"`` runs an op that makes new tensors once,
    on its real kernel, and makes its fake outputs from the real ones; ``"fast"`` and
    ``"repair"`` repair propagated values upstream gets wrong and give ops whose fake side
    refuses or disagrees after the real kernel ran the real kernel's outputs; ``"upstream"``
    leaves FakeTensorMode's propagation as it is. ``None`` leaves a
    setting unchanged. Invalid values raise ValueError naming the setting, the value and the
    valid ones; settings are then unchanged.
    """
    return _install.configure(on_missing=on_missing, buffers=buffers, propagation=propagation)


def _settings_changed() -> None:
    """Let the applied patch follow the settings (nothing is applied without wrapt)."""
    _install.settings_changed()


def settings() -> Settings:
    """The settings in force."""
    return _install.settings()


def patched(
    *,
    on_missing: OnMissing | None = None,
    buffers: Buffers | None = None,
    propagation: Propagation | None = None,
) -> contextlib.AbstractContextManager[None]:
    """Scoped use: the patch is installed (and ``on_missing``/``buffers``/``propagation`` set
    when given:
    ``on_missing`` explicitly) inside the block, and the previous state (installed or not,
    settings exactly, the explicit flag included) is restored on exit. An invalid value raises
    ValueError before anything changes."""
    return _install.patched(on_missing=on_missing, buffers=buffers, propagation=propagation)


def name_parameters(module: torch.nn.Module, prefix: str = "") -> int:
    """Register ``module``'s parameter names for trace events and messages (held weakly)."""
    from ._core.convert.leaves import name_parameters as _name_parameters

    return _name_parameters(module, prefix)


def materialize(
    tree: Any, like: Any = None, *, on_missing: OnMissing | None = None, copy: bool = False
) -> Any:
    """Real tensors from the FakeTensors in ``tree`` (nested tuples/lists/dicts), built from their
    propagated values, on ``like``'s device (and dtype/layout when ``like`` matches ``tree``);
    fakes without real values follow ``on_missing``. See docs/fake-leaves.md."""
    from ._tools.materialize import materialize as _materialize

    return _materialize(tree, like, on_missing=on_missing, copy=copy)


def mirror_to_sources(mode: Any) -> contextlib.AbstractContextManager[None]:
    """Opt-in, scoped: inside the block, gradients accumulated into fake leaves that ``mode``
    converted from real leaves (``mode.from_tensor(param)`` while the block runs) are also
    materialized onto the real source leaves. Off by default because torch.compile/export make
    such fakes internally and must never write real ``.grad``s. See docs/fake-leaves.md."""
    from ._core.convert.fakeleaves import mirror_to_sources as _mirror_to_sources

    return _mirror_to_sources(mode)


def verify(
    model: torch.nn.Module,
    example_inputs: Any,
    loss_fn: Any = None,
    *,
    steps: int = 1,
    optimizer: Any = None,
    zero_grad: str = "none",
    atol: Any = None,
    rtol: Any = None,
    check_buffers: bool | str = True,
    buffers: Buffers | None = None,
) -> Any:
    """Prove the patch on your model: train a deep copy eagerly and a deep copy under
    ``FakeTensorMode(allow_non_fake_inputs=True)`` with real-value propagation and the patch, with
    the same random numbers, for ``steps`` steps (``optimizer``: a factory called with the copy's
    parameters), and return a report comparing every named parameter (gradient real or fake,
    max abs/rel difference, dtype, device, strides, ``.grad`` identity across steps, values after
    the step, what the patch did; ``buffers``: the patched copy's buffers setting, default the
    one in force). ``report.ok`` is the verdict, ``report.format()`` the table,
    ``report.assert_ok()`` raises with it. Your model, RNG state, patch state and settings are
    left unchanged. See docs/verify.md."""
    from ._tools.verify import verify as _verify

    return _verify(
        model,
        example_inputs,
        loss_fn,
        steps=steps,
        optimizer=optimizer,
        zero_grad=zero_grad,  # type: ignore[arg-type]
        atol=atol,
        rtol=rtol,
        check_buffers=check_buffers,  # type: ignore[arg-type]
        buffers=buffers,
    )


def __getattr__(name: str) -> Any:
    # Lazy submodules keep ``import fakegrad_patch`` free of torch and structlog.
    if name == "trace":
        import importlib

        return importlib.import_module(".trace", __name__)
    if name in ("VerifyError", "VerifyReport"):  # torch-dependent: imported on first use
        from ._tools import verify as _verify

        return getattr(_verify, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _check_settings() -> None:
    # Every environment setting is validated now, before the patch is installed: one
    # FakeGradPatchWarning per invalid value (an exception only when warnings are errors).
    from . import _config

    _config.check_environment()


_check_settings()
install()
