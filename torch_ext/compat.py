"""Every difference between the torch versions torch_ext supports (2.9.1 .. 2.14.1), and nothing else.

No other module branches on the torch version: they import the Dynamo internals they need from here.
"""
from __future__ import annotations

import contextlib
import dataclasses
import re
import traceback
import warnings
from typing import Any

import torch


def _release(version: str) -> tuple[int, ...]:
    """(major, minor, patch) of a version string such as "2.14.1+cu130" or "2.15.0.dev20260101"."""
    return tuple(int(re.match(r"\d+", part).group()) for part in version.split("+")[0].split(".")[:3])


# The torch releases CI runs the whole suite on (the Makefile's VERSIONS; the GPU machine adds 2.11);
# `python -m torch_ext doctor` says whether the installed one is among them.
TESTED_TORCH_VERSIONS = ("2.9.1", "2.13.0", "2.14.1")
OLDEST_SUPPORTED_TORCH = _release(TESTED_TORCH_VERSIONS[0])
NEWEST_TESTED_TORCH = _release(TESTED_TORCH_VERSIONS[-1])
TORCH_RELEASE = _release(torch.__version__)


def _shown(release: tuple[int, ...] | None) -> str:
    return torch.__version__ if release is None else ".".join(map(str, release))


def check_torch_version(release: tuple[int, ...] | None = None) -> None:
    """Refuse a torch older than the oldest supported: its Dynamo internals differ."""
    if (release or TORCH_RELEASE) < OLDEST_SUPPORTED_TORCH:
        raise ImportError(f"torch_ext needs torch >= {TESTED_TORCH_VERSIONS[0]} (tested: "
                          f"{', '.join(TESTED_TORCH_VERSIONS)}); this is torch {_shown(release)}. Upgrade "
                          f"torch, e.g. `pip install torch=={TESTED_TORCH_VERSIONS[-1]}`.")


def warn_if_untested(release: tuple[int, ...] | None = None) -> bool:
    """Warn (install() does, once) when torch is newer than the newest tested; returns whether it is."""
    if (release or TORCH_RELEASE) <= NEWEST_TESTED_TORCH:
        return False
    warnings.warn(f"torch_ext is tested with torch {', '.join(TESTED_TORCH_VERSIONS)}; this is torch "
                  f"{_shown(release)}, newer. If compiling fails or results differ from eager, please "
                  "report it with the output of `python -m torch_ext doctor`.", stacklevel=3)
    return True


check_torch_version()  # before the imports of internals below, which older releases lack

from torch._dynamo import exc as _exc  # noqa: E402
from torch._dynamo.variables import higher_order_ops as _hops  # noqa: E402
from torch._dynamo.variables.base import VariableTracker  # noqa: E402,F401  (re-exported)
from torch._dynamo.variables.builder import wrap_fx_proxy  # noqa: E402,F401  (same signature everywhere)

TORCH_VERSION = TORCH_RELEASE[:2]

# 2.10 introduced wrap-semantics speculation in torch itself.
TORCH_HAS_WRAP_SEMANTICS = hasattr(_hops, "speculate_subgraph_with_auto_output_flattening")

# torch 2.9.1's invoke_subgraph autograd assumes every output is a tensor; 2.10+ also returns SymInts.
INVOKE_SUBGRAPH_RETURNS_SYMINTS = TORCH_HAS_WRAP_SEMANTICS

# 2.14 functionalizes a custom op that mutates its inputs inside a nested_compile_region (earlier:
# "Found a custom (non-ATen) operator whose output has alias annotations"), so plain torch.compile
# compiles region layers around an in-place attention op.
INDUCTOR_COMPILES_MUTATING_OPS_IN_REGIONS = TORCH_VERSION >= (2, 14)

