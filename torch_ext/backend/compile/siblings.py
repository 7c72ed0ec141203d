"""Pieces of one ATen graph that differ from a sibling only at their ends, made to share its compile.

AOTAutograd's partitioner sees the whole training graph, and where saving one tensor costs as much
as saving another it may choose differently for one layer: in a Llama the first layer saves its
attention projection's output where every other layer saves the residual sum made from it. That
layer's forward piece then returns another node, and its backward piece recomputes the sum from
two inputs where its siblings take it as one. Each would compile on its own
(compile/aten_pieces.py shares a compile only between pieces of one fingerprint). Two rewrites,
each checked by the fingerprint, so that nothing that matters differs:

* `share_outputs`: pieces equal but for what they return all return the union (each call site
  reads its own outputs; the others are dropped at once).
* `peel_prologues`: a piece that is a sibling plus a few pure ops on its inputs (the recomputed
  sum) runs those ops eagerly, then the sibling's compile.
"""
from __future__ import annotations

import collections
import dataclasses
import operator
from typing import Any, Callable

import torch.fx as fx
import torch.utils._pytree as pytree

from torch_ext.backend.compile.fingerprint import body_fingerprint, graph_fingerprint
from torch_ext.backend.split.hoist import is_pure_call

# Most ops a peeled prologue may hold: it runs eagerly, op by op, at every step.
_MAX_PEELED = 8
_CANDIDATES = 3  # siblings tried per piece, most frequent first


def share_outputs(split_gm: fx.GraphModule, pieces: dict[str, fx.GraphModule]) -> int:
    """Make pieces equal but for their outputs return the union of them; the pieces rewritten."""
    groups: dict[str, list[tuple[str, list[int]]]] = collections.defaultdict(list)
    for name, gm in pieces.items():
        body = body_fingerprint(gm)
        if body is not None:
            groups[body[0]].append((name, body[1]))
    rewritten = 0
    for members in groups.values():
        if len({tuple(outs) for _, outs in members}) < 2:
            continue
        common = collections.Counter(tuple(outs) for _, outs in members).most_common(1)[0][0]
        union = list(common) + sorted({i for _, outs in members for i in outs} - set(common))
        calls = {n.target: n for n in split_gm.graph.find_nodes(op="call_module")}
        if not all(_read_by_getitem(calls[name]) for name, _ in members):
            continue
        for name, outs in members:
            nodes = list(pieces[name].graph.nodes)
            pieces[name].graph.output_node().args = (tuple(nodes[i] for i in union),)
            pieces[name].recompile()
            for user in list(calls[name].users):  # getitem(piece, k): its k-th output is now at union.index
                user.args = (user.args[0], union.index(outs[user.args[1]]))
            rewritten += 1
    if rewritten:
        split_gm.recompile()
    return rewritten


def _read_by_getitem(call: fx.Node) -> bool:
    return all(u.op == "call_function" and u.target is operator.getitem and isinstance(u.args[1], int)
               for u in call.users)


@dataclasses.dataclass
class Peeled:
    """A piece run as `prologue` (eager) then `remainder` (a sibling's twin) on the values it gives."""

    remainder: fx.GraphModule
    prologue: Callable  # the peeled ops: run(*inputs) -> tuple of values
    prologue_inputs: list[int]  # positions of the piece's inputs the prologue reads
    plan: list[tuple[bool, int]]  # per remainder input: (from the prologue, index)


class PeeledPiece:
    """The callable for a peeled piece: boxed, as the compiled piece it wraps."""

    _boxed_call = True

    def __init__(self, peeled: Peeled, compiled: Any):
        self.peeled, self.compiled = peeled, compiled
        self.output_strides = compiled.output_strides

    def __call__(self, args: list):
        p = self.peeled
        values = p.prologue(*[args[i] for i in p.prologue_inputs])
        inputs = [values[i] if peeled else args[i] for peeled, i in p.plan]
        args.clear()
        del values
        return self.compiled(inputs)


def peel_prologues(pieces: dict[str, fx.GraphModule], prologue: Callable[[fx.Graph, str], Callable]
                   ) -> dict[str, Peeled]:
    """For each piece whose fingerprint no other piece shares, a peel that makes it a twin of a
    sibling shared by several, where there is one. `prologue(graph, name)` makes a graph's eager runner."""
    keys = {name: graph_fingerprint(gm) for name, gm in pieces.items()}
    counts = collections.Counter(keys.values())
    shared = [key for key, n in counts.most_common() if n >= 2][:_CANDIDATES]
    sibling = {key: pieces[next(name for name, k in keys.items() if k == key)] for key in shared}
    out = {}
    for name, gm in pieces.items():
        if counts[keys[name]] > 1:
            continue
        for key in shared:
            peeled = _peel(gm, sibling[key], key, prologue, name)
            if peeled is not None:
                out[name] = peeled
                break
    return out


