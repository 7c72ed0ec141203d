"""`torch.ops.torch_ext.decode_attention`: attention of one query token per sequence over a KV cache,
reading the cache at memory bandwidth (split-KV), with SDPA's semantics.

    decode_attention(q, k, v, mask, scale) -> out
        q: (B, H, 1, D); k, v: (B or 1, Hkv, L, D), H a multiple of Hkv (grouped-query attention);
        mask: None, or bool (True attends) / additive float, broadcastable to (B, H, 1, L);
        out = softmax(q @ k^T * scale + mask) @ v: (B, H, 1, D), q's dtype.

Why: a decode step's SDPA runs a prefill kernel for one query row, whose B*H programs leave most of
the GPU idle while each walks the whole cache (H100, HF Llama 16x2048, batch 1: 130 us for ~16 us of
KV bytes). Here L is split across programs (grid B*H x splits; with grouped heads B*Hkv x splits, a
program serving the query heads of one kv head, so the cache is read once): each reduces its chunk
with an online softmax into a float32 partial, and a second launch combines the partials (none where B*H alone fills
the GPU: one split, whose program writes the output). The rewrite that puts this
op in place of SDPA is torch_ext/backend/rewrite/decode_attention.py.

CUDA runs the Triton kernels (head dims up to 256); every other device, and shapes the kernels do not
take, run SDPA itself. A fully masked row gives zeros, as SDPA does.
"""
from __future__ import annotations

import functools

import torch

from torch_ext.hops.fused_add_rms_norm import has_triton

__all__ = ["decode_attention", "decode_attention_reference", "decode_attention_triton"]

_TARGET_PROGRAMS = 264  # about two waves of an H100's 132 SMs
# Per kernel: (cache positions per tile, warps, pipeline stages). The best of a sweep over 32/64/128 x
# 2/4/8 x 1/2/3 on an H200 (`bench/decode_attention_op.py --sweep`, bench/results/decode_attention_sweep*):
# stages 2 or 3 beat Triton's default by up to 10%; the per-head kernel wants small tiles where each row
# is one program walking its whole cache (21 vs 24 us at 32x16x16x256), large ones where rows split it
# (37 vs 47 us at 8x16x16x2048).
_CONFIG = {"grouped": (64, 4, 2), "per_head": (64, 4, 2), "per_head_one_split": (32, 2, 2)}