# Known torch bugs torch_ext avoids (torch_ext/workarounds.py; pinned in tests/test_torch_bugs.py).
# Inductor reuses buffers an invoke_subgraph call still needs: wrong gradients (2.9.1 .. 2.14.1).
INDUCTOR_REUSES_REGION_BUFFERS = True
# The invoke_subgraph backward-graph cache ignores which tangents are the same tensor (2.9.1; 2.13
# adds the aliasing to its key).
BACKWARD_CACHE_IGNORES_TANGENT_ALIASING = TORCH_VERSION < (2, 10)
# invoke_subgraph's backward traces a graph, so it needs fake tensors: under backend="eager" a region
# needing gradients fails ("fake_mode should be enabled for HOPs"); 2.14 runs such calls itself.
EAGER_REGION_BACKWARD_NEEDS_FAKE_MODE = TORCH_VERSION < (2, 14)
# A region bound per instance (`layer.forward = MethodType(nested_compile_region(cls.forward), layer)`)
# and called for two instances: torch's subgraph reuse (keyed on the code) passes the first instance's
# parameters to every later call: wrong outputs (2.13, 2.14.1; 2.9.1 is right; 2.10-2.12 untested).
# torch_ext's region tracing lifts each call's own parameters.
REGION_REUSE_BINDS_FIRST_INSTANCE = TORCH_VERSION >= (2, 13)

# torch's own VariableTrackers that ours extend (we keep their subgraph installation and naming).
WrapHigherOrderVariable = _hops.WrapHigherOrderVariable
CheckpointHigherOrderVariable = _hops.CheckpointHigherOrderVariable
DynamoBypassingWrapperHigherOrderVariable = _hops.DynamoBypassingWrapperHigherOrderVariable
BaseHOPVariable = _hops.BaseHOPVariable
try:  # 2.12+ moved it to its own module
    from torch._dynamo.variables.invoke_subgraph import InvokeSubgraphHigherOrderVariable
except ImportError:
    InvokeSubgraphHigherOrderVariable = _hops.InvokeSubgraphHigherOrderVariable

make_attr = _hops.make_attr
validate_args_and_maybe_create_graph_inputs = _hops.validate_args_and_maybe_create_graph_inputs
dynamo_enable_grad = _hops.dynamo_enable_grad
Unsupported = _exc.Unsupported


def hop_variable_registry() -> dict[str, type]:
    """Dynamo's HOP-name -> VariableTracker class table (same name and role on every version)."""
    return _hops._hop_name_to_variable_class


def hop_variables_module():
    """The module whose global `BaseHOPVariable` is the fallback for BaseHOPs without a table entry."""
    return _hops


def unimplemented(*, gb_type: str, context: str, explanation: str, hints: list[str]):
    """Raise Dynamo's graph-break error (a hard error under fullgraph=True)."""
    if hasattr(_exc, "unimplemented_v2"):  # 2.9.1: the keyword form is unimplemented_v2
        _exc.unimplemented_v2(gb_type=gb_type, context=context, explanation=explanation, hints=hints)
    _exc.unimplemented(gb_type=gb_type, context=context, explanation=explanation, hints=hints)
    raise AssertionError("unreachable")  # pragma: no cover


def subtracer(tx, source_target, description: str):
    """Enter a fresh SubgraphTracer for a HOP body; 2.13 also names it with `description`."""
    if TORCH_VERSION >= (2, 10):
        return tx.output.subtracer(source_target, None, description)
    return tx.output.subtracer(source_target, None)


def defer_outer_mutation_checks(tx):
    """2.11+ defers refusing outer-scope mutations to the end of the body (flag flip-flops are fine)."""
    side_effects = tx.output.side_effects
    if hasattr(side_effects, "defer_side_effect_checks"):
        return side_effects.defer_side_effect_checks()
    return contextlib.nullcontext()


def torch_allows_checkpoint_side_effects() -> bool:
    """torch's own opt-in (2.10+ config flag) to let checkpoint bodies mutate outer Python state."""
    return bool(getattr(torch._dynamo.config, "skip_fwd_side_effects_in_bwd_under_checkpoint", False))


def checkpoint_body_context(tx, allow_side_effects: bool):
    """Mark the current tracer as a checkpoint body; optionally allow outer side effects in it."""
    if hasattr(_hops, "dynamo_under_activation_checkpoint"):  # 2.9.1
        from torch._dynamo.side_effects import allow_side_effects_under_checkpoint

        stack = contextlib.ExitStack()
        stack.enter_context(_hops.dynamo_under_activation_checkpoint(tx))
        if allow_side_effects:
            stack.enter_context(allow_side_effects_under_checkpoint(tx))
        return stack
    if allow_side_effects:
        return _hops.dynamo_allow_side_effects_in_hop(tx)
    return contextlib.nullcontext()


