"""training_cudagraphs="whole": a split training graph (its compiled pieces and the splitting ops
between them) recorded and replayed as one CUDA graph by Inductor's CUDA-graph trees, as
mode="reduce-overhead" replays a whole graph.

With "pieces" each compiled piece is a graph of its own and the splitting ops run eagerly between
them: a tree node per piece (26 a step for an 8-layer Llama with checkpointing), each with its own
liveness checks and input copies on the host, and a static copy of every splitting-op result the
next piece reads (1.31-1.37x Inductor's reserved memory at 8 x 512). One graph for the whole forward
and one for the backward has neither: the splitting ops are captured too, so they must be
capturable (no host synchronisation, no CPU work meant for every call: SDPA and most attention ops
are). Whether they are is the user's to say (this mode); what the graph shows is checked here.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from torch_ext import compat


def _device_of(value) -> str | None:
    return value.device.type if isinstance(value, torch.Tensor) else None


def mutated_inputs(graph: fx.Graph) -> list[int]:
    """Positions of the placeholders that an op of `graph` writes in place."""
    position = {node: i for i, node in enumerate(graph.find_nodes(op="placeholder"))}
    mutated = set()
    for node in graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        arguments = node.target._schema.arguments
        given = list(zip(arguments, node.args)) + [(a, node.kwargs[a.name]) for a in arguments if a.name in node.kwargs]
        for argument, value in given:
            if argument.alias_info is None or not argument.alias_info.is_write:
                continue
            for written in value if isinstance(value, (list, tuple)) else (value,):  # Tensor(a!)[]: a list
                if isinstance(written, fx.Node) and written in position:
                    mutated.add(position[written])
    return sorted(mutated)


def whole_capture_refusal(graph: fx.GraphModule, static_input_idxs) -> str | None:
    """Why `graph` (an ATen forward or backward graph, before its split) cannot be replayed as one
    CUDA graph, or None where it can."""
    for i, node in enumerate(graph.graph.find_nodes(op="placeholder")):
        device = _device_of(node.meta.get("val"))
        if device not in (None, "cuda"):
            return f"input {i} ({node.name}) is on {device}"
    for node in graph.graph.nodes:
        if compat.is_rng_state_hop(node) and node.target.__name__ != compat.GRAPH_SAFE_RNG_STATE_HOP:
            return (f"{node.name} saves or restores the RNG state around a splitting op from Python, which a "
                    "replay would not repeat (a random op under activation checkpointing, on the CPU, several "
                    "devices or with Inductor's fallback_random)")
        values = node.meta.get("val")
        for value in values if isinstance(values, (tuple, list)) else (values,):
            device = _device_of(value)
            if node.op != "placeholder" and device not in (None, "cuda"):
                return f"{node.name} ({node.target}) computes on {device}"
    static = set(static_input_idxs or ())
    written = [i for i in mutated_inputs(graph.graph) if i not in static]
    if written:
        return f"it writes into inputs {written} in place, which are not parameters or buffers"
    return None
