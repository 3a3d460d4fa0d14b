"""What the dispatch path needs to know about an op, read from its schema once and cached.

Every part (the fast path, upstream's path with its repairs, the write-back watch) asks
:func:`facts` instead of reading the schema itself.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import torch

from ..touchpoints import targets as _targets


class Kind(enum.Enum):
    """How the fast path takes an op."""

    #: makes new tensors: no argument written, no return aliased, only tensor returns
    NEW = "new"
    #: a view: every return (a tensor) aliases one argument, none written
    VIEW = "view"
    #: changes only its first argument's values (``add_``, ``relu_``, ``uniform_``)
    IN_PLACE = "in-place"
    #: upstream's path (``out=``, ``inplace_view`` ops, ops returning numbers, other namespaces)
    OTHER = "other"


#: aten ops whose kernels write arguments their schemas do not mark written: BatchNorm's
#: running statistics (``Tensor? running_mean``), the RNNs' dropout state. Their writes are seen
#: through upstream's path (the decomposition's nested ``copy_``: write-back or the lost-update
#: report), so they never take the fast path. tests/test_propagation.py scans every aten schema
#: of the installed build for such arguments and checks that this list holds them all.
HIDDEN_WRITES = frozenset(
    {
        "native_batch_norm",
        "cudnn_batch_norm",
        "miopen_batch_norm",
        "batch_norm",  # composite (decomposed above the mode), unannotated on 2.4
        "_batch_norm_impl_index",
        "_cudnn_rnn",
        "miopen_rnn",
    }
)
#: of those, the kernels the fast path runs itself (BatchNorm's forward: new tensors, and, when the
#: flag argument ``training`` is true, the running statistics updated in place): the argument
#: names they write, and the flag. The watch is told of the writes as of a schema's (the update
#: reaches the real buffer under write-back, and is reported otherwise), so the op runs its real
#: kernel once, where upstream's path runs it and then its decomposition's kernels again.
FAST_HIDDEN_WRITES: dict[str, tuple[tuple[str, ...], str]] = {
    "native_batch_norm": (("running_mean", "running_var"), "training"),
    "cudnn_batch_norm": (("running_mean", "running_var"), "training"),
    "miopen_batch_norm": (("running_mean", "running_var"), "training"),
}
#: aten ops whose outputs upstream's fakes represent with a dispatch key of their own, which a
#: fake made from the real output's metadata would lose (``_efficientzerotensor``: autograd's
#: zero gradients; without the ZeroTensor key on the fake, the next op's real kernel reads the
#: real ZeroTensor's null data pointer)
UPSTREAM_FAKES = frozenset({"_efficientzerotensor"})
#: FakeTensorMode's lift functions (``torch.tensor``): constants, upstream's
_LIFT = frozenset({"lift_fresh", "lift_fresh_copy"})
_TENSORS = ("Tensor", "Tensor?", "Tensor[]", "List[Tensor]", "Optional[Tensor]")
_LISTS = ("Tensor[]", "List[Tensor]")
NO_WRITES: tuple[tuple[int, str], ...] = ()


@dataclass(frozen=True, slots=True)
class OpFacts:
    kind: Kind
    #: ``(position, name)`` of every argument the schema marks written
    written: tuple[tuple[int, str], ...]
    #: the names of the arguments it writes values of (not ``inplace_view`` ops' metadata)
    written_names: frozenset[str]
    #: every return is a new tensor (no alias annotation)
    fresh_outputs: bool
    #: aliases its arguments' storage without writing their values (a view, an
    #: ``inplace_view`` op, ``set_``): its outputs must alias the raw storage itself
    aliasing: bool
    #: the argument a view's returns alias (-1: none readable)
    view_base: int
    #: draws from a generator (``nondeterministic_seeded``, or a generator argument: 2.4's
    #: ``prims.uniform`` has no tag)
    random: bool
    #: changes its first argument's sizes or strides (``inplace_view`` ops, ``resize_``)
    mutates_metadata: bool
    #: a view op, or ``set_`` (its output takes another tensor's storage)
    is_view: bool
    #: ``set_`` with a storage or tensor source
    sets_storage: bool
    #: a view op that sets a conjugate or negative bit (``conj()``, ``x.conj().imag``)
    bit_view: bool
    #: FakeTensorMode runs it on all-real arguments itself (numbers bound to tensors:
    #: ``torch.div(4, 4)``), making a small output a constant
    numbers_as_tensors: bool
    #: ``(position, name)`` of the arguments its kernel writes though its schema does not say
    #: so (:data:`FAST_HIDDEN_WRITES`), and the position of the flag that says it does (-1: none)
    hidden: tuple[tuple[int, str], ...] = ()
    hidden_when: tuple[int, str] = (-1, "")

    def writes(self, op_args: Any, op_kwargs: Any, fast: bool) -> tuple[tuple[int, str], ...]:
        """The arguments this call writes: its schema's; where the fast path runs the kernel
        (``fast``), also its hidden writes when its flag argument is true."""
        if self.written or not self.hidden or not fast:
            return self.written
        index, name = self.hidden_when
        flag = op_args[index] if index < len(op_args) else op_kwargs.get(name)
        return self.hidden if flag else NO_WRITES


_FACTS: dict[Any, OpFacts] = {}
_OTHER_FACTS = OpFacts(
    Kind.OTHER, NO_WRITES, frozenset(), False, True, -1, False, False, False, False, False, False
)


def facts(func: Any) -> OpFacts:
    found = _FACTS.get(func)
    if found is None:
        found = _FACTS[func] = _read(func)
    return found


def _read(func: Any) -> OpFacts:
    schema = getattr(func, "_schema", None)
    if schema is None:
        return _OTHER_FACTS
    arguments = schema.arguments  # (new objects at every read on some builds)
    name = schema.name.partition("::")[2]
    tags = getattr(func, "tags", ())
    inplace_view = torch.Tag.inplace_view in tags
    written = tuple(
        (i, a.name)
        for i, a in enumerate(arguments)
        if a.alias_info is not None and a.alias_info.is_write
    )
    written_names = frozenset() if inplace_view else frozenset(n for _, n in written)
    returns_alias = any(r.alias_info is not None for r in schema.returns)
    allow_numbers = _targets.resolve_optional(_targets.SHOULD_ALLOW_NUMBERS)
    hidden, hidden_when = _hidden(name, arguments, written)
    return OpFacts(
        kind=_kind(func, schema, arguments, name, inplace_view, written),
        written=written,
        written_names=written_names,
        fresh_outputs=all(r.alias_info is None for r in schema.returns),
        aliasing=(inplace_view or name.startswith("set_") or (returns_alias and not written_names)),
        view_base=_view_base(schema, arguments),
        random=torch.Tag.nondeterministic_seeded in tags
        or any("Generator" in str(a.type) for a in arguments),
        mutates_metadata=inplace_view or schema.name in ("aten::resize_", "aten::resize_as_"),
        is_view=bool(getattr(func, "is_view", False)) or schema.name == "aten::set_",
        sets_storage=schema.name == "aten::set_" and len(arguments) > 1,
        bit_view=func in _targets.bit_views(),
        numbers_as_tensors=bool(allow_numbers is not None and allow_numbers(func)),
        hidden=hidden,
        hidden_when=hidden_when,
    )


def _hidden(name: str, arguments: Any, written: Any) -> tuple[Any, tuple[int, str]]:
    """:data:`FAST_HIDDEN_WRITES`' entry for the op, as positions; none where the schema is not
    the one expected (an argument missing or renamed, or annotated written on this build)."""
    entry = FAST_HIDDEN_WRITES.get(name)
    if entry is None or written:
        return NO_WRITES, (-1, "")
    names, flag = entry
    position = {a.name: i for i, a in enumerate(arguments)}
    if flag not in position or any(n not in position for n in names):
        return NO_WRITES, (-1, "")
    return tuple((position[n], n) for n in names), (position[flag], flag)


def _kind(
    func: Any, schema: Any, arguments: Any, name: str, inplace_view: bool, written: Any
) -> Kind:
    if getattr(func, "namespace", None) != "aten" or not schema.returns:
        return Kind.OTHER
    if name in HIDDEN_WRITES and (name not in FAST_HIDDEN_WRITES or written):
        return Kind.OTHER
    if name in _LIFT or inplace_view or name in UPSTREAM_FAKES:
        return Kind.OTHER
    if written:
        return Kind.IN_PLACE if _plain_in_place(schema, arguments, written, name) else Kind.OTHER
    if any(str(r.type) not in _TENSORS for r in schema.returns):
        return Kind.OTHER
    aliased = [r.alias_info is not None for r in schema.returns]
    if not any(aliased) and not any(a.alias_info is not None for a in arguments):
        return Kind.NEW
    if all(aliased) and _view_base(schema, arguments) >= 0:
        return Kind.VIEW
    return Kind.OTHER


def _plain_in_place(schema: Any, arguments: Any, written: Any, name: str) -> bool:
    """``self`` is the one argument written, a tensor, the one return aliases it, no other
    argument aliases, and it keeps ``self``'s sizes and strides (not ``resize_``/``set_``)."""
    first = arguments[0] if arguments else None
    if (
        first is None
        or len(written) != 1
        or written[0][1] != first.name
        or str(first.type) != "Tensor"
        or len(schema.returns) != 1
        or schema.returns[0].alias_info is None
        or "resize" in name
        or name.startswith("set_")
    ):
        return False
    same = schema.returns[0].alias_info.before_set == first.alias_info.before_set
    return same and not any(a.alias_info is not None for a in arguments[1:])


def _view_base(schema: Any, arguments: Any) -> int:
    """The argument a view's returns alias, or -1. A list of views (``split``, ``unbind``:
    ``Tensor(a -> *) self -> Tensor(a)[]``) shows its element's alias set nowhere in the Python
    schema (the list's own is empty): its base is the one argument whose set widens to the
    wildcard (``a -> *``), where that is the only return and a list of tensors."""
    sets = [r.alias_info.before_set for r in schema.returns if r.alias_info is not None]
    if sets == [set()] and str(schema.returns[0].type) in _LISTS:
        wild = [
            i
            for i, a in enumerate(arguments)
            if a.alias_info is not None and "*" in getattr(a.alias_info, "after_set", ())
        ]
        return wild[0] if len(wild) == 1 and not arguments[wild[0]].alias_info.is_write else -1
    for index, argument in enumerate(arguments):
        info = argument.alias_info
        if info is not None and sets and all(info.before_set & s for s in sets):
            return index
    return -1
