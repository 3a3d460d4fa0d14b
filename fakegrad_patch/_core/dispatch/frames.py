"""The outermost op of a mode on a thread (a :class:`Frame`), and each thread's stack of them.

FakeTensorMode runs decompositions and meta implementations under the mode, so an op can run
nested ops; what the patch decides for an op (its real run, what it writes, what it aliases)
belongs to the outermost one. Every part of the dispatch path reads and writes the same frame.
"""

from __future__ import annotations

import threading
from typing import Any


class Frame:
    """The outermost op of one mode on one thread."""

    __slots__ = (
        "aliased",
        "arguments",
        "copy_back",
        "depth",
        "direct",
        "func",
        "keep",
        "lost",
        "mode",
        "nested",
        "op",
        "param_swaps",
        "real_ok",
        "real_out",
        "real_writes",
        "scanned",
        "swaps",
        "writing",
        "written",
    )

    def __init__(self, mode: Any, op: tuple[Any, Any], func: Any = None) -> None:
        self.mode = mode
        self.func = func
        #: the op's (args, kwargs)
        self.op = op
        #: the op's real output, read from upstream's frame at its first nested op (2.4's
        #: decomposition path drops it); None until then
        self.real_out: Any = None
        #: whether the watch's scan ran (only when the op or a nested op writes)
        self.scanned = False
        #: nesting below the outermost op (0: the outermost op itself)
        self.depth = 0
        #: how many of the ops running in this frame (the outermost, nested ones) write
        #: arguments: no conversion lends values then (convert/lending.py)
        self.writing = 0
        #: storage data pointers of the real tensors the outermost op writes, where it writes
        #: only real tensors (BatchNorm's running statistics); None otherwise
        self.real_writes: frozenset[int] | None = None
        #: storage data pointer -> the real tensor over it, for every argument of the op whose
        #: fake aliases a real tensor
        self.aliased: dict[int, Any] = {}
        #: storage data pointers the op writes (its schema, or a nested op writing the argument)
        self.written: set[int] = set()
        #: the subset nested ops wrote directly (the op itself did not run for real)
        self.nested: set[int] = set()
        #: storage data pointers of the values of the op's own tensor arguments
        self.arguments: set[int] = set()
        #: whether FakeTensorMode runs the op for real: every fake argument has real values
        #: (the modes the patch acts on have no ShapeEnv, so that is upstream's whole test)
        self.real_ok = True
        #: (fake, its propagated values before, the shadow given to nested ops)
        self.swaps: list[tuple[Any, Any, Any]] = []
        #: id -> real tensor, for the real tensors the op's schema writes (``p.grad.zero_()``,
        #: ``param.add_(...)``, ``out=``, ``Tensor(a!)[]`` lists)
        self.direct: dict[int, Any] = {}
        #: id -> (real tensor, the op that wrote only its fake copy): reported when the op returns
        self.lost: dict[int, tuple[Any, str]] = {}
        #: write-back: storage data pointer of a private copy the op itself wrote through a view
        #: (``weight.detach()``) -> (the real root, its stand-in record); copied to the real root
        #: when the op returns, unless a nested op wrote that storage too (then it is reported)
        self.copy_back: dict[int, tuple[Any, Any]] = {}
        #: the converted fakes of this op's real arguments that hold private copies, alive until
        #: the op returns (its view outputs then keep the stand-in records)
        self.keep: list[Any] = []
        #: (fake, its propagated values before): parameters aliased for this op only
        self.param_swaps: list[tuple[Any, Any]] = []


class Frames(threading.local):
    """Each thread's stack of outermost ops (one per mode being dispatched)."""

    def __init__(self) -> None:
        self.stack: list[Frame] = []

    def of(self, mode: Any) -> Frame | None:
        """The frame of ``mode`` on this thread, or None (its outermost op is not running)."""
        for frame in reversed(self.stack):
            if frame.mode is mode:
                return frame
        return None

    def top(self) -> Frame | None:
        return self.stack[-1] if self.stack else None
