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

from ... import trace
from .targets import Resolved

_local = threading.local()


def bypassed() -> bool:
    """True while a probe runs on this thread: the patch must not act on the probe's tensors."""
    return getattr(_local, "bypass", False)


@contextlib.contextmanager
def bypass() -> Iterator[None]:
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


#: D1: the defect this package exists for. A real leaf in a propagating fake backward receives a
#: FakeTensor ``.grad`` (or loses its new gradient when it had a real one). Present on every build
#: measured so far (2.6 to 2.15); where a build fixes it upstream, the patch arms nothing.
D1 = Defect(
    "D1_fake_grad_in_real_leaf",
    "a real leaf in a propagating fake backward gets a FakeTensor .grad or loses its gradient",
)

#: P1: a node pre-hook on AccumulateGrad that returns ``(None,)`` also stops the leaf's
#: post-accumulate hooks (seen on 2.6.0; 2.13.0 and 2.15.0 still run them). Where present, the
#: patch runs those hooks itself after writing the real gradient. A behaviour the mechanism relies
#: on, probed like a defect (plain eager mode, no fake tensor involved).
POST_HOOKS = Defect(
    "P1_post_accumulate_hooks_skipped",
    "AccumulateGrad skips post-accumulate hooks after a pre-hook returns (None,)",
)

#: D5: a FakeTensor of one propagating mode converted by another mode (a module shared by models
#: run in two modes, a loss summed across modes) gets an uninitialised ``real_tensor`` instead of
#: the first mode's values (seen on 2.13.0: the same ``_safe_copy`` type test as D2; 2.14.1 and
#: 2.15.0 copy the values). Where present, the patch copies them.
FOREIGN_FAKE = Defect(
    "D5_foreign_fake_real_tensor",
    "a FakeTensor converted by another propagating mode gets an uninitialised real_tensor",
)

ALL_DEFECTS: tuple[Defect, ...] = (D1, D2, GRAD_COPY, POST_HOOKS, FOREIGN_FAKE)


_results: dict[str, bool] = {}
_results_lock = threading.Lock()


class Probes:
    def __init__(self, resolved: Resolved) -> None:
        self._resolved = resolved
        self._lock = _results_lock
        #: shared by every installation in the process: a build's behaviour does not change
        self._results = _results

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

    def cached(self, defect: Defect) -> bool | None:
        """The answer if the probe has run, else None (never runs it)."""
        return self._results.get(defect.key)

    def known(self) -> dict[str, bool]:
        """Answers of the probes that have run so far (nothing is run)."""
        return dict(self._results)

    def detected(self) -> dict[str, bool]:
        """Every probe's answer (runs those not yet run)."""
        return {d.key: self.has(d) for d in ALL_DEFECTS}

    def _run(self, defect: Defect) -> bool:
        probe = {
            D1.key: self._probe_fake_grad_in_real_leaf,
            D2.key: self._probe_parameter_real_tensor,
            GRAD_COPY.key: self._probe_grad_copy,
            POST_HOOKS.key: self._probe_post_hooks_skipped,
            FOREIGN_FAKE.key: self._probe_foreign_fake,
        }[defect.key]
        # An explicit, ordinary autograd state: probes run at first need, which can be inside a
        # fake op's dispatch (autograd keys excluded), under no_grad or inference_mode.
        with self._resolved.ordinary_dispatch(), torch.inference_mode(False):
            found = probe()
        if trace.enabled(trace.INFO):
            trace.emit("defect_probed", trace.INFO, defect=defect.key, present=found)
        return found

    def _probe_fake_grad_in_real_leaf(self) -> bool:
        """Does upstream write a correct real gradient into a real leaf (no prior, then a prior
        that must be accumulated in place)? Our own hooks are bypassed for the probe."""
        try:
            return self._fake_grad_in_real_leaf()
        except Exception:
            return True  # cannot tell (no propagation on this build?): assume upstream is not fixed

    def _fake_grad_in_real_leaf(self) -> bool:
        expected = torch.tensor([2.0, 4.0, 6.0])
        propagate = self._resolved.functorch_config.patch(fake_tensor_propagate_real_tensors=True)
        with self._resolved.disable_current_modes(), torch.enable_grad(), propagate, bypass():
            leaf = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
            with self._resolved.fake_mode_cls(allow_non_fake_inputs=True):
                (leaf * leaf).sum().backward()
            first = leaf.grad
            if first is None or self._resolved.is_fake(first) or not torch.equal(first, expected):
                return True
            with self._resolved.fake_mode_cls(allow_non_fake_inputs=True):
                (leaf * leaf).sum().backward()
            second = leaf.grad
            return not (second is first and torch.equal(second, 2 * expected))

    def _probe_post_hooks_skipped(self) -> bool:
        ran: list[bool] = []
        with self._resolved.disable_current_modes(), torch.enable_grad(), bypass():
            leaf = torch.zeros(2, requires_grad=True)
            leaf.register_post_accumulate_grad_hook(lambda _t: ran.append(True))
            out = (leaf * 2).sum()
            node = out.grad_fn.next_functions[0][0]  # type: ignore[union-attr]
            node.register_prehook(lambda _grads: (None,))  # type: ignore[union-attr]
            out.backward()
        return not ran

    def _probe_parameter_real_tensor(self) -> bool:
        values = torch.linspace(-3.25, 7.5, 24).reshape(4, 6)
        with (
            self._resolved.disable_current_modes(),
            torch.no_grad(),
            self._resolved.functorch_config.patch(fake_tensor_propagate_real_tensors=True),
            bypass(),
        ):
            source = torch.nn.Parameter(values.clone())
            mode = self._resolved.fake_mode_cls()
            fake = mode.from_tensor(source)
            real = getattr(fake, "real_tensor", None)
            if real is None:
                return False  # this build does not propagate through from_tensor: nothing to repair
            return not torch.equal(real, values)

    def _probe_foreign_fake(self) -> bool:
        """Every tensor stays referenced until the comparison, and two different value sets are
        used: a fresh, uninitialised copy can land on a freed block that held the same values
        (seen on 2.4: a probe answering "fixed" by coincidence in one process of two)."""
        with (
            self._resolved.disable_current_modes(),
            torch.no_grad(),
            self._resolved.functorch_config.patch(fake_tensor_propagate_real_tensors=True),
            bypass(),
        ):
            keep = []
            for values in (
                torch.linspace(-3.25, 7.5, 24).reshape(4, 6),
                torch.linspace(9.0, -1.5, 24).reshape(4, 6),
            ):
                source = values.clone()
                first = self._resolved.fake_mode_cls().from_tensor(source)
                if getattr(first, "real_tensor", None) is None:
                    return False  # no propagation through from_tensor: nothing to repair
                second = self._resolved.fake_mode_cls(allow_non_fake_inputs=True).from_tensor(first)
                keep.append((values, source, first, second))
                real = getattr(second, "real_tensor", None)
                if real is not None and not torch.equal(real, values):
                    return True
            return False

    def _probe_grad_copy(self) -> bool:
        """Convert plain and Parameter leaves holding strided grads; compare the fake grad's real
        values, strides and device with the source grad's."""
        with (
            self._resolved.disable_current_modes(),
            torch.no_grad(),
            self._resolved.functorch_config.patch(fake_tensor_propagate_real_tensors=True),
            bypass(),
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
                    fake = self._resolved.fake_mode_cls().from_tensor(source)
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
