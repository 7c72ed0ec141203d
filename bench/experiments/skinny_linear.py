"""Would a Triton kernel for skinny linears (a decode step's few rows) beat cuBLAS? An experiment.

    python bench/experiments/skinny_linear.py [--rows 1,8,32] [--sweep] [--dtype bf16]

Shapes: the projections of bench/hf_decode.py's Llama with merged q/k/v and gate/up (N x K): qkv
6144x2048, o 2048x2048, gate_up 11264x2048, down 2048x5632, lm_head 32000x2048. Each call is timed as a
decode step sees it: back to back inside one CUDA graph, rotating over enough weight copies that none
is served from L2. Floor = weight bytes / device-to-device copy bandwidth measured here. --sweep tries
every tile config and prints the best per shape beside the default's.

The kernel: every program owns BLOCK_N output columns and walks K with all rows at once (one row:
products summed along K, no matrix unit; more rows: tl.dot with the rows padded to 16), so each weight
byte is read once. Measured (H100, torch 2.11, bench/results/skinny_linear_h100_torch2.11.log): the
best config per shape is 0.86-0.94x cuBLAS at one row, 0.89-1.0x at 8, 0.88-1.03x at 32, no single
config best everywhere. But inside a real decode step (bench/inference_floor.py --breakdown) cuBLAS
runs one layer's four projections in 47.5 us at one row against 50.9 us here, so the best configs
would save about 1 us per layer (2% of a step): not worth a custom op in torch_ext.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import os
import sys

import torch

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # bench/: the harness, the benchmarks
sys.path.insert(0, BENCH)
sys.path.insert(0, os.path.dirname(BENCH))

from harness import copy_bandwidth  # noqa: E402
from harness import print_table  # noqa: E402


@dataclasses.dataclass(frozen=True)
class SkinnyConfig:
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def default_config(rows: int, n: int, k: int) -> SkinnyConfig:
    """Tiles by the row count (--sweep measures the alternatives)."""
    if rows == 1:
        return SkinnyConfig(block_n=16, block_k=256, num_warps=4, num_stages=3)
    return SkinnyConfig(block_n=32, block_k=128, num_warps=4, num_stages=3)


def skinny_linear_triton(x, weight, bias, config: SkinnyConfig | None = None) -> torch.Tensor:
    import triton

    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    rows, n = x2.shape[0], weight.shape[0]
    config = config or default_config(rows, n, k)
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    block_m = 1 if rows == 1 else max(16, triton.next_power_of_2(rows))  # every row in one program
    _kernel()[(triton.cdiv(n, config.block_n),)](
        x2, weight, bias if bias is not None else weight, out, rows, n, k,
        x2.stride(0), x2.stride(1), weight.stride(0), weight.stride(1), out.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        num_warps=config.num_warps, num_stages=config.num_stages)
    return out.reshape(*x.shape[:-1], n)


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(x, w, bias, out, M, N, K, sx_m, sx_k, sw_n, sw_k, so_m,
               HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        cols_ok = cols < N
        ks = tl.arange(0, BLOCK_K)
        w_rows = w + cols[:, None].to(tl.int64) * sw_n
        if BLOCK_M == 1:
            # One row: products summed along K at the end, no matrix unit (it would idle 15/16).
            acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
            for k0 in range(0, K, BLOCK_K):
                kk = k0 + ks
                k_ok = kk < K
                wt = tl.load(w_rows + kk[None, :] * sw_k, mask=cols_ok[:, None] & k_ok[None, :], other=0.0)
                xv = tl.load(x + kk * sx_k, mask=k_ok, other=0.0)
                acc += wt.to(tl.float32) * xv.to(tl.float32)[None, :]
            result = tl.sum(acc, axis=1)[None, :]
            rows = tl.arange(0, 1)
        else:
            rows = tl.arange(0, BLOCK_M)
            rows_ok = rows < M
            result = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for k0 in range(0, K, BLOCK_K):
                kk = k0 + ks
                k_ok = kk < K
                wt = tl.load(w_rows + kk[None, :] * sw_k, mask=cols_ok[:, None] & k_ok[None, :], other=0.0)
                xt = tl.load(x + rows[:, None] * sx_m + kk[None, :] * sx_k, mask=rows_ok[:, None] & k_ok[None, :],
                             other=0.0)
                result += tl.dot(xt, tl.trans(wt))
        if HAS_BIAS:
            result += tl.load(bias + cols, mask=cols_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(out + rows[:, None] * so_m + cols[None, :], result.to(out.dtype.element_ty),
                 mask=(rows[:, None] < M) & cols_ok[None, :])

    return kernel


SHAPES = {"qkv": (6144, 2048), "o": (2048, 2048), "gate_up": (11264, 2048), "down": (2048, 5632),
          "lm_head": (32000, 2048)}
ROTATE_BYTES = 256 * 2**20  # several times an H100's 50 MB L2


def per_call_us(fn, weights, x) -> float:
    """Median us of one call, from replays of a graph that calls fn once per weight copy."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for w in weights[:2]:
            fn(x, w)  # compile / warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in weights:
            fn(x, w)
    times = []
    for _ in range(7):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(weights))
    return sorted(times)[len(times) // 2]


def sweep_configs(rows: int):
    for bn, bk, warps, stages in itertools.product((8, 16, 32, 64), (128, 256, 512), (4, 8), (2, 4)):
        if rows > 1 and bn < 16:
            continue
        if bn * bk > 64 * 256:  # more registers than a program has
            continue
        yield SkinnyConfig(bn, bk, warps, stages)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,8,32")
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench/experiments/skinny_linear.py needs a CUDA GPU.")
        return 0
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    bandwidth = copy_bandwidth()
    rows_list = [int(r) for r in args.rows.split(",")]
    table, best_configs = [], []
    for name, (n, k) in SHAPES.items():
        w_bytes = n * k * dtype.itemsize
        copies = max(4, -(-ROTATE_BYTES // w_bytes))
        weights = [torch.randn(n, k, device="cuda", dtype=dtype) / k**0.5 for _ in range(copies)]
        for rows in rows_list:
            x = torch.randn(rows, k, device="cuda", dtype=dtype)
            ref = torch.nn.functional.linear(x.double(), weights[0].double())
            got = skinny_linear_triton(x, weights[0], None)
            err = ((got.double() - ref).norm() / ref.norm()).item()
            floor = (w_bytes + rows * (n + k) * dtype.itemsize) / bandwidth * 1e6
            cublas = per_call_us(lambda a, w: torch.nn.functional.linear(a, w), weights, x)
            mine = per_call_us(lambda a, w: skinny_linear_triton(a, w, None), weights, x)
            row = [name, rows, f"{floor:.1f}", f"{cublas:.1f}", f"{cublas / floor:.2f}", f"{mine:.1f}",
                   f"{mine / floor:.2f}", f"{mine / cublas:.2f}", f"{err:.1e}"]
            if args.sweep:
                results = []
                for cfg in sweep_configs(rows):
                    try:
                        us = per_call_us(lambda a, w, c=cfg: skinny_linear_triton(a, w, None, c), weights, x)
                    except Exception as e:  # a config the compiler refuses (registers, shared memory)
                        print(f"  {name} rows {rows} {cfg}: {type(e).__name__}", file=sys.stderr)
                        continue
                    results.append((us, cfg))
                us, cfg = min(results, key=lambda r: r[0])
                row += [f"{us:.1f}", f"{us / floor:.2f}", f"{cfg.block_n}/{cfg.block_k}/{cfg.num_warps}/{cfg.num_stages}"]
                best_configs.append((name, rows, cfg, sorted(results, key=lambda r: r[0])[:5]))
            table.append(row)
            print(" ".join(str(c) for c in row), flush=True)
        del weights
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, {args.dtype}; copy bandwidth "
          f"{bandwidth / 1e12:.2f} TB/s; us per call inside a CUDA graph, weights rotated past L2")
    header = ["shape", "rows", "floor us", "cuBLAS us", "x floor", "triton us", "x floor", "x cuBLAS", "rel err"]
    if args.sweep:
        header += ["best us", "x floor", "best BN/BK/warps/stages"]
    print_table(header, table)
    if args.sweep:
        print("\nTop five configs per shape (us, BN/BK/warps/stages):")
        for name, rows, _, top in best_configs:
            print(f"  {name:8s} rows {rows:3d}: " + ", ".join(
                f"{us:.1f} {c.block_n}/{c.block_k}/{c.num_warps}/{c.num_stages}" for us, c in top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
