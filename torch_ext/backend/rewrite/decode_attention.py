"""SDPA of one query token per sequence (a decode step) -> torch_ext::decode_attention (split-KV).

A call is replaced where its example values say decode and SDPA's semantics carry over exactly:
q (B, H, 1, D) with the 1 static, k and v (B, Hkv, L, D) with H a multiple of Hkv (grouped heads
with enable_gqa, or equal counts), no dropout, not causal (SDPA's causal mask is top-left aligned: a
single query row would see key 0 only), a mask that is None or a 4-D bool / same-dtype float tensor,
and an output laid out contiguously (what follows was traced on SDPA's strides) and of q's dtype
(under autocast SDPA computes in the autocast dtype; the op is not on autocast's lists). Calls the user made
splitting ops are left as they are. Inference graphs only (the op has no backward).
"""
from __future__ import annotations

import logging
import math
from typing import Callable

import torch
import torch.fx as fx

import torch_ext.hops.decode_attention  # noqa: F401  (registers the op: also where a saved graph calling it loads)

log = logging.getLogger("torch_ext.backend")

SDPA_TARGETS = (torch._C._nn.scaled_dot_product_attention, torch.nn.functional.scaled_dot_product_attention)
_PARAMS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}


def _value(node):
    return node.meta.get("example_value", node.meta.get("val")) if isinstance(node, fx.Node) else node


def _bound(node: fx.Node) -> dict | None:
    if len(node.args) > len(_PARAMS) or any(k not in _PARAMS for k in node.kwargs):
        return None
    bound = dict(_DEFAULTS, **dict(zip(_PARAMS, node.args)), **node.kwargs)
    return bound if all(p in bound for p in _PARAMS[:3]) else None


def _static(*sizes) -> bool:
    return all(isinstance(s, int) for s in sizes)


def decode_call(node: fx.Node) -> dict | None:
    """The op's arguments (q, k, v, mask, scale) for an SDPA call that is a decode step, else None."""
    if node.op != "call_function" or node.target not in SDPA_TARGETS:
        return None
    a = _bound(node)
    if a is None:
        return None
    q, k, v, out = (_value(a["query"]), _value(a["key"]), _value(a["value"]), _value(node))
    mask = a["attn_mask"]
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (q, k, v, out)):
        return None
    if not (_static(q.shape[1], q.shape[2], q.shape[3], k.shape[1], k.shape[3], v.shape[3]) and q.shape[2] == 1):
        return None
    if a["dropout_p"] != 0.0 or a["is_causal"] is not False or a["enable_gqa"] not in (True, False):
        return None
    if q.shape[3] != k.shape[3] or v.shape[3] != q.shape[3] or k.shape[1] != v.shape[1] or not out.is_contiguous():
        return None
    if q.shape[1] % k.shape[1] or (q.shape[1] != k.shape[1] and not a["enable_gqa"]):
        return None
    if not (q.dtype == k.dtype == v.dtype == out.dtype):  # autocast casts SDPA's inputs; the op is not cast
        return None
    if mask is not None:
        m = _value(mask)
        if not (isinstance(m, torch.Tensor) and m.dim() == 4 and (m.dtype == torch.bool or m.dtype == q.dtype)):
            return None
    scale = a["scale"]
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[3])
    if not isinstance(scale, float):
        return None
    return {"q": a["query"], "k": a["key"], "v": a["value"], "mask": mask, "scale": scale}


def use_decode_attention(gm: fx.GraphModule, is_splitting: Callable[[fx.Node], bool]) -> int:
    """Replace every decode SDPA call of gm's graph (in place: no placeholder changes) by
    torch_ext::decode_attention; returns how many."""
    op = torch.ops.torch_ext.decode_attention.default
    replaced = 0
    for node in list(gm.graph.nodes):
        call = decode_call(node)
        if call is None or is_splitting(node):
            continue
        with gm.graph.inserting_before(node):
            new = gm.graph.call_function(op, (call["q"], call["k"], call["v"], call["mask"], call["scale"]))
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        replaced += 1
    if replaced:
        gm.recompile()
        log.debug("torch_ext: %d SDPA decode calls run torch_ext::decode_attention", replaced)
    return replaced
