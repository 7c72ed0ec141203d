"""Python scalars the pieces of a split graph pass each other: only tensors and ints may cross.

Dynamo records float (and bool) arithmetic on sizes as SymFloat/SymBool calls, and sometimes on
plain numbers too. Where one is computed before a splitting op and read after it, the split makes
it a piece output and the next piece's input; Inductor cannot return a Python float, and torch
2.9.1 cannot compile a piece that takes a symbolic float. So a value known at trace time is put in
place of its calls, and a symbolic one is computed again in each partition that reads it.
"""
from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx


def _known_number(value: Any) -> int | float | bool | None:
    """The number a traced scalar value always has (no free symbols), else None."""
    if isinstance(value, torch.SymBool):
        return value.node.maybe_as_bool()
    if isinstance(value, torch.SymInt):
        return value.node.maybe_as_int()
    if isinstance(value, torch.SymFloat):
        return value.node.maybe_as_float()
    return value if isinstance(value, (int, float, bool)) else None


def fold_known_numbers(gm: fx.GraphModule) -> int:
    """Put the number in place of each call whose result is one known at trace time. Dynamo can
    record e.g. GELU's `math.sqrt(2.0 / math.pi)` as SymFloat nodes (HF GPT-2 under `generate`); one
    computed in one piece and read in the next would be a piece output, and Inductor cannot return a
    Python float. Returns how many calls it replaced."""
    folded = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is operator.getitem:
            continue
        number = _known_number(node.meta.get("example_value", node.meta.get("val")))
        if number is None:
            continue
        for user in list(node.users):
            user.args = fx.node.map_arg(user.args, lambda n: number if n is node else n)
            user.kwargs = fx.node.map_arg(user.kwargs, lambda n: number if n is node else n)
        gm.graph.erase_node(node)
        folded += 1
    if folded:
        gm.recompile()
    return folded


def _symbolic_scalar(node: fx.Node) -> bool:
    """A call computing a SymFloat or SymBool from scalars only (sizes, numbers, other such calls)."""
    if node.op != "call_function":
        return False
    if not isinstance(node.meta.get("example_value", node.meta.get("val")), (torch.SymFloat, torch.SymBool)):
        return False
    return not any(isinstance(a.meta.get("example_value", a.meta.get("val")), torch.Tensor)
                   for a in node.all_input_nodes)


def localize_symbolic_scalars(graph: fx.Graph, partition_of: dict[fx.Node, int]) -> int:
    """Compute each SymFloat/SymBool again in every other partition that reads it (`t / 2.0` before
    a splitting op, used after it), so no piece returns or takes one: torch 2.9.1's Inductor cannot
    compile a piece with a symbolic float input. Returns how many copies it made."""
    copies: dict[tuple[fx.Node, int], fx.Node] = {}

    def copy_for(node: fx.Node, partition: int, before: fx.Node) -> fx.Node:
        if (node, partition) not in copies:
            def arg(a: fx.Node) -> fx.Node:
                return copy_for(a, partition, before) if _symbolic_scalar(a) and partition_of[a] != partition else a
            with graph.inserting_before(before):
                copy = graph.node_copy(node, arg)
            partition_of[copy] = partition
            copies[(node, partition)] = copy
        return copies[(node, partition)]

    for node in list(graph.nodes):
        if node not in partition_of:  # placeholders, the output
            continue
        for arg in node.all_input_nodes:
            if _symbolic_scalar(arg) and partition_of[arg] != partition_of[node]:
                node.replace_input_with(arg, copy_for(arg, partition_of[node], node))
    for original, _ in reversed(list(copies)):  # originals nobody reads any more
        if not original.users and original in partition_of:
            graph.erase_node(original)
            del partition_of[original]
    return len(copies)
