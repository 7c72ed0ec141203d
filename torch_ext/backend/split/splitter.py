"""Split a Dynamo graph at splitting ops, also where they hide inside HOP bodies.

`torch.fx.passes.split_module` sees only top-level nodes, so a splitting op inside an
`invoke_subgraph` (torch.compiler.nested_compile_region), `wrap` or activation-checkpoint body
needs one of two treatments:

* "inline" (default): the HOP call is replaced by a copy of its body before the split. Each
  layer then contributes the code after its attention plus the code before the next layer's
  attention to ONE piece; identical layers give identical pieces, which dedup compiles once.
* "in_body": the HOP call stays a single opaque step at the top level; its body is split on
  its own and compiled once, and every call site runs the split body.

Activation-checkpoint regions are never inlined while autograd records (`keep_checkpoints`): they
are split as in "in_body", so that their recompute survives (split/checkpoint.py).

Measured (torch 2.13, 2-core CPU; decoder of nested_compile_region layers, d=64, batch 8; run time
is CPU time on one thread, best of 12 interleaved rounds; bench/compile_time.py --hop-modes):
    layers  hop_split  unique pieces  Inductor compiles  cold backend s  run ms/iter (eager)
      8     inline          3                3               19.4          2.62  (3.36)
      8     in_body         3                3               21.1          2.91
     32     inline          3                3               23.4         10.00 (13.99)
     32     in_body         3                3               19.4         13.98
Compile cost is the same (both compile a constant number of unique pieces; cold times are within
this shared machine's noise). At run time "in_body" pays two piece calls per layer plus the
partition and body graph calls around them, and cannot fuse the residual add and the next
layer's norm across the layer boundary: 11-40% slower. "inline" is the default; "in_body" stays
available (CompileConfig.hop_split).
"""
from __future__ import annotations

import dataclasses
import difflib
import operator
from typing import Any, Callable

import torch
import torch.fx as fx
from torch.fx.passes.split_module import split_module

from torch_ext.backend.counters import counters
from torch_ext.backend.split.matcher import SplittingOpMatcher, op_display_name
from torch_ext.backend.split.checkpoint import CHECKPOINT_HOP, policy_of, where, with_policy
from torch_ext.backend.split.scalars import fold_known_numbers, localize_symbolic_scalars


class SplitError(RuntimeError):
    """The graph cannot be split as configured; the message says why and what to change."""


# HOPs whose call means "run body(*operands)": name -> (index of the body, index of the first operand).
INLINABLE_HOPS = {
    "invoke_subgraph": (0, 2),
    "wrap": (0, 1),
    "tag_activation_checkpoint": (0, 1),
}


def hop_name(node: fx.Node) -> str | None:
    if node.op == "call_function" and isinstance(node.target, torch._ops.HigherOrderOperator):
        return node.target.name()
    return None


def hop_bodies(gm: fx.GraphModule, node: fx.Node) -> list[fx.GraphModule]:
    """The graph-module arguments (bodies) of a HOP call."""
    bodies = []
    for arg in node.args:
        if isinstance(arg, fx.Node) and arg.op == "get_attr":
            value = operator.attrgetter(arg.target)(gm)
            if isinstance(value, fx.GraphModule):
                bodies.append(value)
    return bodies


def contains_splitting_op(gm: fx.GraphModule, is_splitting: Callable[[fx.Node], bool]) -> bool:
    for node in gm.graph.nodes:
        if is_splitting(node):
            return True
        if hop_name(node) and any(contains_splitting_op(b, is_splitting) for b in hop_bodies(gm, node)):
            return True
    return False


def all_calls(gm: fx.GraphModule):
    """Every node of gm and of the HOP bodies it calls, recursively."""
    for node in gm.graph.nodes:
        yield node
        if hop_name(node):
            for body in hop_bodies(gm, node):
                yield from all_calls(body)


def unmatched_splitting_ops(gm: fx.GraphModule, matcher: SplittingOpMatcher) -> dict[str, list[str]]:
    """Configured splitting ops that no call in gm (HOP bodies included) matches -> the calls of gm
    with the nearest names, for the message that says so."""
    matched, called = set(), set()
    for node in all_calls(gm):
        matched.add(matcher.match(node))
        called.add(op_display_name(node))
    called.discard(None)
    bare = {}
    for display in sorted(called):
        bare.setdefault(display.replace("::", ".").rsplit(".", 1)[-1], display)
    unmatched = {}
    for name in matcher.names:
        if name not in matched:
            wanted = name.replace("::", ".").split(".")[1] if "::" in name else name.rsplit(".", 1)[-1]
            close = difflib.get_close_matches(wanted, list(bare), n=3, cutoff=0.5)
            # ...and calls sharing a long word with it: `multi_head_attention_forward` for an attention op
            words = {w for w in wanted.split("_") if len(w) >= 5}
            close += [b for b in bare if b not in close and words & set(b.split("_"))]
            unmatched[name] = [bare[b] for b in close[:4]]
    return unmatched


