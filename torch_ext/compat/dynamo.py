"""Dynamo internals: the HOP VariableTrackers torch_ext extends, tracing helpers, graph sources,
shape symbols and guards, as each supported torch spells them."""
from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch

from torch._dynamo import exc as _exc
from torch._dynamo.variables import higher_order_ops as _hops
from torch._dynamo.variables.base import VariableTracker  # noqa: F401  (re-exported)
from torch._dynamo.variables.builder import wrap_fx_proxy  # noqa: F401  (same signature everywhere)

from torch_ext.compat.versions import TORCH_VERSION

# torch's own VariableTrackers that ours extend (we keep their subgraph installation and naming).
WrapHigherOrderVariable = _hops.WrapHigherOrderVariable
CheckpointHigherOrderVariable = _hops.CheckpointHigherOrderVariable
DynamoBypassingWrapperHigherOrderVariable = _hops.DynamoBypassingWrapperHigherOrderVariable
BaseHOPVariable = _hops.BaseHOPVariable
try:  # 2.12+ moved it to its own module
    from torch._dynamo.variables.invoke_subgraph import InvokeSubgraphHigherOrderVariable
except ImportError:
    InvokeSubgraphHigherOrderVariable = _hops.InvokeSubgraphHigherOrderVariable


def region_reuse_eligibility():
    """(module, name) of Dynamo's check whether a traced region's result may be stamped out for later
    calls (subgraph reuse, REGION_REUSE_FLATTENS_OUTPUT_TYPE), or None on a torch without reuse."""
    try:
        import torch._dynamo.variables.invoke_subgraph as module
    except ImportError:
        return None
    return (module, "is_reuse_eligible") if hasattr(module, "is_reuse_eligible") else None


def plain_sequence_output(vt) -> bool:
    """A tensor, or a tuple exactly (no namedtuple, list or other subclass): what a stamped-out reuse
    gives back as it was returned."""
    from torch._dynamo.variables.lists import TupleVariable
    from torch._dynamo.variables.tensor import TensorVariable

    return isinstance(vt, TensorVariable) or type(vt) is TupleVariable


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


def backend_fallback_exceptions() -> tuple[type, ...]:
    """Exceptions a backend may raise for Dynamo to run the graph's frame eagerly instead (a graph break):
    fake-tensor limits such as a data-dependent .item() inside an op's backward. Inductor raises them
    from the same places our piece compiles do."""
    return tuple(getattr(_exc, "exceptions_allowed_to_be_fallback", ()))


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


def allow_outer_side_effects(tx):
    """Let the HOP body being traced mutate outer Python state (lists, dicts, attributes, cells,
    globals): 2.10+ flags the tracer with `allow_side_effects_in_hop`; 2.9.1 has only
    `allow_externally_visible_side_effects_in_subtracer`, which does the same for its check."""
    if hasattr(_hops, "dynamo_allow_side_effects_in_hop"):
        return _hops.dynamo_allow_side_effects_in_hop(tx)
    from torch._dynamo.side_effects import allow_externally_visible_side_effects_in_subtracer

    return allow_externally_visible_side_effects_in_subtracer(tx)


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


def retrying_float_restarts(trace: Callable[[], Any], attempts: int = 4) -> Any:
    """trace(), again while the backend asks to specialize more floats (restart_with_floats_specialized):
    what Dynamo's own frame compile does, for traces that do not go through it (warm start's AOT
    trace). The specializations are forgotten afterwards, as Dynamo forgets them after a frame."""
    from torch._dynamo.exc import TensorifyScalarRestartAnalysis
    from torch._dynamo.symbolic_convert import TensorifyState

    try:
        for attempt in range(attempts):
            try:
                return trace()
            except TensorifyScalarRestartAnalysis:
                if attempt == attempts - 1:
                    raise
    finally:
        TensorifyState.clear()


def floats_being_specialized() -> bool:
    """Whether a restart of this frame asked Dynamo to specialize Python floats (TensorifyState, the
    same on 2.9.1 .. 2.15): torch's own HOP tracing leaves their `.item()` in HOP bodies, which
    Inductor then cannot compile; torch_ext's body tracing replaces them (specialized_float)."""
    from torch._dynamo.symbolic_convert import TensorifyState

    return not TensorifyState.empty()


def restart_with_floats_specialized(names: list[str]):
    """Make Dynamo trace the frame again with these floats as constants, the way Inductor's own
    `tensorify_python_scalars` pass does when it cannot keep a float symbolic."""
    from torch._dynamo.exc import TensorifyScalarRestartAnalysis
    from torch._dynamo.symbolic_convert import TensorifyState

    for name in names:
        TensorifyState.specialize(name)
    raise TensorifyScalarRestartAnalysis


# --- guard-free dispatch (backend/dispatch/) ------------------------------

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


# --- warm start without re-tracing (backend/warm_start/) ---------------------------------------
#


def compile_lock():
    """Dynamo's process-wide compile lock (an RLock, `torch._dynamo.convert_frame.compile_lock`,
    2.9.1..2.15): held while Dynamo compiles a frame, and so while our backend runs. Compiles the
    backend starts at run time (a piece's size variant) take it too: Inductor's compile is not
    thread-safe (its config patches are process-global), and one lock cannot deadlock with Dynamo's."""
    return torch._dynamo.convert_frame.compile_lock
