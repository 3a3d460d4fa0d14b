"""Registries keyed by object identity that forget an entry when its key object dies.

Every registry of the patch is one of these: O(1) per lookup, insertion and removal at any size
(no periodic rebuild), never keeping a key alive, never confusing a dead object with a new one
that reuses its ``id``. Standard library only.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import Any, Generic, TypeVar

V = TypeVar("V")


class _KeyedRef(weakref.ref):
    """A weak reference that knows its table key (the death callback needs it)."""

    __slots__ = ("key",)

    key: int

    def __new__(cls, obj: Any, callback: Any, key: int) -> _KeyedRef:
        self = super().__new__(cls, obj, callback)
        self.key = key
        return self

    def __init__(self, obj: Any, callback: Any, key: int) -> None:
        super().__init__(obj, callback)  # type: ignore[call-arg]


class WeakIdTable(Generic[V]):
    """``obj -> value`` by identity; the entry goes when ``obj`` is garbage collected.

    Thread-safe for single operations (each is one dict operation under the GIL); a caller that
    needs check-then-set atomicity holds its own lock.
    """

    __slots__ = ("__weakref__", "_data", "_remove")

    def __init__(self) -> None:
        data: dict[int, tuple[_KeyedRef, V]] = {}
        self._data = data

        def remove(ref: _KeyedRef, _data: dict[int, tuple[_KeyedRef, Any]] = data) -> None:
            entry = _data.get(ref.key)
            if entry is not None and entry[0] is ref:  # not a newer object reusing the id
                del _data[ref.key]

        self._remove = remove

    def get(self, obj: Any, default: Any = None) -> Any:
        entry = self._data.get(id(obj))
        if entry is not None and entry[0]() is obj:
            return entry[1]
        return default

    def __contains__(self, obj: Any) -> bool:
        entry = self._data.get(id(obj))
        return entry is not None and entry[0]() is obj

    def set(self, obj: Any, value: V) -> None:
        key = id(obj)
        entry = self._data.get(key)
        if entry is not None and entry[0]() is obj:
            self._data[key] = (entry[0], value)  # same object: keep its reference
        else:
            self._data[key] = (_KeyedRef(obj, self._remove, key), value)

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
