"""SDPA of one query token per sequence (a decode step) -> torch_ext::decode_attention (split-KV).

A call is replaced where its example values say decode and SDPA's semantics carry over exactly:
q (B, H, 1, D) with the 1 static and the output of q's shape, k and v (B or 1, Hkv, L, D) with H a
multiple of Hkv (grouped heads with enable_gqa, or equal counts), no dropout, not causal (SDPA's
causal mask is top-left aligned: a single query row would see key 0 only), a mask that is None or a
4-D bool / same-dtype float tensor, an output laid out contiguously (what follows was traced on SDPA's
strides) and of q's dtype (under autocast SDPA computes in the autocast dtype; the op is not on
autocast's lists), and plain tensors (a subclass, e.g. a quantized cache, runs its own SDPA). Calls
the user made splitting ops are left as they are. Inference graphs only (the op has no backward).
With kernel tuning, a call whose shape SDPA itself ran fastest on this GPU stays SDPA; the others
carry their measured launch (`tuned_config`).

K and v repeated along heads for grouped-query attention, as HF's `repeat_kv` does whenever a mask is
given (`x[:, :, None].expand(B, Hkv, n, L, D).reshape(B, Hkv * n, L, D)`) or as
`repeat_interleave(x, n, dim=1)`, are passed unrepeated: the op maps query head h to kv head h // n
itself, and the copy of the whole cache (n times over, every layer, every step) is left dead; not
where a node between the repeat and the call may write a tensor (the copy holds the values before it).
"""
from __future__ import annotations

import logging
import math
import operator
from typing import Callable

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

import torch_ext.kernels.decode_attention  # noqa: F401  (registers the op: also where a saved graph calling it loads)
from torch_ext.backend.rewrite.writes import writes_between
from torch_ext.kernels.decode_attention_tuning import Shape, Tuner

log = logging.getLogger("torch_ext.backend")

SDPA_TARGETS = (torch._C._nn.scaled_dot_product_attention, torch.nn.functional.scaled_dot_product_attention)
_PARAMS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}


def example_value(node):
    """A node's traced value (Dynamo's example_value, else val); a non-node argument is its own value."""
    return node.meta.get("example_value", node.meta.get("val")) if isinstance(node, fx.Node) else node


def _bound(node: fx.Node) -> dict | None:
    if len(node.args) > len(_PARAMS) or any(k not in _PARAMS for k in node.kwargs):
        return None
    bound = dict(_DEFAULTS, **dict(zip(_PARAMS, node.args)), **node.kwargs)
    return bound if all(p in bound for p in _PARAMS[:3]) else None


def _static(*sizes) -> bool:
    return all(isinstance(s, int) for s in sizes)


def _same_shape(a, b) -> bool:
    return len(a) == len(b) and all(statically_known_true(x == y) for x, y in zip(a, b))  # no guards


def _only_new_dim_2(index) -> bool:
    """A getitem index that inserts a dim at 2 and selects everything else: x[:, :, None] and the like."""
    if not isinstance(index, tuple) or index.count(None) != 1 or index.index(None) != 2:
        return False
    return all(i is None or i is Ellipsis or i == slice(None) for i in index) and Ellipsis not in index[:2]


def unrepeated(node) -> fx.Node | None:
    """The (B, Hkv, L, D) tensor that node repeats along heads, each head n times in a row (HF's
    repeat_kv, or repeat_interleave on dim 1), else None. Shapes are checked on the example values."""
    if not isinstance(node, fx.Node) or node.op not in ("call_method", "call_function"):
        return None
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    out = example_value(node)
    if not isinstance(out, torch.Tensor) or out.dim() != 4:
        return None
    if name == "repeat_interleave":
        src, repeats = node.args[0], node.args[1] if len(node.args) > 1 else node.kwargs.get("repeats")
        dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim")
        if dim not in (1, -3) or not isinstance(repeats, int) or set(node.kwargs) - {"repeats", "dim"}:
            return None
        s = example_value(src)
        ok = isinstance(s, torch.Tensor) and _same_shape(out.shape, (s.shape[0], s.shape[1] * repeats, *s.shape[2:]))
        return src if ok else None
    if name != "reshape" or node.op != "call_method" or len(node.args) < 2:
        return None
    expand = node.args[0]
    if not (isinstance(expand, fx.Node) and expand.op == "call_method" and expand.target == "expand"):
        return None
    inserted = expand.args[0]
    if not isinstance(inserted, fx.Node) or inserted.op not in ("call_function", "call_method"):
        return None
    if inserted.op == "call_function" and inserted.target is operator.getitem:
        if not _only_new_dim_2(inserted.args[1]):
            return None
    elif not (inserted.op == "call_method" and inserted.target == "unsqueeze" and inserted.args[1:] in ((2,), (-3,))):
        return None
    src = inserted.args[0]
    s, u, e = example_value(src), example_value(inserted), example_value(expand)
    if not all(isinstance(t, torch.Tensor) for t in (s, u, e)) or s.dim() != 4 or e.dim() != 5:
        return None
    b, hkv, length, d = s.shape
    n = e.shape[2]
    if not (_same_shape(u.shape, (b, hkv, 1, length, d)) and _same_shape(e.shape, (b, hkv, n, length, d))
            and _same_shape(out.shape, (b, hkv * n, length, d))):
        return None
    return src


