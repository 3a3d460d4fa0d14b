"""Registries keyed by object identity that forget an entry when its key object dies.

Every registry of the patch is one of these: O(1) per lookup, insertion and removal at any size
(no periodic rebuild), never keeping a key alive, never confusing a dead object with a new one
that reuses its ``id``. Standard library only.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from functools import partial as _partial
from typing import Any, Generic, TypeVar

V = TypeVar("V")
_ref = weakref.ref


class WeakIdTable(Generic[V]):
    """``obj -> value`` by identity; the entry goes when ``obj`` is garbage collected.

    Thread-safe for single operations (each is one dict operation under the GIL); a caller that
    needs check-then-set atomicity holds its own lock.
    """

    __slots__ = ("__weakref__", "_data", "_remove")

    def __init__(self) -> None:
        data: dict[int, tuple[weakref.ref[Any], V]] = {}
        self._data = data

        def remove(key: int, ref: weakref.ref[Any], _data: dict[int, Any] = data) -> None:
            entry = _data.get(key)
            if entry is not None and entry[0] is ref:  # not a newer object reusing the id
                del _data[key]

        self._remove = remove

    def get(self, obj: Any, default: Any = None) -> Any:
        entry = self._data.get(id(obj))
        if entry is not None and entry[0]() is obj:
            return entry[1]
        return default

    def get_many(self, objs: list[Any]) -> list[Any]:
        """``[get(obj) for obj in objs]`` in one call (None where absent)."""
        data = self._data
        out: list[Any] = []
        for obj in objs:
            entry = data.get(id(obj))
            out.append(entry[1] if entry is not None and entry[0]() is obj else None)
        return out

    def __contains__(self, obj: Any) -> bool:
        entry = self._data.get(id(obj))
        return entry is not None and entry[0]() is obj

    def set(self, obj: Any, value: V) -> None:
        key = id(obj)
        entry = self._data.get(key)
        if entry is not None and entry[0]() is obj:
            self._data[key] = (entry[0], value)  # same object: keep its reference
        else:
            # the death callback knows its key through a C partial: no Python frame per entry
            self._data[key] = (_ref(obj, _partial(self._remove, key)), value)

    def pop(self, obj: Any, default: Any = None) -> Any:
        key = id(obj)
        entry = self._data.get(key)
        if entry is not None and entry[0]() is obj:
            del self._data[key]
            return entry[1]
        return default

    def items(self) -> Iterator[tuple[Any, V]]:
        """Live ``(obj, value)`` pairs (a snapshot: safe against concurrent changes)."""
        for ref, value in list(self._data.values()):
            obj = ref()
            if obj is not None:
                yield obj, value

    def clear(self) -> None:
        self._data.clear()

    def __len__(self) -> int:
        return len(self._data)
