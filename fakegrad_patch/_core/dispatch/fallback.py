"""Ops without a meta kernel (``fractional_max_pool3d_backward``; aten's CUDA-only fused kernels:
``_thnn_fused_gru_cell``; torchvision/torchaudio ops) take FakeTensorMode's unsafe fallback:
the real kernel on zero-filled inputs, returned without the real kernel's values on one path.
Their outputs get the values of the real kernel run on the op's real values (``real_out``,
read from upstream's frame), or lose the zeros' values where the op had none (then the
gradients are reported, never copied) (``propagation_repaired``, ``repair: "fallback_kernel"``).
"""

from __future__ import annotations

from typing import Any

import torch

from ..touchpoints import targets as _targets
from ..touchpoints.targets import Resolved
from ..typing import InternalErrors
from .fast import FastPath
from .stats import Settings, Stats
from .tensors import same_metadata


class Fallback:
    """The wrapper of ``run_fallback_kernel``."""

    def __init__(
        self,
        resolved: Resolved,
        settings: Settings,
        stats: Stats,
        fast: FastPath,
        errors: InternalErrors,
    ) -> None:
        self._resolved = resolved
        self._is_fake = resolved.is_fake
        self._settings = settings
        self._stats = stats
        self._fast = fast
        self._errors = errors

    def __call__(self, wrapped: Any, _instance: Any, args: Any, kwargs: Any) -> Any:
        result = wrapped(*args, **kwargs)
        mode = args[0] if args else kwargs.get("fake_mode")
        if (
            not self._settings.repair
            or not getattr(mode, "propagate_real_tensors", False)
            or getattr(mode, "shape_env", None) is not None
        ):
            return result
        try:
            real_out = _targets.running_real_out(mode)
            repaired = self._refill(mode, result, real_out)
        except Exception as exc:  # never break the host's fake computation
            self._errors.internal_error("fallback", exc)
            return result
        func = args[1] if len(args) > 1 else kwargs.get("func")
        self._stats.report(
            "fallback_kernel",
            "propagation_repaired",
            func,
            repair="fallback_kernel",
            values="real kernel" if real_out is not _targets.NO_REAL_OUT else "none",
        )
        return repaired

    def _refill(self, mode: Any, fake_out: Any, real_out: Any) -> Any:
        """``fake_out`` with the values of ``real_out`` (the same structure): a fake whose
        metadata agrees takes the real output as its values; one that does not is made again
        from it; with no real output, fakes lose the zeros' values (no values: reported)."""
        if self._is_fake(fake_out):
            if real_out is _targets.NO_REAL_OUT or not isinstance(real_out, torch.Tensor):
                with self._resolved.no_dispatch():
                    fake_out.real_tensor = None
                return fake_out
            if same_metadata(fake_out, real_out):
                with self._resolved.no_dispatch():
                    fake_out.real_tensor = real_out
                return fake_out
            return self._fast.fake_of(mode, real_out)
        if isinstance(fake_out, tuple | list):
            reals = (
                real_out
                if isinstance(real_out, tuple | list) and len(real_out) == len(fake_out)
                else [_targets.NO_REAL_OUT] * len(fake_out)
            )
            made = [self._refill(mode, f, r) for f, r in zip(fake_out, reals, strict=True)]
            if hasattr(fake_out, "_fields"):
                return type(fake_out)(*made)
            return type(fake_out)(made)
        return fake_out
