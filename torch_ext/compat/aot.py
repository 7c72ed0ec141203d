"""Dynamo's AOT compile (warm start: torch_ext/backend/warm_start/)."""
from __future__ import annotations

import contextlib
import dataclasses
import importlib
import traceback
from typing import Any

import torch

# torch 2.11.0 .. 2.15.0 have Dynamo's AOT compile (2.11 lacks two pieces torch_ext adds: _with_builtins, graph_pickler_maps_slices): `torch._dynamo.aot_compile`
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
                     "_dynamo_unbacked_bounds", "_dynamo_hint_overrides", "_has_dynamo_dim_marking",
                     "_dynamo_dynamic_range")  # 2.15: mark_dynamic(min=, max=), guarded by value


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
        runtime_env = _with_builtins(graph_capture.get_runtime_env(), graph_capture.f_globals)
        artifacts = aot.CompileArtifacts(
            signature=convert_frame._get_signature(fn), guard_manager=check_fn.guard_manager,
            guards_state=check_fn.guards_state, backend_id=backend_input.backend_id, compiled_fn=compiled_fn,
            original_code=fn.__code__, runtime_env=runtime_env, source_info=source_info,
            device_type=_graph_device_type(gm.graph), backend_name="torch_ext")
        return aot.AOTCompiledFunction(_artifacts=artifacts, _extra_globals=fn.__globals__), \
            list(graph_capture.traced_code)


def _with_builtins(runtime_env, f_globals: dict):
    """The runtime env with the builtins its bytecode loads (`type`, `__builtins_dict___0`) among its
    globals. 2.13+ put them there; 2.11 does not, and AOTCompiledFunction refuses the env ("Missing
    required external references: ['type']": the forward's module globals hold no builtins)."""
    import builtins

    used = dict(runtime_env.used_globals)
    for ref in runtime_env.external_refs - used.keys():
        if ref.startswith("__builtins_dict__") and ref in f_globals:
            used[ref] = {k: v for k, v in f_globals[ref].items() if _picklable(v)}
        elif hasattr(builtins, ref):
            used[ref] = getattr(builtins, ref)
    if len(used) == len(runtime_env.used_globals):
        return runtime_env
    return dataclasses.replace(runtime_env, used_globals=used)


def _picklable(value) -> bool:
    import pickle

    try:
        pickle.dumps(value)
    except Exception:
        return False
    return True


def _graph_device_type(graph) -> str:
    """The device type an AOT artifact records (its load checks that device): one function on 2.13,
    2.14.1; from 2.15 the set of device types, collapsed to the preferred accelerator."""
    from torch._dynamo import graph_utils

    if hasattr(graph_utils, "_graph_device_type"):
        return graph_utils._graph_device_type(graph)
    from torch._dynamo.package import _collapse_device_types
    return _collapse_device_types(graph_utils._graph_device_types(graph))


@contextlib.contextmanager
def graph_pickler_maps_slices():
    """Around GraphPickler.dumps/loads: a node argument `slice(None, <Node>)` (`cache[: x.shape[0]]`
    under dynamic shapes) has its Node mapped. GraphPickler maps args with pytree, to which a slice
    is a leaf unless registered: 2.13+ register it around dumps and loads themselves; 2.11 does not
    ("Unexpected raw Node during pickling"). Registered here the same way where torch does not."""
    from torch.fx import _graph_pickler as gp
    from torch.utils import _pytree as pytree

    if hasattr(gp, "patch_pytree_map_over_slice") or slice in pytree.SUPPORTED_NODES:
        yield
        return
    pytree._private_register_pytree_node(slice, lambda s: ([s.start, s.stop, s.step], None),
                                         lambda values, _: slice(*values))
    try:
        yield
    finally:
        pytree._deregister_pytree_node(slice)


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

    # 2.15 writes a magic header and format version before the pickle, and checks them on load.
    payload = aot._open_aot_compile_payload(data) if hasattr(aot, "_open_aot_compile_payload") else io.BytesIO(data)
    unpickler = aot.AOTCompileUnpickler(external, payload)
    state = unpickler.load()
    state["runtime_env"] = dataclasses.replace(
        state["runtime_env"], bytecode=SerializedCode.to_code_object(state["runtime_env"].bytecode))
    state["original_code"] = SerializedCode.to_code_object(state["original_code"])
    with _fake_modes_without_stacks():  # one FakeTensorMode per saved tensor guard
        guards_state = load_guards_state(state["guards_state"])
    # Guards read modules from the saved global scope, which keeps none: `G['math'].pi == 3.14...` or
    # `G['__import_transformers_dot_activations'].math.pi == ...` (the value guard of a float Dynamo
    # specialized on a restart). Put back the import aliases and the forward's own globals.
    global_scope = guards_state.output_graph.global_scope
    for alias, module in state["runtime_env"].import_sources.items():
        global_scope.setdefault(alias, importlib.import_module(module))
    for name, value in f_globals.items():
        global_scope.setdefault(name, value)
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


def aot_guard_accepts(compiled, args: tuple, kwargs: dict) -> bool:
    """Whether the saved guards accept this call (the check alone: no verbose pass on a refusal)."""
    return bool(compiled._artifacts.guard_manager.check(compiled.prepare_f_locals(*args, **kwargs)))


def aot_guard_reason(compiled, args: tuple, kwargs: dict) -> str | None:
    """Why the saved guards refuse this call ("L['x'] ... size mismatch ..."), or None if they accept it."""
    f_locals = compiled.prepare_f_locals(*args, **kwargs)
    if compiled._artifacts.guard_manager.check(f_locals):
        return None
    info = compiled._artifacts.guard_manager.check_verbose(f_locals)
    return "; ".join(" ".join(part.split()) for part in getattr(info, "verbose_code_parts", None) or [str(info)])


def aot_traced_files(traced_code) -> list[str]:
    return [code.co_filename for code in traced_code]


