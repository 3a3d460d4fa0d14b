"""Every private PyTorch touch point of fakegrad_patch, in one place.

PyTorch's private internals change between releases. Nothing else in this package reaches
into ``torch._*`` directly: it asks this module, which resolves each target by name, checks
what it can (presence, call signature) and reports what is missing so the patch can refuse to
apply instead of breaking the host program.

Each target carries a banner: what it is, the torch builds it was checked on, and why we need it.
Checked on: torch 2.4.0 (Python 3.10), 2.13.0+cpu and 2.14.1+cu130 (run on CPU, Python 3.11),
2.15.0 (Python 3.12, 3.13). Older builds (2.3.1 measured) have no real-value propagation
(``fake_tensor_propagate_real_tensors``, ``FakeTensor.real_tensor``, ``Tensor._use_count``
absent): the patch refuses to apply there, with one warning.

Why it is long: one module by design, so that a reader (or a torch upgrade) finds every private
name in one file; most of its lines are the banners. Sections, in order: the touch points
(``Target`` definitions), resolving them (``Resolved``), the readers of FakeTensorMode's frames,
DDP's and FSDP2's targets, torch.profiler's, TorchScript's builtin table, and the lists read from
the definitions.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

#: torch builds the whole list below was read and tested against.
CHECKED_ON: tuple[str, ...] = ("2.4.0", "2.13.0+cpu", "2.14.1+cu130", "2.15.0")

#: Oldest and newest torch release the suite runs on in CI (inclusive). ``doctor`` reports a
#: build outside it; pyproject.toml declares the same range.
TESTED_TORCH: tuple[str, str] = ("2.4.0", "2.15.0")

#: The module whose import makes the patch applicable (wrapt post-import hook target).
FAKE_TENSOR_MODULE = "torch._subclasses.fake_tensor"


#: every Target, in the order of this module (the lists at its end read it)
_REGISTERED: list[Target] = []


@dataclass(frozen=True)
class Target:
    """One private attribute of torch that fakegrad_patch relies on."""

    module: str
    qualname: str
    why: str
    checked_on: tuple[str, ...] = CHECKED_ON
    #: absent, a detail degrades (said by ``doctor``); present or not, the patch applies
    optional: bool = False
    #: "core" (resolved with the patch) or "ddp" (resolved apart: a missing one leaves DDP to
    #: upstream, the rest of the patch applies)
    group: str = "core"
    #: an attribute set on instances (read there): the class is what can be checked
    on_instances: bool = False

    def __post_init__(self) -> None:
        _REGISTERED.append(self)

    @property
    def dotted(self) -> str:
        return f"{self.module}.{self.qualname}"


# --- The touch points -------------------------------------------------------------------------

#: WRAPPED. The single routine that turns a real tensor into a FakeTensor: implicit conversion of
#: real inputs during dispatch under ``allow_non_fake_inputs=True`` (validate_and_convert_non_fake_
#: tensors calls it for every real argument of every op) and ``FakeTensorMode.from_tensor``.
#: We wrap it (wrapt) to (1) arm the AccumulateGrad node of every real leaf that enters a fake
#: computation, directly or through a real autograd graph (FINDINGS D3), and (2) repair the
#: uninitialised ``real_tensor`` of converted ``nn.Parameter``s on builds with defect D2.
#: Signature checked: ``(self, fake_mode, t, make_constant=False, shape_env=None, *, source=None,
#: symbolic_context=None, trace=True)`` on both builds.
FROM_REAL_TENSOR = Target(
    FAKE_TENSOR_MODULE,
    "FakeTensorConverter.from_real_tensor",
    "wrapped: sees every real tensor entering a fake computation (arming, D2 repair)",
)

#: READ. The FakeTensor class: isinstance checks on incoming gradients, and its ``real_tensor``
#: attribute (set when the mode propagates real tensors) carries the true values we materialize.
FAKE_TENSOR = Target(
    FAKE_TENSOR_MODULE,
    "FakeTensor",
    "isinstance checks on gradients; FakeTensor.real_tensor holds propagated values",
)

#: READ. The mode class: the D2 and D4 probes build one with propagation on;
#: ``mirror_to_sources`` checks its argument's type.
FAKE_TENSOR_MODE = Target(
    FAKE_TENSOR_MODULE,
    "FakeTensorMode",
    "the probes build a propagating mode; mirror_to_sources type check",
)

#: CALLED. Pops every active TorchDispatchMode (FakeTensorMode, FlopCounterMode, ...) for the
#: duration of a block. AccumulateGrad runs with the fake mode still active in thread-local state,
#: so writing a real ``.grad`` needs the modes disabled (FINDINGS "Mechanics").
DISABLE_CURRENT_MODES = Target(
    "torch.utils._python_dispatch",
    "_disable_current_modes",
    "write real gradients while AccumulateGrad runs with the fake mode active",
)

#: CALLED (through config.patch). The flag that makes FakeTensorMode carry real values; the D2 probe
#: turns it on for its private mode. We never read it to decide behaviour: the per-mode attribute
#: ``FakeTensorMode.propagate_real_tensors`` is what counts (the config is per-thread on 2.13).
PROPAGATE_CONFIG = Target(
    "torch._functorch.config",
    "fake_tensor_propagate_real_tensors",
    "D2 probe: build a mode that propagates real tensors",
)

#: CALLED. C++ guard excluding the Python dispatch keys for a block: no TorchDispatchMode
#: (FakeTensorMode, FlopCounterMode, ...) and no tensor subclass sees the ops inside. FakeTensorMode
#: uses the same guard (``torch.utils._mode_utils.no_dispatch``) to run real kernels while it
#: propagates. We copy and accumulate real gradients under it in the AccumulateGrad pre-hook: about
#: 1 us where popping and re-pushing the mode stack (DISABLE_CURRENT_MODES) costs about 15 us per
#: leaf. The zero-copy set path runs no op (attribute reads, the ``.grad`` setter) and skips it.
NO_DISPATCH = Target(
    "torch._C",
    "_DisableTorchDispatch",
    "write real gradients (hot path) with every dispatch mode bypassed",
)

#: CALLED. Sets the thread-local dispatch key sets for a block. We arm a leaf from inside the fake
#: mode's dispatch, i.e. below the Autograd key with most keys excluded; reaching the leaf's
#: AccumulateGrad node (``leaf.view_as(leaf).grad_fn.next_functions[0][0]``, what the public
#: ``torch.autograd.graph.get_gradient_edge`` does) needs the dispatch state of ordinary code.
#: We capture that state (include/exclude sets) when the patch is applied and force it, with the
#: Python dispatch keys (``torch._C.DispatchKey.Python``, ``PythonTLSSnapshot``, ``PreDispatch``)
#: excluded so no mode sees the lookup, for the few microseconds it takes.
FORCE_DISPATCH_KEY_GUARD = Target(
    "torch._C",
    "_ForceDispatchKeyGuard",
    "reach a leaf's AccumulateGrad node from inside fake dispatch; run real kernels inside "
    "the mode with the Conjugate, Negative and ZeroTensor keys enabled, as eager runs them",
)
TLS_INCLUDE_SET = Target(
    "torch._C",
    "_dispatch_tls_local_include_set",
    "capture ordinary dispatch state for FORCE_DISPATCH_KEY_GUARD",
)
TLS_EXCLUDE_SET = Target(
    "torch._C",
    "_dispatch_tls_local_exclude_set",
    "capture ordinary dispatch state for FORCE_DISPATCH_KEY_GUARD",
)

#: CALLED. TensorImpl reference count. AccumulateGrad steals a new gradient instead of copying it
#: only when nothing else holds it (``is_tensor_stealable``); we apply the same test before taking
#: a propagated buffer over as ``.grad`` (zero-copy set path).
TENSOR_USE_COUNT = Target(
    "torch",
    "Tensor._use_count",
    "zero-copy set path: AccumulateGrad's stealable test",
)

#: CALLED, OPTIONAL (three together). Lending a parameter's values to its fakes without a copy
#: (issue 46, _core/convert/lending.py): a storage over the parameter's bytes that does not own
#: them (``_construct_storage_from_data_pointer``, what cudagraph trees use), and the swap of two
#: storages' data (``StorageBase._swap_data_ptr_``: every tensor over the storage follows, so the
#: first write to any fake over it copies once, for all of them). WRAPPED: upstream's copy of a
#: converted tensor's storage when the mode propagates (``meta_utils.
#: _clone_real_storage_from_tensor``, 2.14+; on 2.13 the D2 repair lends instead of copying).
#: Checked on 2.13.0 (no clone function: the repair lends), 2.14.1, 2.15.0; 2.4.0 has no swap:
#: nothing is lent, every value is copied as before. Probed at installation (lend, own, the
#: lender untouched).
CONSTRUCT_STORAGE = Target(
    "torch._C",
    "_construct_storage_from_data_pointer",
    "lend a parameter's values to its fakes: a storage over its bytes that does not own them",
    optional=True,
)
SWAP_STORAGE_DATA = Target(
    "torch._C",
    "StorageBase._swap_data_ptr_",
    "copy lent values at the first write: every tensor over the storage follows",
    optional=True,
)
CLONE_REAL_STORAGE = Target(
    "torch._subclasses.meta_utils",
    "_clone_real_storage_from_tensor",
    "wrapped: a converted parameter's storage is lent, not copied (2.14+)",
    optional=True,
)


#: WRAPPED while lending is on (replaced on the class, torch's own back when it is off): the
#: methods that free or move a tensor's bytes, as Python calls them; each first gives the fakes
#: lent from the storage concerned their own values (lending.py). ``(class, method, what it
#: frees)``; "self": the receiver's storage, "source": also ``set_``'s first argument's, which
#: ``set_`` grows to the size it is given. Public but for the two sharing methods (PRIVATE:
#: ``UntypedStorage._share_fd_cpu_`` / ``_share_filename_cpu_``, which ``share_memory_`` and
#: multiprocessing's pickling of a CPU storage both call; Python methods of ``UntypedStorage``).
#: Checked on 2.4.0, 2.13.0, 2.14.1, 2.15.0 (a method a build lacks is left alone).
LENDING_GUARDS: tuple[tuple[str, str, str], ...] = (
    ("UntypedStorage", "resize_", "self"),
    ("UntypedStorage", "_share_fd_cpu_", "self"),
    ("UntypedStorage", "_share_filename_cpu_", "self"),
    ("Tensor", "resize_", "self"),
    ("Tensor", "resize_as_", "self"),
    ("Tensor", "set_", "source"),
)


def storage_key(storage: Any) -> int:
    """READ (lending, records): a storage's identity while it lives, the address of its
    StorageImpl (``UntypedStorage._cdata``; storages are PyObject-preserved, so one StorageImpl
    has one Python object). Checked on 2.4.0, 2.13.0, 2.14.1, 2.15.0."""
    return int(storage._cdata)


#: CALLED, OPTIONAL. torch's own "is this a fake tensor" test (2.14+: also true for the coming C++
#: FakeTensor, which an ``isinstance(x, FakeTensor)`` test would not see). Fallback: isinstance.
IS_FAKE_TENSOR = Target(
    FAKE_TENSOR_MODULE,
    "is_fake_tensor",
    "optional: recognise fakes the way torch does (2.14+); isinstance fallback",
    optional=True,
)

#: CALLED, OPTIONAL. torch's accessor for a fake's propagated real tensor (2.14+). Fallback: the
#: ``real_tensor`` attribute.
MAYBE_GET_REAL_TENSOR = Target(
    FAKE_TENSOR_MODULE,
    "maybe_get_real_tensor",
    "optional: a fake's propagated values the way torch reads them (2.14+)",
    optional=True,
)

#: CALLED, OPTIONAL. Whether FakeTensorMode lets an op bind Python numbers to tensors; with no fake
#: argument such an op (``mul_(3)``, ``add_``, ``div_``) is first run *for real* on the real
#: arguments (``FakeTensorMode._dispatch_impl``'s constant-propagation branch), then again on
#: converted copies. Read, with the op and the argument list of the ``_dispatch_impl`` frame that
#: converts (READ: its locals ``func`` and ``flat_arg_fake_tensors``, same names on 2.4.0, 2.13.0,
#: 2.14.1 and 2.15.0), so that a managed real ``.grad`` is not aliased into a fake for an op that
#: already changed it for real (it would be applied twice). Absent: never alias.
SHOULD_ALLOW_NUMBERS = Target(
    FAKE_TENSOR_MODULE,
    "should_allow_numbers_as_tensors",
    "optional: ops FakeTensorMode already runs for real on all-real arguments",
    optional=True,
)

#: READ, OPTIONAL. The dict behind ``Tensor.register_post_accumulate_grad_hook``. Only used on
#: builds where probe P1 finds that a pre-hook returning ``(None,)`` stops AccumulateGrad from
#: running the leaf's post-accumulate hooks (seen on 2.6.0): we then run them ourselves.
POST_ACCUMULATE_HOOKS = Target(
    "torch",
    "Tensor._post_accumulate_grad_hooks",
    "optional: run post-accumulate hooks where the build skips them after our pre-hook",
    optional=True,
)

#: CALLED, OPTIONAL. Id of the backward pass (GraphTask) running on this thread, -1 outside one.
#: Only used to give trace events a ``backward_id``; when absent, events carry ``None``.
GRAPH_TASK_ID = Target(
    "torch._C",
    "_current_graph_task_id",
    "optional: backward-pass id in trace events",
    optional=True,
)

#: READ. Per-mode switch of real-value propagation (an instance attribute set from the config at
#: construction; FINDINGS: the config itself is per-thread on 2.13). The patch acts only in
#: modes where it is true, or where the user set ``on_missing`` explicitly: everywhere else
#: (torch.compile, export, make_fx, estimators) upstream's behaviour is untouched. Read with
#: ``getattr(mode, "propagate_real_tensors", False)``.
PROPAGATE_ATTR = Target(
    FAKE_TENSOR_MODULE,
    "FakeTensorMode.propagate_real_tensors",
    "act only in modes that propagate real values (instance attribute)",
    on_instances=True,
)

#: CALLED, OPTIONAL. The functorch interpreter stack (non-empty inside ``torch.func.grad``,
#: ``vmap``, ...): the patch arms nothing and writes nothing inside a functorch transform.
FUNCTORCH_STACK = Target(
    "torch._C._functorch",
    "peek_interpreter_stack",
    "optional: stand aside inside functorch transforms",
    optional=True,
)

#: READ, OPTIONAL. Compiled autograd's module flags ``compiled_autograd_enabled`` (while it
#: captures or runs a backward) and ``in_compiled_autograd_region``: read from ``sys.modules``
#: only if the module was imported by the program (never imported by the patch). While either is
#: set the pre-hook and the arming stand aside: compiled autograd calls node pre-hooks with its
#: own fake gradients while tracing.
COMPILED_AUTOGRAD = Target(
    "torch._dynamo.compiled_autograd",
    "compiled_autograd_enabled",
    "optional: stand aside inside compiled autograd (read only if imported)",
    optional=True,
)

#: READ, OPTIONAL. What a converter converted: the real tensors it described
#: (``FakeTensorConverter.meta_converter.describer.lookup_tensor``, a WeakIdKeyDictionary), how
#: many new fakes it made (``meta_converter.hit``) and its memo (``FakeTensorConverter._get_memo``;
#: read on 2.13.0, 2.14.1 and 2.15.0). On builds with D2, the first time the patch meets a
#: converter after being applied (again), these tell whether it converted Parameters while the
#: patch was not installed (their propagated values were uninitialised): that mode's gradients
#: are then not written. Absent: that check is skipped.
DESCRIBED_TENSORS = Target(
    FAKE_TENSOR_MODULE,
    "FakeTensorConverter.meta_converter",
    "optional: conversions made while the patch was not installed (D2 builds)",
    optional=True,
    on_instances=True,
)

#: CALLED, OPTIONAL. ``torch._dynamo.trace_rules.add(import_name)``: adds a package's directory to
#: the directories whose frames TorchDynamo never compiles (as it does for torch's own files).
#: Without it, a backward called inside a compiled function runs the patch's Python wrapper
#: frames under dynamo's frame hook: dynamo compiles them as new frames (extra frames and graph
#: breaks, and on 2.13 a broken resume function). Called for ``fakegrad_patch`` and ``wrapt``
#: (its import finder runs for every import once a post-import hook is registered) when
#: ``torch._dynamo`` is imported (a wrapt post-import hook; the patch never imports it). Same
#: name on 2.13.0, 2.14.1 and 2.15.0. Skipped is not invisible: a function of ours that code
#: dynamo traces *calls* is a graph break there ("Attempted to call function marked as
#: skipped"; in a loop the whole frame runs uncompiled). So nothing of ours is registered where
#: traced code calls it (a global hook of torch) unless a propagating user mode needs it:
#: write-back's optimizer step post-hook (_core/dispatch/objects.py; seen on 2.4.0, 2.13.0, 2.14.1).
DYNAMO_SKIP = Target(
    "torch._dynamo.trace_rules",
    "add",
    "optional: dynamo never compiles the patch's own frames",
    optional=True,
)

#: WRAPPED, OPTIONAL, from the first propagating user mode on (its construction, FAKE_MODE_INIT,
#: or its first conversion) until ``uninstall()`` (dispatch/wrapper.py; never wrapped in a
#: process whose modes never propagate real values).
#: ``FakeTensorMode.dispatch(self, func, types, args=(), kwargs=...)``:
#: the entry of every op the mode handles (``__torch_dispatch__`` calls it positionally; the
#: nested ops of decompositions, ``func.decompose`` and Python meta/fake implementations that
#: ``_dispatch_impl`` runs ``with self`` come back through it). Wrapped to know, per thread and
#: mode, the outermost op: write-back aliases only its arguments, and gives its nested ops a
#: shadow of what they write (FakeTensorMode runs them for real after running the outer op for
#: real: ``native_batch_norm``'s running statistics would be updated twice). Same signature and
#: the same order (real run before the fake implementation) on 2.13.0 and 2.14.1. Absent:
#: write-back unavailable (one warning), buffers keep upstream semantics.
FAKE_MODE_DISPATCH = Target(
    FAKE_TENSOR_MODULE,
    "FakeTensorMode.dispatch",
    "optional: buffers='write_back' (the outermost op of a mode)",
    optional=True,
)

#: WRAPPED, OPTIONAL. ``FakeTensorMode.__torch_dispatch__(self, func, types, args, kwargs)``:
#: the mode's entry for every op (behind ``torch._disable_dynamo`` and a call counter; it asserts
#: that no fake mode is set, then calls ``dispatch``). Wrapped alongside FAKE_MODE_DISPATCH, in a
#: propagating user mode only: ``prim.device`` (~1.5 calls per aten op of a propagating step,
#: made by autograd and the dispatcher) is answered there by upstream's own handler
#: (:func:`device_handler`), ~1 µs instead of ~8 through the entry, its decorators and
#: ``dispatch``.
#: Same signature on 2.4.0 ... 2.15.0. Absent: ``prim.device`` takes the mode's entry.
FAKE_MODE_TORCH_DISPATCH = Target(
    FAKE_TENSOR_MODULE,
    "FakeTensorMode.__torch_dispatch__",
    "optional: prim.device answered at the mode's entry (propagating user modes)",
    optional=True,
)


def device_handler(module: Any) -> tuple[Any, Callable[[Any], Any]] | None:
    """``(prim.device, its handler)``: upstream's answer to ``prim.device`` from a fake's
    metadata (``_DISPATCH_META_HANDLERS[prim.device]``: the fake's device, ``meta`` inside its
    mode's kernel invocation; DISPATCH_DIRECT_OPS); None where the table or the op is absent."""
    import torch

    op = getattr(getattr(torch.ops.prim, "device", None), "default", None)
    handlers = getattr(module, "_DISPATCH_META_HANDLERS", None)
    handler = handlers.get(op) if isinstance(handlers, dict) and op is not None else None
    return (op, handler) if callable(handler) else None


#: WRAPPED, OPTIONAL. ``MetadataMismatchError`` (a dataclass ``RuntimeError`` with ``reason``):
#: raised by ``FakeTensorMode._maybe_infer_fake`` when real-value propagation finds an op's fake
#: output metadata different from the real kernel's ("Real tensor propagation found a metadata
#: mismatch ... at output<path>, for func: <op>", raised from the inner comparison error). Its
#: ``__init__`` is wrapped (dispatch/mismatch.py: nothing runs unless one is made) to trace
#: ``propagation_mismatch`` and add a note naming the known CPU-autocast norm defect. Same
#: name and message on 2.13.0 and 2.14.1. Absent: no trace event, no note.
METADATA_MISMATCH_ERROR = Target(
    FAKE_TENSOR_MODULE,
    "MetadataMismatchError",
    "optional: say plainly when propagation refuses a fake kernel",
    optional=True,
)

#: CALLED, OPTIONAL. ``torch.autograd._profiler_enabled()``: True while ``torch.profiler.profile``
#: or the autograd profiler records (the C++ ``profilerEnabled()``); about 0.03 us. Checked first
#: so that no range costs anything when no profiler runs.
PROFILER_ENABLED = Target(
    "torch.autograd",
    "_profiler_enabled",
    "optional: open profiler ranges only while a profiler records",
    optional=True,
)

#: CALLED, OPTIONAL. ``torch._C._profiler._RecordFunctionFast(name)``: the C++ ``RecordFunction``
#: as a context manager without the dispatcher (``torch.profiler.record_function`` goes through
#: ``torch.ops.profiler._record_function_enter_new``, an op a FakeTensorMode active in the
#: pre-hook's thread would see). Exported as ``cpu_op`` ranges.
RECORD_FUNCTION_FAST = Target(
    "torch._C._profiler",
    "_RecordFunctionFast",
    "optional: name the patch's work (arm, materialize) in torch.profiler traces",
    optional=True,
)

#: WRAPPED, OPTIONAL. ``FakeTensorMode.__init__``: after a mode is built, the wrapper reads its
#: ``propagate_real_tensors`` (PROPAGATE_ATTR); a propagating mode puts the
#: ``torch.autograd.backward`` interception in place for as long as it lives (a process
#: that never builds one runs torch's own ``backward``). A mode that propagates but never converts
#: a real tensor still needs it: ``g = torch.ones(3)`` inside it, then ``real_out.backward(g)``.
#: A propagating mode without a ShapeEnv also wraps ``dispatch`` (FAKE_MODE_DISPATCH) before its
#: first op (every in-place update of a real tensor it makes is seen, reported or
#: written back). Cost: one call per mode built (none per op). Same name on 2.13.0 and 2.14.1.
#: Absent: the interception is in place for the whole installation (0.3's behaviour), and
#: ``dispatch`` is wrapped at the first propagating conversion (the very first op's direct writes
#: are still seen through the converting frame). Also WRITTEN by the installation alone when it
#: must wait (torch finished importing inside the import of a module of ours: applying then would
#: import that module half-made): a one-shot function of ours in the class's ``__init__`` applies
#: the patch at the first mode built, and the patch's wrapper of torch's own then replaces it
#: (install/__init__.py ``_defer``, applied.py ``_wrap_mode_init``); torch's own is put back
#: where nothing was applied.
FAKE_MODE_INIT = Target(
    FAKE_TENSOR_MODULE,
    "FakeTensorMode.__init__",
    "optional: a propagating mode is built (backward interception while it lives)",
    ("2.13.0+cpu", "2.14.1+cu130"),
    optional=True,
)

#: WRITTEN, OPTIONAL. TorchScript's builtin table (``torch.jit._builtins._builtin_ops``, a list of
#: ``(function, "aten::...")`` read when ``_builtin_table`` (``id(function) -> op name``, None
#: until first use) is built): ``torch.autograd.backward`` is ``aten::backward`` there, keyed by
#: the function object's ``id``. While the interception is in place, the wrapper is added with
#: torch's op name (to the table if built, to the list otherwise), so a scripted function that
#: calls ``torch.autograd.backward`` still compiles to the builtin. Same names on 2.13.0 and
#: 2.14.1. Absent: scripting a call to ``torch.autograd.backward`` while a propagating mode lives
#: fails as it did in 0.3.
SCRIPT_BUILTINS = Target(
    "torch.jit._builtins",
    "_builtin_ops",
    "optional: TorchScript sees torch's builtin for the backward wrapper",
    ("2.13.0+cpu", "2.14.1+cu130"),
    optional=True,
)

#: WRAPPED, OPTIONAL, like FAKE_MODE_DISPATCH (while a propagating user mode lives).
#: ``run_fallback_kernel(fake_mode, func, flat_args, args_spec, orig_not_implemented_exception)``:
#: FakeTensorMode's "unsafe fallback" for an op without a meta kernel (aten's CUDA-only fused
#: kernels such as ``_thnn_fused_gru_cell``, torchvision/torchaudio ops): it runs the real kernel
#: on **zero-filled** inputs and converts the outputs with ``from_real_tensor``, so their
#: propagated values are the zeros' result; on the path where the meta kernel raised
#: NotImplementedError, ``_dispatch_impl`` returns them without propagating the real kernel's
#: output (``real_out``, computed before on the real values). Wrapped
#: (fakegrad_patch/_core/dispatch/fallback.py) to give the outputs the real kernel's values, or none
#: where the op had none. Looked up as a module global at call time; same signature on 2.4.0,
#: 2.13.0 and 2.14.1. Absent: such ops are reported as not repaired.
RUN_FALLBACK_KERNEL = Target(
    FAKE_TENSOR_MODULE,
    "run_fallback_kernel",
    "optional: outputs of the unsafe fallback kernel get the real kernel's values",
    ("2.4.0", "2.13.0+cpu", "2.14.1+cu130"),
    optional=True,
)

#: READ, OPTIONAL. The locals ``real_out`` and ``nil`` of a ``FakeTensorMode._dispatch_impl``
#: frame (with ``self``, the mode, and ``func``): the real kernel's output on the op's
#: propagated values (``real_out is nil`` when it did not run: an argument without values);
#: and ``fake_out``, the argument of its inner ``maybe_propagate_real_tensors`` (the fake
#: kernel's output being checked against it).
#: Read from the running frame (the fallback kernel) or from a raised exception's traceback (the
#: fake side failed after the real kernel ran: a fake kernel that refuses without a ShapeEnv,
#: ``DynamicOutputShapeException``/``DataDependentOutputException``, a missing one,
#: ``UnsupportedOperatorException``, one that disagrees, ``MetadataMismatchError``, or one that
#: raises; the frames of ``torch/_library/utils.py`` tell upstream's schema checks of custom ops
#: apart): the real kernel is what eager runs, so the op's fake outputs are made from its
#: outputs. Same names on 2.4.0, 2.13.0,
#: 2.14.1 and 2.15.0. Absent: no repair, upstream's behaviour (an exception, or the report).
DISPATCH_IMPL_REAL_OUT = Target(
    FAKE_TENSOR_MODULE,
    "FakeTensorMode._dispatch_impl",
    "optional: the real kernel's output of the op being dispatched (frame locals)",
    ("2.4.0", "2.13.0+cpu", "2.14.1+cu130", "2.15.0"),
    optional=True,
)

#: CALLED, OPTIONAL. ``FakeTensorConverter.from_meta_and_device(fake_mode, meta, device)``:
#: a FakeTensor of ``mode`` over a fresh meta tensor, on ``device`` (what
#: ``wrap_meta_outputs_with_default_device_logic`` uses). The fake outputs made from a real
#: kernel's outputs (sizes, strides, offset, dtype and device of the real tensor) are made with
#: it (or as it makes them: MAKE_SUBCLASS, :class:`FakeMaker`), their ``real_tensor`` set to the
#: real output. Same signature on 2.4.0 ... 2.15.0.
FROM_META_AND_DEVICE = Target(
    FAKE_TENSOR_MODULE,
    "FakeTensorConverter.from_meta_and_device",
    "optional: fake outputs made from a real kernel's outputs",
    optional=True,
)

#: CALLED, OPTIONAL, VERIFIED AT FIRST USE. What ``FakeTensor.__new__`` does to a fresh meta tensor
#: (2.4.0 ... 2.15.0: ``Tensor._make_subclass(FakeTensor, meta, requires_grad,
#: dispatch_device=True, device_for_backend_keys=device)``, the mutable-data-pointer flag per the
#: mode's ``_allow_unsafe_data_ptr_access``, then plain attributes: the device, the mode,
#: ``constant``, the ``*_memo`` fields, all None but the first two), without its Python (~15 µs of
#: validation and memo descriptors per fake; ~3 µs here). :class:`FakeMaker` learns the attributes
#: from a fake FROM_META_AND_DEVICE made for the same device and checks that its own fake has the
#: same type, dispatch keys, device and attributes; any difference (a build that sets more, a value
#: that is not plain, ``FakeTensorConfig.debug``'s traceback, a device without an index) and that
#: device keeps FROM_META_AND_DEVICE. Used only for fresh meta tensors (the memo
#: ``from_meta_and_device`` keeps for them is never looked up again) in modes without a ShapeEnv.
MAKE_SUBCLASS = Target("torch", "Tensor._make_subclass", "optional: fakes made without __new__")
UNSAFE_DATA_PTR_ATTR = "_allow_unsafe_data_ptr_access"


#: CALLED. ``aten._sparse_coo_tensor_with_dims(sparse_dim, dense_dim, size, dtype, layout,
#: device="meta")`` and ``Tensor._coalesced_``: the meta tensor meta_utils makes for a real sparse
#: COO tensor (2.4.0: this op; 2.13.0 ... 2.15.0: ``_sparse_coo_tensor_with_dims_and_tensors``
#: with empty indices and values: the same sizes, dims, dtype, flag, no entries). The fast path
#: makes a sparse output's fake over it (the propagated values hold the entries). Present on
#: 2.4.0 ... 2.15.0.
def sparse_meta_like(real: Any) -> Any:
    """A meta sparse COO tensor of ``real``'s sparse and dense dims, sizes, dtype and coalesced
    flag, without indices or values (call under ``no_dispatch``)."""
    import torch

    meta = torch.ops.aten._sparse_coo_tensor_with_dims(
        real.sparse_dim(),
        real.dense_dim(),
        real.shape,
        dtype=real.dtype,
        layout=torch.sparse_coo,
        device="meta",
    )
    meta._coalesced_(real.is_coalesced())
    return meta


#: CALLED, OPTIONAL. ``in_kernel_invocation_manager(fake_mode)``: the context FakeTensorMode runs
#: meta kernels in (its fakes dispatch as meta tensors; Python dispatch off). The repairs run
#: meta kernels on fakes inside it as upstream does: a written fake restrided to its real values'
#: layout (``as_strided_``), the refused ops' metadata changes. (The fast path's fake views no
#: longer use it, since issue 46: a meta tensor ``set_`` over the aliased fake's storage, no
#: dispatch.) Same name and signature on 2.4.0 ... 2.15.0. Absent: those repairs stand aside.
IN_KERNEL_INVOCATION = Target(
    FAKE_TENSOR_MODULE,
    "in_kernel_invocation_manager",
    "optional: fake views made over the aliased fake's storage (the fast path)",
    optional=True,
)

#: READ, OPTIONAL. ``_DISPATCH_META_HANDLERS`` (a dict: ``prim.device``, ``aten.sym_size``, ...)
#: and ``_DISPATCH_HANDLE_DIRECTLY`` (a set: ``aten.is_coalesced``, ...): the ops
#: ``FakeTensorMode.dispatch`` answers itself from the fakes' metadata, before any fake kernel or
#: real-value propagation. The dispatch wrapper hands them straight on (``prim.device`` alone is
#: called ~5 times per op of a propagating step). Absent: they take the wrapper's usual path.
DISPATCH_DIRECT_OPS = Target(
    FAKE_TENSOR_MODULE,
    "_DISPATCH_META_HANDLERS",
    "optional: ops the mode answers from metadata pass the dispatch wrapper at once",
    optional=True,
)

#: CALLED. Set a tensor's conjugate / negative view bit (what ``conj()`` and ``_neg_view`` do to
#: their outputs). The fast path gives a fake view the bits eager's view has, and reads a fake's
#: propagated values (its raw storage) with the fake's own bits: upstream's converter gives a
#: conjugate view's fake the bit and a copy of the raw storage without it. Checked on the builds
#: above (2.4 included).
SET_CONJ = Target(
    "torch._C", "_set_conj", "fakes with eager's conjugate bit; raw values read with it"
)
SET_NEG = Target("torch._C", "_set_neg", "fakes with eager's negative bit; raw values read with it")
#: CALLED. A ZeroTensor (autograd's ``_efficientzerotensor``: no storage). Its fakes keep
#: upstream's path (the ZeroTensor key on the fake), and real kernels run with its key on.
IS_ZEROTENSOR = Target("torch", "Tensor._is_zerotensor", "ZeroTensors keep upstream's path")


def bit_views() -> frozenset[Any]:
    """The aten view ops that set a conjugate or negative bit (``conj()``: ``aten._conj``;
    ``x.conj().imag``: ``aten._neg_view``), present on every build above."""
    import torch

    return frozenset({torch.ops.aten._conj.default, torch.ops.aten._neg_view.default})


def value_bit_tools() -> tuple[Callable[..., Any], Callable[..., Any], Callable[[Any], bool]]:
    """``(set_conj, set_neg, is_zerotensor)``: SET_CONJ, SET_NEG, IS_ZEROTENSOR."""
    return resolve(SET_CONJ), resolve(SET_NEG), resolve(IS_ZEROTENSOR)


#: READ. The ``Tensor.data`` descriptor of torch's C tensor class. ``real.data = fake`` inside a
#: propagating mode makes the real tensor's implementation a meta one (``set_data``: the real
#: Parameter then reports device meta, and every later op on it fails or, outside the mode, is
#: garbage). While a propagating user mode lives, ``torch.Tensor.data`` is a property of ours
#: over this descriptor (sites.ABSENT: deleted again afterwards) whose setter gives the real
#: tensor the fake's propagated values instead, as eager would give it the new tensor's.
TENSOR_DATA = Target("torch._C", "TensorBase.data", "real.data = fake inside the mode")


#: CALLED. ``Tensor.retain_grad`` of torch's C tensor class (``torch.Tensor`` inherits it). While a
#: propagating user mode lives, ``torch.Tensor.retain_grad`` is ours over it (sites.ABSENT): a
#: real non-leaf retained after it entered the mode gets the hooks that make its retained
#: gradient real.
def tensor_retain_grad() -> Any:
    import torch

    return getattr(torch._C.TensorBase, "retain_grad", None)


#: CALLED (READ of ``meta_converter.describer.lookup_tensor``). A converter's memo maps a real
#: tensor to the fake it made; after ``real.data = ...`` that fake describes the old tensor, so
#: the real tensor's entry is dropped (its next conversion makes a new fake). Same names on 2.4.0,
#: 2.13.0, 2.14.1 and 2.15.0.
def forget_conversion(converter: Any, t: Any) -> bool:
    """Drop ``t`` from ``converter``'s memo; False where the memo is not readable."""
    lookup = getattr(
        getattr(getattr(converter, "meta_converter", None), "describer", None),
        "lookup_tensor",
        None,
    )
    if lookup is None:
        return False
    with contextlib.suppress(KeyError):
        del lookup[t]
    return True


#: READ and WRITTEN: meta_utils' convention (2.4.0 ... 2.15.0): the meta storage of a fake the
#: converter made in a propagating mode carries the real storage it stands for as its
#: ``real_storage`` attribute. The fast path gives the storages of the fakes it makes the same
#: attribute, so that ``fake.set_(other_fake.untyped_storage(), ...)`` finds the real storage.
REAL_STORAGE_ATTR = "real_storage"


def real_storage_of(meta_storage: Any) -> Any:
    """The real storage a fake's meta storage stands for, or None."""
    return getattr(meta_storage, REAL_STORAGE_ATTR, None)


def set_real_storage(meta_storage: Any, real_storage: Any) -> None:
    setattr(meta_storage, REAL_STORAGE_ATTR, real_storage)


#: READ (2.4.0 ... 2.15.0): ``FakeTensorConverter.constant_storage_mapping``, the storages of the
#: mode's constants (``torch.tensor([4.0])``). An in-place op must reach upstream's path while
#: any exists: it invalidates the constants a write aliases (the fast path would leave a stale
#: constant for ``.item()`` to read). Absent: assume constants exist.
def has_constants(converter: Any) -> bool:
    mapping = getattr(converter, "constant_storage_mapping", None)
    return mapping is None or bool(mapping)


# Public, documented torch APIs we also rely on (listed for completeness; not private):
# torch.autograd.graph.get_gradient_edge (>=2.2), Node.register_prehook, Node.next_functions,
# AccumulateGrad.variable, Tensor._base, Tensor.retains_grad, Tensor._version.
# WRAPPED (public): ``torch.autograd.backward``, the function ``Tensor.backward`` calls, to arm
# the leaves of a *real* graph that receives a fake gradient (``out.backward(fake_grad)``): no
# conversion happens there, so the converter wrapper never sees those leaves. Checked on the
# builds above: ``Tensor.backward`` looks ``torch.autograd.backward`` up at call time. In place
# only while a propagating mode lives or a policy is set explicitly (_core/accumulate/arming.py).
AUTOGRAD_BACKWARD = Target(
    "torch.autograd",
    "backward",
    "wrapped (public API): real graphs that receive fake gradients",
)

_FROM_REAL_TENSOR_PARAMS = ("self", "fake_mode", "t")


# --- Resolving them -------------------------------------------------------------------------


class MissingTargetError(LookupError):
    """A private torch target is absent or has a signature the patch does not know."""

    def __init__(self, target: Target, reason: str) -> None:
        super().__init__(f"{target.dotted}: {reason}")
        self.target = target
        self.reason = reason


def resolve(target: Target, *, owner_only: bool = False) -> Any:
    """Return the object named by ``target`` or raise :class:`MissingTargetError`
    (``owner_only``: the class that owns it, for an attribute set on instances)."""
    try:
        obj: Any = importlib.import_module(target.module)
    except ImportError as exc:
        raise MissingTargetError(target, f"module not importable ({exc})") from None
    parts = target.qualname.split(".")
    for part in parts[:-1] if owner_only else parts:
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise MissingTargetError(target, f"attribute {part!r} not found") from None
    return obj


def _check_from_real_tensor(func: Callable[..., Any]) -> None:
    try:
        params = tuple(inspect.signature(func).parameters)
    except (TypeError, ValueError) as exc:  # pragma: no cover - builtins only
        raise MissingTargetError(FROM_REAL_TENSOR, f"signature unreadable ({exc})") from None
    if params[: len(_FROM_REAL_TENSOR_PARAMS)] != _FROM_REAL_TENSOR_PARAMS:
        raise MissingTargetError(
            FROM_REAL_TENSOR,
            f"signature changed: expected parameters starting with {_FROM_REAL_TENSOR_PARAMS}, "
            f"found {params}",
        )


@dataclass(frozen=True)
class Resolved:
    """The touch points, resolved and checked, ready for the patch to use."""

    fake_tensor_module: Any
    converter_cls: type
    fake_tensor_cls: type
    fake_mode_cls: type
    disable_current_modes: Callable[[], Any]
    no_dispatch: Callable[[], Any]
    functorch_config: Any
    graph_task_id: Callable[[], int] | None
    grad_accumulator: Callable[[Any], Any]
    tensor_use_count: Callable[[Any], int]
    is_fake: Callable[[Any], bool]
    real_of: Callable[[Any], Any]
    post_accumulate_hooks: Callable[[Any], Any]
    ordinary_dispatch: Callable[[], Any]
    #: the caller's dispatch state with the Conjugate, Negative and ZeroTensor keys enabled
    value_keys: Callable[[], Any]
    #: ``set_bits(t, conj, neg)``: a tensor's conjugate and negative bits (SET_CONJ, SET_NEG)
    set_bits: Callable[[Any, bool, bool], None]
    op_ran_for_real: Callable[[], bool | None]
    dispatching_op: Callable[[], tuple[Any, Any, Any] | None]
    torch_is_tracing: Callable[[], bool]
    described_tensors: Callable[[Any], Any]
    conversions_made: Callable[[Any], int | None]
    memo_of: Callable[[Any], Any]
    #: the FakeTensorMode on this thread's dispatch stack, or None (None: unknown on this build)
    current_fake_mode: Callable[[], Any] | None


def resolve_all() -> Resolved:
    """Resolve every target; raise :class:`MissingTargetError` for the first one missing."""
    from_real = resolve(FROM_REAL_TENSOR)
    _check_from_real_tensor(from_real)
    resolve(PROPAGATE_CONFIG)
    module = importlib.import_module(FAKE_TENSOR_MODULE)
    disable_current_modes = resolve(DISABLE_CURRENT_MODES)
    fake_cls = resolve(FAKE_TENSOR)
    return Resolved(
        fake_tensor_module=module,
        converter_cls=module.FakeTensorConverter,
        fake_tensor_cls=fake_cls,
        fake_mode_cls=resolve(FAKE_TENSOR_MODE),
        disable_current_modes=disable_current_modes,
        no_dispatch=resolve(NO_DISPATCH),
        functorch_config=importlib.import_module(PROPAGATE_CONFIG.module),
        graph_task_id=resolve_optional(GRAPH_TASK_ID),
        grad_accumulator=_make_grad_accumulator_getter(),
        ordinary_dispatch=_make_ordinary_dispatch(),
        value_keys=_make_value_keys(),
        set_bits=_make_set_bits(),
        op_ran_for_real=_make_op_ran_for_real(module.FakeTensorMode),
        dispatching_op=_make_dispatching_op(module.FakeTensorMode),
        tensor_use_count=resolve(TENSOR_USE_COUNT),
        is_fake=_make_is_fake(fake_cls),
        real_of=_make_real_of(fake_cls),
        post_accumulate_hooks=lambda leaf: getattr(leaf, "_post_accumulate_grad_hooks", None),
        torch_is_tracing=_make_torch_is_tracing(),
        described_tensors=_described_tensors,
        conversions_made=_conversions_made,
        memo_of=_memo_of,
        current_fake_mode=_make_current_fake_mode(),
    )


def _make_current_fake_mode() -> Callable[[], Any] | None:
    """``current_fake_mode()``: the fake mode on this thread's dispatch stack (GET_DISPATCH_MODE);
    None where the build lacks it."""
    get_mode = resolve_optional(GET_DISPATCH_MODE)
    fake_key = resolve_optional(DISPATCH_MODE_KEY_FAKE)
    if get_mode is None or fake_key is None:
        return None
    return lambda: get_mode(fake_key)


def _make_torch_is_tracing() -> Callable[[], bool]:
    """``torch_is_tracing()``: True inside a functorch transform or while compiled autograd
    captures or runs a backward (see FUNCTORCH_STACK, COMPILED_AUTOGRAD)."""
    import sys

    peek = resolve_optional(FUNCTORCH_STACK)
    modules = sys.modules
    name = COMPILED_AUTOGRAD.module

    def torch_is_tracing() -> bool:
        if peek is not None and peek() is not None:
            return True
        ca = modules.get(name)
        return ca is not None and bool(
            getattr(ca, "compiled_autograd_enabled", False)
            or getattr(ca, "in_compiled_autograd_region", False)
        )

    return torch_is_tracing


def skip_in_dynamo(*packages: str) -> None:
    """Make TorchDynamo skip the frames of ``packages``, now if ``torch._dynamo`` is imported,
    else when it is (never imports it). Never raises."""
    import contextlib
    import sys

    import wrapt

    def add(_module: Any = None) -> None:
        # optional: where it fails, dynamo compiles our frames as user code
        for package in packages:
            with contextlib.suppress(Exception):
                resolve(DYNAMO_SKIP)(package)

    if "torch._dynamo.trace_rules" in sys.modules:
        add()
    else:
        wrapt.register_post_import_hook(add, "torch._dynamo.trace_rules")


def _conversions_made(converter: Any) -> int | None:
    """How many new fakes ``converter``'s meta converter has made (its ``hit`` counter)."""
    hit = getattr(getattr(converter, "meta_converter", None), "hit", None)
    return hit if isinstance(hit, int) else None


def _memo_of(converter: Any) -> Any:
    """``lookup(real) -> the fake its memo holds, or None`` (``FakeTensorConverter._get_memo``),
    or None where absent."""
    get = getattr(converter, "_get_memo", None)
    return get if callable(get) else None


def _described_tensors(converter: Any) -> Any:
    """The real tensors ``converter`` described so far (a snapshot list), or None."""
    try:
        lookup = converter.meta_converter.describer.lookup_tensor
        return list(lookup.keys())
    except Exception:
        return None


def _make_is_fake(fake_cls: type) -> Callable[[Any], bool]:
    """``is_fake(x)``: the exact-type test first (the common case, ~50 ns), then torch's own
    helper where the build has one (C++ fakes), else ``isinstance``."""
    helper = resolve_optional(IS_FAKE_TENSOR)
    if helper is None:
        return lambda x: isinstance(x, fake_cls)
    return lambda x: type(x) is fake_cls or bool(helper(x))


def _make_real_of(fake_cls: type) -> Callable[[Any], Any]:
    """``real_of(x)``: a fake's propagated values or None. The exact-type case reads the
    attribute torch's own helper reads (``FakeTensor.real_tensor``) without the helper's frame
    (once per materialized gradient); anything else asks the helper where the build
    has one (C++ fakes), else the attribute."""
    helper = resolve_optional(MAYBE_GET_REAL_TENSOR)
    set_conj, set_neg = resolve(SET_CONJ), resolve(SET_NEG)
    no_dispatch = resolve(NO_DISPATCH)

    def read(x: Any) -> Any:
        if type(x) is fake_cls or helper is None:
            real = getattr(x, "real_tensor", None)
        else:
            real = helper(x)
        if real is not None and (x.is_conj() != real.is_conj() or x.is_neg() != real.is_neg()):
            # the fake's own conjugate/negative bits say how to read its raw values (the
            # converter's convention; a constant's conj of a 0-d tensor): an alias with them
            if real.layout != _strided():
                return real  # no alias to read it through (sparse): upstream's values
            with no_dispatch():  # a mode may be on the stack (a backward's pre-hook)
                real = real.view(real.shape)
            set_conj(real, x.is_conj())
            set_neg(real, x.is_neg())
        return real

    return read


def _strided() -> Any:
    import torch

    return torch.strided


def _make_grad_accumulator_getter() -> Callable[[Any], Any]:
    """``get(leaf) -> AccumulateGrad node``, usable from inside fake dispatch.

    Same lookup as ``torch.autograd.graph.get_gradient_edge(leaf).node``, run with the dispatch
    key state of ordinary code (captured here: autograd on, only autocast excluded) plus the
    Python keys excluded, so no dispatch mode or subclass sees the temporary view: it is a real
    autograd view of the real leaf. Cheaper than popping the mode stack.
    """
    import torch

    guard = resolve(FORCE_DISPATCH_KEY_GUARD)
    keys = torch._C.DispatchKeySet
    # Captured in an explicit, ordinary autograd state whatever the caller's is: the first
    # ``import fakegrad_patch`` may run inside ``torch.inference_mode()``, whose TLS excludes the
    # autograd keys (capturing that would break every later lookup).
    include, exclude_now = _ordinary_keys()
    exclude = (
        exclude_now
        | keys(torch._C.DispatchKey.Python)
        | keys(torch._C.DispatchKey.PythonTLSSnapshot)
        | keys(torch._C.DispatchKey.PreDispatch)
    )
    enable_grad = torch.enable_grad

    def get(leaf: Any) -> Any:
        """The node, or None when the leaf has none (it does not require grad)."""
        with guard(include, exclude), enable_grad():
            grad_fn = leaf.view_as(leaf).grad_fn
            return None if grad_fn is None else grad_fn.next_functions[0][0]

    return get


def _ordinary_keys() -> tuple[Any, Any]:
    """TLS dispatch key sets of ordinary code (autograd on, no mode), captured in an explicit
    state whatever the caller's is."""
    import torch

    with torch.inference_mode(False):
        include, exclude = resolve(TLS_INCLUDE_SET)(), resolve(TLS_EXCLUDE_SET)()
    # The patch may be installed inside a mode (``import fakegrad_patch`` in a FakeTensorMode
    # block): the Python keys that a mode push adds are not part of the ordinary state.
    key = torch._C.DispatchKey
    for python_key in (key.Python, key.PythonTLSSnapshot, key.PreDispatch):
        include = include.remove(python_key)
        exclude = exclude.remove(python_key)
    return include, exclude


def _make_ordinary_dispatch() -> Callable[[], Any]:
    """A context manager factory forcing ordinary dispatch state: the probes run a tiny autograd
    graph under a private mode, possibly from inside a fake op's dispatch (first need), where
    autograd keys are excluded."""
    guard = resolve(FORCE_DISPATCH_KEY_GUARD)
    include, exclude = _ordinary_keys()
    return lambda: guard(include, exclude)


def _make_value_keys() -> Callable[[], Any]:
    """A context manager factory: the dispatch state of the caller with the Conjugate, Negative
    and ZeroTensor keys no longer excluded. Inside a mode's ``__torch_dispatch__`` every key
    above the Python key is excluded, so a real kernel called there reads a conjugate or
    negative view's raw storage and a ZeroTensor's null data pointer, and a composite kernel's
    own conjugate views (``linalg.pinv``'s ``mH``) are read raw. Eager runs those keys'
    fallbacks; so do the real kernels the patch runs under this guard."""
    import torch

    guard = resolve(FORCE_DISPATCH_KEY_GUARD)
    include_set, exclude_set = resolve(TLS_INCLUDE_SET), resolve(TLS_EXCLUDE_SET)
    key = torch._C.DispatchKey
    keys = (key.Conjugate, key.Negative, key.ZeroTensor)

    def value_keys() -> Any:
        exclude = exclude_set()
        if not any(exclude.has(k) for k in keys):
            return contextlib.nullcontext()
        for k in keys:
            exclude = exclude.remove(k)
        return guard(include_set(), exclude)

    return value_keys


def _make_set_bits() -> Callable[[Any, bool, bool], None]:
    set_conj, set_neg = resolve(SET_CONJ), resolve(SET_NEG)

    def set_bits(t: Any, conj: bool, neg: bool) -> None:
        set_conj(t, conj)
        set_neg(t, neg)

    return set_bits


def _make_op_ran_for_real(mode_cls: type) -> Callable[[], bool | None]:
    """``op_ran_for_real()``, called from inside a conversion: True when the op being dispatched
    was already run on the real arguments (no fake argument, numbers allowed as tensors), False
    when not, None when it cannot tell (then callers keep upstream semantics)."""
    import sys

    allow = resolve_optional(SHOULD_ALLOW_NUMBERS)

    def op_ran_for_real() -> bool | None:
        if allow is None:
            return None
        local = _dispatch_impl_locals(sys._getframe(1), mode_cls)
        if local is None or "func" not in local or "flat_arg_fake_tensors" not in local:
            return None
        return not local["flat_arg_fake_tensors"] and bool(allow(local["func"]))

    return op_ran_for_real


# --- Readers of FakeTensorMode's frames (what its dispatch is running, what it raised) -------


def _dispatch_impl_locals(frame: Any, mode_cls: type) -> dict[str, Any] | None:
    """The locals of the nearest ``FakeTensorMode._dispatch_impl`` frame at or above ``frame``
    (12 frames at most: a conversion is a few calls below it), or None."""
    for _ in range(12):
        if frame is None:
            return None
        if frame.f_code.co_name == "_dispatch_impl" and isinstance(
            frame.f_locals.get("self"), mode_cls
        ):
            return frame.f_locals
        frame = frame.f_back
    return None


_NO_REAL_OUT = object()


def direct_ops(module: Any) -> frozenset[Any]:
    """The ops ``FakeTensorMode.dispatch`` answers itself (DISPATCH_DIRECT_OPS); empty where
    unreadable."""
    handlers = getattr(module, "_DISPATCH_META_HANDLERS", None)
    directly = getattr(module, "_DISPATCH_HANDLE_DIRECTLY", None)
    out: set[Any] = set()
    for table in (handlers, directly):
        with contextlib.suppress(TypeError):
            out.update(table or ())
    return frozenset(out)


def real_out_of(local: dict[str, Any] | None) -> Any:
    """The real kernel's output in a ``_dispatch_impl`` frame's locals (DISPATCH_IMPL_REAL_OUT),
    or ``NO_REAL_OUT`` when it did not run or cannot be read."""
    if local is None or "real_out" not in local or "nil" not in local:
        return _NO_REAL_OUT
    value = local["real_out"]
    return _NO_REAL_OUT if value is local["nil"] else value


NO_REAL_OUT = _NO_REAL_OUT


def running_real_out(mode: Any, depth: int = 2, limit: int = 8) -> Any:
    """From inside a function ``_dispatch_impl`` calls (the fallback kernel, a decomposition's
    nested op): the real output of the op its nearest frame of ``mode`` dispatches, or
    ``NO_REAL_OUT``."""
    import sys

    frame: Any = sys._getframe(depth)
    for _ in range(limit):
        if frame is None:
            break
        if frame.f_code.co_name == "_dispatch_impl" and frame.f_locals.get("self") is mode:
            return real_out_of(frame.f_locals)
        frame = frame.f_back
    return _NO_REAL_OUT


def raised_real_out(tb: Any, mode: Any) -> Any:
    """From a traceback that starts at a ``dispatch`` call of ``mode``: the real output of the
    op of the first ``_dispatch_impl`` frame of ``mode`` in it (that call's own), or
    ``NO_REAL_OUT``."""
    for _ in range(64):
        if tb is None:
            break
        frame = tb.tb_frame
        if frame.f_code.co_name == "_dispatch_impl" and frame.f_locals.get("self") is mode:
            return real_out_of(frame.f_locals)
        tb = tb.tb_next
    return _NO_REAL_OUT


def raised_fake_out(tb: Any) -> Any:
    """From such a traceback: the fake kernel's output that real-value propagation was checking
    when it raised (``maybe_propagate_real_tensors``'s argument ``fake_out``), or
    ``NO_REAL_OUT``."""
    for _ in range(64):
        if tb is None:
            break
        frame = tb.tb_frame
        if frame.f_code.co_name == "maybe_propagate_real_tensors" and "fake_out" in frame.f_locals:
            return frame.f_locals["fake_out"]
        tb = tb.tb_next
    return _NO_REAL_OUT


def raised_by_schema_check(tb: Any) -> bool:
    """Was the error raised by upstream's schema checks of a custom op's real run
    (``torch._library.utils``: ``MutationChecker.check``, ``check_aliasing_constraint``)?"""
    innermost = None
    for _ in range(64):
        if tb is None:
            break
        innermost = tb.tb_frame
        tb = tb.tb_next
    while innermost is not None:
        code = innermost.f_code
        if code.co_filename.replace("\\", "/").endswith("torch/_library/utils.py"):
            return True
        if code.co_name == "_dispatch_impl":
            return False
        innermost = innermost.f_back
    return False


def _make_dispatching_op(mode_cls: type) -> Callable[[], tuple[Any, Any, Any] | None]:
    """``dispatching_op()``, called from inside a conversion: ``(func, args, kwargs)`` of the op
    the converting ``FakeTensorMode._dispatch_impl`` frame dispatches (its locals before it
    deletes ``args``/``kwargs``), or None where unreadable. Used only for the conversions of an
    op that started before ``FakeTensorMode.dispatch`` was wrapped (the first op of the first
    propagating mode): is the tensor one the op writes? Same locals as ``op_ran_for_real``
    (2.13.0, 2.14.1, 2.15.0)."""
    import sys

    def dispatching_op() -> tuple[Any, Any, Any] | None:
        local = _dispatch_impl_locals(sys._getframe(1), mode_cls)
        if local is None or "func" not in local or "args" not in local:
            return None
        return local["func"], local["args"], local.get("kwargs")

    return dispatching_op


_PLAIN = (type(None), bool, int, float, str)


class FakeMaker:
    """``make(converter, mode, meta, device)``: FROM_META_AND_DEVICE's fake for a fresh meta
    tensor, made as MAKE_SUBCLASS says where the first fake of that device showed the same."""

    def __init__(self, from_meta: Callable[..., Any], fake_cls: type, module: Any) -> None:
        import torch

        self._from_meta = from_meta
        self._cls = fake_cls
        self._config = getattr(module, "FakeTensorConfig", None)
        self._subclass = resolve_optional(MAKE_SUBCLASS)
        self._throw = getattr(torch._C, "_set_throw_on_mutable_data_ptr", None)
        self._warn = getattr(torch._C, "_set_warn_deprecated_on_mutable_data_ptr", None)
        self._keys = getattr(torch._C, "_dispatch_keys", None)
        self._strided = torch.strided
        #: device -> the attributes of its fakes but the mode (None: that device's kept upstream's)
        self._state: dict[Any, dict[str, Any] | None] = {}

    def __call__(self, converter: Any, mode: Any, meta: Any, device: Any) -> Any:
        if meta.layout != self._strided:  # a sparse meta tensor: upstream's constructor
            return self._from_meta(converter, mode, meta, device)
        state = self._state.get(device)
        if state is None or self._config is None or self._config.debug:
            return self._learn(converter, mode, meta, device)
        return self._lean(mode, meta, device, state)

    def _lean(self, mode: Any, meta: Any, device: Any, state: dict[str, Any]) -> Any:
        fake = self._subclass(
            self._cls,
            meta,
            meta.requires_grad,
            dispatch_device=True,
            device_for_backend_keys=device,
        )
        flag = self._warn if getattr(mode, UNSAFE_DATA_PTR_ATTR) else self._throw
        flag(fake)  # type: ignore[misc]
        attrs = fake.__dict__
        attrs.update(state)
        attrs["fake_mode"] = mode
        return fake

    def _learn(self, converter: Any, mode: Any, meta: Any, device: Any) -> Any:
        fake = self._from_meta(converter, mode, meta, device)
        if device not in self._state and (self._config is None or not self._config.debug):
            self._state[device] = self._check(mode, fake, device)
        return fake

    def _check(self, mode: Any, fake: Any, device: Any) -> dict[str, Any] | None:
        """The attributes of ``fake`` (upstream's) but the mode where a fake made here matches
        it, else None (and this device keeps FROM_META_AND_DEVICE for good)."""
        import torch

        if (
            None in (self._subclass, self._throw, self._warn, self._keys)
            or (device.type != "cpu" and device.index is None)
            or not hasattr(mode, UNSAFE_DATA_PTR_ATTR)
        ):
            return None
        attrs = dict(fake.__dict__)
        if attrs.pop("fake_mode", None) is not mode or attrs.get("real_tensor", 0) is not None:
            return None
        if not all(isinstance(v, _PLAIN) or type(v) is torch.device for v in attrs.values()):
            return None
        try:
            meta = torch.empty(fake.shape, dtype=fake.dtype, device="meta")
            lean = self._lean(mode, meta, device, attrs)
        except Exception:
            return None
        same = (
            type(lean) is type(fake)
            and repr(self._keys(lean)) == repr(self._keys(fake))  # type: ignore[misc]
            and lean.device == fake.device
            and lean.__dict__ == fake.__dict__
        )
        return attrs if same else None


#: :meth:`LeanConversion.when`'s states beyond a tensor new to the converter
AGAIN = ("again",)
OVER = ("over a live storage",)
_KIND_LEN = 5  # the length of LeanConversion.kind's tuple


def _layout(x: Any) -> tuple[Any, ...]:
    return (x.shape, x.stride(), x.storage_offset(), x.dtype, x.device)


def _alike(keys: Any, lean: Any, fake: Any) -> bool:
    """What a lean fake must share with upstream's fake of the same tensor, whatever the state
    it was converted in: type, dispatch keys, every attribute but the values, metadata,
    autograd flags, version, ``grad_dtype``, and values of the same type and metadata."""
    theirs, ours = dict(fake.__dict__), dict(lean.__dict__)
    real, lean_real = theirs.pop("real_tensor", None), ours.pop("real_tensor", None)
    return (
        type(lean) is type(fake)
        and repr(keys(lean)) == repr(keys(fake))
        and ours == theirs
        and _layout(lean) == _layout(fake)
        and (lean.requires_grad, lean.is_leaf, lean._version, lean.grad)
        == (fake.requires_grad, fake.is_leaf, fake._version, fake.grad)
        and getattr(lean, "grad_dtype", None) == getattr(fake, "grad_dtype", None)
        and real is not None
        and lean_real is not None
        and type(real) is type(lean_real)
        and _layout(real) == _layout(lean_real)
    )


def _live_storage(meta_converter: Any, storage: Any) -> Any:
    """The meta storage ``meta_converter``'s storage memo keeps for ``storage``, or None."""
    sid = meta_converter.describer.lookup_storage.get(storage)
    return None if sid is None else meta_converter.storage_memo.get(sid)


#: CALLED / WRITTEN (2.4.0, 2.13.0, 2.14.1, 2.15.0: the same names and protocol). What
#: ``FakeTensorConverter.from_real_tensor`` does for a plain dense leaf (a parameter, an input: no
#: view, no grad, offset 0, its storage exactly its elements), made without MetaConverter's Python
#: (``describe_tensor``, ``meta_tensor``: ~100 µs warm, 3-5x that in a large model's step):
#: ``meta_converter.describer``'s ids (``get_tensor_id``, ``get_storage_id``; ``lookup_tensor``,
#: ``lookup_storage``), a fake over a fresh ``empty_strided`` meta tensor (FakeMaker), its values
#: and REAL_STORAGE_ATTR, ``requires_grad`` and ``_is_param`` as ``meta_tensor`` sets them, the
#: memos (``meta_converter.storage_memo[storage id]`` = the fake's meta storage,
#: ``tensor_memo[tensor id]`` = the fake: a later conversion of the tensor, or of a view of its
#: storage, finds them, as it finds upstream's) and the ``hit`` counter. MetaConverter suspends
#: functionalization and functorch's interpreter stack around its work: a lean conversion runs
#: only where neither is active (``torch._C._functorch.peek_interpreter_stack``, the Functionalize
#: key), and where neither the tensor nor the thread is in inference mode (MetaConverter makes the
#: fake under ``inference_mode(t.is_inference())``). Used only once checked per kind of tensor
#: (device, type, dtype, requires_grad, dispatch keys): the first conversion of each kind is
#: upstream's, and a lean one of the same tensor made into a scratch converter must match it
#: (type, dispatch keys, metadata, autograd flags, every attribute but the values, the memos'
#: entries); any difference keeps upstream's for that kind. A tensor the converter met before
#: whose fake died (``tensor_memo`` has none for its id) is a kind of its own, per state: its
#: storage's meta storage dead too (AGAIN: ``meta_tensor`` then makes a fresh fake under the
#: same ids; checked as a new one), or alive in ``storage_memo`` (OVER: ``meta_tensor`` makes a
#: fresh fake and ``set_``s it and its values over that storage and its REAL_STORAGE_ATTR, as
#: the lean one is made; checked against upstream's fake over the same storage, unregistered).
#: Checked on 2.4.0, 2.13.0, 2.14.1 and 2.15.0 (tests/test_lean_conversion.py).
class LeanConversion:
    """``convert(converter, mode, t, values)``: the converter's fake of ``t`` made lean, or None
    (upstream's conversion then); ``learn(...)`` after upstream's conversion of ``t``."""

    def __init__(self, make: FakeMaker) -> None:
        import torch

        self._make = make
        self._no_dispatch = resolve(NO_DISPATCH)
        self._keys = getattr(torch._C, "_dispatch_keys", None)
        functorch = getattr(torch._C, "_functorch", None)
        self._peek = getattr(functorch, "peek_interpreter_stack", None)
        self._included = getattr(torch._C, "_dispatch_tls_is_dispatch_key_included", None)
        self._functionalize = getattr(getattr(torch._C, "DispatchKey", None), "Functionalize", None)
        self._inference = torch.is_inference_mode_enabled
        self._types = (torch.Tensor, torch.nn.Parameter)
        self._strided = torch.strided
        self._parameter = torch.nn.Parameter
        #: kind -> a lean conversion matched upstream's (False: upstream's for good)
        self._checked: dict[tuple[Any, ...], bool] = {}
        self.usable = None not in (self._keys, self._peek, self._included, self._functionalize)

    def kind(self, t: Any) -> tuple[Any, ...] | None:
        """``t``'s kind where a lean conversion may make its fake, else None."""
        if type(t) not in self._types or t.layout != self._strided or not self.usable:
            return None
        if t.grad_fn is not None or t._base is not None or t.grad is not None:
            return None
        numel = t.numel()
        if numel == 0 or t.storage_offset() != 0 or getattr(t, "_is_buffer", False):
            return None
        if t.untyped_storage().nbytes() != numel * t.element_size():
            return None
        requires_grad = t.requires_grad
        if requires_grad and getattr(t, "grad_dtype", t.dtype) != t.dtype:
            return None
        if self._peek() is not None or self._included(self._functionalize):  # type: ignore[misc]
            return None
        if t.is_inference() or self._inference():
            return None  # MetaConverter makes the fake under inference_mode(t.is_inference())
        keys = repr(self._keys(t))  # type: ignore[misc]
        return (t.device, type(t), t.dtype, requires_grad, keys)

    def when(self, converter: Any, t: Any, kind: tuple[Any, ...]) -> tuple[Any, ...] | None:
        """``kind`` (:meth:`kind`) with what ``converter`` knows of ``t``: as it is where ``t``
        is new to it; ``+ AGAIN`` where it converted ``t`` before and neither that fake nor its
        storage lives (a weight used again after its fake died: the same ids, fresh memos);
        ``+ OVER`` where that fake died but its meta storage lives (an RNN's weight at every
        time step, a tied weight: a view saved for backward keeps it); None where its fake lives
        (upstream's memo returns it at once). Known to it only through an alias of its storage:
        as new (``convert`` then leaves it to upstream)."""
        meta_converter = converter.meta_converter
        describer = meta_converter.describer
        tid = describer.lookup_tensor.get(t)
        if tid is None:
            return kind
        if meta_converter.tensor_memo.get(tid) is not None:
            return None
        live = _live_storage(meta_converter, t.untyped_storage())
        return kind + (AGAIN if live is None else OVER)

    def convert(
        self, converter: Any, mode: Any, t: Any, kind: tuple[Any, ...], values: Callable[[Any], Any]
    ) -> Any:
        """``t``'s fake (``kind``: :meth:`when`), or None: its kind not checked (yet), or
        known to this converter otherwise than ``kind`` says."""
        if self._checked.get(kind) is not True:
            return None
        meta_converter = converter.meta_converter
        describer = meta_converter.describer
        storage = t.untyped_storage()
        again = kind[_KIND_LEN:]
        if again:
            tid = describer.lookup_tensor.get(t)
            if tid is None or meta_converter.tensor_memo.get(tid) is not None:
                return None
            live = _live_storage(meta_converter, storage)
            if again == OVER:
                if live is None:
                    return None
                return self._over(meta_converter, mode, converter, t, live, tid)
            if live is not None:
                return None
        elif t in describer.lookup_tensor or storage in describer.lookup_storage:
            return None  # known to this converter (its memo, an alias): upstream's
        return self._build(meta_converter, mode, converter, t, storage, values)

    def _over(
        self, meta_converter: Any, mode: Any, converter: Any, t: Any, live: Any, tid: Any
    ) -> Any:
        """``t``'s fake over ``live``, the meta storage of its earlier fake (the converter's
        storage memo), its values over that storage's real one, as ``meta_tensor`` sets both
        (``set_`` over the memo's storage and its REAL_STORAGE_ATTR); registered in the tensor
        memo where ``tid`` is given. None where that storage carries no values."""
        import torch

        real_storage = real_storage_of(live)
        nbytes = t.untyped_storage().nbytes()
        if real_storage is None or live.nbytes() < nbytes or real_storage.nbytes() < nbytes:
            return None  # no values, or storages smaller than the tensor now is: upstream's
        shape, stride = t.shape, t.stride()
        with self._no_dispatch():
            meta = torch.empty(0, dtype=t.dtype, device="meta")
            meta.set_(live, 0, shape, stride)
            fake = self._make(converter, mode, meta, t.device)
            real = torch.empty(0, dtype=t.dtype, device=t.device)
            real.set_(real_storage, 0, shape, stride)
            fake.real_tensor = real
        if t.requires_grad:
            fake.requires_grad = True
        if type(t) is self._parameter:
            fake._is_param = True
        if tid is not None:
            meta_converter.tensor_memo[tid] = fake
            meta_converter.hit += 1
        return fake

    def _build(
        self,
        meta_converter: Any,
        mode: Any,
        converter: Any,
        t: Any,
        storage: Any,
        values: Callable[[Any], Any],
    ) -> Any:
        import torch

        describer = meta_converter.describer
        with self._no_dispatch():
            meta = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
            fake = self._make(converter, mode, meta, t.device)
            real = values(t)
            fake.real_tensor = real
            set_real_storage(fake.untyped_storage(), real.untyped_storage())
        if t.requires_grad:
            fake.requires_grad = True
        if type(t) is self._parameter:
            fake._is_param = True
        meta_converter.storage_memo[describer.get_storage_id(storage)] = fake.untyped_storage()
        meta_converter.tensor_memo[describer.get_tensor_id(t)] = fake
        meta_converter.hit += 1
        return fake

    def learn(self, converter: Any, mode: Any, t: Any, kind: tuple[Any, ...], fake: Any) -> None:
        """After upstream converted ``t`` (``kind``: :meth:`when`) into ``fake``: at the first
        of its kind, a lean conversion of ``t`` must match it: into a scratch converter of the
        same class (new, AGAIN), or over the same live storage, unregistered (OVER)."""
        if kind in self._checked:
            return
        try:
            if kind[_KIND_LEN:] == OVER:
                same = self._same_over(converter, mode, t, fake)
            else:
                same = self._same(converter, mode, t, fake)
        except Exception:
            same = False
        self._checked[kind] = same

    def _same_over(self, converter: Any, mode: Any, t: Any, fake: Any) -> bool:
        """Upstream's fake of ``t`` over a live storage and ours over the same one: the same
        type, dispatch keys, attributes but the values, metadata, autograd flags, version, meta
        storage, and values over the same real storage, upstream's in the tensor memo."""
        meta_converter = converter.meta_converter
        live = fake.untyped_storage()
        lean = self._over(meta_converter, mode, converter, t, live, None)
        if lean is None or not _alike(self._keys, lean, fake):
            return False
        tid = meta_converter.describer.lookup_tensor.get(t)
        real, lean_real = fake.real_tensor, lean.real_tensor
        return (
            storage_key(lean.untyped_storage()) == storage_key(live)
            and storage_key(real.untyped_storage()) == storage_key(lean_real.untyped_storage())
            and tid is not None
            and meta_converter.tensor_memo.get(tid) is fake
        )

    def _same(self, converter: Any, mode: Any, t: Any, fake: Any) -> bool:
        import torch

        scratch = type(converter)(copy_data=True)
        storage = t.untyped_storage()

        def copy(source: Any) -> Any:
            return source.detach().clone(memory_format=torch.preserve_format)

        lean = self._build(scratch.meta_converter, mode, scratch, t, storage, copy)

        def memo(conv: Any, f: Any) -> bool:
            mc = conv.meta_converter
            tid = mc.describer.lookup_tensor.get(t)
            sid = mc.describer.lookup_storage.get(storage)
            kept = mc.storage_memo.get(sid) if sid is not None else None
            return (
                tid is not None
                and mc.tensor_memo.get(tid) is f
                and kept is not None
                and storage_key(kept) == storage_key(f.untyped_storage())
            )

        return (
            _alike(self._keys, lean, fake)
            and type(fake.real_tensor) is torch.Tensor
            and lean.untyped_storage().nbytes() == fake.untyped_storage().nbytes()
            and real_storage_of(fake.untyped_storage()) is not None
            and real_storage_of(lean.untyped_storage()) is not None
            and scratch.meta_converter.hit == 1
            and memo(converter, fake)
            and memo(scratch, lean)
        )


def resolve_optional(target: Target) -> Any:
    try:
        return resolve(target)
    except MissingTargetError:
        return None


def report() -> list[tuple[Target, str | None]]:
    """For ``doctor``: every target with ``None`` when found or the reason it is missing."""
    rows: list[tuple[Target, str | None]] = []
    for target in ALL_TARGETS:
        try:
            obj = resolve(target, owner_only=target.on_instances)
            if target is FROM_REAL_TENSOR:
                _check_from_real_tensor(obj)
        except MissingTargetError as exc:
            rows.append((target, exc.reason))
        else:
            rows.append((target, None))
    return rows


# ==============================================================================================
# --- DDP: DistributedDataParallel inside a propagating fake mode (_core/accumulate/ddp.py) -----
# ==============================================================================================
# Resolved apart from the core's targets: a build where one is missing leaves DDP to upstream
# (one warning), the rest of the patch applies. Checked on: torch 2.13.0+cpu, 2.14.1+cu130 (run
# on CPU), Python 3.11.

#: WRAPPED. DDP's per-forward preparation, run before the wrapped module's forward: lazy init,
#: ``reducer.prepare_for_forward()``, the join notification (an allreduce), the one-time bucket
#: rebuild (``reducer._rebuild_buckets()``: allocates the buckets), the pre-forward buffer
#: broadcast, the join-config sync check. Under a fake mode all of them dispatch to it (fake
#: buckets, fake collectives): we run it with the fake mode popped. Signature read:
#: ``(self, *inputs, **kwargs) -> (inputs, kwargs)`` on the builds above.
DDP_PRE_FORWARD = Target(
    "torch.nn.parallel.distributed",
    "DistributedDataParallel._pre_forward",
    "wrapped: DDP's bucket rebuild, buffer broadcast and join hook run with the fake mode popped",
    ("2.13.0+cpu", "2.14.1+cu130"),
    group="ddp",
)

#: WRAPPED. DDP's per-forward wrap-up, run after the module's forward: the post-forward buffer
#: broadcast (comm hook location), ``reducer.prepare_for_backward(outputs)``, DDPSink, the delayed
#: allreduce grad buffer. Run with the fake mode popped like ``_pre_forward``. Signature read:
#: ``(self, output) -> output``.
DDP_POST_FORWARD = Target(
    "torch.nn.parallel.distributed",
    "DistributedDataParallel._post_forward",
    "wrapped: DDP's post-forward buffer sync and reducer preparation with the fake mode popped",
    ("2.13.0+cpu", "2.14.1+cu130"),
    group="ddp",
)

#: CALLED. Pops the active FakeTensorMode (only it: other dispatch modes stay) for a block and
#: pushes it back after: around DDP's forward pieces, and around the engine call of a backward
#: started inside a mode in which a DDP forward ran (the graph task captures the thread-local
#: state when it is created, so the Reducer's hooks and queued callbacks run without the mode).
UNSET_FAKE_TEMPORARILY = Target(
    FAKE_TENSOR_MODULE,
    "unset_fake_temporarily",
    "DDP: run the Reducer and DDP's forward pieces with the fake mode popped",
    ("2.13.0+cpu", "2.14.1+cu130"),
    group="ddp",
)

#: CALLED. The active infra mode of a kind (``torch._C._get_dispatch_mode(FAKE)``): which fake
#: mode, if any, a DDP forward or a backward runs in; in the AccumulateGrad pre-hook, whether a
#: real gradient would be accumulated under a fake mode (optional there: absent, real gradients
#: are AccumulateGrad's). ``FakeTensorMode.propagate_real_tensors``
#: (READ, an attribute set at construction) says whether the patch can make its gradients real.
GET_DISPATCH_MODE = Target(
    "torch._C",
    "_get_dispatch_mode",
    "DDP, accumulate: the fake mode a DDP forward, a backward or AccumulateGrad runs in",
    ("2.13.0+cpu", "2.14.1+cu130"),
    group="ddp",
)
DISPATCH_MODE_KEY_FAKE = Target(
    "torch._C",
    "_TorchDispatchModeKey.FAKE",
    "DDP: the key of the fake mode for GET_DISPATCH_MODE",
    ("2.13.0+cpu", "2.14.1+cu130"),
    group="ddp",
)

#: The module of FSDP2's per-module state (``fully_shard``), imported lazily by torch.
FSDP_STATE_MODULE = "torch.distributed.fsdp._fully_shard._fsdp_state"

#: WRAPPED. FSDP2's forward pre-hook (registered by ``fully_shard`` as a bound method): root
#: lazy init, the unshard (``fsdp::all_gather_copy_in`` and the all-gather into the unsharded
#: parameters), prefetch. Under a fake mode the copy-in is dispatched to it and rejected by its
#: schema check. Run with the fake mode popped. Signature read: ``(self, module, args, kwargs)``.
FSDP_PRE_FORWARD = Target(
    FSDP_STATE_MODULE,
    "FSDPState._pre_forward",
    "wrapped: FSDP2's unshard (all-gather) runs with the fake mode popped",
    ("2.13.0+cpu", "2.14.1+cu130"),
    group="ddp",
)

#: WRAPPED. FSDP2's forward post-hook: reshard, the pre-backward hook registration on the
#: outputs. Signature read: ``(self, module, input, output)``.
FSDP_POST_FORWARD = Target(
    FSDP_STATE_MODULE,
    "FSDPState._post_forward",
    "wrapped: FSDP2's reshard and pre-backward registration with the fake mode popped",
    ("2.13.0+cpu", "2.14.1+cu130"),
    group="ddp",
)


@dataclass(frozen=True)
class ResolvedDDP:
    """The DDP touch points, resolved."""

    ddp_cls: type
    unset_fake: Callable[[], Any]
    current_fake_mode: Callable[[], Any]


def resolve_ddp() -> ResolvedDDP | None:
    """Resolve the DDP targets; None when this build has no ``torch.distributed`` (nothing to
    cover); :class:`MissingTargetError` for the first one missing otherwise."""
    import torch.distributed

    if not torch.distributed.is_available():
        return None
    pre, post = resolve(DDP_PRE_FORWARD), resolve(DDP_POST_FORWARD)
    for target, func, expected in (
        (DDP_PRE_FORWARD, pre, ("self", "inputs", "kwargs")),
        (DDP_POST_FORWARD, post, ("self", "output")),
    ):
        try:
            params = tuple(inspect.signature(func).parameters)
        except (TypeError, ValueError) as exc:  # pragma: no cover - builtins only
            raise MissingTargetError(target, f"signature unreadable ({exc})") from None
        if params != expected:
            raise MissingTargetError(target, f"signature changed: expected {expected}, {params}")
    get_mode = resolve(GET_DISPATCH_MODE)
    fake_key = resolve(DISPATCH_MODE_KEY_FAKE)
    return ResolvedDDP(
        ddp_cls=importlib.import_module(DDP_PRE_FORWARD.module).DistributedDataParallel,
        unset_fake=resolve(UNSET_FAKE_TEMPORARILY),
        current_fake_mode=lambda: get_mode(fake_key),
    )


def resolve_fsdp() -> type:
    """FSDP2's ``FSDPState`` class, its two hooks checked; :class:`MissingTargetError` else."""
    pre, post = resolve(FSDP_PRE_FORWARD), resolve(FSDP_POST_FORWARD)
    for target, func, expected in (
        (FSDP_PRE_FORWARD, pre, ("self", "module", "args", "kwargs")),
        (FSDP_POST_FORWARD, post, ("self", "module", "input", "output")),
    ):
        params = tuple(inspect.signature(func).parameters)
        if params != expected:
            raise MissingTargetError(target, f"signature changed: expected {expected}, {params}")
    cls: type = importlib.import_module(FSDP_STATE_MODULE).FSDPState
    return cls


# ==============================================================================================
# --- torch.profiler ranges for the patch's own work (_core/accumulate/profiling.py) --------------
# ==============================================================================================
# Checked on: torch 2.13.0+cpu and 2.14.1+cu130 (run on CPU), Python 3.11: both present, same
# behaviour (a range opened in an AccumulateGrad pre-hook nests inside the engine's
# ``autograd::engine::evaluate_function: torch::autograd::AccumulateGrad`` range, in
# ``key_averages()`` and ``export_chrome_trace``). Optional: where either is missing the patch
# opens no range and works as before. The two targets are defined with the others above
# (PROFILER_ENABLED, RECORD_FUNCTION_FAST).


def resolve_profiler() -> tuple[Callable[[], bool], Callable[[str], Any]] | None:
    """``(profiler_enabled, RecordFunctionFast)``, or None where either is missing."""
    enabled = resolve_optional(PROFILER_ENABLED)
    record = resolve_optional(RECORD_FUNCTION_FAST)
    if not callable(enabled) or not callable(record):
        return None
    return enabled, record


# ==============================================================================================
# --- TorchScript's builtin table (SCRIPT_BUILTINS) ---------------------------------------------
# ==============================================================================================

#: every object registered as a builtin: kept alive for the process, so its ``id`` is never
#: reused by another object while the table maps it (one per installation; tiny)
_SCRIPT_REGISTERED: list[Any] = []


def register_script_builtin(alias: Any, original: Any) -> bool:
    """Make TorchScript treat ``alias`` as the builtin ``original`` is (SCRIPT_BUILTINS).
    Returns True when registered; never raises, never builds the table itself."""
    try:
        ops = resolve(SCRIPT_BUILTINS)
        module = importlib.import_module(SCRIPT_BUILTINS.module)
        table = getattr(module, "_builtin_table", None)
        name = table.get(id(original)) if isinstance(table, dict) else None
        if name is None:
            name = next((op for fn, op in ops if fn is original), None)
        if not isinstance(name, str):
            return False
        _SCRIPT_REGISTERED.append(alias)
        if isinstance(table, dict):
            table[id(alias)] = name
        else:
            ops.append((alias, name))  # read when the table is built
        return True
    except Exception:
        return False


# --- The lists, read from the definitions above (one source) ----------------------------------

#: The core's targets, each reported by ``doctor``.
ALL_TARGETS: tuple[Target, ...] = tuple(t for t in _REGISTERED if t.group == "core")
#: Targets whose absence degrades a detail instead of blocking the patch.
OPTIONAL_TARGETS: frozenset[Target] = frozenset(t for t in ALL_TARGETS if t.optional)
#: DDP's and FSDP2's, resolved apart (:func:`resolve_ddp`).
DDP_TARGETS: tuple[Target, ...] = tuple(t for t in _REGISTERED if t.group == "ddp")
