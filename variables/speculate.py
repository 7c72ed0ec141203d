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

import sympy
import torch
import torch.fx
from torch._dynamo.variables.lists import BaseListVariable
from torch._dynamo.variables.tensor import SymNodeVariable, TensorVariable

from torch_ext import compat

from .collect import Found, walk


@dataclass
class Speculation:
    """The traced body of one HOP call."""

    output: compat.VariableTracker  # what Dynamo continues tracing with
    graph: torch.fx.Graph
    lifted_freevars: dict  # outer proxy -> subgraph placeholder proxy, in placeholder order
    # One entry per subgraph output: every VT in the output structure that holds that value.
    output_vts: list[list[compat.VariableTracker]] = field(default_factory=list)
    example_value: tuple = ()
    # SymInt VTs the body computed that are a symbol the caller's graph already binds: after the call
    # they point at the caller's proxy for it instead of becoming outputs.
    outer_symbols: list[tuple[compat.VariableTracker, torch.fx.Proxy]] = field(default_factory=list)


@dataclass(frozen=True)
class BodyOptions:
    """How a HOP family constrains its body (mirrors torch's per-HOP class attributes)."""

    hop_name: str
    supports_input_mutation: bool = True
    supports_aliasing: bool = True
    checkpoint: bool = False  # body of an activation checkpoint
    allow_side_effects: bool = False  # body may mutate outer Python state (checkpoint opt-in)


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


def _outer_symbol_proxy(subtracer, vt):
    """The caller's proxy for a SymInt that is exactly one symbol bound in the caller's graph."""
    sym = vt.sym_num
    if not isinstance(sym, torch.SymInt) or not isinstance(sym.node.expr, sympy.Symbol):
        return None
    proxy = subtracer.parent.bound_symbols.get(sym.node.expr)
    if proxy is not None and not isinstance(proxy, torch.fx.Proxy):
        proxy = proxy()  # a LazyProxy: materialize it in the caller's graph
    return proxy


def _collect_outputs(tx, subtracer, output, opts: BodyOptions):
    """Group the body-computed tensor/SymInt VTs of `output` by graph node, in first-seen order;
    also return the SymInt VTs that the caller can bind to a symbol it already has."""
    groups: dict[torch.fx.Node, list[Any]] = {}
    outer_symbols = []
    for found in walk(tx, output):
        vt = found.vt
        if _is_graph_value(vt):
            proxy = vt.as_proxy()
            if proxy.tracer is not subtracer:
                continue  # passthrough: an input or outer value, the caller already holds it
            if isinstance(vt, SymNodeVariable):
                outer = _outer_symbol_proxy(subtracer, vt)
                if outer is not None:
                    outer_symbols.append((vt, outer))
                    continue
            if isinstance(vt, SymNodeVariable) and vt.python_type() is not int:
                _fail(
                    opts,
                    found,
                    f"a symbolic {vt.python_type().__name__}",
                    "Return a tensor (torch.tensor(value)) or an int instead.",
                )
            groups.setdefault(proxy.node, []).append(vt)
        elif isinstance(vt, BaseListVariable) and _unrepresentable(vt, subtracer):
            # A torch.Size caches a proxy of the whole size; its items are walked on their own and
            # the cache is rebuilt from them (now HOP outputs) when next needed.
            vt.proxy = None
        elif _unrepresentable(vt, subtracer):
            _fail(opts, found, f"a traced {type(vt).__name__}", "Return tensors, or convert this value "
                  "to a tensor inside the body.")
    return list(groups.values()), outer_symbols


def _explicit_inputs_first(graph: torch.fx.Graph, lifted: dict, explicit: list) -> dict:
    """Reorder placeholders so the body's explicit arguments come first (in argument order) and
    closed-over values and symbols after them; returns lifted_freevars in the new order."""
    by_outer_node = {outer.node: (outer, inner) for outer, inner in lifted.items()}
    first = []
    for arg in explicit:
        entry = by_outer_node.pop(arg.node, None)
        if entry is not None:
            first.append(entry)
    order = first + list(by_outer_node.values())
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    if [inner.node for _, inner in order] != placeholders:
        anchor = placeholders[0]
        for _, inner in order:
            anchor.prepend(inner.node)
        graph.lint()
    return dict(order)


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
    if not opts.supports_aliasing:
        info = subtracer.has_aliasing()
        if info.has_aliasing:
            compat.unimplemented(
                gb_type=f"torch_ext: {opts.hop_name} body output aliases an input or another output",
                context=f"{info.msg} in\n{graph}",
                explanation=f"{opts.hop_name} is not inlined before autograd, so an output may not be a view "
                "of an input or of another output. Returning an input unchanged is fine.",
                hints=["Return `.clone()` of the view (or compute the view after the region call)."],
            )


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
        # after the call. Mutations of outer objects are still refused by Dynamo's scope check.
        body_ctx = (
            compat.checkpoint_body_context(tx, opts.allow_side_effects)
            if opts.checkpoint
            else contextlib.nullcontext()
        )
        with body_ctx, compat.defer_outer_mutation_checks(tx):
            output = fn_vt.call_function(tx, list(args), dict(kwargs))

        output_vts, outer_symbols = _collect_outputs(tx, subtracer, output, opts)
        proxies = tuple(group[0].as_proxy() for group in output_vts)
        tx.output.create_node("output", "output", subtracer.create_arg((proxies,)), {})
        graph = subtracer.graph
        graph.lint()

        explicit = [a.as_proxy() for a in args if _is_graph_value(a)]
        lifted = _explicit_inputs_first(graph, dict(subtracer.lifted_freevars), explicit)
        _check_aliasing_and_mutation(subtracer, graph, opts)

        example_value = tuple(p.node.meta["example_value"] for p in proxies)
        return Speculation(output, graph, lifted, output_vts, example_value, outer_symbols)