def hard_error_on_graph_break(reason: str):
    """A graph break inside a nested_compile_region is a hard error in torch. 2.9.1 says so with a
    decorator on `_call_function`; 2.10+ with the class attribute `_ALLOW_FALLBACK_TO_EAGER = False`."""
    if hasattr(_hops, "raise_hard_error_if_graph_break"):
        return _hops.raise_hard_error_if_graph_break(reason=reason)
    return lambda fn: fn


def python_constant_with_guards(vt) -> Any:
    """The Python value of a constant-like VT (functools.partial, function), guarding on it."""
    return vt.guard_as_python_constant()


def side_effect_stack(subtracer) -> Any:
    """Outer side effects recorded while tracing a body that was allowed to have them (2.13), else None."""
    return getattr(subtracer, "side_effect_stack", None)


# --- local_map (torch 2.10+ ships the `local_map_hop` HOP and its VT; 2.9.1 has neither) ----------

def torch_local_map_hop():
    """torch's own `local_map_hop` HOP, or None where torch lacks it (2.9.1)."""
    try:
        from torch._higher_order_ops.local_map import local_map_hop
    except ImportError:
        return None
    return local_map_hop


# torch's local_map VT where it exists (ours extends it), else the wrap VT it derives from.
LocalMapHigherOrderVariableBase = getattr(_hops, "LocalMapWrappedHigherOrderVariable", WrapHigherOrderVariable)


def torch_local_map_autoparallel_enabled() -> bool:
    """2.10+: `LocalMapWrappedHigherOrderVariable.enable()` turns on torch's own local_map tracing for
    Autoparallel (plain tensors standing for global ones, bodies traced with local shapes)."""
    return bool(getattr(LocalMapHigherOrderVariableBase, "_enabled", False))


def builder_id_dispatch() -> dict:
    """VariableBuilder's id(value) -> handler(builder, value) table, consulted before any other rule
    when Dynamo wraps a Python value (same role on every version; functools.cache'd, never cleared)."""
    from torch._dynamo.variables.builder import VariableBuilder

    return VariableBuilder._id_dispatch()


def user_function_variable(fn):
    """A VT for a plain Python function that Dynamo inlines when called (no guard, no source)."""
    from torch._dynamo.variables.functions import UserFunctionVariable

    return UserFunctionVariable(fn)


# --- CUDA graphs (backend/cudagraph.py) ----------------------------------------------------------

def non_owning_storage(data_ptr: int, device: torch.device, nbytes: int):
    """A storage over memory it does not own (torch's cudagraph trees use the same private helper,
    present from 2.9.1 to 2.13): captured outputs kept this way let the graph pool reuse them."""
    return torch._C._construct_storage_from_data_pointer(data_ptr, device, nbytes)


def rng_state_before_capture(device_index: int):
    """A copy of the device's default CUDA generator state, for recover_from_failed_capture."""
    return torch.cuda.default_generators[device_index].clone_state()


def recover_from_failed_capture(device_index: int, pool, rng_state) -> None:
    """Undo what a failed capture leaves behind (2.9.1 through 2.14.1, seen on 2.11): when
    cudaStreamEndCapture fails (the capture was invalidated, e.g. by a host sync), CUDAGraph.capture_end
    throws before it runs the generators' capture epilogue and before it ends the allocator's routing
    into the pool: the default generator stays in capture mode, and every later random op on the
    device raises "Offset increment outside graph capture encountered unexpectedly". The device
    allocator's routing is ended here; the pinned-host allocator's (2.11+) has no Python binding,
    so the pool id stays taken there: later captures must use a new pool ("beginAllocateToPool:
    already recording to mempool_id" otherwise, seen on 2.11)."""
    torch.cuda.default_generators[device_index].graphsafe_set_state(rng_state)
    try:
        torch._C._cuda_endAllocateToPool(device_index, pool)
    except RuntimeError:  # capture_end got that far itself
        pass


