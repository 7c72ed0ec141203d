"""Recompute a symbolic value (SymInt, SymFloat, SymBool) of a HOP body in the caller's graph.

Sizes and arithmetic on them are pure functions of the inputs' shapes, so the caller can compute the
same value itself: `x.size(0) / 2.0` in the body becomes `sym_size(x, 0) / 2.0` in the caller. That
needs no subgraph output, which matters because HOP outputs must be tensors or SymInts (torch 2.9.1's
invoke_subgraph: tensors only). A value that depends on tensor data (`.item()`) cannot be recomputed.
"""
from __future__ import annotations

import torch
import torch.fx

_SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool)


def _is_symbolic(value) -> bool:
    if isinstance(value, (torch.Size, tuple)):  # x.size() on the way to x.size()[0]
        return all(isinstance(v, _SYMBOLIC) for v in value)
    return isinstance(value, _SYMBOLIC)


def _replayable_nodes(node: torch.fx.Node) -> list[torch.fx.Node] | None:
    """The body nodes `node` depends on, in graph order, if all are placeholders or symbolic ops."""
    seen: dict[torch.fx.Node, None] = {}
    stack = [node]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen[n] = None
        if n.op == "placeholder":
            continue
        if n.op not in ("call_function", "call_method") or not _is_symbolic(n.meta.get("example_value")):
            return None  # depends on tensor data, or a call we should not repeat
        stack.extend(n.all_input_nodes)
    order = {n: i for i, n in enumerate(node.graph.nodes)}
    return sorted(seen, key=order.__getitem__)


def recompute_in_caller(subtracer, lifted_freevars: dict, node: torch.fx.Node) -> torch.fx.Proxy | None:
    """A proxy in the caller's graph that computes what `node` computes in the body, or None."""
    nodes = _replayable_nodes(node)
    if nodes is None:
        return None
    outer_of = {inner.node: outer for outer, inner in lifted_freevars.items()}
    caller = subtracer.parent
    env: dict[torch.fx.Node, torch.fx.Proxy] = {}
    for n in nodes:
        if n.op == "placeholder":
            if n not in outer_of:
                return None
            env[n] = outer_of[n]
            continue
        args, kwargs = torch.fx.node.map_arg((n.args, n.kwargs), lambda a: env[a])
        proxy = caller.create_proxy(n.op, n.target, args, kwargs)
        proxy.node.meta["example_value"] = n.meta["example_value"]
        env[n] = proxy
    return env[node]
