"""torch_ext::decode_linear's kernel paths against cuBLAS, on a chain of Llama-shaped projections.

    python bench/decode_linear_op.py [--rows 1,2,4,8] [--layers 16]

A chain of qkv 6144x2048 -> o 2048x2048 -> gate_up 11264x2048 -> down 2048x5632, bf16, `rows` rows
(each reading a fixed input: a kernel waits for the one before it all the same), in one CUDA graph: cuBLAS (torch.mm),
and the op's kernel on each path ("row"/"rows": weight tile times vectors; "dot": tensor cores),
with and without programmatic dependent launch. ms per chain (median of interleaved rounds), x floor
(weight bytes / copy bandwidth), x cuBLAS, and the relative error of one projection against float64.
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from decode import copy_bandwidth  # noqa: E402
from graphs import capture, interleaved, ratio_cells  # noqa: E402
from table import print_table  # noqa: E402

from torch_ext.hops.decode_linear import decode_linear_triton  # noqa: E402

SHAPES = [(6144, 2048), (2048, 2048), (11264, 2048), (2048, 5632)]  # (out, in) of qkv, o, gate_up, down


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--sweep-dot", action="store_true", help="the tensor-core path's launch configs, with PDL")
    ap.add_argument("--dot-configs", default="", help="features x columns x warps x stages,... (with PDL)")
    args = ap.parse_args()
    bandwidth = copy_bandwidth()
    weights = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") / k ** 0.5
               for _ in range(args.layers) for n, k in SHAPES]
    floor_ms = sum(w.numel() * 2 for w in weights) / bandwidth * 1e3
    table = []
    for rows in [int(r) for r in args.rows.split(",")]:
        inputs = {k: torch.randn(rows, k, dtype=torch.bfloat16, device="cuda") for k in {k for _, k in SHAPES}}
        vector_path = "row" if rows == 1 else "rows"
        variants = {"cuBLAS": lambda x, w: torch.mm(x, w.t())}
        for path in (vector_path, "dot"):
            for pdl in (False, True):
                variants[f"{path}{' pdl' if pdl else ''}"] = (
                    lambda x, w, path=path, pdl=pdl: decode_linear_triton(x, w, None, pdl, path))
        configs = list(itertools.product((16, 32), (256, 512), (4, 8), (2, 3, 4))) if args.sweep_dot else []
        configs += [tuple(int(v) for v in c.split("x")) for c in args.dot_configs.split(",") if c]
        if configs:
            for bn, bk, warps, stages in configs:
                cfg = dict(BLOCK_N=bn, BLOCK_K=bk, PRE_K=bk, num_warps=warps, num_stages=stages)
                variants[f"dot pdl n{bn} k{bk} w{warps} s{stages}"] = (
                    lambda x, w, cfg=cfg: decode_linear_triton(x, w, None, True, "dot", cfg))
        graphs, errors = {}, {}
        for name, linear in variants.items():
            def chain(linear=linear):
                for w in weights:
                    linear(inputs[w.shape[1]], w)
            try:
                y = linear(inputs[5632], weights[3])
                ref = inputs[5632].double() @ weights[3].double().t()
                errors[name] = ((y.double() - ref).norm() / ref.norm()).item()
                graphs[name], _ = capture(chain)
            except Exception as e:  # a config past the shared memory must not cost the others
                print(f"{rows} rows, {name}: {type(e).__name__}: {str(e)[:200]}")
        times = interleaved(graphs, args.rounds)
        for name in graphs:
            table.append([rows, name, *ratio_cells(times, name, "cuBLAS", floor_ms), f"{errors[name]:.1e}"])
    print(f"\n{args.layers} layers of 4 projections, bf16, {torch.cuda.get_device_name()}, torch {torch.__version__}; "
          f"copy bandwidth {bandwidth / 1e12:.2f} TB/s; floor {floor_ms:.3f} ms; {args.rounds} interleaved rounds")
    print_table(["rows", "variant", "ms", "x floor", "x cuBLAS", "spread", "rel err"], table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
