"""Ops FakeTensorMode runs under the mode inside another op (a decomposition, a meta
implementation): they run for real again, after the outer op already did.

* **A nested write** of an argument of the outer op, when the outer op ran for real, would apply
  its update a second time (``index_add_`` into ``index_put_``; ``native_batch_norm``'s running
  statistics): the nested op gets a shadow copy until the outer op returns
  (``propagation_repaired``, ``repair: "nested_write"``). When the outer op did not run for real,
  the nested op is the only one that updates: it writes the values once.
* **A nested random op** would draw its numbers again (``uniform_``'s ``prims.uniform``): its
  generators keep their state.
* **The outer op's real output**, read from upstream's frame at its first nested op: 2.4's
  decomposition path returns the nested ops' values without it (another rounding, other strides,
  other random draws); the outer op's new outputs get it (``repair: "decomposition_values"``).
"""

from __future__ import annotations

from typing import Any

import torch

from ..touchpoints.targets import Resolved
from .frames import Frame
from .stats import Stats
from .tensors import CannotRebuild, pair, private_copy, storage_ptr, tensors_in, written_tensors
from .upstream import Upstream
from .watch import Watch


class Nested:
    def __init__(self, resolved: Resolved, stats: Stats, watch: Watch, upstream: Upstream) -> None:
        self._resolved = resolved
        self._is_fake = resolved.is_fake
        self._stats = stats
        self._watch = watch
        self._upstream = upstream

    def ran_for_real(self, frame: Frame) -> bool:
        """Did the outermost op of ``frame`` run for real (every fake argument with values)?"""
        if not frame.scanned:
            self._watch.scan(frame)
        return frame.real_ok

    def shadow(self, frame: Frame, func: Any, written: Any, op_args: Any, op_kwargs: Any) -> None:
        """The nested op ``func`` writes arguments of the outer op, which ran for real: each
        gets a shadow copy of its values until the outer op returns."""
        if not frame.scanned:
            self._watch.scan(frame)
        if not frame.arguments or not frame.real_ok:
            return
        no_dispatch = self._resolved.no_dispatch
        for t in written_tensors(written, op_args, op_kwargs):
            if not self._is_fake(t):
                continue
            real = t.real_tensor
            ptr = storage_ptr(real)
            if ptr is None or ptr not in frame.arguments:
                continue
            with no_dispatch(), torch.no_grad():
                shadow = private_copy(real)
                t.real_tensor = shadow
            frame.swaps.append((t, real, shadow))
            self._stats.report(
                "nested_write", "propagation_repaired", func, repair="nested_write", values="shadow"
            )

    def unshadow(self, frame: Frame) -> None:
        with self._resolved.no_dispatch():
            for fake, before, _shadow in reversed(frame.swaps):
                fake.real_tensor = before

    def values_of_the_real_run(self, mode: Any, func: Any, result: Any, real_out: Any) -> Any:
        """The outer op's new outputs came back from its decomposition without its real run's
        values: they get them, where every output agrees in sizes, dtype and device, and are
        made again from them where their strides are not the real ones'."""
        fakes: list[Any] = []
        reals: list[Any] = []
        try:
            pair(result, real_out, fakes, reals)
        except CannotRebuild:
            return result
        if not fakes or all(
            getattr(f, "real_tensor", None) is r for f, r in zip(fakes, reals, strict=True)
        ):
            return result  # upstream propagated them (the build's decomposition path does)
        try:
            result = self._upstream.with_values(result, real_out)
        except CannotRebuild:
            return result
        self._stats.report(
            "decomposition_values",
            "propagation_repaired",
            func,
            repair="decomposition_values",
            values="real kernel",
        )
        return self._upstream.agreeing(mode, func, result)


class GeneratorsKept:
    """The generators an op draws from have the same state after it as before: its explicit
    ``generator`` argument, else the default generators of the devices it names or works on
    (CPU and CUDA; another device's default generator is not reachable by a public API and is
    left to draw)."""

    def __init__(self, op_args: Any, op_kwargs: Any) -> None:
        generators = [v for v in (*op_args, *op_kwargs.values()) if isinstance(v, torch.Generator)]
        if not generators:
            devices = {t.device for t in tensors_in((*op_args, *op_kwargs.values()))}
            device = op_kwargs.get("device")
            if device is not None:
                devices.add(torch.device(device))
            if not devices:
                devices.add(torch.device("cpu"))
            for d in devices:
                if d.type == "cpu":
                    generators.append(torch.random.default_generator)
                elif d.type == "cuda" and torch.cuda.is_initialized():
                    index = d.index if d.index is not None else torch.cuda.current_device()
                    generators.append(torch.cuda.default_generators[index])
        self.kept = [(g, g.get_state()) for g in generators]

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        for generator, state in self.kept:
            generator.set_state(state)
