"""Fake values for the nodes of an ATen graph that AOTAutograd's partitioner made without one.

A piece is compiled with its placeholders' `meta["val"]` as example inputs, and a placeholder takes
the meta of the node whose value crosses into the piece. The partitioner builds some nodes without a
value: in a backward graph's recompute, the RNG-state HOP `run_with_rng_state` around a random op of a
checkpointed region. With Inductor's random-op replacement that op is `inductor_seeds`, one call whose
seeds every dropout of the graph looks up; where a lookup sits in another piece than the HOP, that
piece's fake propagation read None (HF OPT with gradient checkpointing, split at SDPA: a TypeError in
`inductor_lookup_seed`, torch 2.15). Plain Inductor never splits the graph, so never meets it.
"""
from __future__ import annotations

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor


def fill_missing_values(graph: fx.Graph) -> int:
    """Give each call without `meta["val"]` the value its target returns on its inputs' fake values
    (in the graph's fake mode: nothing runs, no random number is drawn); the number filled. A node
    whose inputs have no value, or whose target fails on them, is left as it was."""
    fake_mode = next((v.fake_mode for n in graph.nodes if isinstance(v := n.meta.get("val"), FakeTensor)), None)
    if fake_mode is None:
        return 0
    filled = 0
    for node in graph.nodes:
        if node.op != "call_function" or "val" in node.meta:
            continue
        if any("val" not in used.meta for used in node.all_input_nodes):
            continue
        args, kwargs = fx.map_arg((node.args, node.kwargs), lambda used: used.meta["val"])
        try:
            with fake_mode:
                node.meta["val"] = node.target(*args, **kwargs)
        except Exception:  # noqa: BLE001  (Inductor reports what it cannot compile, as before)
            continue
        filled += 1
    return filled