def python_custom_op_def(op: torch._ops.OpOverload):
    """The CustomOpDef of an op defined with torch.library.custom_op (its kernels run through Python
    autograd, version and alias-checking layers), or None. The registry is private. Its `_backend_fns`
    (device type, None for all -> the user's kernel, wrapped to honour disabled kernels) is what
    the op's backend kernel calls, on 2.9.1 through 2.14.1."""
    from torch._library import custom_ops

    opdef = getattr(custom_ops, "OPDEFS", {}).get(op._schema.name)
    if opdef is None or getattr(opdef, "_opoverload", None) is not op \
            or not isinstance(getattr(opdef, "_backend_fns", None), dict):
        return None
    return opdef


_mode_checks = (torch._C._is_torch_function_mode_enabled, torch._C._len_torch_dispatch_stack,
                torch._C._is_any_autocast_enabled, torch._C._are_functorch_transforms_active)


def no_modes_or_autocast_active() -> bool:
    """No torch-function or dispatch mode, autocast or functorch transform is active (0.3 us)."""
    a, b, c, d = _mode_checks
    return not (a() or b() or c() or d())


def symbol_upper_bound(size: torch.SymInt) -> int | None:
    """The largest value Dynamo's shape env allows for a symbolic size (mark_dynamic(max=...),
    torch._check), or None when unbounded. `var_to_range` holds it on 2.9.1 through 2.14.1."""
    node = size.node
    bounds = node.shape_env.var_to_range.get(node.expr)
    upper = getattr(bounds, "upper", None)
    try:
        return int(upper) if upper is not None and upper.is_finite else None
    except (TypeError, AttributeError):
        return None


# --- Python floats Dynamo left symbolic (backend/backend.py) -------------------------------------

def floats_to_specialize(example_inputs) -> list[str]:
    """Names ("zf0") of the Python floats Dynamo passed as 0-d tensors and read back with `.item()`
    (torch.compile(dynamic=True) leaves floats unspecialized on every supported version) that no
    restart has asked to specialize yet. The shape env keeps their values in `var_to_val` (2.9.1)
    or `backed_var_to_val` (2.13+)."""
    from torch._dynamo.symbolic_convert import TensorifyState
    from torch._guards import detect_fake_mode
    from torch.utils._sympy.symbol import SymT, symbol_is_type

    shape_env = getattr(detect_fake_mode(example_inputs), "shape_env", None)
    if shape_env is None:
        return []
    values = getattr(shape_env, "backed_var_to_val", None)
    if values is None:
        values = shape_env.var_to_val
    names = (str(s) for s in values if symbol_is_type(s, SymT.FLOAT))
    return sorted(name for name in names if not TensorifyState.should_specialize(name))


def specialized_float(item_node) -> float | None:
    """If `item_node` is `t.item()` of a Python float Dynamo passed as a 0-d tensor `t`, and a restart
    asked for that float to be specialized, its value (guarded on, like Dynamo's own
    `remove_tensorify_specialized_graphargs` does for top-level uses); else None. Dynamo only
    specializes uses in the root graph; uses inside HOP bodies are ours to replace."""
    from torch._dynamo.symbolic_convert import TensorifyState
    from torch.fx.experimental.symbolic_shapes import guard_scalar

    if item_node.op != "call_method" or item_node.target != "item" or not item_node.args:
        return None
    memo = getattr(item_node.args[0].meta.get("example_value"), "item_memo", None)
    name = getattr(getattr(memo, "node", None), "_expr", None)
    if memo is None or not hasattr(name, "name") or not TensorifyState.should_specialize(name.name):
        return None
    return guard_scalar(memo)


def restart_with_floats_specialized(names: list[str]):
    """Make Dynamo trace the frame again with these floats as constants, the way Inductor's own
    `tensorify_python_scalars` pass does when it cannot keep a float symbolic."""
    from torch._dynamo.exc import TensorifyScalarRestartAnalysis
    from torch._dynamo.symbolic_convert import TensorifyState

    for name in names:
        TensorifyState.specialize(name)
    raise TensorifyScalarRestartAnalysis


