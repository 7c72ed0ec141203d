"""Wrap-semantics speculation: trace a HOP body into a subgraph whose outputs are only its tensors.

At run time these HOPs just run their body, so the VT Dynamo continues with after the call can be
any Python structure the body returned. What the outer graph needs from the subgraph is only the
tensors and SymInts inside that structure that the body computed. Values the body merely passed
through (an input, an outer tensor) need no output at all: the caller already has them.

One implementation for every torch version; differences go through `torch_ext.compat`.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from torch._dynamo.variables.lists import BaseListVariable
from torch._dynamo.variables.tensor import SymNodeVariable, TensorVariable

from torch_ext import compat

from .collect import Found, walk
from .symbolic import inputs_of_caller, is_view, replay, replay_plan, storage_of


@dataclass
class Speculation:
    """The traced body of one HOP call."""

    output: compat.VariableTracker  # what Dynamo continues tracing with
    graph: torch.fx.Graph
    lifted_freevars: dict  # outer proxy -> subgraph placeholder proxy, in placeholder order
    # One entry per subgraph output: every VT (in the output, or reached through outer side effects)
    # that holds that value.
    output_vts: list[list[compat.VariableTracker]] = field(default_factory=list)
    example_value: tuple = ()
    # VTs the caller recomputes itself (sizes, views of inputs): after the call they point at these
    # proxies of the caller's graph instead of at subgraph outputs.
    recomputed: list[tuple[compat.VariableTracker, torch.fx.Proxy]] = field(default_factory=list)
    # Views of other outputs, taken on the HOP's results after the call: (VTs, body nodes to replay).
    views_of_outputs: list[tuple[list[compat.VariableTracker], list[torch.fx.Node]]] = field(default_factory=list)


@dataclass(frozen=True)
class BodyOptions:
    """How a HOP family constrains its body (mirrors torch's per-HOP class attributes)."""

    hop_name: str
    supports_input_mutation: bool = True
    supports_aliasing: bool = True
    symint_outputs: bool = True  # the HOP can return SymInts (torch 2.9.1's invoke_subgraph cannot)
    checkpoint: bool = False  # body of an activation checkpoint
    allow_side_effects: bool = False  # body may mutate outer Python state (regions; checkpoint opt-in)


def _is_graph_value(vt) -> bool:
    return isinstance(vt, (TensorVariable, SymNodeVariable))


def _unrepresentable(vt, subtracer) -> bool:
    """A VT that carries a proxy of this body but is neither a tensor nor a SymInt."""
    proxy = getattr(vt, "proxy", None)
    return isinstance(proxy, torch.fx.Proxy) and proxy.tracer is subtracer


def _fail(opts: BodyOptions, found: Found, what: str, fix: str):
    compat.unimplemented(
        gb_type=f"torch_ext: {opts.hop_name} body output cannot be represented",
        context=f"{found.path}: {type(found.vt).__name__} ({what})",
        explanation=f"The {opts.hop_name} body returns {what} at `{found.path}`; only tensors, SymInts "
        "and Python values that do not depend on traced tensors can leave a HOP body.",
        hints=[fix],
    )


def _side_effect_roots(tx) -> list[Found]:
    """Where a body's outer side effects can leave tensors: objects with pending mutations
    (list.append, attribute stores), and the callers' local variables (a local list that Dynamo
    does not track as a side effect). Their body-computed tensors must become outputs too; tensors
    the caller already had are passthrough, so unrelated objects add nothing."""
    side_effects = tx.output.side_effects
    roots = []
    for vt in list(side_effects.id_to_variable.values()):
        # Tensors are tracked there too (2.9.1); only containers and objects hold what was stored.
        if not _is_graph_value(vt) and side_effects.is_modified(vt):
            roots.append(Found(type(vt).__name__, vt))
    frame = tx
    while frame is not None:
        name = frame.f_code.co_name
        roots += [Found(f"{name}.{local}", vt) for local, vt in frame.symbolic_locals.items()]
        frame = getattr(frame, "parent", None)
    return roots


class _Outputs:
    """Sorts the VTs reachable from the body's output into subgraph outputs and recomputed values."""

    def __init__(self, tx, subtracer, opts: BodyOptions):
        self.tx, self.subtracer, self.opts = tx, subtracer, opts
        self.groups: dict[torch.fx.Node, list[Any]] = {}
        self.symbolic: list[tuple[Found, torch.fx.Node]] = []

    def add(self, root: Found) -> None:
        for found in walk(self.tx, root.vt, root.path):
            vt = found.vt
            if _is_graph_value(vt):
                proxy = vt.as_proxy()
                if proxy.tracer is not self.subtracer:
                    continue  # passthrough: an input or outer value, the caller already holds it
                if isinstance(vt, SymNodeVariable):
                    self.symbolic.append((found, proxy.node))
                else:
                    self.groups.setdefault(proxy.node, []).append(vt)
            elif isinstance(vt, BaseListVariable) and _unrepresentable(vt, self.subtracer):
                # A torch.Size caches a proxy of the whole size; its items are walked on their own
                # and the cache is rebuilt from them (now caller values) when next needed.
                vt.proxy = None
            elif _unrepresentable(vt, self.subtracer):
                _fail(self.opts, found, f"a traced {type(vt).__name__}",
                      "Return tensors, or convert this value to a tensor inside the body.")

    def resolve_symbolic(self, lifted_freevars: dict) -> list[tuple[Any, torch.fx.Proxy]]:
        """Recompute symbolic values in the caller; a SymInt that cannot be becomes an output
        where the HOP allows it."""
        caller_inputs = inputs_of_caller(lifted_freevars)
        recomputed = []
        for found, node in self.symbolic:
            plan = replay_plan(node, set(caller_inputs))
            if plan is not None:
                recomputed.append((found.vt, replay(self.tx, plan, caller_inputs, self.subtracer.parent)))
            elif found.vt.python_type() is int and self.opts.symint_outputs:
                self.groups.setdefault(node, []).append(found.vt)
            else:
                _fail(self.opts, found, f"a {found.vt.python_type().__name__} computed from tensor data",
                      "Return the tensor and call .item() (or int()/float()) after the HOP call.")
        return recomputed

    def resolve_aliasing(self, lifted_freevars: dict):
        """For HOPs whose outputs may not alias (invoke_subgraph): an output that is a view of an
        input is taken in the caller before the call; a view of another output, on the HOP's output
        after the call. Returns (recomputed before, [(vts, plan)] to replay after the call).
        Aliasing that is not a plain view stays an output and fails the aliasing check."""
        caller_inputs = inputs_of_caller(lifted_freevars)
        input_storages = {storage_of(n) for n in caller_inputs} - {None}
        before, after = [], []
        output_storages = set()
        # Bases before views, each in graph order: a view's plan then reads only nodes already kept.
        order = {n: i for i, n in enumerate(self.subtracer.graph.nodes)}
        for node in sorted(self.groups, key=lambda n: (is_view(n), order[n])):
            storage = storage_of(node)
            if storage is None:
                continue
            if storage in input_storages:
                plan = replay_plan(node, set(caller_inputs))
                if plan is not None:
                    outer = replay(self.tx, plan, caller_inputs, self.subtracer.parent)
                    before += [(vt, outer) for vt in self.groups.pop(node)]
                    continue
            elif storage in output_storages:
                plan = replay_plan(node, set(self.groups) - {node})
                if plan is not None:
                    after.append((self.groups.pop(node), plan))
                    continue
            output_storages.add(storage)
        return before, after


def _explicit_inputs_first(graph: torch.fx.Graph, lifted: dict, explicit: list) -> dict:
    """Reorder placeholders so the body's explicit arguments come first (in argument order) and
    closed-over values and symbols after them; returns lifted_freevars in the new order, which is
    the order of the HOP call's arguments."""
    by_outer_node = {outer.node: (outer, inner) for outer, inner in lifted.items()}
    first = []
    for arg in explicit:
        entry = by_outer_node.pop(arg.node, None)
        if entry is not None:
            first.append(entry)
    order = first + list(by_outer_node.values())
    wanted = [inner.node for _, inner in order]
    if wanted != [n for n in graph.nodes if n.op == "placeholder"]:
        head = next(iter(graph.nodes))
        if wanted[0] is not head:
            head.prepend(wanted[0])
        for prev, node in zip(wanted, wanted[1:]):
            prev.append(node)
        graph.lint()
    if wanted != [n for n in graph.nodes if n.op == "placeholder"]:
        raise AssertionError(f"torch_ext: subgraph inputs {wanted} out of order")  # call args would be wrong
    return dict(order)


def _specialize_floats(graph: torch.fx.Graph, lifted: dict) -> dict:
    """Python floats a restart asked Dynamo to specialize (see compat.specialized_float) become
    constants of the body; the 0-d tensors that carried them stop being inputs."""
    freed = set()
    for node in list(graph.find_nodes(op="call_method", target="item")):
        value = compat.specialized_float(node)
        if value is None or any(user.op == "output" for user in node.users):
            continue
        freed.add(node.args[0])
        node.replace_all_uses_with(value)
        graph.erase_node(node)
    unused = {node for node in freed if node.op == "placeholder" and not node.users}
    for node in unused:
        graph.erase_node(node)
    return {outer: inner for outer, inner in lifted.items() if inner.node not in unused}


def _aliased_pairs(nodes: list, others: list | None = None) -> list[tuple[str, str]]:
    """Pairs of nodes (by name) whose tensors share storage: within `nodes`, or between the two lists."""
    pairs, seen = [], {}
    for node in nodes:
        storage = storage_of(node)
        if storage is None:
            continue
        if others is None and storage in seen:
            pairs.append((seen[storage], node.name))
        seen.setdefault(storage, node.name)
    if others is not None:
        pairs = [(seen[storage_of(o)], o.name) for o in others if storage_of(o) in seen]
    return pairs


def _refuse_aliasing(opts: BodyOptions, graph, what: str, pairs, explanation: str, hint: str):
    compat.unimplemented(
        gb_type=f"torch_ext: {opts.hop_name} {what}",
        context=f"{', '.join(f'{a} and {b}' for a, b in pairs) or what} share storage in\n{graph}",
        explanation=explanation,
        hints=[hint],
    )


def _check_aliasing_and_mutation(subtracer, graph, opts: BodyOptions) -> None:
    if not opts.supports_input_mutation:
        info = subtracer.has_input_mutation()
        if info.has_mutation:
            compat.unimplemented(
                gb_type=f"torch_ext: {opts.hop_name} body mutates an input",
                context=f"{info.msg} in\n{graph}",
                explanation=f"{opts.hop_name} does not allow its body to mutate its inputs in place.",
                hints=["Compute a new tensor instead of the in-place op (e.g. `x = x + 1` for `x += 1`)."],
            )
    if opts.supports_aliasing:
        return
    # Which aliasing decides the message: the user fixes two aliased inputs at the call, an aliased
    # output in the body.
    inputs = list(graph.find_nodes(op="placeholder"))
    (output,) = graph.find_nodes(op="output")
    outputs = [n for n in output.args[0] if isinstance(n, torch.fx.Node)]
    if pairs := _aliased_pairs(inputs):
        _refuse_aliasing(opts, graph, "inputs alias each other", pairs,
                         f"Two inputs of {opts.hop_name} share memory (one is a view of the other, or the "
                         f"same tensor reached two ways); {opts.hop_name} requires distinct inputs.",
                         "Pass the tensor once and take the view inside the body, or pass `.clone()` of one.")
    if pairs := _aliased_pairs(inputs, outputs):
        _refuse_aliasing(opts, graph, "output aliases an input", pairs,
                         f"An output of {opts.hop_name} shares memory with one of its inputs. Returning an "
                         "input unchanged, or a plain view of one (taken in the caller), is fine.",
                         "Return `.clone()` of it (or compute the view after the region call).")
    if pairs := _aliased_pairs(outputs):
        _refuse_aliasing(opts, graph, "outputs alias each other", pairs,
                         f"Two outputs of {opts.hop_name} share memory in a way that is not a plain view "
                         "of one another.", "Return `.clone()` of one of them.")
    info = subtracer.has_aliasing()  # anything the checks above do not classify
    if info.has_aliasing:
        _refuse_aliasing(opts, graph, "body output aliases an input or another output", [],
                         f"{info.msg}: an output of {opts.hop_name} may not alias its inputs or other outputs.",
                         "Return `.clone()` of the aliasing output.")


def speculate(tx, source_target, fn_vt, args: list, kwargs: dict, opts: BodyOptions) -> Speculation:
    """Trace `fn_vt(*args, **kwargs)` as the body of HOP `source_target` with wrap semantics."""
    with compat.subtracer(tx, source_target, opts.hop_name) as subtracer:
        # "automatic": tensors are lifted to placeholders when the body first uses them.
        args = compat.validate_args_and_maybe_create_graph_inputs(
            list(args), subtracer, tx, "automatic", opts.hop_name
        )
        compat.validate_args_and_maybe_create_graph_inputs(
            list(kwargs.values()), subtracer, tx, "automatic", opts.hop_name
        )
        # Side effects are not rolled back: objects the body creates keep their attributes for the code
        # after the call. Mutations of outer objects are refused by Dynamo's scope check unless the
        # checkpoint side-effect opt-in is on.
        if opts.checkpoint:
            body_ctx = compat.checkpoint_body_context(tx, opts.allow_side_effects)
        elif opts.allow_side_effects:
            body_ctx = compat.allow_outer_side_effects(tx)
        else:
            body_ctx = contextlib.nullcontext()
        with body_ctx, compat.defer_outer_mutation_checks(tx):
            output = fn_vt.call_function(tx, list(args), dict(kwargs))

        outputs = _Outputs(tx, subtracer, opts)
        outputs.add(Found("out", output))
        if opts.allow_side_effects:
            for root in _side_effect_roots(tx):
                outputs.add(root)
        explicit = [a.as_proxy() for a in args if _is_graph_value(a)]
        lifted = _explicit_inputs_first(subtracer.graph, dict(subtracer.lifted_freevars), explicit)
        recomputed = outputs.resolve_symbolic(lifted)
        views_of_outputs = []
        if not opts.supports_aliasing:
            views_of_inputs, views_of_outputs = outputs.resolve_aliasing(lifted)
            recomputed += views_of_inputs

        output_vts = list(outputs.groups.values())
        proxies = tuple(group[0].as_proxy() for group in output_vts)
        tx.output.create_node("output", "output", subtracer.create_arg((proxies,)), {})
        graph = subtracer.graph
        lifted = _specialize_floats(graph, lifted)
        graph.lint()
        _check_aliasing_and_mutation(subtracer, graph, opts)

        example_value = tuple(p.node.meta["example_value"] for p in proxies)
        return Speculation(output, graph, lifted, output_vts, example_value, recomputed, views_of_outputs)
