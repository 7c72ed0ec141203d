"""Activation-checkpoint regions that hold a splitting op: kept as regions, not inlined.

Inlining a `tag_activation_checkpoint` body into the pieces around it would throw its recompute
away: every piece would save its own activations. So, while autograd records (training), such a
region stays one opaque step of the split graph, its body split on its own, and:

* plain checkpointing: the runtime runs the split body under one non-reentrant
  torch.utils.checkpoint (runtime/checkpoint.py): forward keeps the region's inputs only.
* selective checkpointing (a `context_fn` policy): each compiled piece of the body becomes one
  checkpoint HOP call of its own, carrying the policy (`with_policy`), so the piece's AOTAutograd
  trace applies the policy and its partitioner saves what the policy saves and recomputes the
  rest. Each splitting op between them runs eagerly under torch.utils.checkpoint with the policy
  (runtime/checkpoint.py): its ATen ops are saved or recomputed as the policy says.
"""
from __future__ import annotations

import operator
import re

import torch
import torch.fx as fx

CHECKPOINT_HOP = "tag_activation_checkpoint"
CONTEXT_FN = "_checkpoint_context_fn"  # where Dynamo keeps a checkpoint's context_fn: the body's meta


def policy_of(body: fx.GraphModule):
    """The checkpoint's context_fn (selective checkpointing), or None for plain checkpointing."""
    return body.meta.get(CONTEXT_FN)


def carries_policy(gm: fx.GraphModule) -> bool:
    """A piece made by `with_policy` (or any graph calling a selective checkpoint body)."""
    return any(isinstance(m, fx.GraphModule) and CONTEXT_FN in m.meta for m in gm.modules())


def where(node: fx.Node) -> str:
    """The user's source line of a HOP call, for messages: 'model.py:42', or the node's name."""
    frames = re.findall(r'File "([^"]+)", line (\d+)', node.meta.get("stack_trace") or "")
    if not frames:
        return node.name
    path, line = frames[-1]
    return f"{path}:{line}"


def with_policy(piece: fx.GraphModule, context_fn, hop_kwargs: dict) -> fx.GraphModule:
    """A graph that calls `piece` through one checkpoint HOP whose body carries `context_fn`.

    Takes the same inputs and returns the same outputs as `piece` (with the same example values,
    which later stages read); `piece` becomes the HOP's body and returns a tuple, as Dynamo's
    bodies do."""
    output = piece.graph.output_node()
    result = output.args[0]
    single = not isinstance(result, (tuple, list))
    results = [result] if single else list(result)
    if single:
        output.args = ((result,),)
        piece.recompile()
    piece.meta[CONTEXT_FN] = context_fn

    graph = fx.Graph()
    inputs = []
    for node in piece.graph.find_nodes(op="placeholder"):
        inputs.append(graph.placeholder(node.name))
        inputs[-1].meta = dict(node.meta)
    root = torch.nn.Module()
    root.add_module("checkpoint_body", piece)
    call = graph.call_function(torch.ops.higher_order.tag_activation_checkpoint,
                               (graph.get_attr("checkpoint_body"), *inputs), dict(hop_kwargs))
    values = [_value(r) for r in results]
    call.meta["example_value"] = tuple(values)
    outs = []
    for i, value in enumerate(values):
        outs.append(graph.call_function(operator.getitem, (call, i)))
        outs[-1].meta["example_value"] = value
    graph.output(outs[0] if single else tuple(outs))
    return fx.GraphModule(root, graph)


def _value(result):
    if isinstance(result, fx.Node):
        return result.meta.get("example_value", result.meta.get("val"))
    return result