# --- guard-free dispatch (backend/dispatch.py, backend/signature.py) ------------------------------

def source_name(source) -> str:
    """Dynamo's name of a source, "L['caches'][0]": a method on 2.9.1, a property from 2.13."""
    name = source.name
    return name if isinstance(name, str) else name()


def graph_inputs_by_source(gm) -> dict[str, Any]:
    """The placeholders of a graph Dynamo hands a backend, by the name of the source Dynamo reads
    each from ("L['x']", "L['caches'][0]", "L['self']._modules['lin']._parameters['weight']"),
    with their example values (fake tensors, SymInts). Dynamo puts a GraphArg in every placeholder's
    meta["grapharg"] (2.9.1 .. 2.14.1)."""
    out = {}
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        name = placeholder_source(node)
        if name is not None:
            out[name] = node.meta.get("example_value", node.meta.get("val"))
    return out


def placeholder_source(node) -> str | None:
    """The source name of a placeholder of a graph Dynamo hands a backend: from meta["grapharg"],
    or the `_dynamo_source` Dynamo also sets on the node before calling the backend (2.13+; the graph
    of an AOT capture has no grapharg meta left)."""
    source = getattr(node.meta.get("grapharg"), "source", None) or getattr(node, "_dynamo_source", None)
    return source_name(source) if source is not None else None


def tensor_guards(tensors: list, sizes: list, strides: list):
    """Dynamo's C++ tensor check (its TENSOR_MATCH guard): dispatch keys (device type, inference
    tensors), dtype, device index, requires_grad, rank, and the sizes and strides given as ints
    (None: any). `.check(*tensors)` -> bool. Same constructor on 2.9.1 .. 2.14.1."""
    from torch._C._dynamo.guards import TensorGuards

    return TensorGuards(*tensors, dynamic_dims_sizes=sizes, dynamic_dims_strides=strides)


def tensor_guards_reason(guards, tensors: list, names: list[str]) -> str | None:
    """Why `tensors` fail `guards` ("tensor 'x' size mismatch at index 0. expected 1, actual 8"), or
    None. check_verbose crashes the process without tensor_check_names (2.9.1 .. 2.14.1): pass them."""
    result = guards.check_verbose(*tensors, tensor_check_names=names)
    return None if result is True else str(result)


def global_state_guard():
    """Dynamo's check of the global state it guards on every frame (grad mode, autocast,
    deterministic algorithms, default dtype, ...), as it is now: `.check()` -> bool."""
    from torch._C._dynamo.guards import GlobalStateGuard

    return GlobalStateGuard()


def global_state_reason(check) -> str:
    """What differs from the state a global_state_guard() recorded (its bound `.check` method)."""
    return check.__self__.reason()


# --- warm start without re-tracing (backend/warm_start.py) ---------------------------------------
#
# torch 2.13.0 and 2.14.1 (identical code) have Dynamo's AOT compile: `torch._dynamo.aot_compile`
# (AOTCompiledFunction: the transformed bytecode with its runtime globals, the guards serialized,
# a SystemInfo check, and a backend artifact implementing `aot_compile_types.SerializableCallable`).
# torch 2.9.1 has a first draft of the same module (no runtime globals or system check, guards
# pickled as an output graph, no `aot_compile_types`): warm start stays off there.

def _has_aot_compile() -> bool:
    try:
        from torch._dynamo import aot_compile, aot_compile_types  # noqa: F401
        from torch._dynamo.convert_frame import GraphRuntimeEnv  # noqa: F401
    except ImportError:
        return False
    return hasattr(aot_compile, "CompileArtifacts") and hasattr(aot_compile.AOTCompiledFunction, "serialize")


HAS_AOT_COMPILE = _has_aot_compile()
if HAS_AOT_COMPILE:
    from torch._dynamo.aot_compile_types import SerializableCallable  # noqa: E402
else:
    class SerializableCallable:  # type: ignore[no-redef]
        """Stand-in where torch has no AOT compile (warm start is off there; nothing is serialized)."""

