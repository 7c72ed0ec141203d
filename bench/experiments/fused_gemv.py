"""Would fusing a decode step's small kernels into its GEMVs pay? An experiment for issue 25, item 5.

    python bench/experiments/fused_gemv.py [--rows 1,8,32] [--dtype bf16] [--check]

A decode step of bench/inference_floor.py's Llama spends ~170 us of 1145 in ~150 small kernels between
its GEMMs (bench/results/inference_floor_breakdown_h100_torch2.11.log): per layer two RMSNorms
(one with the residual add) and silu(gate) * up, each ~1.2-2 us. Two prototypes fold them into the
GEMV that reads their output, so they cost no launch and no round trip through memory:

  norm_linear(x, g, w):      rms_norm(x) * g @ w.T. Each program walks K accumulating both
                             sum(x^2) and (x * g) . w, and scales by rsqrt(mean + eps) at the end
                             (the factor is per row, so it commutes with the dot product).
  silu_mul_linear(gu, w):    (silu(gate) * up) @ w.T for gu = [gate | up], as gate_up's merged output.

Each is timed against what torch_ext runs now, the same function compiled by Inductor (a fused norm
or pointwise kernel, then cuBLAS), both inside one CUDA graph, back to back, rotating weights past L2
(bench/experiments/skinny_linear.py's harness). Shapes: norm + qkv (6144x2048), norm + gate_up (11264x2048),
silu_mul + down (2048x5632). --check compares the prototypes with a float64 reference (on the CPU
under TRITON_INTERPRET=1 too: fp16 for rows > 1, the interpreter's bf16 matrix product is wrong).
"""
from __future__ import annotations

import argparse
import functools
import os
import sys

import torch

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # bench/: the harness, the benchmarks
sys.path.insert(0, BENCH)

EPS = 1e-5


def rms_norm(x, g, eps: float = EPS):
    """HF's LlamaRMSNorm: float32 statistics, rounded to x's dtype before the weight."""
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * g


def silu_mul(gu):
    gate, up = gu.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def _launch(x, w, extra, up_offset: int, norm: bool, block_n: int, block_k: int, num_warps: int = 4,
            num_stages: int = 2):
    import triton

    rows, n = x.shape[0], w.shape[0]
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    block_m = 1 if rows == 1 else max(16, triton.next_power_of_2(rows))
    _kernel()[(triton.cdiv(n, block_n),)](x, w, extra, out, rows, n, w.shape[1], x.stride(0), w.stride(0), out.stride(0),
                                          up_offset, EPS, NORM=norm, BLOCK_M=block_m, BLOCK_N=block_n,
                                          BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages)
    return out


def norm_linear(x, g, w, block_n: int | None = None, block_k: int | None = None):
    rows = x.shape[0]
    return _launch(x, w, g, 0, True, block_n or (8 if rows == 1 else 32), block_k or (512 if rows == 1 else 128))


