"""Conversions the patch did not see, on builds with D2 (a converted Parameter gets
uninitialised propagated values unless the patch repairs it).

The first time a converter is met after the patch was applied (again), the tensors it converted
before are compared with the patch's records (convert/records.py). A Parameter converted while
the patch was not installed had uninitialised values, so everything its mode computed is
untrusted: real gradients are not written for that mode (trace, warning, ``on_missing``), never
silently wrong ones. Once per converter per generation (``uninstall()`` and each installation
start a new one).
"""

from __future__ import annotations

from typing import Any

import torch

from ... import trace
from ..touchpoints.probes import D2, Probes
from ..touchpoints.targets import Resolved
from ..weak import WeakIdTable
from . import leaves as _leaves
from . import records as _records

#: converter -> the generation in which its earlier conversions were last checked
_contacts: WeakIdTable[int] = WeakIdTable()
#: mode -> why its propagated values cannot be trusted
_tainted: WeakIdTable[str] = WeakIdTable()
#: converter -> how many new conversions it had made when the patch last saw one (D2 builds)
_made: WeakIdTable[int] = WeakIdTable()
#: converter -> the generation in which its conversions were last checked for Parameters
#: converted with no record at all (check_mode(definite_only=True))
_definite: WeakIdTable[int] = WeakIdTable()


class _Generation:
    """Bumped by every uninstall() (conversions may happen unseen from then on) and every
    installation, once its converter wrapper is in place (it checks each converter again at its
    first contact). A removed installation's wrapper that had passed its ``active`` test before
    ``uninstall()`` finishes its conversion after it, first contact included: that contact must
    not count for the next installation (a Parameter converted unseen right after, before the
    next ``install()``, went unnoticed: wrong real gradients in the re-install stress test;
    tests/test_multi_mode.py)."""

    value = 0


def new_generation() -> None:
    _Generation.value += 1


def generation() -> int:
    """Bumped by every ``uninstall()`` and every installation (:class:`_Generation`)."""
    return _Generation.value


def taint_count() -> int:
    return len(_tainted)


def tainted(mode: Any) -> bool:
    """Whether a mode's propagated values cannot be trusted (a conversion unseen on a D2 build)."""
    return len(_tainted) > 0 and mode in _tainted


class Unseen:
    """One installation's check of conversions it did not see."""

    def __init__(self, resolved: Resolved, probes: Probes) -> None:
        self._resolved = resolved
        self._probes = probes
        self._is_fake = resolved.is_fake
        #: probe D2, read at the first propagating conversion
        self._d2: bool | None = None

    def first_contact(self, conv: Any, mode: Any, current: Any) -> None:
        """A propagating conversion by ``conv``: the first this generation checks its earlier
        ones."""
        if _contacts.get(conv) != _Generation.value:
            self._contact(conv, mode, current)

    def note_made(self, conv: Any) -> None:
        """Remember the converter's count of new fakes (only where D2 is known present: the
        untrusted-mode check needs it; never runs the probe)."""
        if self._d2 is None:
            self._d2 = self._probes.cached(D2)
        if self._d2:
            made = self._resolved.conversions_made(conv)
            if made is not None:
                _made.set(conv, made)

    def check_mode(self, mode: Any, *, definite_only: bool = False) -> bool:
        """Before a backward from ``mode``'s fakes: is the mode tainted? (Checks its converter's
        earlier conversions once per generation.)

        ``definite_only`` (a gradient materialized by a hook that outlived ``uninstall()``, the
        patch still uninstalled): only a Parameter the converter describes with no record of
        ours at all (converted while uninstalled: a forward that straddles ``uninstall()``)
        taints the mode; this neither counts as the generation's full check (the next armed
        backward still runs it) nor uses its re-conversion rule (conversions of plain tensors
        during the backward, unseen while uninstalled, are harmless)."""
        if mode is None:
            return False
        conv = getattr(mode, "fake_tensor_converter", None)
        if conv is not None and getattr(mode, "propagate_real_tensors", False):
            if definite_only:
                if _definite.get(conv) != _Generation.value:
                    _definite.set(conv, _Generation.value)
                    self._contact(conv, mode, None, definite_only=True)
            elif _contacts.get(conv) != _Generation.value:
                self._contact(conv, mode, None)
        return tainted(mode)

    def _contact(self, conv: Any, mode: Any, current: Any, *, definite_only: bool = False) -> None:
        """First time this generation: did ``conv`` convert Parameters the patch never synced?
        (Only where D2 makes such conversions wrong; once per converter per generation.)

        A Parameter it described that has no record of ours was converted unseen. When the
        converter made new conversions since the patch last saw one, a Parameter whose recorded
        fake is gone (or is not the one the converter's memo holds now) may have been re-converted
        unseen too: not proven right, so not trusted."""
        if not definite_only:
            _contacts.set(conv, _Generation.value)
        described = self._resolved.described_tensors(conv)
        if not described:
            return
        if not any(type(src) is not torch.Tensor and not self._is_fake(src) for src in described):
            return  # no Parameter (or other subclass) converted: D2 cannot matter, no probe
        if not self._probes.has(D2):
            return
        table = _records.lookup(conv)
        made = self._resolved.conversions_made(conv)
        unseen = (
            not definite_only
            and made is not None
            and made > _made.get(conv, 0) + (current is not None)
        )
        memo = self._resolved.memo_of(conv)
        skip = {id(current), id(current._base)} if current is not None else set()
        for src in described:
            if type(src) is torch.Tensor or id(src) in skip or self._is_fake(src):
                continue
            if src.device.type == "meta":
                continue
            entry = table.get(src) if table is not None else None
            if entry is not None:
                if not unseen:
                    continue
                ours = entry[0]() if entry[0] is not None else None
                if ours is not None and (memo is None or memo(src) in (None, ours)):
                    continue
            _tainted.set(mode, "converted while the patch was not installed (D2)")
            if trace.enabled(trace.WARNING):
                trace.emit(
                    "mode_untrusted",
                    trace.WARNING,
                    **_leaves.leaf_fields(src),
                    reason="converted while the patch was not installed (D2)",
                )
            return