# Tensor attributes that mark dims dynamic/static (mark_dynamic & co.); Dynamo guards on them.
DIM_MARKING_ATTRS = ("_dynamo_dynamic_indices", "_dynamo_weak_dynamic_indices", "_dynamo_unbacked_indices",
                     "_dynamo_strict_unbacked_indices", "_dynamo_static_indices", "_dynamo_shape_ids",
                     "_dynamo_unbacked_bounds", "_dynamo_hint_overrides", "_has_dynamo_dim_marking")


def aot_compile(fn, self_arg, args: tuple, kwargs: dict, backend, *, dynamic: bool | None, guard_filter):
    """Trace `fn` (fullgraph) with Dynamo, compile its graph with `backend` and build guards that can
    be saved: torch's `aot_compile_fullgraph` (2.13, 2.14.1), except that the backend runs with the
    traced code in its TracingContext, as under torch.compile (the torch_ext backend keys its disk
    cache on those files), and that `guard_filter(entries) -> [keep?]` decides which guards are kept
    (torch's default drops every guard it cannot save, e.g. the identity of an object argument,
    which could run saved code for another object; a kept guard that cannot be saved fails the
    compile). Returns (AOTCompiledFunction, traced code objects)."""
    from torch._dynamo import aot_compile as aot, convert_frame
    from torch._dynamo.eval_frame import set_enable_dynamic
    from torch._dynamo.graph_utils import _graph_device_type
    from torch._dynamo.hooks import Hooks
    from torch._dynamo.package import SourceInfo
    from torch._dynamo.utils import dynamo_timed, get_metrics_context
    from torch._dynamo.variables.torch_function import torch_function_mode_stack_state_mgr
    from torch._guards import TracingContext

    target = fn.__get__(self_arg) if self_arg is not None else fn
    hooks = Hooks(guard_filter_fn=guard_filter)
    with contextlib.ExitStack() as stack:
        stack.enter_context(get_metrics_context())
        stack.enter_context(dynamo_timed("fullgraph_capture"))
        stack.enter_context(torch._functorch.config.patch(strict_autograd_cache=True))
        if dynamic is not None:
            stack.enter_context(set_enable_dynamic(dynamic))
        stack.enter_context(torch_function_mode_stack_state_mgr)
        capture = convert_frame.fullgraph_capture(target, args, kwargs)
        graph_capture = capture.graph_capture_output
        backend_input = capture.backend_input
        if backend_input is None:
            raise RuntimeError("Dynamo captured no graph (nothing to compile)")
        gm = backend_input.graph_module
        gm._backend_id = backend_input.backend_id
        tracing_context = TracingContext(backend_input.fake_mode)
        tracing_context.tensor_to_context = backend_input.tensor_to_context
        tracing_context.traced_code = list(graph_capture.traced_code)
        with torch._guards.tracing(tracing_context):
            compiled_fn = backend(gm, backend_input.example_inputs)
        if not isinstance(compiled_fn, SerializableCallable):
            raise TypeError(f"the backend returned {type(compiled_fn).__name__}, not a SerializableCallable")
        restore = contextlib.ExitStack()
        if torch_function_mode_stack_state_mgr.stack:
            restore.enter_context(torch_function_mode_stack_state_mgr.temp_restore_stack())
        with restore:
            check_fn = graph_capture.build_guards(fn.__code__, hooks=hooks, save=True, strict_error=True)
        source_info = SourceInfo(inlined_sources=set())
        for code in graph_capture.traced_code:
            source_info.add_code(code)
        artifacts = aot.CompileArtifacts(
            signature=convert_frame._get_signature(fn), guard_manager=check_fn.guard_manager,
            guards_state=check_fn.guards_state, backend_id=backend_input.backend_id, compiled_fn=compiled_fn,
            original_code=fn.__code__, runtime_env=graph_capture.get_runtime_env(), source_info=source_info,
            device_type=_graph_device_type(gm.graph), backend_name="torch_ext")
        return aot.AOTCompiledFunction(_artifacts=artifacts, _extra_globals=fn.__globals__), \
            list(graph_capture.traced_code)