def _align(piece: fx.Graph, sibling: fx.Graph) -> dict[fx.Node, fx.Node] | None:
    """Sibling node -> piece node, matched from the outputs back: same ops, same constants; a
    sibling input may match any piece node. None where they differ."""
    mine, theirs = piece.output_node().args[0], sibling.output_node().args[0]
    if not isinstance(mine, (tuple, list)) or not isinstance(theirs, (tuple, list)) or len(mine) != len(theirs):
        return None
    image: dict[fx.Node, fx.Node] = {}
    stack = list(zip(theirs, mine))
    while stack:
        q, p = stack.pop()
        if not isinstance(q, fx.Node) or not isinstance(p, fx.Node):
            return None
        if q in image:
            if image[q] is not p:
                return None
            continue
        image[q] = p
        if q.op == "placeholder":
            continue
        if q.op != "call_function" or p.op != "call_function" or p.target != q.target:
            return None
        q_leaves, q_spec = pytree.tree_flatten((q.args, q.kwargs))
        p_leaves, p_spec = pytree.tree_flatten((p.args, p.kwargs))
        if q_spec != p_spec:
            return None
        for a, b in zip(q_leaves, p_leaves):
            if isinstance(a, fx.Node) or isinstance(b, fx.Node):
                stack.append((a, b))
            elif type(a) is not type(b) or a != b:
                return None
    computed = [p for q, p in image.items() if q.op != "placeholder"]
    if len(set(computed)) != len(computed):
        return None
    return image


def _peel(gm: fx.GraphModule, sibling: fx.GraphModule, key: str, prologue: Callable, name: str) -> Peeled | None:
    image = _align(gm.graph, sibling.graph)
    inputs = list(sibling.graph.find_nodes(op="placeholder"))
    if image is None or any(q not in image for q in inputs):
        return None
    computed = {p for q, p in image.items() if q.op != "placeholder"}
    peeled: set[fx.Node] = set()
    stack = [image[q] for q in inputs if image[q].op != "placeholder"]
    while stack:
        node = stack.pop()
        if node not in peeled:
            peeled.add(node)
            stack.extend(a for a in node.all_input_nodes if a.op != "placeholder")
    rest = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    if not peeled or len(peeled) > _MAX_PEELED or peeled & computed or \
            any(n not in computed and n not in peeled for n in rest) or not all(is_pure_call(n) for n in peeled):
        return None
    remainder, plan, front = _cut(gm, inputs, image, peeled)
    if graph_fingerprint(remainder) != key:  # equal in all that matters, or not shared
        return None
    return Peeled(remainder, prologue(front, f"{name} prologue"), _prologue_inputs(gm, front), plan)


def _cut(gm: fx.GraphModule, inputs: list[fx.Node], image: dict, peeled: set[fx.Node]):
    """(the piece with the peeled values as inputs in the sibling's order, the input plan, the prologue graph)."""
    own = list(gm.graph.find_nodes(op="placeholder"))
    boundary = [image[q] for q in inputs if image[q] in peeled]
    front = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in own:
        if any(u in peeled for u in node.users):
            env[node] = front.placeholder(node.name)
            env[node].meta = dict(node.meta)
    for node in gm.graph.nodes:
        if node in peeled:
            env[node] = front.node_copy(node, lambda n: env[n])
    front.output(tuple(env[n] for n in boundary))
    graph = fx.Graph()
    env = {}
    plan = []
    for q in inputs:
        p = image[q]
        env[p] = graph.placeholder(p.name)
        env[p].meta = dict(p.meta)
        plan.append((True, boundary.index(p)) if p in peeled else (False, own.index(p)))
    for node in gm.graph.nodes:
        if node.op not in ("placeholder", "output") and node not in peeled:
            env[node] = graph.node_copy(node, lambda n: env[n])
    graph.output(tuple(env[n] for n in gm.graph.output_node().args[0]))
    return fx.GraphModule(gm, graph), plan, front


def _prologue_inputs(gm: fx.GraphModule, front: fx.Graph) -> list[int]:
    own = [n.name for n in gm.graph.find_nodes(op="placeholder")]
    return [own.index(n.name) for n in front.find_nodes(op="placeholder")]
