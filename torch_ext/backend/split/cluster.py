"""Splitting ops moved next to each other where the graph allows it, so that no piece runs between them.

A checkpointed region's backward recomputes its forward. AOTAutograd's partitioner puts each
recomputed node right before its first use, so a checkpointed Llama's backward runs, per layer:
attention backward of layer L+1 | grads of L+1's q/k/v projections and norm, recompute of layer L's
norm and q/k/v | attention forward of L (recompute). The recompute of layer L reads only what the
forward saved: it may run before layer L+1's attention backward, and the two attention calls become
neighbours (HF Llama, 8 layers: 17 backward pieces -> 10).

For each pair of consecutive splitting ops S1, S2 the nodes between them that S2 needs move before S1
when none of them reads S1's result; S2 (with its tuple unpacking) then moves up to S1. Only pure,
deterministic nodes move (split/hoist.py's `is_pure_call`).
"""
from __future__ import annotations

import operator
from typing import Callable

import torch.fx as fx

from torch_ext.backend.split.hoist import is_pure_call


def cluster_splitting_ops(gm: fx.GraphModule, is_splitting: Callable[[fx.Node], bool]) -> int:
    """Bring consecutive splitting ops together where no node between them that the second needs
    reads the first's result; the number of pairs brought together."""
    graph = gm.graph
    ops = [node for node in graph.nodes if is_splitting(node)]
    for op in ops:
        _gather_unpacking(op)
    joined = sum(1 for first, second in zip(ops, ops[1:]) if _join(graph, first, second))
    if joined:
        graph.lint()
        gm.recompile()
    return joined


def _unpacking(op: fx.Node) -> list[fx.Node]:
    out, stack = [], [op]
    while stack:
        node = stack.pop()
        for user in node.users:
            if user.op == "call_function" and user.target is operator.getitem:
                out.append(user)
                stack.append(user)
    position = {node: i for i, node in enumerate(op.graph.nodes)}
    return sorted(out, key=position.__getitem__)


def _gather_unpacking(op: fx.Node) -> None:
    last = op
    for node in _unpacking(op):
        last.append(node)
        last = node


def _join(graph: fx.Graph, first: fx.Node, second: fx.Node) -> bool:
    first_block = [first, *_unpacking(first)]
    second_block = [second, *_unpacking(second)]
    between, seen = [], False
    for node in graph.nodes:
        if node is second:
            break
        if node is first_block[-1]:
            seen = True
        elif seen:
            between.append(node)
    if not between or not all(_movable(node) for node in between):
        return False
    inside = set(between)
    reads_first = set(first_block)
    for node in between:
        if any(arg in reads_first for arg in node.all_input_nodes):
            reads_first.add(node)
    needed = _ancestors_within(second, inside)
    if needed & reads_first:
        return False
    for node in between:
        if node in needed:
            first.prepend(node)
    last = first_block[-1]
    for node in second_block:
        last.append(node)
        last = node
    return True


def _movable(node: fx.Node) -> bool:
    if node.op == "get_attr":
        return True
    if node.op == "call_function" and getattr(node.target, "__module__", None) == "_operator":
        return True
    return is_pure_call(node)


def _ancestors_within(node: fx.Node, inside: set[fx.Node]) -> set[fx.Node]:
    out: set[fx.Node] = set()
    stack = [a for a in node.all_input_nodes if a in inside]
    while stack:
        current = stack.pop()
        if current not in out:
            out.add(current)
            stack.extend(a for a in current.all_input_nodes if a in inside)
    return out