def aot_serialize(compiled, external: dict[str, Any]) -> bytes:
    """An AOTCompiledFunction as bytes (its backend artifact through serialize_compile_artifacts).
    Objects in `external` are saved as references by key (aot_deserialize takes them back)."""
    from torch._dynamo.aot_compile import AOTCompiledFunction

    return AOTCompiledFunction.serialize(compiled, external).serialized_data


def aot_module_aliases(compiled, f_globals: dict) -> dict[str, str]:
    """Globals the transformed code reads that Dynamo installed for modules it had no import alias
    for (`___module_collections_<id>_c0`: the name holds an id, so another process lacks it):
    name -> module name. torch's AOT compile neither saves nor restores them (2.13, 2.14.1)."""
    import types as _types

    env = compiled._artifacts.runtime_env
    out = {}
    for name in env.external_refs:
        value = f_globals.get(name)
        if isinstance(value, _types.ModuleType) and name not in env.import_sources and name not in env.used_globals:
            out[name] = value.__name__
    return out


def aot_backend_result(compiled):
    """What the backend returned for the program of an AOTCompiledFunction (2.13-2.14)."""
    return compiled._artifacts.compiled_fn


def aot_transformed_code(compiled):
    """Dynamo's transformed bytecode of an AOTCompiledFunction."""
    return compiled._artifacts.runtime_env.bytecode


def aot_deserialize(data: bytes, f_globals: dict, marks: dict[tuple, dict], external: dict[str, Any]):
    """Load an AOTCompiledFunction (torch's `AOTCompiledFunction.deserialize`, 2.13 and 2.14.1), with one
    repair: saved guards are rebuilt from meta tensors that lost the dim markings (mark_dynamic & co.)
    of the compiled call, so a marked argument would fail them ("_has_dynamo_dim_marking is present on
    runtime tensor but was absent at compile time"). `marks` maps an argument path (("x",),
    ("caches", 0)) to the marking attributes its tensor had; they are put back before the guards are
    built. Raises on a torch/Python/GPU mismatch (torch's SystemInfo check) or unloadable data."""
    import io

    from torch._dynamo import aot_compile as aot, convert_frame
    from torch._dynamo.package import SerializedCode, load_guard_manager, load_guards_state
    from torch._dynamo.utils import dynamo_timed, get_metrics_context
    from torch._guards import CompileContext, compile_context

    # As torch's AOTCompiledModel.deserialize: the backend may compile (a piece missing on disk).
    with compile_context(CompileContext(convert_frame.get_compile_id({}))), get_metrics_context(), \
            dynamo_timed("torch_ext_warm_start_load"):
        return _aot_deserialize(aot, data, f_globals, marks, external, SerializedCode, load_guard_manager,
                                load_guards_state)


def _aot_deserialize(aot, data, f_globals, marks, external, SerializedCode, load_guard_manager, load_guards_state):
    import io

    unpickler = aot.AOTCompileUnpickler(external, io.BytesIO(data))
    state = unpickler.load()
    state["runtime_env"] = dataclasses.replace(
        state["runtime_env"], bytecode=SerializedCode.to_code_object(state["runtime_env"].bytecode))
    state["original_code"] = SerializedCode.to_code_object(state["original_code"])
    with _fake_modes_without_stacks():  # one FakeTensorMode per saved tensor guard
        guards_state = load_guards_state(state["guards_state"])
    scope = guards_state.output_graph.local_scope
    for path, attrs in marks.items():
        value = scope
        for key in path:
            value = value[key] if isinstance(value, (dict, list, tuple)) and key in (
                value if isinstance(value, dict) else range(len(value))) else None
        if isinstance(value, torch.Tensor):  # else the guards refuse such a marked argument: Dynamo runs
            for name, attr in attrs.items():
                setattr(value, name, attr)
    deserializer, compiled_fn_state = state["compiled_fn"]
    with torch._inductor.config.patch(enable_autograd_for_aot=True):
        state["compiled_fn"] = deserializer(compiled_fn_state)
    artifacts = aot.CompileArtifacts(**state)
    artifacts.check_compatibility()
    fn_globals = artifacts.runtime_env.forward_callable(artifacts.backend_id, artifacts.compiled_fn,
                                                        extra_globals=f_globals).__globals__
    artifacts.guard_manager = load_guard_manager(guards_state, artifacts.original_code, fn_globals)
    return aot.AOTCompiledFunction(artifacts, _extra_globals=f_globals)


