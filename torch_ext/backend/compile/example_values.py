"""Example values of a loaded graph's nodes, restored before Inductor compiles one of its pieces.

A warm start saves the Dynamo graph without the example values the backend never reads
(warm_start/saved_graph.py marks each such node VALUE_DROPPED); Inductor's passes may read them,
so they are propagated again from the piece's inputs before it compiles.
"""
from __future__ import annotations

import logging
from typing import Any

import torch
import torch.fx as fx

log = logging.getLogger(__name__)

# Marks a node whose example value was dropped when its graph was saved (inside a piece).
VALUE_DROPPED = "torch_ext_value_dropped"


class RestoreError(RuntimeError):
    pass


def placeholder_values(gm: fx.GraphModule) -> list[Any]:
    return [n.meta.get("example_value", n.meta.get("val")) for n in gm.graph.find_nodes(op="placeholder")]


def restore_example_values(gm: fx.GraphModule) -> None:
    """Example values of the nodes dump_graph dropped, propagated again from the graph's inputs
    (for Inductor, whose passes may read them, before it compiles a piece of a loaded graph).
    No-op for a graph that was not loaded; best effort (Inductor traces a piece from its inputs)."""
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    for module in gm.modules():
        if not isinstance(module, fx.GraphModule):
            continue
        nodes = list(module.graph.nodes)
        missing = [n for n in nodes if n.meta.get(VALUE_DROPPED)]
        if not missing:
            continue
        had_val = {n for n in nodes if "val" in n.meta}
        inputs = placeholder_values(module)
        mode = next((v.fake_mode for v in inputs if isinstance(v, torch._subclasses.FakeTensor)), None)
        try:
            if mode is None:
                raise RestoreError("its inputs carry no fake tensors")
            with mode:
                FakeTensorProp(module, mode).propagate_dont_convert_inputs(*inputs)
        except Exception as e:
            log.debug("torch_ext: cannot restore example values of a loaded piece (%s: %s)", type(e).__name__, e)
            for n in nodes:
                if n not in had_val:
                    n.meta.pop("val", None)
            continue
        for n in nodes:
            if n not in had_val:
                value = n.meta.pop("val", None)
                if n in missing:
                    n.meta["example_value"] = value
                    del n.meta[VALUE_DROPPED]