def silu_mul_linear(gu, w, block_n: int | None = None, block_k: int | None = None):
    rows = gu.shape[0]
    return _launch(gu, w, gu, gu.shape[1] // 2, False, block_n or (8 if rows == 1 else 16), block_k or 512)


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    # out = prologue(x) @ w.T; NORM: rms_norm(x) * g (scaled at the end), else silu(x[:, :UP]) * x[:, UP:].
    @triton.jit
    def fused_gemv_kernel(x, w, g, out, M, N, K, sx_m, sw_n, so_m, UP, eps, NORM: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        cols_ok = cols < N
        rows = tl.arange(0, BLOCK_M)
        rows_ok = rows < M
        ks = tl.arange(0, BLOCK_K)
        if BLOCK_M == 1:
            acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        else:
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        ss = tl.zeros([BLOCK_M], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + ks
            k_ok = kk < K
            at = rows_ok[:, None] & k_ok[None, :]
            xt = tl.load(x + rows[:, None] * sx_m + kk[None, :], mask=at, other=0.0).to(tl.float32)
            if NORM:
                ss += tl.sum(xt * xt, axis=1)
                h = xt * tl.load(g + kk, mask=k_ok, other=0.0).to(tl.float32)[None, :]
            else:
                up = tl.load(x + rows[:, None] * sx_m + UP + kk[None, :], mask=at, other=0.0).to(tl.float32)
                h = xt * tl.sigmoid(xt) * up
            wt = tl.load(w + cols[:, None].to(tl.int64) * sw_n + kk[None, :], mask=cols_ok[:, None] & k_ok[None, :],
                         other=0.0)
            if BLOCK_M == 1:  # one row: products summed along K at the end, no matrix unit
                acc += wt.to(tl.float32) * h
            else:
                acc = tl.dot(h.to(wt.dtype), tl.trans(wt), acc)
        if BLOCK_M == 1:
            result = tl.sum(acc, axis=1)[None, :]
        else:
            result = acc
        if NORM:  # the norm's factor is per row: it commutes with the dot product
            result = result * tl.rsqrt(ss / K + eps)[:, None]
        tl.store(out + rows[:, None] * so_m + cols[None, :], result.to(out.dtype.element_ty),
                 mask=rows_ok[:, None] & cols_ok[None, :])

    return fused_gemv_kernel


def check(device: str, dtype_rows: list[tuple[torch.dtype, int]]) -> float:
    """Worst relative error of the prototypes against float64 references; raises past 1e-2."""
    worst = 0.0
    torch.manual_seed(0)
    for dtype, rows in dtype_rows:
        x = torch.randn(rows, 200, dtype=dtype, device=device)
        g = torch.rand(200, dtype=dtype, device=device) + 0.5
        w = (torch.randn(70, 200, device=device) / 200**0.5).to(dtype)
        gu = torch.randn(rows, 2 * 200, dtype=dtype, device=device)
        cases = [(norm_linear(x, g, w, 16, 64),
                  torch.nn.functional.linear(rms_norm(x.double(), g.double()), w.double())),
                 (silu_mul_linear(gu, w, 16, 64), torch.nn.functional.linear(silu_mul(gu.double()), w.double()))]
        for got, want in cases:
            err = ((got.double() - want).norm() / want.norm()).item()
            if not err < 1e-2:
                raise AssertionError(f"{dtype} rows {rows}: relative error {err:.2e}")
            worst = max(worst, err)
    return worst


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,8,32")
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    parser.add_argument("--check", action="store_true", help="only the float64 check (CPU: TRITON_INTERPRET=1)")
    args = parser.parse_args()
    if args.check:
        if torch.cuda.is_available():
            cases = [(torch.bfloat16, 1), (torch.bfloat16, 8), (torch.float16, 32)]
        else:
            cases = [(torch.bfloat16, 1), (torch.float16, 3), (torch.float16, 17)]
        print(f"worst relative error {check('cuda' if torch.cuda.is_available() else 'cpu', cases):.1e}")
        return 0
    if not torch.cuda.is_available():
        print("bench/experiments/fused_gemv.py needs a CUDA GPU (or --check under TRITON_INTERPRET=1).")
        return 0
    from harness import copy_bandwidth
    from skinny_linear import ROTATE_BYTES, per_call_us
    from harness import print_table

    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    bandwidth = copy_bandwidth()
    print(f"check: worst relative error {check('cuda', [(dtype, r) for r in (1, 8, 32)]):.1e}")
    cases = {"norm + qkv": ("norm", 6144, 2048), "norm + gate_up": ("norm", 11264, 2048),
             "silu_mul + down": ("silu", 2048, 5632)}
    unfused = {"norm": torch.compile(lambda x, g, w: torch.nn.functional.linear(rms_norm(x, g), w), dynamic=False),
               "silu": torch.compile(lambda gu, w: torch.nn.functional.linear(silu_mul(gu), w), dynamic=False)}
    table = []
    for name, (kind, n, k) in cases.items():
        weights = [torch.randn(n, k, device="cuda", dtype=dtype) / k**0.5
                   for _ in range(max(4, -(-ROTATE_BYTES // (n * k * dtype.itemsize))))]
        g = torch.rand(k, device="cuda", dtype=dtype) + 0.5
        for rows in [int(r) for r in args.rows.split(",")]:
            x = torch.randn(rows, k if kind == "norm" else 2 * k, device="cuda", dtype=dtype)
            if kind == "norm":
                base = per_call_us(lambda a, w: unfused["norm"](a, g, w), weights, x)
                mine = per_call_us(lambda a, w: norm_linear(a, g, w), weights, x)
            else:
                base = per_call_us(lambda a, w: unfused["silu"](a, w), weights, x)
                mine = per_call_us(lambda a, w: silu_mul_linear(a, w), weights, x)
            floor = n * k * dtype.itemsize / bandwidth * 1e6
            table.append([name, rows, f"{floor:.1f}", f"{base:.1f}", f"{base / floor:.2f}", f"{mine:.1f}",
                          f"{mine / floor:.2f}", f"{mine / base:.2f}"])
        del weights
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, {args.dtype}; copy bandwidth "
          f"{bandwidth / 1e12:.2f} TB/s; us per call inside a CUDA graph, weights rotated past L2")
    print_table(["case", "rows", "floor us", "Inductor + cuBLAS us", "x floor", "fused us", "x floor",
                 "fused / unfused"], table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
