"""Linear calls of a few rows (a decode step's projections) -> torch_ext::decode_linear.

A call is replaced in inference graphs where its example values say: a CUDA input of static shape
with a row count (batch x tokens) and dtype the op serves (`serves`: one row, or up to MAX_ROWS of a
16-bit float), a plain 2-D weight (no subclass: a quantized weight or a
DTensor computes its own linear), input, weight, bias and output of one dtype (under autocast linear
computes in another; the op is not on autocast's lists). Where the kernel cannot take the tensors
it meets at run time (say a weight made non-contiguous later), the op runs F.linear.

With a tuner (CompileConfig.kernel_tuning), each shape's kernel is the one measured fastest on this
GPU (kernels/decode_linear_tuning.py): where cuBLAS won, the linear stays; otherwise the call carries
the winner in its `config` argument.

The op may load its first weight columns before the kernel before it has finished (programmatic
dependent launch). That is safe only where no kernel that may run right before it writes the weight:
the weight is a graph input whose every user is a linear or an embedding (nothing in the graph
writes it), and the input depends on a computing op of the graph (so a kernel of this graph, not
the caller's `weight.copy_()`, runs right before). Elsewhere the call loads after the wait.
"""
from __future__ import annotations

import logging
import math

import torch
import torch.fx as fx
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from torch_ext.backend.rewrite.decode_attention import SDPA_TARGETS, example_value
from torch_ext.backend.rewrite.merge_projections import LINEAR_TARGETS
from torch_ext.kernels import decode_linear as op_module  # registers the op: also where a saved graph calling it loads
from torch_ext.kernels.decode_linear_tuning import Shape, Tuner

log = logging.getLogger("torch_ext.backend")

_PARAMS = ("input", "weight", "bias")
# Ops that always launch a kernel: none is an identity Inductor could drop on some input (pow by 1, a
# mean over a dim of one could be), so an input downstream of one is produced by this graph's kernels.
_COMPUTING = {"linear", "decode_linear", "scaled_dot_product_attention", "decode_attention", "rsqrt", "silu", "gelu", "softmax",
              "layer_norm", "rms_norm", "matmul", "bmm", "mm", "embedding", "tanh", "sigmoid", "exp", "relu"}
_WALK_LIMIT = 64  # nodes looked at behind an input
DEVICES = ("cuda",)  # where the op has its kernel (tests add "cpu": the op runs F.linear there)


def op_name(node: fx.Node) -> str:
    """A call's op without its namespace: "mul" for operator.mul, torch.mul and x.mul; "decode_linear"
    for torch.ops.torch_ext.decode_linear.default."""
    if node.op == "call_method":
        return node.target
    if isinstance(node.target, torch._ops.OpOverload):
        return node.target._schema.name.split("::")[-1]
    return getattr(node.target, "__name__", str(node.target)).split(".")[-1]


def computed_in_graph(node: fx.Node) -> bool:
    """Whether node depends on an op of the graph that launches a kernel."""
    seen, todo = set(), [node]
    while todo and len(seen) < _WALK_LIMIT:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op in ("call_function", "call_method") and (op_name(n) in _COMPUTING or n.target in SDPA_TARGETS):
            return True
        todo.extend(n.all_input_nodes)
    return False


def _reads_only(user: fx.Node) -> bool:
    """A linear (ours too) or an embedding without max_norm (which renormalizes its weight in place)."""
    if user.op != "call_function":
        return False
    if user.target in LINEAR_TARGETS or user.target is torch.ops.torch_ext.decode_linear.default:
        return True
    max_norm = user.args[3] if len(user.args) > 3 else user.kwargs.get("max_norm")
    return user.target is torch.nn.functional.embedding and max_norm is None


def _read_only_input(node) -> bool:
    """A graph input that nothing in the graph writes (every user a linear or an embedding)."""
    return isinstance(node, fx.Node) and node.op == "placeholder" and all(_reads_only(u) for u in node.users)


def decode_call(node: fx.Node, tuner: Tuner | None = None) -> dict | None:
    """The op's arguments (x, weight, bias, prefetch, config) for a linear call of a few rows, else None
    (also where the tuner measured cuBLAS fastest)."""
    if node.op != "call_function" or node.target not in LINEAR_TARGETS:
        return None
    if len(node.args) > 3 or any(k not in _PARAMS for k in node.kwargs):
        return None
    a = dict(dict(zip(_PARAMS, node.args)), **node.kwargs)
    x_node, w_node, b_node = a.get("input"), a.get("weight"), a.get("bias")
    x, w, b, out = example_value(x_node), example_value(w_node), example_value(b_node), example_value(node)
    tensors = (x, w, out) if b_node is None else (x, w, b, out)
    if not all(isinstance(t, torch.Tensor) and not is_traceable_wrapper_subclass(t) for t in tensors):
        return None
    if x.device.type not in DEVICES or w.dim() != 2 or x.dim() < 1 or (b is not None and b.dim() != 1):
        return None
    if not all(isinstance(s, int) for s in (*x.shape, *w.shape)):  # symbolic rows: any count may come
        return None
    rows = math.prod(x.shape[:-1])
    if not op_module.serves(rows, x.dtype, x.device) or not all(t.dtype == x.dtype for t in tensors):
        return None
    choice = tuner.choose(Shape.of(x, w, b is not None), x.device) if tuner else None
    if choice is not None and choice.path == "cublas":
        return None
    prefetch = (_read_only_input(w_node) and (b_node is None or _read_only_input(b_node))
                and isinstance(x_node, fx.Node) and computed_in_graph(x_node))
    return {"x": x_node, "weight": w_node, "bias": b_node, "prefetch": prefetch,
            "config": choice.encode() if choice else None}


def use_decode_linear(gm: fx.GraphModule, tuner: Tuner | None = None) -> int:
    """Replace every linear call of a few rows of gm's graph (in place: no placeholder changes) by
    torch_ext::decode_linear; returns how many."""
    op = torch.ops.torch_ext.decode_linear.default
    replaced = prefetching = 0
    for node in list(gm.graph.nodes):
        call = decode_call(node, tuner)
        if call is None:
            continue
        args = (call["x"], call["weight"], call["bias"], call["prefetch"])
        if call["config"] is not None:  # by position after the fused parts' defaults (the fusion keeps it there)
            args += (None, 0.0, None, None, None, call["config"])
        with gm.graph.inserting_before(node):
            new = gm.graph.call_function(op, args)
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        replaced += 1
        prefetching += call["prefetch"]
    if replaced:
        gm.recompile()
        log.debug("torch_ext: %d linear calls of a few rows run torch_ext::decode_linear (%d prefetch weights)",
                  replaced, prefetching)
    return replaced