@contextlib.contextmanager
def _fake_modes_without_stacks():
    """FakeTensorMode() records the Python stack where it was made (for its error messages): about
    0.2 ms, paid per tensor guard when torch loads saved guards (GuardsStatePickler._unpickle_tensor
    makes a mode per tensor; 2.13-2.14). Skipped here: those modes run no user code."""
    from torch._subclasses import fake_tensor

    class WithoutStacks:  # the traceback module, but extract_stack
        def __getattr__(self, name):
            return getattr(traceback, name)

        @staticmethod
        def extract_stack(*args, **kwargs):
            return traceback.StackSummary()

    real = fake_tensor.traceback
    fake_tensor.traceback = WithoutStacks()
    try:
        yield
    finally:
        fake_tensor.traceback = real


def aot_guard_reason(compiled, args: tuple, kwargs: dict) -> str | None:
    """Why the saved guards refuse this call ("L['x'] ... size mismatch ..."), or None if they accept it."""
    f_locals = compiled.prepare_f_locals(*args, **kwargs)
    if compiled._artifacts.guard_manager.check(f_locals):
        return None
    info = compiled._artifacts.guard_manager.check_verbose(f_locals)
    return "; ".join(" ".join(part.split()) for part in getattr(info, "verbose_code_parts", None) or [str(info)])


def aot_traced_files(traced_code) -> list[str]:
    return [code.co_filename for code in traced_code]


def cpu_vec_isa_names() -> list[str] | None:
    """The vector ISAs Inductor found usable for C++ kernels in this process (it compiles and loads a
    probe per candidate, in subprocesses: about a second per process on a small CPU), or None if it
    has not looked yet. `torch._inductor.cpu_vec_isa.valid_vec_isa_list` (functools.cache), 2.9-2.14."""
    from torch._inductor import cpu_vec_isa

    if cpu_vec_isa.valid_vec_isa_list.cache_info().currsize == 0:
        return None
    return [str(isa) for isa in cpu_vec_isa.valid_vec_isa_list()]


def prime_cpu_vec_isa(names: list[str]) -> bool:
    """Let Inductor take `names` (what an earlier process on the same CPU ISA and torch found, saved
    with a warm-start entry) as the probe results instead of probing again. Only candidates the CPU
    reports are considered, as in the probe. No-op (False) once this process has its own list."""
    from torch._inductor import cpu_vec_isa

    if cpu_vec_isa.valid_vec_isa_list.cache_info().currsize:
        return False
    original = cpu_vec_isa.VecISA.check_build
    cpu_vec_isa.VecISA.check_build = lambda self, code: str(self) in names
    try:
        cpu_vec_isa.valid_vec_isa_list()
    finally:
        cpu_vec_isa.VecISA.check_build = original
    return True


def lazy_graph_modules():
    """GraphModules made in this context generate their Python code at their first call, not when
    built (what Dynamo does with its graphs): the split of a loaded graph builds one per piece,
    and the pieces deduplication replaces never run. torch.fx._lazy_graph_module, 2.9-2.14."""
    from torch.fx._lazy_graph_module import _use_lazy_graph_module

    return _use_lazy_graph_module(True)


def torch_key() -> bytes:
    """Inductor's digest of torch's sources (computed once per process; 2.9-2.14)."""
    from torch._inductor.codecache import torch_key as key

    return key()


def prime_torch_key(value: bytes) -> bool:
    """Let Inductor take `value` as torch_key() instead of hashing torch's sources; False when this
    process has it already. `torch_key.set`: an assert on 2.9, a RuntimeError on 2.13-2.14."""
    from torch._inductor.codecache import torch_key as key

    try:
        key.set(value)
    except (AssertionError, RuntimeError):
        return False
    return True
