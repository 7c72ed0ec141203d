"""Decode attention in one Triton launch, writing into a buffer the caller passes.

One program per (sequence, head): it stores the step's key and value at `pos` of the KV cache,
then attends over positions 0..pos with an online softmax, and writes the result into `out`.
Why one kernel with an output argument: under piecewise CUDA graphs every host call of a
splitting op is paid on every step (SDPA plus the cache write are several launches), and an
output the op allocates itself must be copied into the next graph's static buffer, while `out`
allocated by the piece before lives in that graph's memory and is read in place (the shape of
vLLM's unified_attention_with_output).

    python bench/dev/decode_attention.py     checks the kernel against SDPA (TRITON_INTERPRET=1 on a CPU)
"""
from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl


@triton.jit
def _attend_block(keys, values, qv, t, d, pos, sc_t, m, l, acc):
    """One block of positions t into the per-slot online softmax (m, l, acc)."""
    live = t < pos
    k = tl.load(keys + t[:, None] * sc_t + d[None, :], mask=live[:, None], other=0.0)
    v = tl.load(values + t[:, None] * sc_t + d[None, :], mask=live[:, None], other=0.0)
    score = tl.where(live, tl.sum(k.to(tl.float32) * qv[None, :], axis=1), float("-inf"))
    m_new = tl.maximum(m, score)
    alpha = tl.where(m_new == float("-inf"), 1.0, tl.exp(m - m_new))  # an empty slot stays empty
    p = tl.where(live, tl.exp(score - m_new), 0.0)
    return m_new, l * alpha + p, acc * alpha[:, None] + p[:, None] * v.to(tl.float32)


