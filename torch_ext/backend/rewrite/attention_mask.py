"""Boolean masks of splitting-op SDPA calls made additive inside the compiled pieces.

A splitting op runs eagerly between compiled pieces, so what SDPA does to its arguments costs host
time once per layer per step. Given a bool mask, SDPA first converts it to an additive one (a `where`
and its allocation): on an H200 a decode call with HF's bool mask took 50-79 us of host time, the same
call with the mask already additive 29-39 us, outputs bitwise equal (bench/dev/attention_host_cost.py).
Here the conversion becomes graph nodes just before the call, so it runs inside the piece before it (in
its CUDA graph, fused by Inductor). Where no node between two calls may write the mask, the second
call reuses the first one's conversion: an HF model passes one mask to every layer, and its KV-cache
writes between them touch other storage, so one conversion serves the step and the bool mask stays
out of the later pieces.

The additive mask is SDPA's own: 0 where the mask is True, -inf where it is False, in the query's dtype.
A row with a key left visible computes the same as with the bool mask on every backend. A row that
masks every key gets SDPA's convention, zeros (what the math, efficient and flash backends give); with
a bool mask torch's cuDNN path fills a finite -65504 instead, and such a row then ignores its mask
(pytorch #177842; seen with torch 2.11 on an H200, tests/test_attention_mask_gpu.py).
"""
from __future__ import annotations

import logging
from typing import Callable

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from torch_ext.backend.rewrite.decode_attention import SDPA_TARGETS, _PARAMS, example_value
from torch_ext.backend.rewrite.writes import writes_between

log = logging.getLogger("torch_ext.backend")

_MASK_POSITION = _PARAMS.index("attn_mask")


def _mask_of(node: fx.Node) -> fx.Node | None:
    """The bool mask node of an SDPA call on plain floating tensors, else None."""
    if node.op != "call_function" or node.target not in SDPA_TARGETS:
        return None
    mask = node.args[_MASK_POSITION] if len(node.args) > _MASK_POSITION else node.kwargs.get("attn_mask")
    q, m = example_value(node.args[0]) if node.args else None, example_value(mask)
    if not (isinstance(mask, fx.Node) and isinstance(q, torch.Tensor) and isinstance(m, torch.Tensor)):
        return None
    if m.dtype != torch.bool or not q.dtype.is_floating_point or m.device != q.device:
        return None
    if is_traceable_wrapper_subclass(q) or is_traceable_wrapper_subclass(m):  # a subclass runs its own SDPA
        return None
    return mask if isinstance(m, FakeTensor) else None  # its fake mode makes the new nodes' example values


def _additive(graph: fx.Graph, mask: fx.Node, dtype: torch.dtype, meta: dict) -> fx.Node:
    """Nodes computing where(mask, 0, -inf) in `dtype`, inserted at the graph's insertion point."""
    m = example_value(mask)
    where = graph.call_function(torch.where, (mask, 0.0, float("-inf")))
    cast = graph.call_method("to", (where, dtype))
    with m.fake_mode:
        where_value = torch.where(m, 0.0, float("-inf"))
        cast_value = where_value.to(dtype)
    for new, value in ((where, where_value), (cast, cast_value)):
        new.meta = {k: v for k, v in meta.items() if k not in ("example_value", "val")}
        new.meta["example_value"] = value
    return cast


def additive_attention_masks(gm: fx.GraphModule, is_splitting: Callable[[fx.Node], bool]) -> int:
    """Give every splitting-op SDPA call of gm with a bool mask the additive form (in place, no
    placeholder changes); returns how many calls changed."""
    made: dict[tuple[fx.Node, torch.dtype], fx.Node] = {}  # (bool mask, dtype) -> its additive form
    changed = 0
    for node in list(gm.graph.nodes):
        mask = _mask_of(node) if is_splitting(node) else None
        if mask is None:
            continue
        dtype = example_value(node.args[0]).dtype
        additive = made.get((mask, dtype))
        if additive is None or writes_between(additive, node, example_value(mask)):  # it may have changed
            with gm.graph.inserting_before(node):
                additive = made[(mask, dtype)] = _additive(gm.graph, mask, dtype, node.meta)
        if len(node.args) > _MASK_POSITION:
            node.args = (*node.args[:_MASK_POSITION], additive, *node.args[_MASK_POSITION + 1:])
        else:
            node.kwargs = {**node.kwargs, "attn_mask": additive}
        changed += 1
    if changed:
        gm.recompile()
        log.debug("torch_ext: %d splitting-op SDPA calls take their bool mask in additive form", changed)
    return changed
