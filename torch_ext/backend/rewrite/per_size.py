"""The decode rewrites again, on a piece compiled for one size of a dynamic graph.

The rewrites of backend.rewrite() run on Dynamo's graph, before the split. Where that graph has a
dynamic batch dim, a linear's row count is a symbol and rewrite/decode_linear.py leaves it alone
(any count may come). A size variant (compile/compiler.py: CompileConfig.compile_sizes, and the sizes
below) is compiled from real inputs, so its shapes are known: here the piece's example values are
propagated again with those shapes, and the decode rewrites run on a copy of the piece. A batch-1
decode step of a dynamic compile (HF generate, a server's batch dim) then gets the one-row kernel,
and batches up to decode_linear's MAX_ROWS its CUDA path, as a static compile does. Pieces never change their inputs here, so the split graph is untouched.
"""
from __future__ import annotations

import logging
from copy import deepcopy

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from torch_ext.backend.config import CompileConfig
from torch_ext.backend.rewrite.decode import decode_rewrites
from torch_ext.backend.rewrite.decode_attention import example_value
from torch_ext.backend.rewrite.merge_projections import LINEAR_TARGETS
from torch_ext.kernels import decode_linear as linear_op

log = logging.getLogger("torch_ext.backend")


def wants_size_variant(config: CompileConfig, size: int, gm: fx.GraphModule) -> bool:
    """Whether a dynamic piece called at this size of its batch dim is compiled for it alone even
    where compile_sizes do not name it: the rows decode_linear takes (a decode step of a batch that
    small) get its kernel only where the shapes are known, so a piece with a linear call gets one.
    Sizes no call hits cost nothing."""
    if size in config.compile_sizes:
        return True
    return config.uses("decode_linear") and any(
        node.op == "call_function" and node.target in LINEAR_TARGETS and _served(size, node) for node in gm.graph.nodes)


def _served(size: int, linear: fx.Node) -> bool:
    """Whether decode_linear would run a kernel for this linear at `size` rows (its dtype decides
    above one row)."""
    x = example_value(linear.args[0]) if linear.args else None
    return isinstance(x, torch.Tensor) and linear_op.serves(size, x.dtype, x.device)


def rewrite_for_size(gm: fx.GraphModule, example_inputs, config: CompileConfig) -> fx.GraphModule:
    """gm, or a copy of it with the decode rewrites applied at these inputs' shapes (inference only)."""
    if torch.is_grad_enabled() or not (config.uses("decode_linear") or config.uses("decode_attention")):
        return gm
    copy = fx.GraphModule(gm, deepcopy(gm.graph))  # nodes with copies of their meta: rewritten here
    try:
        _propagate(copy, example_inputs)
    except Exception as e:  # an op fake tensors cannot run: compile the piece as it is
        log.debug("torch_ext: no per-size decode rewrite of a piece (%s: %s)", type(e).__name__, e)
        return gm
    replaced = decode_rewrites(copy, config, lambda node: False)  # pieces hold no splitting ops
    return copy if replaced else gm


def _propagate(gm: fx.GraphModule, example_inputs) -> None:
    """Every node's example value at the inputs' static shapes (fake tensors: nothing runs; a mode
    without a shape env keeps every shape static)."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fake = [mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in example_inputs]
    FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*fake)
    for node in gm.graph.nodes:
        if "val" in node.meta:
            node.meta["example_value"] = node.meta["val"]