def decode_attention_reference(q, k, v, mask, scale: float) -> torch.Tensor:
    """SDPA with the op's arguments (grouped heads repeated): what the op computes."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


@torch.library.custom_op("torch_ext::decode_attention", mutates_args=())
def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                     scale: float) -> torch.Tensor:
    """Every device without a dedicated kernel: SDPA."""
    return decode_attention_reference(q, k, v, mask, scale)


@decode_attention.register_fake
def _(q, k, v, mask, scale):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


@decode_attention.register_kernel("cuda")
def _(q, k, v, mask, scale):
    if not _triton_takes(q, k, v, mask):
        return decode_attention_reference(q, k, v, mask, scale)
    return decode_attention_triton(q, k, v, mask, scale)


def _triton_takes(q, k, v, mask) -> bool:
    d = q.shape[-1]
    return (has_triton() and q.shape[2] == 1 and d <= 256 and d == k.shape[-1] == v.shape[-1]
            and q.dtype in (torch.float16, torch.bfloat16, torch.float32) and k.dtype == v.dtype == q.dtype
            and q.shape[1] % k.shape[1] == 0 and (mask is None or mask.dim() == 4))


def decode_attention_triton(q, k, v, mask, scale: float) -> torch.Tensor:
    """The Triton path (also on CPU tensors under TRITON_INTERPRET=1, for tests)."""
    import triton

    b, h, _, d = q.shape
    hkv, length = k.shape[1], k.shape[2]
    if length == 0:  # nothing to attend to: zeros, as SDPA gives
        return q.new_zeros((b, h, 1, d))
    # SDPA broadcasts a batch of one; the kernels index k and v by q's batch (stride 0 reads it again).
    k, v = k.expand(b, hkv, length, d), v.expand(b, hkv, length, d)
    out = torch.empty((b, h, 1, d), dtype=q.dtype, device=q.device)
    groups = h // hkv
    # Grouped heads: one program serves the query heads of one kv head, so each cache byte is read once
    # (a program per query head read it `groups` times: 4.3x the cache's bytes, H100, 4 of 16 heads).
    rows = b * hkv if groups > 1 else b * h
    kind = "grouped" if groups > 1 else "per_head" if rows < _TARGET_PROGRAMS else "per_head_one_split"
    block_n, warps, stages = _CONFIG[kind]
    tiles = triton.cdiv(length, block_n)
    splits = max(1, min(tiles, triton.cdiv(_TARGET_PROGRAMS, rows)))
    per_split = triton.cdiv(tiles, splits) * block_n
    splits = triton.cdiv(length, per_split)
    # One split: no partials (the kernel writes `out`; the argument is unused).
    partial = torch.empty((b * h, splits, d + 2), dtype=torch.float32, device=q.device) if splits > 1 else out
    if mask is not None:
        mask = mask.expand(b, h, 1, length)  # stride 0 where it broadcasts: read once per row
        ms, is_bool = mask.stride(), mask.dtype == torch.bool
    else:
        ms, is_bool = (0, 0, 0, 0), False
    partial_kernel, grouped_kernel, combine_kernel = _kernels()
    block_d = triton.next_power_of_2(d)
    direct = splits == 1  # one split per row (the rows fill the GPU): the partial kernel writes the output
    args = (q, k, v, mask if mask is not None else q, partial, out, scale * 1.4426950408889634,  # exp2 of log2(e)-scaled scores
            q.stride(0), q.stride(1), q.stride(3), k.stride(0), k.stride(1), k.stride(2), k.stride(3),
            v.stride(0), v.stride(1), v.stride(2), v.stride(3), ms[0], ms[1], ms[3], out.stride(0), out.stride(1),
            h, groups, length, per_split, d, splits)
    flags = dict(HAS_MASK=mask is not None, BOOL_MASK=is_bool, DIRECT=direct, BLOCK_N=block_n, BLOCK_D=block_d,
                 num_warps=warps, num_stages=stages)
    if groups > 1:  # tl.dot needs 16 rows: the group's heads, padded
        flags["BLOCK_D"] = max(16, block_d)  # tl.dot's smallest K
        grouped_kernel[(rows, splits)](*args, BLOCK_G=max(16, triton.next_power_of_2(groups)),
                                       IEEE=q.dtype == torch.float32, **flags)
    else:
        partial_kernel[(rows, splits)](*args, **flags)
    if not direct:
        combine_kernel[(b * h,)](partial, out, out.stride(0), out.stride(1), h, d, splits,
                                 BLOCK_S=triton.next_power_of_2(splits), BLOCK_D=block_d, num_warps=4)
    return out


@functools.cache
def _kernels():
    # Defined lazily: importing this module must not need Triton.
    import triton
    import triton.language as tl

    @triton.jit
    def partial_kernel(q, k, v, mask, partial, out, scale_log2,
                       sq_b, sq_h, sq_d, sk_b, sk_h, sk_n, sk_d, sv_b, sv_h, sv_n, sv_d, sm_b, sm_h, sm_n, so_b, so_h,
                       H, GROUPS, L, PER_SPLIT, D, SPLITS,
                       HAS_MASK: tl.constexpr, BOOL_MASK: tl.constexpr, DIRECT: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_D: tl.constexpr):
        row = tl.program_id(0)  # b * H + h
        split = tl.program_id(1)
        bi = (row // H).to(tl.int64)
        hi = row % H
        kv_h = (hi // GROUPS).to(tl.int64)
        d = tl.arange(0, BLOCK_D)
        d_ok = d < D
        qv = tl.load(q + bi * sq_b + hi.to(tl.int64) * sq_h + d * sq_d, mask=d_ok, other=0.0).to(tl.float32)
        m = tl.full([BLOCK_N], float("-inf"), tl.float32)  # per slot: online softmax in log2 units
        l = tl.zeros([BLOCK_N], tl.float32)
        acc = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        start = split * PER_SPLIT
        for n0 in range(start, tl.minimum(start + PER_SPLIT, L), BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            live = n < L
            kt = tl.load(k + bi * sk_b + kv_h * sk_h + n[:, None].to(tl.int64) * sk_n + d[None, :] * sk_d,
                         mask=live[:, None] & d_ok[None, :], other=0.0)
            s = tl.sum(kt.to(tl.float32) * qv[None, :], axis=1) * scale_log2
            if HAS_MASK:
                mv = tl.load(mask + bi * sm_b + hi.to(tl.int64) * sm_h + n.to(tl.int64) * sm_n, mask=live,
                             other=0)
                if BOOL_MASK:
                    s = tl.where(mv != 0, s, float("-inf"))
                else:
                    s = s + mv.to(tl.float32) * 1.4426950408889634
            s = tl.where(live, s, float("-inf"))
            m_new = tl.maximum(m, s)
            alpha = tl.where(m_new == float("-inf"), 1.0, tl.exp2(m - m_new))  # an empty slot stays empty
            p = tl.where(m_new == float("-inf"), 0.0, tl.exp2(s - m_new))
            vt = tl.load(v + bi * sv_b + kv_h * sv_h + n[:, None].to(tl.int64) * sv_n + d[None, :] * sv_d,
                         mask=live[:, None] & d_ok[None, :], other=0.0)
            l = l * alpha + p
            acc = acc * alpha[:, None] + p[:, None] * vt.to(tl.float32)
            m = m_new
        # Fold the slots into one (m, l, acc) for this split.
        m_all = tl.max(m, axis=0)
        w = tl.where(m == float("-inf"), 0.0, tl.exp2(m - m_all))
        l_all = tl.sum(l * w, axis=0)
        acc_all = tl.sum(acc * w[:, None], axis=0)
        if DIRECT:  # the only split: normalize here, as the combine kernel would (zeros where all masked)
            result = tl.where(l_all > 0, acc_all / tl.where(l_all > 0, l_all, 1.0), 0.0)
            o = out + bi * so_b + hi.to(tl.int64) * so_h
            tl.store(o + d, result.to(out.dtype.element_ty), mask=d_ok)
        else:
            base = partial + (row.to(tl.int64) * SPLITS + split) * (D + 2)
            tl.store(base + d, acc_all, mask=d_ok)
            tl.store(base + D, m_all)
            tl.store(base + D + 1, l_all)

    @triton.jit
    def grouped_kernel(q, k, v, mask, partial, out, scale_log2,
                       sq_b, sq_h, sq_d, sk_b, sk_h, sk_n, sk_d, sv_b, sv_h, sv_n, sv_d, sm_b, sm_h, sm_n, so_b, so_h,
                       H, GROUPS, L, PER_SPLIT, D, SPLITS,
                       HAS_MASK: tl.constexpr, BOOL_MASK: tl.constexpr, DIRECT: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_D: tl.constexpr, BLOCK_G: tl.constexpr, IEEE: tl.constexpr):
        # partial_kernel for the GROUPS query heads of one kv head at once (rows of a tl.dot): the
        # program reads its chunk of the cache once for all of them.
        row = tl.program_id(0)  # b * Hkv + kv head
        split = tl.program_id(1)
        hkv = H // GROUPS
        bi = (row // hkv).to(tl.int64)
        kv_h = (row % hkv).to(tl.int64)
        g = tl.arange(0, BLOCK_G)
        g_ok = g < GROUPS
        heads = (kv_h * GROUPS + g).to(tl.int64)  # query heads kv_h * GROUPS ... in SDPA's enable_gqa order
        d = tl.arange(0, BLOCK_D)
        d_ok = d < D
        qt = tl.load(q + bi * sq_b + heads[:, None] * sq_h + d[None, :] * sq_d, mask=g_ok[:, None] & d_ok[None, :],
                     other=0.0)
        m = tl.full([BLOCK_G], float("-inf"), tl.float32)  # per head: online softmax in log2 units
        l = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        start = split * PER_SPLIT
        for n0 in range(start, tl.minimum(start + PER_SPLIT, L), BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            live = n < L
            kt = tl.load(k + bi * sk_b + kv_h * sk_h + n[:, None].to(tl.int64) * sk_n + d[None, :] * sk_d,
                         mask=live[:, None] & d_ok[None, :], other=0.0)
            vt = tl.load(v + bi * sv_b + kv_h * sv_h + n[:, None].to(tl.int64) * sv_n + d[None, :] * sv_d,
                         mask=live[:, None] & d_ok[None, :], other=0.0)
            if IEEE:  # float32 inputs: no TF32 rounding
                s = tl.dot(qt, tl.trans(kt), input_precision="ieee") * scale_log2
            else:
                s = tl.dot(qt, tl.trans(kt)) * scale_log2
            if HAS_MASK:
                mv = tl.load(mask + bi * sm_b + heads[:, None] * sm_h + n[None, :].to(tl.int64) * sm_n,
                             mask=g_ok[:, None] & live[None, :], other=0)
                if BOOL_MASK:
                    s = tl.where(mv != 0, s, float("-inf"))
                else:
                    s = s + mv.to(tl.float32) * 1.4426950408889634
            s = tl.where(live[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            alpha = tl.where(m_new == float("-inf"), 1.0, tl.exp2(m - m_new))  # a head with nothing yet stays empty
            p = tl.where(m_new[:, None] == float("-inf"), 0.0, tl.exp2(s - m_new[:, None]))
            l = l * alpha + tl.sum(p, axis=1)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p, vt, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt)
            m = m_new
        if DIRECT:  # the only split: normalize here (zeros where all masked)
            result = tl.where(l[:, None] > 0, acc / tl.where(l > 0, l, 1.0)[:, None], 0.0)
            o = out + bi * so_b + heads[:, None] * so_h + d[None, :]
            tl.store(o, result.to(out.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])
        else:  # the partial rows of query heads, as partial_kernel lays them out
            base = partial + ((bi * H + heads) * SPLITS + split) * (D + 2)
            tl.store(base[:, None] + d[None, :], acc, mask=g_ok[:, None] & d_ok[None, :])
            tl.store(base + D, m, mask=g_ok)
            tl.store(base + D + 1, l, mask=g_ok)

    @triton.jit
    def combine_kernel(partial, out, so_b, so_h, H, D, SPLITS, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
        row = tl.program_id(0)
        sp = tl.arange(0, BLOCK_S)
        d = tl.arange(0, BLOCK_D)
        sp_ok = sp < SPLITS
        base = partial + row.to(tl.int64) * SPLITS * (D + 2)
        m = tl.load(base + sp * (D + 2) + D, mask=sp_ok, other=float("-inf"))
        l = tl.load(base + sp * (D + 2) + D + 1, mask=sp_ok, other=0.0)
        acc = tl.load(base + sp[:, None] * (D + 2) + d[None, :], mask=sp_ok[:, None] & (d[None, :] < D), other=0.0)
        m_all = tl.max(m, axis=0)
        w = tl.where(m == float("-inf"), 0.0, tl.exp2(m - m_all))
        total = tl.sum(l * w, axis=0)
        # A fully masked row gives zeros, as SDPA does (its safe softmax).
        result = tl.where(total > 0, tl.sum(acc * w[:, None], axis=0) / tl.where(total > 0, total, 1.0), 0.0)
        o = out + (row // H).to(tl.int64) * so_b + (row % H).to(tl.int64) * so_h
        tl.store(o + d, result.to(out.dtype.element_ty), mask=d < D)

    return partial_kernel, grouped_kernel, combine_kernel

