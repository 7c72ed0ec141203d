"""Can a decode step's projections overlap across kernel boundaries?

A projection at batch 1 is a GEMV whose kernel pays a ramp (the first loads' latency: at ~4 TB/s and
~0.7 us, ~3 MB must be in flight) and a tail each time; `bench/experiments/l2_prefetch.py` found a 2048x2048
GEMV at 3.5x its bytes even with its weights in L2. Programmatic dependent launch (PDL) lets the next
kernel start while this one runs: its programs load their first weight tiles (which depend on
nothing) and only then wait for the previous kernel (`griddepcontrol.wait`) to read its input.

    python bench/experiments/pdl_gemv.py [--layers 16] [--pre-k 0,512,1024]

A chain of Llama-shaped projections (qkv 6144x2048 -> o 2048x2048 -> gate_up 11264x2048 ->
down 2048x5632, each reading the previous output's first columns), bf16, one row, captured in one
CUDA graph: cuBLAS (F.linear), a Triton GEMV, the same launched with PDL (weights of the first
PRE_K columns loaded before the wait). ms per chain, x floor (weight bytes / copy bandwidth).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # bench/: the harness, the benchmarks
sys.path.insert(0, BENCH)

from harness import copy_bandwidth  # noqa: E402
from harness import capture, interleaved, ratio_cells  # noqa: E402
from harness import print_table  # noqa: E402

SHAPES = [(6144, 2048), (2048, 2048), (11264, 2048), (2048, 5632)]  # (out, in) of qkv, o, gate_up, down


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, y_ptr, N, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 PRE_K: tl.constexpr, PDL: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    live = rows < N
    if PDL:
        gdc_launch_dependents()  # the next kernel's programs may start their own prologue now
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    if PRE_K > 0:
        pre_cols = tl.arange(0, PRE_K)
        w_pre = tl.load(w_ptr + rows[:, None] * K + pre_cols[None, :], mask=live[:, None], other=0.0)
    if PDL:
        gdc_wait()  # the previous kernel has finished: its output (our x) is complete
    if PRE_K > 0:
        x_pre = tl.load(x_ptr + pre_cols).to(tl.float32)
        acc += tl.sum(w_pre.to(tl.float32) * x_pre[None, :], axis=1)
    for k0 in range(PRE_K, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + rows[:, None] * K + cols[None, :], mask=live[:, None], other=0.0)
        x = tl.load(x_ptr + cols).to(tl.float32)
        acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
    tl.store(y_ptr + rows, acc.to(y_ptr.dtype.element_ty), mask=live)


def triton_gemv(x, w, y, block_n: int, pre_k: int, pdl: bool, block_k: int = 256, warps: int = 4):
    n, k = w.shape
    _gemv_kernel[(triton.cdiv(n, block_n),)](x, w, y, n, K=k, BLOCK_N=block_n, BLOCK_K=block_k, PRE_K=pre_k,
                                             PDL=pdl, num_warps=warps, launch_pdl=pdl)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--pre-k", default="0,512,1024")
    ap.add_argument("--block-n", default="8,16")
    ap.add_argument("--block-k", default="256")
    ap.add_argument("--warps", default="4")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    bandwidth = copy_bandwidth()
    weights = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") / k ** 0.5
               for _ in range(args.layers) for n, k in SHAPES]
    outs = [torch.empty(w.shape[0], dtype=torch.bfloat16, device="cuda") for w in weights]
    x0 = torch.randn(SHAPES[-1][0], dtype=torch.bfloat16, device="cuda")
    floor_ms = sum(w.numel() * 2 for w in weights) / bandwidth * 1e3

    def chain(gemv):
        x = x0
        for w, y in zip(weights, outs):
            gemv(x[: w.shape[1]], w, y)
            x = y
        return x

    def cublas(x, w, y):
        torch.mm(x.view(1, -1), w.t(), out=y.view(1, -1))

    variants = {"cuBLAS": cublas}
    ints = lambda text: [int(v) for v in text.split(",")]  # noqa: E731
    for bn in ints(args.block_n):
        for pre in ints(args.pre_k):
            for bk in ints(args.block_k):
                for warps in ints(args.warps):
                    for pdl in (False, True):
                        variants[f"triton n{bn} pre{pre} k{bk} w{warps}{' pdl' if pdl else ''}"] = (
                            lambda x, w, y, bn=bn, pre=pre, pdl=pdl, bk=bk, warps=warps:
                            triton_gemv(x, w, y, bn, pre, pdl, bk, warps))

    # One GEMV each against float64: every variant computes the same function.
    errors = {}
    for name, gemv in variants.items():
        worst = 0.0
        for w in weights[:4]:
            x = torch.randn(w.shape[1], dtype=torch.bfloat16, device="cuda")
            y = torch.full((w.shape[0],), float("nan"), dtype=torch.bfloat16, device="cuda")
            gemv(x, w, y)
            ref = w.double() @ x.double()
            worst = max(worst, ((y.double() - ref).norm() / ref.norm()).item())
        errors[name] = worst

    graphs = {}
    for name, gemv in variants.items():
        try:
            graphs[name], _ = capture(lambda gemv=gemv: chain(gemv))
        except Exception as e:  # one variant that fails must not cost the others
            print(f"{name}: {type(e).__name__}: {str(e)[:300]}")
    times = interleaved(graphs, args.rounds)
    rows = [[name, *ratio_cells(times, name, "cuBLAS", floor_ms), f"{errors[name]:.1e}"] for name in graphs]
    print(f"\n{args.layers} layers of 4 projections (batch 1, bf16), {torch.cuda.get_device_name()}, torch "
          f"{torch.__version__}, triton {triton.__version__}; copy bandwidth {bandwidth / 1e12:.2f} TB/s; "
          f"floor {floor_ms:.3f} ms; {args.rounds} interleaved rounds")
    print_table(["variant", "ms", "x floor", "x cuBLAS", "spread", "rel err"], rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
