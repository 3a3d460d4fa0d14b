"""Lending: a parameter's values given to its fakes without a copy (issue 46, item 2).

A propagating mode gives the fake of a real tensor its own copy of the values: on 2.14+ upstream
clones the storage (``meta_utils._clone_real_storage_from_tensor``), on 2.6-2.13 the D2 repair
copies into the uninitialised storage upstream made (values.py). For a tensor that requires grad
(a parameter) that copy is only read, unless an op inside the mode writes it. Where the build has
the primitives, the fake's values are *lent* instead: a storage over the parameter's bytes that
does not own them (``_construct_storage_from_data_pointer``), the parameter's storage held here
until that storage dies. The first write to any fake over a lent storage (the converted fake, its
views, the ones autograd saved: one StorageImpl) copies the values once for all of them
(:func:`own`: ``_swap_data_ptr_`` with a clone). Who calls :func:`own`:

* the dispatch wrapper, for every fake an op writes (its schema's writes, BatchNorm's hidden
  ones), before the op runs, outer or nested; while such an op runs nothing is lent, and a lent
  fake the converter's memo returns is owned (values.py), so a real tensor the op writes is
  converted to a copy, exactly as before (and its update reported as lost);
* every copy of ours into a fake's values (a stale re-sync, records' refresh);
* the stand-ins follow the new data pointer (``on_owned``), so a write is still reported.

Never lent: write-back on (its aliases are real writes), ``propagation="upstream"``, a tracer's
conversion or a mode with a ShapeEnv, a subclass, a tensor that does not require grad (buffers
have hidden writes), a view with bits, not strided, empty, not on the CPU (CUDA: the primitives
exist, but lending has not run on a GPU yet, where streams may read the bytes being copied); a
build without the primitives (2.4.0): copied as before. ``uninstall()`` owns every lent storage.

Reads see the parameter's current bytes: an update made outside the mode (an optimizer step
between two graphs of one mode) is what the fake reads next, as the copy's re-sync by version
made it read before; ``p.data = other`` leaves the fake with the old bytes (held), as the copy did.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch

from ... import trace
from ..state import warn_once
from ..touchpoints.targets import LENDING_GUARDS
from ..touchpoints.targets import storage_key as _key

#: what may be lent: plain tensors and parameters (dispatch.tensors' PLAIN_TYPES; no subclass)
_PLAIN = (torch.Tensor, torch.nn.Parameter)
#: reentrant: a finalizer (``_forget``) may run inside a locked section of this thread (the
#: garbage collector runs at any allocation)
_lock = threading.RLock()
#: StorageImpl address of a lent storage -> [the lender's storage (held until the lent one dies),
#: the lender's data pointer, owned, weak reference to the lent storage]
_loans: dict[int, list[Any]] = {}
#: StorageImpl address of a lender -> the addresses of the storages lent from it
_by_lender: dict[int, set[int]] = {}
#: the storage being converted on this thread that may be lent (values.py sets it around
#: upstream's conversion; the clone wrapper reads it)
_converting = threading.local()


class _State:
    #: the primitives exist and work on this build (probed by :func:`configure`)
    available = False
    #: smaller storages are copied: lending's bookkeeping (an alias, a swap, a registry entry
    #: and its finalizer: ~5-10 µs) costs more than copying 64 KiB (measured: the tiny MLP's
    #: 16 KiB weights were 1-5 % slower lent, 2.13.0)
    min_bytes = 1 << 16
    #: lending allowed now (available, write-back off, propagation repairs)
    enabled = False
    construct: Any = None
    swap: Any = None
    no_dispatch: Any = None
    #: ``(old data pointer, new data pointer)`` after a storage is owned (the stand-ins)
    on_owned: Callable[[int, int], None] | None = None


def configure(construct: Any, swap: Any, no_dispatch: Any) -> bool:
    """Probe the primitives once (a storage lent and owned, the lender untouched); True where
    lending works on this build."""
    if construct is None or swap is None:
        _State.available = False
        return False
    try:
        with no_dispatch(), torch.no_grad():
            source = torch.arange(4, dtype=torch.float32)
            storage = source.untyped_storage()
            alias = construct(storage.data_ptr(), storage.device, storage.nbytes())
            view = torch.empty(0, dtype=torch.float32).set_(alias, 0, (4,), (1,))
            same = view.data_ptr() == source.data_ptr() and bool(view.eq(source).all())
            copy = alias.clone()
            swap(alias, copy)
            view.add_(1)
            works = same and bool(source.eq(torch.arange(4.0)).all()) and view[0].item() == 1.0
    except Exception:
        works = False
    _State.available = works
    _State.construct = construct if works else None
    _State.swap = swap if works else None
    _State.no_dispatch = no_dispatch
    return works


def set_enabled(on: bool) -> None:
    _State.enabled = on and _State.available
    if _State.enabled:
        _guard(True)
    else:
        own_all()
        _guard(False)


# -- a lender's bytes are never freed under a loan -----------------------------------------------
#
# The lent storage holds the lender's storage, not its bytes: resizing the lender, or moving its
# bytes, frees them (FSDP frees an unsharded parameter's storage with
# ``untyped_storage().resize_(0)`` after its forward and gathers it again for backward;
# ``share_memory_`` moves them into shared memory). While lending is on, the public methods that
# do so, as Python calls them, first give every storage lent from the one concerned its own
# values: ``Tensor.resize_``, ``resize_as_``, ``set_`` (which grows the storage it is given),
# ``UntypedStorage.resize_`` and the two sharing methods every sharing path calls. A C++ caller
# (an ``out=`` kernel growing a parameter outside the mode) is not seen: :func:`check` finds the
# moved bytes afterwards, at the next backward of a propagating graph or the next write, and
# reports them (docs/how-it-works.md, "Lending").


def _own_loans_of(storage: Any) -> None:
    keys = _by_lender.get(_key(storage))
    if not keys:
        return
    for key in list(keys):
        loan = _loans.get(key)
        lent = loan[3]() if loan is not None else None
        if lent is not None:
            own(lent)


def _own_loans_of_tensor(t: Any) -> None:
    try:
        if t.layout != torch.strided or t.device.type != "cpu":
            return
        storage = t.untyped_storage()
    except Exception:  # a tensor without storage (functional, nested): lends nothing
        return
    _own_loans_of(storage)


def _storage_self(self: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    _own_loans_of(self)


def _tensor_self(self: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    _own_loans_of_tensor(self)


def _tensor_source(self: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """``Tensor.set_(source, ...)`` grows ``source`` (a storage or a tensor's) to the size given."""
    _own_loans_of_tensor(self)
    source = args[0] if args else kwargs.get("source")
    if isinstance(source, torch.Tensor):
        _own_loans_of_tensor(source)
    elif isinstance(source, torch.TypedStorage):
        _own_loans_of(source.untyped())
    elif isinstance(source, torch.UntypedStorage):
        _own_loans_of(source)


_BEFORE = {
    ("UntypedStorage", "self"): _storage_self,
    ("Tensor", "self"): _tensor_self,
    ("Tensor", "source"): _tensor_source,
}


def _guarded(original: Any, before: Callable[[Any, tuple[Any, ...], dict[str, Any]], None]) -> Any:
    def guarded(self: Any, *args: Any, **kwargs: Any) -> Any:
        if _by_lender:
            before(self, args, kwargs)
        return original(self, *args, **kwargs)

    guarded.__wrapped__ = original  # type: ignore[attr-defined]
    guarded.__name__ = getattr(original, "__name__", "guarded")
    guarded._fakegrad_lending = True  # type: ignore[attr-defined]
    return guarded


def _guard(on: bool) -> None:
    """Put the guards (targets.LENDING_GUARDS) in place (``on``) or take them off, where they
    are ours."""
    for owner_name, attr, frees in LENDING_GUARDS:
        owner: Any = getattr(torch, owner_name)
        if not hasattr(owner, attr):
            continue
        current: Any = owner.__dict__.get(attr)
        ours = getattr(current, "_fakegrad_lending", False)
        if on and not ours:
            setattr(owner, attr, _guarded(getattr(owner, attr), _BEFORE[owner_name, frees]))
        elif not on and ours:
            original = current.__wrapped__
            if original is getattr(owner.__mro__[1], attr, None):
                delattr(owner, attr)
            else:
                setattr(owner, attr, original)


def enabled() -> bool:
    return _State.enabled


def set_on_owned(callback: Callable[[int, int], None] | None) -> None:
    _State.on_owned = callback


def may_lend(t: Any) -> bool:
    """Lending is on and ``t``'s values may be lent (:func:`lendable`)."""
    return _State.enabled and lendable(t)


def lendable(t: Any) -> bool:
    """Whether ``t``'s values may be lent to its fake, lending being on (see the module
    docstring)."""
    return (
        type(t) in _PLAIN
        and t.requires_grad
        and t.layout == torch.strided
        and t.device.type == "cpu"  # CUDA: not yet run on a GPU (streams; issue 47)
        and not t.is_conj()
        and not t.is_neg()
        and not t.is_quantized
        and t.untyped_storage().nbytes() >= _State.min_bytes
    )


# -- lending ------------------------------------------------------------------------------------


def _register(lent: Any, lender: Any) -> None:
    key, lender_key = _key(lent), _key(lender)
    with _lock:
        _loans[key] = [lender, lender.data_ptr(), False, weakref.ref(lent)]
        _by_lender.setdefault(lender_key, set()).add(key)
    weakref.finalize(lent, _forget, key, lender_key)


def _forget(key: int, lender_key: int) -> None:
    """The lent storage died (its finalizer)."""
    with _lock:
        _loans.pop(key, None)
        keys = _by_lender.get(lender_key)
        if keys is not None:
            keys.discard(key)
            if not keys:
                del _by_lender[lender_key]


def _alias(lender: Any) -> Any:
    """A storage over ``lender``'s bytes that does not own them."""
    return _State.construct(lender.data_ptr(), lender.device, lender.nbytes())


def lend(lender: Any) -> Any:
    """A storage over ``lender``'s bytes that does not own them, registered."""
    lent = _alias(lender)
    _register(lent, lender)
    return lent


def lend_into(storage: Any, lender: Any) -> bool:
    """``storage`` (a fake's fresh values, the lender's size) takes an alias of ``lender``'s
    bytes in place of its own (2.6-2.13: instead of the D2 repair's copy)."""
    if storage.nbytes() != lender.nbytes() or storage.device != lender.device:
        return False
    _State.swap(storage, _alias(lender))  # the alias takes the fresh bytes, freed with it
    _register(storage, lender)
    return True


class Converting:
    """Around upstream's conversion of ``t``: upstream's clone of its storage is a loan."""

    __slots__ = ("_before",)

    def __init__(self, t: Any) -> None:
        self._before = getattr(_converting, "key", None)
        _converting.key = _key(t.untyped_storage())

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        _converting.key = self._before


def clone_real_storage(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
    """``meta_utils._clone_real_storage_from_tensor`` (2.14+): the storage of the tensor being
    converted, when it may be lent, is lent."""
    key = getattr(_converting, "key", None)
    if key is not None and _State.enabled and len(args) == 1 and not kwargs:
        t = args[0]
        if type(t) in _PLAIN:
            storage = t.untyped_storage()
            if _key(storage) == key:
                _converting.key = None  # once: a second clone in one conversion copies
                return lend(storage)
    return wrapped(*args, **kwargs)


# -- the first write ----------------------------------------------------------------------------


def any_lent() -> bool:
    return bool(_loans)


def is_lent(storage: Any) -> bool:
    """``storage`` is lent and not yet owned."""
    loan = _loans.get(_key(storage))
    return loan is not None and not loan[2]


def lent_from(storage: Any, lender: Any) -> bool:
    """``storage`` is lent and not owned, over ``lender``'s bytes as they are now."""
    loan = _loans.get(_key(storage))
    return loan is not None and not loan[2] and _key(loan[0]) == _key(lender) and not _moved(loan)


def own(storage: Any) -> None:
    """``storage`` (lent) gets its own copy of the values, for every tensor over it; a no-op for
    any other storage. Raises what the copy raises (out of memory): the write must not reach the
    lender."""
    loan = _loans.get(_key(storage))
    if loan is None or loan[2]:
        return
    with _lock:
        if loan[2]:
            return
        old = storage.data_ptr()
        lost = _moved(loan)
        with _State.no_dispatch(), torch.no_grad():
            if lost:  # the lent bytes were freed under the loan: never read them
                copy = torch.full((storage.nbytes(),), 255, dtype=torch.uint8).untyped_storage()
            else:
                copy = storage.clone()
        _State.swap(storage, copy)  # ``copy`` now holds the alias (not owning), dies here
        loan[2] = True
        new = storage.data_ptr()
    if lost:
        _report_lost(storage.nbytes())
    callback = _State.on_owned
    if callback is not None:
        callback(old, new)


def _moved(loan: list[Any]) -> bool:
    """The lender's bytes are no longer the ones lent (freed or moved under the loan)."""
    return bool(loan[0].data_ptr() != loan[1])


def check() -> None:
    """Loans whose lender's bytes moved under them since they were lent (a C++ caller resized
    the parameter: an ``out=`` kernel outside the mode): the fakes over them get values with
    every bit set (NaN in every floating dtype) in place of freed memory, reported. Called
    before a backward of a propagating graph reads what its fakes saved, and by every write."""
    if not _loans:
        return
    for loan in list(_loans.values()):
        if not loan[2] and _moved(loan):
            lent = loan[3]()
            if lent is not None:
                own(lent)


LOST_MESSAGE = (
    "fakegrad_patch: a parameter's storage was resized or moved outside the mode (a C++ caller, "
    "such as an out= kernel writing a parameter whose shape it changes) while a fake of a "
    "propagating mode read its values; those values were freed with the old bytes and are "
    "replaced by NaN (every bit set; by the parameter's new values where it is converted "
    "again), so gradients that depend on them are NaN. Resize or move a "
    "parameter's storage only after the backward of the graphs that used it, or through "
    "Tensor.resize_ / UntypedStorage.resize_ (seen: the fakes keep their values)."
)


def _report_lost(nbytes: int) -> None:
    if trace.enabled(trace.WARNING):
        trace.emit_fields("lent_values_lost", trace.WARNING, {"bytes": nbytes}, owned=True)
    warn_once("lent_values_lost", LOST_MESSAGE, stacklevel=4)


def own_tensor(t: Any) -> None:
    """:func:`own` for a fake's values (its ``real_tensor``), where it has strided ones."""
    real = getattr(t, "real_tensor", None)
    if real is not None and real.layout == torch.strided:
        own(real.untyped_storage())


def own_all() -> None:
    """Every lent storage gets its own values (``uninstall()``, lending switched off)."""
    for loan in list(_loans.values()):
        storage = loan[3]()
        if storage is not None and not loan[2]:
            own(storage)
