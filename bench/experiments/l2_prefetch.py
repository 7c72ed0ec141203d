"""Does pulling the next projection's weights into L2 while the small kernels run pay?

A decode step at batch 1-8 reads every weight once: the projections are memory-bound, and between
them run norms, rotary, cache writes and attention that leave memory bandwidth idle (H100, HF Llama
16x2048, batch 1: ~260 of ~1070 us of kernel time). Here a second branch of the CUDA graph, forked
right after each projection, prefetches the next projection's weights into L2 (evict_last) while
the small kernels run; the projection then reads part of its weights from L2.

    python bench/experiments/l2_prefetch.py [--batches 1,8] [--cap-mb 4,8,16,32] [--programs 16,32,66]

A Llama-shaped stack (16 layers 2048 / 5632, 16 heads of 128, cache 256, bf16): projections through
cuBLAS (F.linear), the small ops through Inductor (torch.compile, no CUDA graphs), attention through
torch_ext's decode_attention; the whole step captured in one CUDA graph by hand. Columns: ms per step
(median of interleaved rounds), x floor (weights + cache bytes / copy bandwidth), x base. A variant's
output must equal the base's bit for bit (the prefetch reads only).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # bench/: the harness, the benchmarks
sys.path.insert(0, BENCH)
sys.path.insert(0, os.path.dirname(BENCH))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from harness import copy_bandwidth  # noqa: E402
from harness import capture, interleaved, ratio_cells  # noqa: E402
from harness import print_table  # noqa: E402

LAYERS, HIDDEN, MLP, HEADS, HEAD_DIM, CACHE, VOCAB = 16, 2048, 5632, 16, 128, 256, 32000
DTYPE = torch.bfloat16


@triton.jit
def _load_kernel(ptr, n, iters, programs, sink, BLOCK: tl.constexpr):
    """Plain loads kept in L2 (evict_last); a store nobody takes keeps them alive."""
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for i in range(0, iters):
        offs = (pid + i * programs) * BLOCK + tl.arange(0, BLOCK)
        acc ^= tl.load(ptr + offs, mask=offs < n, other=0, eviction_policy="evict_last")
    total = tl.reduce(acc, 0, _xor)
    if total == 0x7FABCDEF:
        tl.store(sink + pid, total)


@triton.jit
def _xor(a, b):
    return a ^ b


@triton.jit
def _asm_prefetch_kernel(ptr, n, iters, programs, BLOCK: tl.constexpr, WORDS: tl.constexpr, ASM: tl.constexpr):
    """One prefetch instruction (ASM) per WORDS int32 words: n of them, from ptr."""
    pid = tl.program_id(0)
    for i in range(0, iters):
        offs = (pid + i * programs) * BLOCK + tl.arange(0, BLOCK)
        tl.inline_asm_elementwise(ASM, "=r,l", [ptr + tl.minimum(offs, n - 1) * WORDS], dtype=tl.int32,
                                  is_pure=False, pack=1)


# `prefetch.global.L2::evict_last` per 128-byte line (no registers wait for the data), or sm90's
# `cp.async.bulk.prefetch.L2` per 4 KiB chunk: (instruction, int32 words each covers, programs' block).
_ASM = {"prefetch": ("prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0;", 32, 256),
        "bulk": ("cp.async.bulk.prefetch.L2.global [$1], 4096; mov.u32 $0, 0;", 1024, 128)}


class Prefetcher:
    """Launches the prefetch of `nbytes` of a weight on a side stream forked from the current one."""

    def __init__(self, kind: str, programs: int, cap_bytes: int, windows: str):
        self.kind, self.programs, self.cap, self.windows = kind, programs, cap_bytes, windows.split("+")
        self.stream = torch.cuda.Stream()
        self.sink = torch.zeros(programs, dtype=torch.int32, device="cuda")

    def fork(self, weight: torch.Tensor, window: str) -> None:
        if window not in self.windows:
            return
        words = weight.view(-1).view(torch.int32)[: self.cap // 4]
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            if self.kind == "load":
                _load_kernel[(self.programs,)](words, words.numel(), self._iters(words.numel(), 1024), self.programs, self.sink, BLOCK=1024,
                                                num_warps=8)
            else:
                asm, per, block = _ASM[self.kind]
                n = words.numel() // per
                _asm_prefetch_kernel[(self.programs,)](words, n, self._iters(n, block), self.programs, BLOCK=block,
                                                       WORDS=per, ASM=asm, num_warps=4)

    def _iters(self, n: int, block: int) -> int:
        return -(-n // (block * self.programs))

    def join(self) -> None:
        torch.cuda.current_stream().wait_stream(self.stream)


def rms_norm(x, w):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * w


@torch.compile(dynamic=False)
def add_norm(x, r, w):
    h = x + r
    return h, rms_norm(h, w)


@torch.compile(dynamic=False)
def rope_write(qkv, cos, sin, k_cache, v_cache, pos):
    b = qkv.shape[0]
    q, k, v = qkv.view(b, 3, HEADS, HEAD_DIM).unbind(1)

    def rot(t):
        t1, t2 = t[..., : HEAD_DIM // 2], t[..., HEAD_DIM // 2:]
        return t * cos + torch.cat([-t2, t1], -1) * sin
    k_cache.index_copy_(2, pos, rot(k).unsqueeze(2))
    v_cache.index_copy_(2, pos, v.unsqueeze(2))
    return rot(q).unsqueeze(2)


@torch.compile(dynamic=False)
def silu_mul(gu):
    g, u = gu.chunk(2, -1)
    return F.silu(g) * u


def make_model():
    def w(*shape):
        return torch.randn(*shape, dtype=DTYPE, device="cuda") * 0.02
    layers = [dict(qkv=w(3 * HIDDEN, HIDDEN), o=w(HIDDEN, HIDDEN), gu=w(2 * MLP, HIDDEN), down=w(HIDDEN, MLP),
                   n1=torch.ones(HIDDEN, dtype=DTYPE, device="cuda"), n2=torch.ones(HIDDEN, dtype=DTYPE, device="cuda"))
              for _ in range(LAYERS)]
    return layers, w(VOCAB, HIDDEN), torch.ones(HIDDEN, dtype=DTYPE, device="cuda")


def step(layers, head, norm_w, x, caches, cos, sin, pos, pf: Prefetcher | None):
    b = x.shape[0]
    r = torch.zeros_like(x)
    for i, p in enumerate(layers):
        h, n = add_norm(x, r, p["n1"])
        qkv = F.linear(n, p["qkv"])
        if pf:
            pf.fork(p["o"], "o")
        q = rope_write(qkv, cos, sin, *caches[i], pos)
        a = torch.ops.torch_ext.decode_attention(q, *caches[i], None, HEAD_DIM ** -0.5)
        o = F.linear(a.reshape(b, HIDDEN), p["o"])
        if pf:
            pf.fork(p["gu"], "gu")
        x, n = add_norm(o, h, p["n2"])
        gu = F.linear(n, p["gu"])
        if pf:
            pf.fork(p["down"], "down")
        d = F.linear(silu_mul(gu), p["down"])
        if pf:
            pf.fork(layers[i + 1]["qkv"] if i + 1 < len(layers) else head, "qkv")
        r = d
    _, n = add_norm(x, r, norm_w)
    out = F.linear(n, head)
    if pf:
        pf.join()
    return out


def gemv_cold_and_warm(b: int) -> list:
    """The upper bound: each projection's kernel time (profiler, inside a CUDA graph) with its weights
    cold (a 256 MiB copy before it flushes L2) and warm (a full bulk prefetch after the flush)."""
    from torch.profiler import ProfilerActivity, profile
    flush_src = torch.empty(128 << 20, dtype=DTYPE, device="cuda")
    flush_dst = torch.empty_like(flush_src)
    pf = Prefetcher("bulk", 32, 1 << 40, "w")
    rows = []
    for name, (n, k) in {"qkv": (3 * HIDDEN, HIDDEN), "o": (HIDDEN, HIDDEN), "gate_up": (2 * MLP, HIDDEN),
                         "down": (HIDDEN, MLP)}.items():
        w = torch.randn(n, k, dtype=DTYPE, device="cuda") * 0.02
        x = torch.randn(b, k, dtype=DTYPE, device="cuda")
        us = {}
        for warm in (False, True):
            def body():
                for _ in range(10):
                    flush_dst.copy_(flush_src)
                    if warm:
                        pf.fork(w, "w")
                        pf.join()
                    F.linear(x, w)
            g, _ = capture(body)
            g.replay()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                g.replay()
                torch.cuda.synchronize()
            times = [e.device_time for e in prof.events() if e.device_type.name == "CUDA"
                     and "copy" not in e.name.lower() and "prefetch" not in e.name and "bulk" not in e.name
                     and "Memcpy" not in e.name and "elementwise" not in e.name]
            us[warm] = sum(times) / 10  # all of F.linear's kernels (a split-K reduce too)
        floor_us = n * k * 2 / copy_bandwidth.value * 1e6
        rows.append([b, name, f"{n}x{k}", f"{floor_us:.1f}", f"{us[False]:.1f}", f"{us[True]:.1f}",
                     f"{us[True] / us[False]:.2f}"])
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--cap-mb", default="8,16,32")
    ap.add_argument("--programs", default="32,66")
    ap.add_argument("--kinds", default="prefetch,bulk,load")
    ap.add_argument("--windows", default="o+gu+down+qkv", help="which projections to prefetch, each a variant")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--gemv", action="store_true", help="also each projection's kernel cold and L2-warm")
    args = ap.parse_args()
    import torch_ext.kernels.decode_attention  # noqa: F401  (registers the op)
    bandwidth = copy_bandwidth.value = copy_bandwidth()
    layers, head, norm_w = make_model()
    weight_bytes = sum(t.numel() * 2 for p in layers for t in p.values()) + head.numel() * 2
    rows = []
    for b in [int(s) for s in args.batches.split(",")]:
        caches = [(torch.randn(b, HEADS, CACHE, HEAD_DIM, dtype=DTYPE, device="cuda"),
                   torch.randn(b, HEADS, CACHE, HEAD_DIM, dtype=DTYPE, device="cuda")) for _ in range(LAYERS)]
        x = torch.randn(b, HIDDEN, dtype=DTYPE, device="cuda")
        cos = torch.randn(b, 1, HEAD_DIM, dtype=DTYPE, device="cuda")
        sin = torch.randn(b, 1, HEAD_DIM, dtype=DTYPE, device="cuda")
        pos = torch.tensor([CACHE - 1], device="cuda")
        floor_ms = (weight_bytes + sum(c.numel() * 2 for kv in caches for c in kv)) / bandwidth * 1e3
        variants = {"base": None}
        for kind in args.kinds.split(","):
            for cap in [int(c) for c in args.cap_mb.split(",")]:
                for programs in [int(p) for p in args.programs.split(",")]:
                    for windows in args.windows.split(","):
                        variants[f"{kind} {cap}MB x{programs} {windows}"] = Prefetcher(kind, programs, cap << 20, windows)
        graphs, outs = {}, {}
        for name, pf in variants.items():
            try:
                graphs[name], outs[name] = capture(lambda pf=pf: step(layers, head, norm_w, x, caches, cos, sin, pos, pf))
            except Exception as e:  # a variant that fails to compile must not cost the others
                print(f"{name}: {type(e).__name__}: {str(e)[:300]}")
        times = interleaved(graphs, args.rounds, replays=40)
        for name, g in graphs.items():
            g.replay()
        torch.cuda.synchronize()
        for name in graphs:
            same = torch.equal(outs[name], outs["base"])
            rows.append([b, name, *ratio_cells(times, name, "base", floor_ms), "yes" if same else "NO"])
    if args.gemv:
        gemv_rows = [r for b in [int(s) for s in args.batches.split(",")] for r in gemv_cold_and_warm(b)]
        print("\nOne projection (F.linear) kernel, us: weights cold vs prefetched into L2 just before")
        print_table(["batch", "projection", "shape", "floor", "cold", "L2-warm", "warm/cold"], gemv_rows)
    print(f"\nLlama-shaped decode step ({LAYERS}x{HIDDEN}, MLP {MLP}, cache {CACHE}), {torch.cuda.get_device_name()}, "
          f"torch {torch.__version__}; copy bandwidth {bandwidth / 1e12:.2f} TB/s; {args.rounds} interleaved rounds")
    print_table(["batch", "variant", "ms", "x floor", "x base", "spread", "same output"], rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