def _splitting_hop(gm: fx.GraphModule, node: fx.Node, is_splitting) -> bool:
    """True for a HOP call whose body holds a splitting op; refuses HOPs we cannot see through."""
    name = hop_name(node)
    if name is None or not any(contains_splitting_op(b, is_splitting) for b in hop_bodies(gm, node)):
        return False
    if name not in INLINABLE_HOPS:
        raise SplitError(
            f"a splitting op sits inside the body of the higher-order op {name!r} (node {node.name}); "
            f"torch_ext can split inside {sorted(INLINABLE_HOPS)} only. Move the splitting op out of the "
            f"{name} region, or leave it out of CompileConfig.splitting_ops."
        )
    return True


def inline_splitting_hops(gm: fx.GraphModule, is_splitting: Callable[[fx.Node], bool],
                          keep_checkpoints: bool = False) -> int:
    """Replace every HOP call whose body holds a splitting op by a copy of the body (checkpoint
    regions excepted, with keep_checkpoints); returns the count."""
    graph = gm.graph
    inlined = 0
    for node in list(graph.nodes):
        if not _splitting_hop(gm, node, is_splitting) or _kept_checkpoint(node, keep_checkpoints):
            continue
        body_index, first_operand = INLINABLE_HOPS[hop_name(node)]
        body_attr = node.args[body_index]
        body = operator.attrgetter(body_attr.target)(gm)
        inlined += inline_splitting_hops(body, is_splitting, keep_checkpoints)  # nested regions first
        outputs = _copy_body_before(gm, node, body, node.args[first_operand:])
        for user in list(node.users):
            if not (user.op == "call_function" and user.target is operator.getitem):
                raise SplitError(f"cannot inline {node.name}: its result is used whole by {user.name}, "
                                 "not through indexing")
            user.replace_all_uses_with(outputs[user.args[1]])
            graph.erase_node(user)
        graph.erase_node(node)
        if not body_attr.users:
            graph.erase_node(body_attr)
        inlined += 1
    if inlined:
        graph.lint()
        gm.recompile()
    return inlined


def _kept_checkpoint(node: fx.Node, keep_checkpoints: bool) -> bool:
    return keep_checkpoints and hop_name(node) == CHECKPOINT_HOP


def _copy_body_before(gm: fx.GraphModule, anchor: fx.Node, body: fx.GraphModule, operands) -> list:
    graph = gm.graph
    env: dict[fx.Node, Any] = {}
    placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(operands):
        raise SplitError(f"{anchor.name}: body takes {len(placeholders)} inputs but gets {len(operands)}")
    env.update(zip(placeholders, operands))
    outputs: list = []
    with graph.inserting_before(anchor):
        for node in body.graph.nodes:
            if node.op == "placeholder":
                continue
            if node.op == "output":
                result = node.args[0]
                outputs = list(result) if isinstance(result, (tuple, list)) else [result]
                outputs = [env[o] if isinstance(o, fx.Node) else o for o in outputs]
            elif node.op == "get_attr":
                # The body's own attributes (nested bodies, constants) move into the caller.
                value = operator.attrgetter(node.target)(body)
                name = _fresh_attr_name(gm, node.target)
                setattr(gm, name, value)
                env[node] = graph.get_attr(name)
                env[node].meta = dict(node.meta)
            else:
                env[node] = graph.node_copy(node, lambda n: env[n])
    return outputs


def _fresh_attr_name(gm: fx.GraphModule, base: str) -> str:
    base = "inlined_" + base.replace(".", "_")
    name, k = base, 0
    while hasattr(gm, name):
        k += 1
        name = f"{base}_{k}"
    return name


@dataclasses.dataclass
class Piece:
    """One partition of a split graph, called from the split graph as `split_gm.<name>`."""

    name: str
    graph_module: fx.GraphModule
    kind: str  # "compute" (compiled), "splitting" (runs eagerly) or "hop" (split body)
    body: SplitGraph | None = None  # for "hop": the split body
    hop_node: str | None = None  # for "hop": the HOP call inside graph_module
    # A checkpoint region kept as one ("hop"), or the selective region a splitting op sits in.
    checkpoint: Checkpoint | None = None


@dataclasses.dataclass
class Checkpoint:
    """A checkpoint region the split keeps (split/checkpoint.py)."""

    options: dict  # the HOP call's kwargs: torch.utils.checkpoint's options
    context_fn: Any  # a selective checkpoint's policy (None: plain checkpointing)
    where: str  # the user's source line


