"""Behaviour probes: detect upstream defects on the installed torch, never by version string.

Each probe runs once per process, lazily (the first time its answer matters), on tiny tensors,
with every dispatch mode disabled and our own wrapper bypassed, and caches its answer.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from . import trace
from ._targets import Resolved

_local = threading.local()


def bypassed() -> bool:
    """True while a probe runs on this thread: the patch must not act on the probe's tensors."""
    return getattr(_local, "bypass", False)


@contextlib.contextmanager
def _bypass() -> Iterator[None]:
    _local.bypass = True
    try:
        yield
    finally:
        _local.bypass = False


@dataclass(frozen=True)
class Defect:
    key: str
    summary: str


#: D2: propagation gives a converted ``nn.Parameter`` an uninitialised ``real_tensor`` (seen on
#: 2.13.0: ``meta_utils._safe_copy`` skips sources whose type is not exactly ``torch.Tensor``).
D2 = Defect(
    "D2_parameter_real_tensor",
    "converted nn.Parameter gets an uninitialised real_tensor under propagation",
)


#: D4: converting a real leaf that has a ``.grad`` gives a fake leaf whose fake ``.grad`` carries
#: wrong real values (or wrong real strides/device) under propagation. Not seen on 2.13.0 or 2.14.1
#: (plain tensors and Parameters; contiguous, transposed, sliced and channels_last grads are copied
#: exactly), so the repair in _fakeleaves never runs there; the probe keeps us honest on other
#: builds.
GRAD_COPY = Defect(
    "D4_grad_copy_real_tensor",
    "converted leaf's fake .grad carries wrong real values under propagation",
)


class Probes:
    def __init__(self, resolved: Resolved) -> None:
        self._r = resolved
        self._lock = threading.Lock()
        self._results: dict[str, bool] = {}

    def has(self, defect: Defect) -> bool:
        """Does this torch have ``defect``? Probed on first call, then cached."""
        result = self._results.get(defect.key)
        if result is None:
            with self._lock:
                result = self._results.get(defect.key)
                if result is None:
                    result = self._run(defect)
                    self._results[defect.key] = result
        return result

    def known(self) -> dict[str, bool]:
        """Answers of the probes that have run so far (nothing is run)."""
        return dict(self._results)

    def detected(self) -> dict[str, bool]:
        """Every probe's answer (runs those not yet run)."""
        return {d.key: self.has(d) for d in (D2, GRAD_COPY)}

    def _run(self, defect: Defect) -> bool:
        if defect is D2:
            found = self._probe_parameter_real_tensor()
        elif defect is GRAD_COPY:
            found = self._probe_grad_copy()
        else:  # pragma: no cover - one probe today
            raise KeyError(defect.key)
        if trace.enabled(trace.INFO):
            trace.emit("defect_probed", trace.INFO, defect=defect.key, present=found)
        return found

    def _probe_parameter_real_tensor(self) -> bool:
        values = torch.linspace(-3.25, 7.5, 24).reshape(4, 6)
        with (
            self._r.disable_current_modes(),
            torch.no_grad(),
            self._r.functorch_config.patch(fake_tensor_propagate_real_tensors=True),
            _bypass(),
        ):
            source = torch.nn.Parameter(values.clone())
            mode = self._r.fake_mode_cls()
            fake = mode.from_tensor(source)
            real = getattr(fake, "real_tensor", None)
            if real is None:
                return False  # this build does not propagate through from_tensor: nothing to repair
            return not torch.equal(real, values)

    def _probe_grad_copy(self) -> bool:
        """Convert plain and Parameter leaves holding strided grads; compare the fake grad's real
        values, strides and device with the source grad's."""
        with (
            self._r.disable_current_modes(),
            torch.no_grad(),
            self._r.functorch_config.patch(fake_tensor_propagate_real_tensors=True),
            _bypass(),
        ):
            base = torch.linspace(-2.5, 4.0, 120)
            cases = [
                (base[:24].reshape(4, 6), base[24:48].reshape(6, 4).t()),  # transposed grad
                (base[:24].reshape(4, 6), base[48:96].reshape(4, 12)[:, ::2]),  # sliced grad
                (
                    base[:120].reshape(2, 3, 4, 5),
                    base.flip(0).reshape(2, 3, 4, 5).contiguous(memory_format=torch.channels_last),
                ),
            ]
            for data, grad in cases:
                for make in (torch.nn.Parameter, lambda d: d.clone().requires_grad_()):
                    source = make(data.clone())
                    source.grad = grad
                    fake = self._r.fake_mode_cls().from_tensor(source)
                    real = getattr(fake, "real_tensor", None)
                    if real is None:
                        return False  # no propagation through from_tensor: nothing to repair
                    fake_grad = fake.grad
                    real_grad = getattr(fake_grad, "real_tensor", None)
                    if (
                        real_grad is None
                        or real_grad.shape != grad.shape
                        or real_grad.stride() != grad.stride()
                        or real_grad.device != grad.device
                        or not torch.equal(real_grad, grad)
                    ):
                        return True
            return False