def decode_call(node: fx.Node) -> dict | None:
    """The op's arguments (q, k, v, mask, scale) for an SDPA call that is a decode step, else None."""
    if node.op != "call_function" or node.target not in SDPA_TARGETS:
        return None
    a = _bound(node)
    if a is None:
        return None
    k_src, v_src = unrepeated(a["key"]), unrepeated(a["value"])
    # The op reads k_src at the call: a write after the repeat copied it would change what it reads.
    copied_as_read = k_src is not None and v_src is not None and not any(
        writes_between(r, node) for r in (a["key"], a["value"]))
    if copied_as_read and _same_shape(example_value(k_src).shape[1:2], example_value(v_src).shape[1:2]):
        a = dict(a, key=k_src, value=v_src, enable_gqa=True)  # the op repeats heads by itself
    q, k, v, out = (example_value(a["query"]), example_value(a["key"]), example_value(a["value"]), example_value(node))
    mask = a["attn_mask"]
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 and not is_traceable_wrapper_subclass(t)
               for t in (q, k, v, out, example_value(mask) if mask is not None else q)):  # a subclass: its own SDPA
        return None
    if not (_static(q.shape[1], q.shape[2], q.shape[3], k.shape[1], k.shape[3], v.shape[3]) and q.shape[2] == 1):
        return None
    if a["dropout_p"] != 0.0 or a["is_causal"] is not False or a["enable_gqa"] not in (True, False):
        return None
    if q.shape[3] != k.shape[3] or v.shape[3] != q.shape[3] or k.shape[1] != v.shape[1] or not out.is_contiguous():
        return None
    if not _same_shape(out.shape, q.shape):  # SDPA broadcast a batch of one of q against k and v
        return None
    if q.shape[1] % k.shape[1] or (q.shape[1] != k.shape[1] and not a["enable_gqa"]):
        return None
    if not (q.dtype == k.dtype == v.dtype == out.dtype):  # autocast casts SDPA's inputs; the op is not cast
        return None
    if mask is not None:
        m = example_value(mask)
        if not (isinstance(m, torch.Tensor) and m.dim() == 4 and (m.dtype == torch.bool or m.dtype == q.dtype)):
            return None
    scale = a["scale"]
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[3])
    if not isinstance(scale, float):
        return None
    return {"q": a["query"], "k": a["key"], "v": a["value"], "mask": mask, "scale": scale}


def tuned_config(call: dict, tuner: Tuner | None) -> tuple[bool, list[int] | None]:
    """(whether the op serves the call, its `config`): with a tuner, the launch measured fastest for the
    call's shape on its GPU (SDPA itself among the candidates: where it won, the call stays SDPA)."""
    q, k, mask = (example_value(call[name]) for name in ("q", "k", "mask"))
    shape = Shape.of(q, k, mask) if tuner is not None else None
    choice = tuner.choose(shape, q.device) if shape is not None else None
    if choice is None:
        return True, None
    return choice.path != "sdpa", choice.encode()


def use_decode_attention(gm: fx.GraphModule, is_splitting: Callable[[fx.Node], bool], tuner: Tuner | None = None) -> int:
    """Replace every decode SDPA call of gm's graph (in place: no placeholder changes) by
    torch_ext::decode_attention; returns how many. With a tuner (CompileConfig.kernel_tuning) each
    call's launch is the one measured fastest for its shape (kernels/decode_attention_tuning.py)."""
    op = torch.ops.torch_ext.decode_attention.default
    replaced = 0
    for node in list(gm.graph.nodes):
        call = decode_call(node)
        if call is None or is_splitting(node):
            continue
        serves, config = tuned_config(call, tuner)
        if not serves:
            continue
        args = (call["q"], call["k"], call["v"], call["mask"], call["scale"])
        with gm.graph.inserting_before(node):
            new = gm.graph.call_function(op, args if config is None else (*args, config))
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        replaced += 1
    if replaced:
        gm.recompile()
        log.debug("torch_ext: %d SDPA decode calls run torch_ext::decode_attention", replaced)
    return replaced