@dataclasses.dataclass
class SplitGraph:
    split_gm: fx.GraphModule
    pieces: list[Piece]

    def compute_pieces(self) -> list[Piece]:
        return [p for p in self.pieces if p.kind == "compute"]

    def all_compute_pieces(self) -> list[Piece]:
        """Compute pieces here and in split HOP bodies (in_body mode), in call order."""
        out = []
        for piece in self.pieces:
            if piece.kind == "compute":
                out.append(piece)
            elif piece.body is not None:
                out.extend(piece.body.all_compute_pieces())
        return out


def split_graph(gm: fx.GraphModule, is_splitting: Callable[[fx.Node], bool], hop_split: str = "inline",
                _split_bodies: dict | None = None, *, keep_checkpoints: bool = False) -> SplitGraph:
    """Partition gm so that each splitting op (or, in "in_body" mode, each HOP call holding one;
    with keep_checkpoints, each checkpoint region holding one) is a piece of its own; the pieces
    between them are compiled. Keeps the original op order."""
    split_bodies = {} if _split_bodies is None else _split_bodies  # id(body) -> SplitGraph, shared by call sites
    if hop_split == "inline":
        counters.inlined_hops += inline_splitting_hops(gm, is_splitting, keep_checkpoints)
    fold_known_numbers(gm)

    opaque_kind: dict[fx.Node, str] = {}
    for node in gm.graph.nodes:
        if is_splitting(node):
            opaque_kind[node] = "splitting"
        elif (hop_split == "in_body" or _kept_checkpoint(node, keep_checkpoints)) and \
                _splitting_hop(gm, node, is_splitting):
            opaque_kind[node] = "hop"

    partition_of: dict[fx.Node, int] = {}
    kinds: dict[int, str] = {}
    current = 0
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        source = node.args[0] if node.target is operator.getitem and node.args else None
        if isinstance(source, fx.Node) and (source in opaque_kind or _unpacks(source, partition_of, kinds)):
            # Unpacking an opaque result stays with it, nested tuples too: pieces never take tuples as inputs.
            partition_of[node] = partition_of[source]
        elif node in opaque_kind:
            current += 1
            partition_of[node] = current
            kinds[current] = opaque_kind[node]
            current += 1
        else:
            partition_of[node] = current

    if localize_symbolic_scalars(gm.graph, partition_of):
        gm.recompile()
    split_gm = split_module(gm, None, lambda n: partition_of[n], keep_original_order=True)

    pieces = []
    for node in split_gm.graph.nodes:
        if node.op != "call_module":
            continue
        index = int(node.target.rsplit("_", 1)[1])
        sub = getattr(split_gm, node.target)
        kind = kinds.get(index, "compute")
        piece = Piece(node.target, sub, kind)
        if kind == "hop":
            hop = next(n for n in sub.graph.nodes if hop_name(n))
            body_index, _ = INLINABLE_HOPS[hop_name(hop)]
            body = operator.attrgetter(hop.args[body_index].target)(sub)
            piece.hop_node = hop.name
            if hop_name(hop) == CHECKPOINT_HOP:
                piece.checkpoint = Checkpoint(dict(hop.kwargs), policy_of(body), where(hop))
            if id(body) not in split_bodies:
                split_bodies[id(body)] = split_graph(body, is_splitting, hop_split, split_bodies,
                                                     keep_checkpoints=keep_checkpoints)
                if piece.checkpoint is not None and piece.checkpoint.context_fn is not None:
                    _carry_policy(split_bodies[id(body)], piece.checkpoint)
            piece.body = split_bodies[id(body)]
        pieces.append(piece)
    return SplitGraph(split_gm, pieces)


def _unpacks(node: fx.Node, partition_of: dict, kinds: dict) -> bool:
    """Whether node is a tuple unpacked from an opaque result (run_and_save_rng_state's (state, outputs))."""
    value = node.meta.get("example_value", node.meta.get("val"))
    return node.target is operator.getitem and isinstance(value, (tuple, list)) and \
        partition_of.get(node) in kinds


def _carry_policy(body: SplitGraph, checkpoint: Checkpoint) -> None:
    """A selective checkpoint's policy reaches every piece of its split body: each compiled piece
    becomes a checkpoint call of its own with the policy (split/checkpoint.py); each splitting op
    is marked, for the runtime to run it under the policy."""
    for piece in body.pieces:
        if piece.kind == "compute" and not is_trivial(piece.graph_module):
            piece.graph_module = with_policy(piece.graph_module, checkpoint.context_fn, checkpoint.options)
            setattr(body.split_gm, piece.name, piece.graph_module)
        elif piece.kind == "splitting":
            piece.checkpoint = checkpoint


def is_trivial(gm: fx.GraphModule) -> bool:
    """Nothing for Inductor to do: only tuple unpacking and integer arithmetic on sizes."""
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if node.op == "call_function" and node.target is operator.getitem:
            continue
        value = node.meta.get("example_value", node.meta.get("val"))
        if isinstance(value, (int, float, bool, torch.SymInt, torch.SymFloat, torch.SymBool)):
            continue
        return False
    return True
