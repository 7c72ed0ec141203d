"""The Triton kernels of `torch.ops.torch_ext.decode_attention` (kernels/decode_attention.py launches them).

A module of its own because it imports Triton at its top (the op's module must import without it),
and the kernels share @triton.jit helpers, which the interpreter (TRITON_INTERPRET=1, the CPU tests)
finds only as module globals.

Scores are in log2 units (the caller folds log2(e) into the scale) so the softmax uses exp2.
"""
from __future__ import annotations

import triton
import triton.language as tl

from torch_ext.kernels.pdl_kernels import wait_then_release


@triton.jit
def _cache_tile(base, n, d, s_n, s_d, live, d_ok):
    """Positions n x head dim d of one sequence's kv head of k or v; zeros past the cache."""
    return tl.load(base + n[:, None].to(tl.int64) * s_n + d[None, :] * s_d, mask=live[:, None] & d_ok[None, :],
                   other=0.0)


@triton.jit
def _masked(s, mv, BOOL_MASK: tl.constexpr):
    """Scores with SDPA's mask applied: bool keeps True, a float mask adds (in log2 units)."""
    if BOOL_MASK:
        s = tl.where(mv != 0, s, float("-inf"))
    else:
        s = s + mv.to(tl.float32) * 1.4426950408889634
    return s


@triton.jit
def _normalized(acc, l):
    """acc / l, zeros where nothing was attended (SDPA's safe softmax of a fully masked row)."""
    return tl.where(l > 0, acc / tl.where(l > 0, l, 1.0), 0.0)


@triton.jit
def partial_kernel(q, k, v, mask, partial, out, scale_log2,
                   sq_b, sq_h, sq_d, sk_b, sk_h, sk_n, sk_d, sv_b, sv_h, sv_n, sv_d, sm_b, sm_h, sm_n, so_b, so_h,
                   H, GROUPS, L, PER_SPLIT, D, SPLITS,
                   HAS_MASK: tl.constexpr, BOOL_MASK: tl.constexpr, DIRECT: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    """One query head's split of the cache: an online softmax per tile slot, folded at the end."""
    wait_then_release(PDL)  # q and the cache come from the kernels before
    row = tl.program_id(0)  # b * H + h
    split = tl.program_id(1)
    bi = (row // H).to(tl.int64)
    hi = (row % H).to(tl.int64)
    kv_h = hi // GROUPS
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    qv = tl.load(q + bi * sq_b + hi * sq_h + d * sq_d, mask=d_ok, other=0.0).to(tl.float32)
    m = tl.full([BLOCK_N], float("-inf"), tl.float32)  # per slot
    l = tl.zeros([BLOCK_N], tl.float32)
    acc = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    start = split * PER_SPLIT
    for n0 in range(start, tl.minimum(start + PER_SPLIT, L), BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        live = n < L
        kt = _cache_tile(k + bi * sk_b + kv_h * sk_h, n, d, sk_n, sk_d, live, d_ok)
        s = tl.sum(kt.to(tl.float32) * qv[None, :], axis=1) * scale_log2
        if HAS_MASK:
            s = _masked(s, tl.load(mask + bi * sm_b + hi * sm_h + n.to(tl.int64) * sm_n, mask=live, other=0),
                        BOOL_MASK)
        s = tl.where(live, s, float("-inf"))
        m_new = tl.maximum(m, s)
        alpha = tl.where(m_new == float("-inf"), 1.0, tl.exp2(m - m_new))  # an empty slot stays empty
        p = tl.where(m_new == float("-inf"), 0.0, tl.exp2(s - m_new))
        vt = _cache_tile(v + bi * sv_b + kv_h * sv_h, n, d, sv_n, sv_d, live, d_ok)
        l = l * alpha + p
        acc = acc * alpha[:, None] + p[:, None] * vt.to(tl.float32)
        m = m_new
    # Fold the slots into one (m, l, acc) for this split.
    m_all = tl.max(m, axis=0)
    w = tl.where(m == float("-inf"), 0.0, tl.exp2(m - m_all))
    l_all = tl.sum(l * w, axis=0)
    acc_all = tl.sum(acc * w[:, None], axis=0)
    if DIRECT:  # the only split: normalize here, as the combine kernel would
        tl.store(out + bi * so_b + hi * so_h + d, _normalized(acc_all, l_all).to(out.dtype.element_ty), mask=d_ok)
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
                   BLOCK_D: tl.constexpr, BLOCK_G: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr):
    """partial_kernel for the GROUPS query heads of one kv head at once (rows of a tl.dot): the
    program reads its split of the cache once for all of them."""
    wait_then_release(PDL)
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
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)  # per head
    l = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    start = split * PER_SPLIT
    for n0 in range(start, tl.minimum(start + PER_SPLIT, L), BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        live = n < L
        kt = _cache_tile(k + bi * sk_b + kv_h * sk_h, n, d, sk_n, sk_d, live, d_ok)
        vt = _cache_tile(v + bi * sv_b + kv_h * sv_h, n, d, sv_n, sv_d, live, d_ok)
        if IEEE:  # float32 inputs: no TF32 rounding
            s = tl.dot(qt, tl.trans(kt), input_precision="ieee") * scale_log2
        else:
            s = tl.dot(qt, tl.trans(kt)) * scale_log2
        if HAS_MASK:
            mv = tl.load(mask + bi * sm_b + heads[:, None] * sm_h + n[None, :].to(tl.int64) * sm_n,
                         mask=g_ok[:, None] & live[None, :], other=0)
            s = _masked(s, mv, BOOL_MASK)
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
    if DIRECT:  # the only split: normalize here
        tl.store(out + bi * so_b + heads[:, None] * so_h + d[None, :],
                 _normalized(acc, l[:, None]).to(out.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])
    else:  # the partial rows of query heads, as partial_kernel lays them out
        base = partial + ((bi * H + heads) * SPLITS + split) * (D + 2)
        tl.store(base[:, None] + d[None, :], acc, mask=g_ok[:, None] & d_ok[None, :])
        tl.store(base + D, m, mask=g_ok)
        tl.store(base + D + 1, l, mask=g_ok)


@triton.jit
def combine_kernel(partial, out, so_b, so_h, H, D, SPLITS, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
                   PDL: tl.constexpr):
    """A row's splits merged by their maxima into the output."""
    wait_then_release(PDL)
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
    result = _normalized(tl.sum(acc * w[:, None], axis=0), tl.sum(l * w, axis=0))
    o = out + (row // H).to(tl.int64) * so_b + (row % H).to(tl.int64) * so_h
    tl.store(o + d, result.to(out.dtype.element_ty), mask=d < D)
