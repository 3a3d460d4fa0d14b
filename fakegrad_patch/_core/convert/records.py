"""What the patch knows of the conversions propagating modes made: per converter, which real
tensor each fake's values copy and how current they are; and the live copies of each real tensor.

The values machinery (the converter wrapper) writes these records; the dispatch path refreshes
the copies when an op inside the mode updates a real tensor for real.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from ... import trace
from ..touchpoints import targets as _targets
from ..weak import WeakIdTable
from . import leaves as _leaves
from . import lending as _lending

#: converter -> (real source root -> (weak ref to the fake root, data pointer of its propagated
#: storage, source version when synced))
_records: WeakIdTable[WeakIdTable[tuple[Any, int, int]]] = WeakIdTable()
#: real root -> {StorageImpl address: weak reference to the storage} of the propagated copies
#: made of it (a storage lives while any fake or view over it does; its data pointer moves when
#: lent values are owned: lending.py)
_copies: WeakIdTable[dict[int, Any]] = WeakIdTable()


#: converter -> {real leaf that requires grad: True}: the leaves its mode's ops read without
#: converting them (dispatch/fast.py, direct reads); ``uninstall()`` arms them as it arms the
#: converted ones, so a graph built while installed finishes with real gradients
_read: WeakIdTable[WeakIdTable[bool]] = WeakIdTable()


def records() -> Any:
    """Every live ``(converter, table)``."""
    return _records.items()


def note_read(conv: Any, t: Any) -> None:
    """``t`` (real, requires grad) was read directly by an op of ``conv``'s mode."""
    table = _read.get(conv)
    if table is None:
        table = WeakIdTable()
        _read.set(conv, table)
    if t not in table:
        table.set(t, True)


def read_leaves() -> list[Any]:
    """Every real tensor that requires grad a live converter's mode read directly."""
    return [t for _conv, table in _read.items() for t, _ in table.items()]


def table_of(conv: Any) -> WeakIdTable[tuple[Any, int, int]]:
    """``conv``'s table (made at its first conversion)."""
    table = _records.get(conv)
    if table is None:
        table = WeakIdTable()
        _records.set(conv, table)
    return table


def lookup(conv: Any) -> WeakIdTable[tuple[Any, int, int]] | None:
    return _records.get(conv)


def note_copy(root: Any, real: Any) -> None:
    """``real`` (a fake's propagated values) is a copy of the real tensor ``root``."""
    storage = real.untyped_storage()
    key = _targets.storage_key(storage)
    copies = _copies.get(root)
    if copies is None:
        copies = {}
        _copies.set(root, copies)
    ref = copies.get(key)
    if ref is None or ref() is not storage:
        copies[key] = weakref.ref(storage)


class Copies:
    """Refreshes the copies of a real tensor updated for real inside a mode."""

    def __init__(self, no_dispatch: Any) -> None:
        self._no_dispatch = no_dispatch

    def refresh(self, t: Any) -> None:
        """``t`` (real) was just updated for real by an op inside a propagating mode (all real
        arguments: upstream runs it on ``t`` itself): every live copy of it gets its new values
        now, so views made of them earlier read what eager's views of ``t`` read. The copies'
        storages, not their fakes: a fast-path view outlives the fake it was made of. (No
        version test: ADInplaceOrView bumps ``t``'s version after the kernel returns.)"""
        if t.layout != torch.strided or t.device.type == "meta":
            return
        root = t._base if t._base is not None else t
        copies = _copies.get(root)
        if not copies:
            return
        source = root.untyped_storage()
        ptr = source.data_ptr()
        for key, ref in list(copies.items()):
            storage = ref()
            if storage is None:
                del copies[key]
                continue
            if storage.data_ptr() == ptr or storage.nbytes() != source.nbytes():
                continue  # an alias of t (write-back, lent values), or a layout of its own
            _lending.own(storage)  # lent values of t's earlier bytes: copied first
            with self._no_dispatch(), torch.no_grad():
                storage.copy_(source)
            if trace.enabled(trace.INFO):
                fields = _leaves.leaf_fields(root)
                fields["bytes"] = source.nbytes()
                trace.emit_fields("propagated_values_resynced", trace.INFO, fields, owned=True)
        version = root._version
        for _conv, table in _records.items():
            entry = table.get(root)
            if entry is not None and entry[0] is not None and entry[1] != ptr:
                table.set(root, (entry[0], entry[1], version))
