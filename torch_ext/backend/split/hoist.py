"""Model-wide values computed where the partitioner put them would make one layer's piece unlike its siblings.

In a backward graph AOTAutograd's partitioner recomputes cheap values from the graph's inputs (a
Llama's RoPE cos/sin from `inv_freq`, the zero buffers its slice_scatter grads start from) right
before their first use: inside the last layer's piece, which then computes them and hands them on,
while every other layer's piece takes them as inputs. That piece compiles on its own
(compile/aten_pieces.py dedups by fingerprint). `hoist_shared_values` moves such values to the end
of the piece before (just ahead of the splitting op that precedes their first use): the piece that
used them becomes its siblings' twin, and the value lives across one more splitting op, no longer.

Only values computed from graph inputs alone, by pure and deterministic ops (never RNG: moving one
would change which numbers it draws), and read by more than two pieces: a value of the whole model,
not one layer's activation carried from one piece to the next.
"""
from __future__ import annotations

import operator
from typing import Callable

import torch
import torch.fx as fx

_MIN_READERS = 3  # pieces reading a value for it to count as model-wide


def hoist_shared_values(gm: fx.GraphModule, is_splitting: Callable[[fx.Node], bool]) -> int:
    """Move model-wide values to the end of the piece before their first reader; the nodes moved."""
    graph = gm.graph
    part: dict[fx.Node, int] = {}
    splitting_at: dict[int, fx.Node] = {}  # odd partition index -> its splitting op
    current = 0
    for node in graph.nodes:
        if is_splitting(node):
            current += 1
            splitting_at[current] = node
            part[node] = current
            current += 1
        elif node.target is operator.getitem and node.args and part.get(node.args[0], -1) in splitting_at:
            part[node] = part[node.args[0]]  # unpacking a splitting op's result stays with it
        else:
            part[node] = current
    movable = _input_only(graph, is_splitting)
    moves: dict[int, list[fx.Node]] = {}
    for node in graph.nodes:
        if node not in movable or part[node] == 0:
            continue
        readers = {part[user] for user in node.users if user.op != "output"}
        if len(readers | {part[node]}) < _MIN_READERS:
            continue
        moves.setdefault(part[node], []).append(node)
    moved = 0
    for p, roots in moves.items():
        anchor = splitting_at.get(p - 1)
        if anchor is None:
            continue
        group = _with_ancestors(roots, movable, part, p)
        for node in graph.nodes:  # in graph order, so that each lands after its inputs
            if node in group:
                anchor.prepend(node)
                moved += 1
    if moved:
        graph.lint()
        gm.recompile()
    return moved


def _input_only(graph: fx.Graph, is_splitting) -> set[fx.Node]:
    """Tensor values of pure, deterministic calls whose inputs are graph inputs or such values."""
    out: set[fx.Node] = set()
    for node in graph.nodes:
        if node.op != "call_function" or is_splitting(node) or not isinstance(node.meta.get("val"), torch.Tensor):
            continue
        if not is_pure_call(node):
            continue
        if all(arg.op == "placeholder" or arg in out for arg in node.all_input_nodes):
            out.add(node)
    return out


def is_pure_call(node: fx.Node) -> bool:
    """An ATen call that may run anywhere else in the graph: no side effect, no random numbers
    (moved, an RNG op would draw other numbers)."""
    target = node.target
    if node.op != "call_function":
        return False
    if isinstance(target, torch._ops.OpOverload):
        if torch.Tag.nondeterministic_seeded in target.tags or target._schema.is_mutable:
            return False
    elif target is not operator.getitem:
        return False  # a Python function or a HOP: not ours to move
    return not node.is_impure()


def _with_ancestors(roots: list[fx.Node], movable: set[fx.Node], part: dict, p: int) -> set[fx.Node]:
    """roots and the movable values of partition p they are computed from."""
    group: set[fx.Node] = set()
    stack = list(roots)
    while stack:
        node = stack.pop()
        if node in group:
            continue
        group.add(node)
        stack.extend(a for a in node.all_input_nodes if a in movable and part[a] == p)
    return group
