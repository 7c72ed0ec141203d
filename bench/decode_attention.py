"""Decode attention in one Triton launch, writing into a buffer the caller passes.

One program per (sequence, head): it stores the step's key and value at `pos` of the KV cache,
then attends over positions 0..pos with an online softmax, and writes the result into `out`.
Why one kernel with an output argument: under piecewise CUDA graphs every host call of a
splitting op is paid on every step (SDPA plus the cache write are several launches), and an
output the op allocates itself must be copied into the next graph's static buffer, while `out`
allocated by the piece before lives in that graph's memory and is read in place (the shape of
vLLM's unified_attention_with_output).

    python bench/decode_attention.py     checks the kernel against SDPA (TRITON_INTERPRET=1 on a CPU)
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl


@triton.jit
def _decode_attention(q, kv, cache, out, pos, scale,
                      sq_b, sq_h, skv_b, skv_2, skv_h, sc_b, sc_2, sc_h, sc_t, so_b, so_h,
                      HEAD_DIM: tl.constexpr, CONTEXT: tl.constexpr, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    d = tl.arange(0, HEAD_DIM)
    qv = tl.load(q + b * sq_b + h * sq_h + d).to(tl.float32) * scale
    k_new = tl.load(kv + b * skv_b + h * skv_h + d)
    v_new = tl.load(kv + b * skv_b + skv_2 + h * skv_h + d)
    keys = cache + b * sc_b + h * sc_h
    values = keys + sc_2
    tl.store(keys + pos * sc_t + d, k_new)
    tl.store(values + pos * sc_t + d, v_new)
    # Position `pos` comes from registers: the stores above are not visible to the program's
    # other threads without a barrier, so the loop reads only positions before it. The loop runs
    # to the cache's length (a constant) with later blocks masked off: loads of masked rows
    # move no bytes, and Triton's interpreter cannot loop to a runtime bound.
    m = tl.sum(qv * k_new.to(tl.float32), axis=0)  # running max of the scores
    l = tl.full((), 1.0, tl.float32)  # running sum of exp(score - m)
    acc = v_new.to(tl.float32)
    for start in range(0, CONTEXT, BLOCK):
        t = start + tl.arange(0, BLOCK)
        live = t < pos
        k = tl.load(keys + t[:, None] * sc_t + d[None, :], mask=live[:, None], other=0.0)
        v = tl.load(values + t[:, None] * sc_t + d[None, :], mask=live[:, None], other=0.0)
        s = tl.where(live, tl.sum(k.to(tl.float32) * qv[None, :], axis=1), float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=0))
        p = tl.exp(s - m_new)
        alpha = tl.exp(m - m_new)
        acc = acc * alpha + tl.sum(p[:, None] * v.to(tl.float32), axis=0)
        l = l * alpha + tl.sum(p, axis=0)
        m = m_new
    tl.store(out + b * so_b + h * so_h + d, (acc / l).to(out.dtype.element_ty))


def decode_attention(q: torch.Tensor, kv: torch.Tensor, kv_cache: torch.Tensor, pos: int, out: torch.Tensor,
                     block: int = 64, num_warps: int = 4) -> None:
    """q, out: (B, heads, head_dim); kv: (B, 2, heads, head_dim), the step's key and value;
    kv_cache: (max_batch, 2, heads, context, head_dim). Writes kv_cache[:B, :, :, pos] and out."""
    b, heads, head_dim = q.shape
    assert kv_cache.stride(-1) == kv.stride(-1) == q.stride(-1) == out.stride(-1) == 1, "head_dim must be contiguous"
    _decode_attention[(b, heads)](
        q, kv, kv_cache, out, pos, 1.0 / math.sqrt(head_dim),
        q.stride(0), q.stride(1), kv.stride(0), kv.stride(1), kv.stride(2),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3), out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, CONTEXT=kv_cache.shape[3], BLOCK=block, num_warps=num_warps)


def reference(q, kv, kv_cache, pos: int) -> torch.Tensor:
    """What decode_attention computes, in float64 through SDPA (kv_cache is not touched)."""
    b = q.shape[0]
    cache = kv_cache[:b, :, :, :pos + 1].double().clone()
    cache[:, :, :, pos] = kv.double()
    return torch.nn.functional.scaled_dot_product_attention(q.double()[:, :, None], cache[:, 0], cache[:, 1])[:, :, 0]


def check(device: str, dtype=torch.bfloat16, heads: int = 4, head_dim: int = 128, context: int = 200) -> float:
    """Largest relative L2 error against `reference` over a few shapes; fresh random inputs, a
    NaN-poisoned output, and the cache write checked too."""
    worst = 0.0
    for b, pos in ((1, 0), (3, 63), (5, 64), (2, context - 1)):
        q = torch.randn(b, heads, head_dim, device=device, dtype=dtype)
        kv = torch.randn(b, 2, heads, head_dim, device=device, dtype=dtype)
        kv_cache = torch.randn(b + 2, 2, heads, context, head_dim, device=device, dtype=dtype)
        before = kv_cache.clone()
        out = torch.full_like(q, float("nan"))
        expected = reference(q, kv, kv_cache, pos)
        decode_attention(q, kv, kv_cache, pos, out)
        after = before.clone()
        after[:b, :, :, pos] = kv
        assert torch.equal(kv_cache, after), f"cache write wrong at batch {b}, pos {pos}"
        assert not out.isnan().any(), f"unwritten output at batch {b}, pos {pos}"
        worst = max(worst, ((out.double() - expected).norm() / expected.norm()).item())
    return worst


if __name__ == "__main__":
    device = "cuda" if torch.cuda.is_available() else "cpu"
    errs = {dtype: check(device, dtype) for dtype in (torch.float32, torch.bfloat16)}
    for dtype, err in errs.items():
        print(f"decode_attention vs float64 SDPA on {device}, {dtype}: max rel err {err:.2e}")
    raise SystemExit(0 if errs[torch.float32] < 1e-5 and errs[torch.bfloat16] < 1e-2 else 1)
