"""A graph in a few short lines: per graph and subgraph, its op count and the ops by name.

    forward     7 ops  invoke_subgraph×2, getitem×2, mul
    subgraph_0  1 op   mul

`print_readable` gives every node with its full target and arguments on one line (often 200+
characters); to see *what* was captured, the op names and counts are enough.
"""
from __future__ import annotations

import collections
import textwrap

import torch
import torch.fx as fx

# Nodes that are plumbing rather than computation.
_NOT_OPS = ("placeholder", "output", "get_attr")


def op_name(node: fx.Node) -> str:
    """A short name for what a node computes: `linear`, `mul`, `invoke_subgraph`, `mylib.attention`."""
    target = node.target
    if node.op == "call_module":
        return str(target)
    if node.op == "call_method":
        return str(target)
    if isinstance(target, torch._ops.HigherOrderOperator):
        return target.name()
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        qualified = target._schema.name if isinstance(target, torch._ops.OpOverload) else target._qualified_op_name
        namespace, base = qualified.split("::")
        return base if namespace in ("aten", "prims") else f"{namespace}.{base}"
    return getattr(target, "__name__", str(target))


def op_counts(gm: fx.GraphModule) -> collections.Counter:
    """Ops of this graph only (its subgraphs are listed separately), in order of first use."""
    return collections.Counter(op_name(n) for n in gm.graph.nodes if n.op not in _NOT_OPS)


def format_counts(counts: collections.Counter) -> str:
    return ", ".join(name if n == 1 else f"{name}×{n}" for name, n in counts.items()) or "(no ops)"


def graph_modules(gm: fx.GraphModule, root_name: str = "forward") -> list[tuple[str, fx.GraphModule]]:
    """The graph and the subgraphs (HOP bodies) it calls, each once, outermost first. A subgraph
    the graph holds but no longer calls (torch 2.13 inlines single-use regions) is left out."""
    found = [(root_name, gm)]
    for _, module in found:  # grows while it is walked: breadth-first over get_attr references
        for node in module.graph.nodes:
            sub = getattr(module, node.target, None) if node.op == "get_attr" else None
            if isinstance(sub, fx.GraphModule) and all(sub is not m for _, m in found):
                found.append((node.target, sub))
    return found


def summarize(gm: fx.GraphModule, *, width: int = 96, indent: str = "") -> list[str]:
    """One line per graph and subgraph (wrapped under `width`): name, op count, ops by name."""
    graphs = graph_modules(gm)
    name_width = max(len(name) for name, _ in graphs)
    lines = []
    for name, module in graphs:
        counts = op_counts(module)
        total = sum(counts.values())
        head = f"{indent}{name:<{name_width}}  {total:>3} op{'s' if total != 1 else ' '}  "
        lines += textwrap.wrap(format_counts(counts), width=width, initial_indent=head,
                               subsequent_indent=" " * len(head), break_on_hyphens=False) or [head.rstrip()]
    return lines