@triton.jit
def _decode_attention(q, kv, cache, out, part, counter, pos, scale,
                      sq_b, sq_h, skv_b, skv_2, skv_h, sc_b, sc_2, sc_h, sc_t, so_b, so_h,
                      HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, SPLITS: tl.constexpr, CHUNK: tl.constexpr,
                      BLOCK: tl.constexpr, STAGES: tl.constexpr, PART: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    d = tl.arange(0, HEAD_DIM)
    r = tl.arange(0, BLOCK)
    qv = tl.load(q + b * sq_b + h * sq_h + d).to(tl.float32) * scale
    k_new = tl.load(kv + b * skv_b + h * skv_h + d)
    v_new = tl.load(kv + b * skv_b + skv_2 + h * skv_h + d)
    keys = cache + b * sc_b + h * sc_h
    values = keys + sc_2
    if split == 0:
        tl.store(keys + pos * sc_t + d, k_new)
        tl.store(values + pos * sc_t + d, v_new)
    # Online softmax per row slot: slot r sees positions start + r of each block, so the loop
    # needs no reduction across threads; the slots are folded once at the end. Position `pos`
    # itself comes from registers (the stores above are not visible to other threads without a
    # barrier), so the loop reads only positions before it.
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK], tl.float32)
    acc = tl.zeros([BLOCK, HEAD_DIM], tl.float32)
    if STAGES == 0:  # unrolled
        for start in tl.static_range(0, CHUNK, BLOCK):
            m, l, acc = _attend_block(keys, values, qv, split * CHUNK + start + r, d, pos, sc_t, m, l, acc)
    else:  # software-pipelined loads
        for start in tl.range(0, CHUNK, BLOCK, num_stages=STAGES):
            m, l, acc = _attend_block(keys, values, qv, split * CHUNK + start + r, d, pos, sc_t, m, l, acc)
    s_new = tl.where(split == 0, tl.sum(qv * k_new.to(tl.float32), axis=0), float("-inf"))
    top = tl.maximum(tl.max(m, axis=0), s_new)  # -inf only for a split past pos
    w = tl.where(m == float("-inf"), 0.0, tl.exp(m - top))
    w_new = tl.where(s_new == float("-inf"), 0.0, tl.exp(s_new - top))
    l_sum = tl.sum(l * w, axis=0) + w_new
    acc_sum = tl.sum(acc * w[:, None], axis=0) + w_new * v_new.to(tl.float32)
    o = out + b * so_b + h * so_h + d
    if SPLITS == 1:
        tl.store(o, (acc_sum / l_sum).to(out.dtype.element_ty))
    else:
        # Flash-decoding in one launch: every split stores its partial result, and the last split
        # of (b, h) to arrive (a counter, as CUTLASS's semaphores: barrier, then one release
        # atomic) combines them and resets the counter for the next launch.
        row = (b * HEADS + h) * SPLITS
        tl.store(part + (row + split) * PART + d, acc_sum)
        tl.store(part + (row + split) * PART + HEAD_DIM, top)
        tl.store(part + (row + split) * PART + HEAD_DIM + 1, l_sum)
        tl.debug_barrier()
        arrived = tl.atomic_add(counter + b * HEADS + h, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLITS - 1:
            i = tl.arange(0, SPLITS)
            tops = tl.load(part + (row + i) * PART + HEAD_DIM, volatile=True)
            sums = tl.load(part + (row + i) * PART + HEAD_DIM + 1, volatile=True)
            accs = tl.load(part + (row + i)[:, None] * PART + d[None, :], volatile=True)
            best = tl.max(tops, axis=0)
            ws = tl.where(tops == float("-inf"), 0.0, tl.exp(tops - best))
            tl.store(o, (tl.sum(accs * ws[:, None], axis=0) / tl.sum(sums * ws, axis=0)).to(out.dtype.element_ty))
            tl.store(counter + b * HEADS + h, 0)


# Per device: the partial results and arrival counters of split launches. Buffers only grow, and
# an outgrown one stays allocated: CUDA graphs captured earlier keep its address.
_workspaces: dict = {}


def _workspace(device: torch.device, rows: int, part: int, counters: int):
    kept = _workspaces.setdefault(device, [])
    if kept and kept[-1][0].shape[0] >= rows and kept[-1][1].numel() >= counters:
        return kept[-1]
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("decode_attention: its workspace must grow during CUDA-graph capture; call it once "
                           "at the largest batch size before capturing")
    size = max(rows, kept[-1][0].shape[0] if kept else 0)
    n = max(counters, kept[-1][1].numel() if kept else 0)
    kept.append((torch.empty(size, part, device=device, dtype=torch.float32),
                 torch.zeros(n, device=device, dtype=torch.int32)))
    return kept[-1]


@functools.lru_cache(maxsize=None)
def launch_config(batch: int, heads: int, context: int, device: torch.device) -> dict:
    """Splits of the context per (sequence, head), positions per block, warps, pipeline stages.
    Measured on an H200 (`python bench/dev/decode_attention.py --tune`, 16 heads of 128, context 256):
    split until the programs about fill the SMs (batch 1: 4.2 us against SDPA's 8.9); a GPU
    barely filled by (sequence, head) programs alone wants eight warps per program, more loads
    in flight (batch 8: 6.2 us, SDPA 9.8); a full GPU wants two warps over 16 positions with
    three-stage pipelined loads (batch 128: 68.9 us, SDPA 74.1, one read of the cache 63.9)."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 64
    programs, splits = batch * heads, 1
    while programs * splits * 2 <= sms and context // (splits * 2) >= 32:
        splits *= 2
    if splits > 1:
        return {"splits": splits, "block": 32, "num_warps": 2}
    if programs < sms:
        return {"splits": 1, "block": 16, "num_warps": 8}
    return {"splits": 1, "block": 16, "num_warps": 2, "stages": 3}


def decode_attention(q: torch.Tensor, kv: torch.Tensor, kv_cache: torch.Tensor, pos: int, out: torch.Tensor,
                     config: dict | None = None) -> None:
    """q, out: (B, heads, head_dim); kv: (B, 2, heads, head_dim), the step's key and value;
    kv_cache: (max_batch, 2, heads, context, head_dim). Writes kv_cache[:B, :, :, pos] and out."""
    # Host time matters here (piecewise graphs pay this call 16 times per step): each stride tuple
    # is read once.
    b, heads, head_dim = q.shape
    sq, skv, sc, so = q.stride(), kv.stride(), kv_cache.stride(), out.stride()
    assert sq[2] == skv[3] == sc[4] == so[2] == 1, "head_dim must be contiguous"
    cfg = config or launch_config(b, heads, kv_cache.shape[3], q.device)
    splits, block = cfg["splits"], cfg["block"]
    chunk = triton.cdiv(triton.cdiv(kv_cache.shape[3], splits), block) * block
    part_stride = head_dim + 4  # rows of 16-byte multiples
    part, counter = _workspace(q.device, b * heads * splits, part_stride, b * heads) if splits > 1 else (out, out)
    _decode_attention[(b, heads, splits)](
        q, kv, kv_cache, out, part, counter, pos, 1.0 / math.sqrt(head_dim),
        sq[0], sq[1], skv[0], skv[1], skv[2], sc[0], sc[1], sc[2], sc[3], so[0], so[1],
        HEADS=heads, HEAD_DIM=head_dim, SPLITS=splits, CHUNK=chunk, BLOCK=block, STAGES=cfg.get("stages", 0),
        PART=part_stride, num_warps=cfg["num_warps"])


def reference(q, kv, kv_cache, pos: int) -> torch.Tensor:
    """What decode_attention computes, in float64 through SDPA (kv_cache is not touched)."""
    b = q.shape[0]
    cache = kv_cache[:b, :, :, :pos + 1].double().clone()
    cache[:, :, :, pos] = kv.double()
    return torch.nn.functional.scaled_dot_product_attention(q.double()[:, :, None], cache[:, 0], cache[:, 1])[:, :, 0]


CONFIGS = [{"splits": s, "block": bl, "num_warps": w} for s in (1, 2, 4, 8, 16) for bl in (16, 32, 64) for w in (2, 4, 8)]
CONFIGS += [{"splits": s, "block": bl, "num_warps": w, "stages": st}
            for s in (1, 8) for bl in (16, 32, 64) for w in (2, 4, 8) for st in (2, 3, 4)]


def check(device: str, dtype=torch.bfloat16, configs=(None,), heads: int = 4, head_dim: int = 128,
          context: int = 200, repeats: int = 1) -> float:
    """Largest relative L2 error against `reference` over shapes and launch configs (None: the
    default one); fresh random inputs, a NaN-poisoned output, the cache write checked too.
    Repeated launches reuse the split counters: a counter left unreset, or a race in the
    combine, shows up as a wrong or unwritten output."""
    worst = 0.0
    for cfg in configs:
        for b, pos in ((1, 0), (3, 63), (5, 64), (2, context - 1)):
            for _ in range(repeats):
                q = torch.randn(b, heads, head_dim, device=device, dtype=dtype)
                kv = torch.randn(b, 2, heads, head_dim, device=device, dtype=dtype)
                kv_cache = torch.randn(b + 2, 2, heads, context, head_dim, device=device, dtype=dtype)
                before = kv_cache.clone()
                out = torch.full_like(q, float("nan"))
                expected = reference(q, kv, kv_cache, pos)
                decode_attention(q, kv, kv_cache, pos, out, cfg)
                after = before.clone()
                after[:b, :, :, pos] = kv
                where = f"batch {b}, pos {pos}, config {cfg}"
                assert torch.equal(kv_cache, after), f"cache write wrong at {where}"
                assert not out.isnan().any(), f"unwritten output at {where}"
                err = ((out.double() - expected).norm() / expected.norm()).item()
                assert err < (1e-5 if dtype == torch.float32 else 1e-2), f"rel err {err:.1e} at {where}"
                worst = max(worst, err)
    return worst


def sdpa_op(q, kv, kv_cache, pos: int, out) -> None:
    """The same op through a cache write and SDPA (what --attention auto runs): the peer to beat."""
    b = q.shape[0]
    kv_cache[:b, :, :, pos] = kv
    cache = kv_cache[:b, :, :, :pos + 1]
    out.copy_(torch.nn.functional.scaled_dot_product_attention(q[:, :, None], cache[:, 0], cache[:, 1])[:, :, 0])


def tune(batches=(1, 8, 32, 128), heads: int = 16, head_dim: int = 128, context: int = 256) -> None:
    """GPU time (CUDA-graph replays, so launch costs stay out) of every config against SDPA."""
    from triton.testing import do_bench_cudagraph

    for b in batches:
        q = torch.randn(b, heads, head_dim, device="cuda", dtype=torch.bfloat16)
        kv = torch.randn(b, 2, heads, head_dim, device="cuda", dtype=torch.bfloat16)
        cache = torch.randn(b, 2, heads, context, head_dim, device="cuda", dtype=torch.bfloat16)
        out = torch.empty_like(q)
        floor = cache.numel() * 2 / 4.2e12 * 1e6  # us to read the cache once at ~4.2 TB/s
        times = {"sdpa": do_bench_cudagraph(lambda: sdpa_op(q, kv, cache, context - 1, out)) * 1e3}
        for cfg in CONFIGS + [None]:
            decode_attention(q, kv, cache, context - 1, out, cfg)  # compile and grow the workspace outside capture
            times[str(cfg)] = do_bench_cudagraph(lambda: decode_attention(q, kv, cache, context - 1, out, cfg)) * 1e3
        best = sorted(times.items(), key=lambda kv_: kv_[1])
        print(f"B={b}: cache read floor {floor:.1f} us; sdpa {times['sdpa']:.1f} us; default "
              f"{launch_config(b, heads, context, q.device)} {times['None']:.1f} us; best: "
              + "; ".join(f"{k} {t:.1f}" for k, t in best[:6]), flush=True)


if __name__ == "__main__":
    import sys

    if "--tune" in sys.argv:
        tune()
        raise SystemExit(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    # On the GPU: float32 over a sample of the configs (each is one more compile), bf16 over all.
    configs = CONFIGS + [None] if device == "cuda" else [None, CONFIGS[0], CONFIGS[-1], {"splits": 8, "block": 16, "num_warps": 4},
                                                         {"splits": 1, "block": 32, "num_warps": 2, "stages": 2}]
    for dtype in (torch.float32, torch.bfloat16):
        sample = configs[::7] + [None] if device == "cuda" and dtype == torch.float32 else configs
        err = check(device, dtype, sample, repeats=3 if device == "cuda" else 1)
        print(f"decode_attention vs float64 SDPA on {device}, {dtype}, {len(sample)} launch configs: "
              f"max rel err {err:.2e}", flush=True)
