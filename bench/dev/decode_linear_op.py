"""torch_ext::decode_linear's kernel paths against cuBLAS, on a chain of Llama-shaped projections.

    python bench/dev/decode_linear_op.py [--rows 1,2,4,8] [--layers 16] [--shapes qkv,o] [--paths row,mma]
                                     [--mma-configs 1x16x2,1x8x1] [--mlp]

A chain of qkv 6144x2048 -> o 2048x2048 -> gate_up 11264x2048 -> down 2048x5632, bf16, `rows` rows
(each reading a fixed input: a kernel waits for the one before it all the same), in one CUDA graph: cuBLAS (torch.mm),
and the op's kernels ("row": the Triton GEMV, one row only; "mma": the CUDA path for a few rows,
kernels/decode_linear_mma.py),
with and without programmatic dependent launch. ms per chain (median of interleaved rounds), x floor
(weight bytes / copy bandwidth), x cuBLAS, and the relative error of one projection against float64.
--mlp: a chain of gated MLPs instead, each reading the one before (h = h + down(silu(gate) * up) of
gate_up(h)): cuBLAS with eager's silu and mul, the CUDA path with them (two eager kernels between
the projections), and the CUDA path with its gate epilogue (none between them).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # bench/: the harness, the benchmarks
sys.path.insert(0, BENCH)
sys.path.insert(0, os.path.dirname(BENCH))

from harness import copy_bandwidth  # noqa: E402
from harness import capture, interleaved, ratio_cells  # noqa: E402
from harness import print_table  # noqa: E402

from torch_ext.kernels.decode_linear import decode_linear_triton  # noqa: E402
from torch_ext.kernels.decode_linear_mma import decode_linear_mma, variant_attributes  # noqa: E402

SHAPES = {"qkv": (6144, 2048), "o": (2048, 2048), "gate_up": (11264, 2048), "down": (2048, 5632),
          "lm_head": (32000, 2048)}  # (out, in); the default chain leaves lm_head out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--mma-configs", default="", help="the CUDA path's m-tiles x warps x chunks in flight[x x mode: 1 x a round ahead, 2 the ordered pipeline, 3 the same with x through shared memory],... (with PDL)")
    ap.add_argument("--shapes", default="qkv,o,gate_up,down", help="which projections the chain holds")
    ap.add_argument("--paths", default="row,mma", help="which of the op's kernels to time beside cuBLAS")
    ap.add_argument("--mlp", action="store_true", help="a chain of gated MLPs, each reading the one before")
    ap.add_argument("--gate-pads", default="", help="with --mlp: gated variants whose up rows start this many rows "
                    "after the gate's (DRAM placement of the two halves),...")
    ap.add_argument("--x-broadcast", action="store_true",
                    help="diagnostic: every row of x reads the same row (stride 0), so x's bytes come from L1; "
                         "against a normal run, what reading x costs the kernel")
    args = ap.parse_args()
    if args.mlp:
        return mlp_chain(args)
    shapes = [SHAPES[s] for s in args.shapes.split(",")]
    bandwidth = copy_bandwidth()
    weights = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") / k ** 0.5
               for _ in range(args.layers) for n, k in shapes]
    floor_ms = sum(w.numel() * 2 for w in weights) / bandwidth * 1e3
    table = []
    for rows in [int(r) for r in args.rows.split(",")]:
        inputs = {k: (torch.randn(1, k, dtype=torch.bfloat16, device="cuda").expand(rows, k) if args.x_broadcast
                      else torch.randn(rows, k, dtype=torch.bfloat16, device="cuda")) for k in {k for _, k in shapes}}
        variants = {"cuBLAS": lambda x, w: torch.mm(x, w.t())}
        paths = [p for p in args.paths.split(",") if p and (p != "row" or rows == 1)]
        configs = {}
        for path in paths:
            for pdl in (False, True):
                variants[f"{path}{' pdl' if pdl else ''}"] = (
                    (lambda x, w, pdl=pdl: decode_linear_mma(x, w, None, pdl)) if path == "mma" else
                    (lambda x, w, pdl=pdl: decode_linear_triton(x, w, None, pdl)))
        for c in (c for c in args.mma_configs.split(",") if c):
            cfg = tuple(int(v) for v in c.split("x"))  # m-tiles x warps x chunks [x x mode: 1 ahead, 2 ordered]
            label = f"mma pdl m{cfg[0]} w{cfg[1]} u{cfg[2]}" + {(1,): " xpf", (2,): " ord", (3,): " ord-smem"}.get(cfg[3:], "")
            variants[label] = lambda x, w, cfg=cfg: decode_linear_mma(x, w, None, True, config=cfg)
            configs[label] = cfg
        graphs, errors = {}, {}
        for name, linear in variants.items():
            def chain(linear=linear):
                for w in weights:
                    linear(inputs[w.shape[1]], w)
            try:
                y = linear(inputs[weights[-1].shape[1]], weights[-1])
                ref = inputs[weights[-1].shape[1]].double() @ weights[-1].double().t()
                errors[name] = ((y.double() - ref).norm() / ref.norm()).item()
                graphs[name], _ = capture(chain)
            except Exception as e:  # a config past the shared memory must not cost the others
                print(f"{rows} rows, {name}: {type(e).__name__}: {str(e)[:200]}")
        times = interleaved(graphs, args.rounds)
        for name in graphs:
            table.append([rows, name, *ratio_cells(times, name, "cuBLAS", floor_ms), f"{errors[name]:.1e}",
                          occupancy(configs.get(name), rows, shapes) if name != "cuBLAS" else ""])
    print(f"\n{args.layers} layers of {args.shapes}, bf16, {torch.cuda.get_device_name()}, torch {torch.__version__}; "
          f"copy bandwidth {bandwidth / 1e12:.2f} TB/s; floor {floor_ms:.3f} ms; {args.rounds} interleaved rounds")
    print_table(["rows", "variant", "ms", "x floor", "x cuBLAS", "spread", "rel err",
                 "regs / blocks an SM (first shape)"], table)
    return 0


def occupancy(config, rows: int, shapes) -> str:
    """Registers a thread and blocks an SM of the CUDA path's kernel for the chain's first shape."""
    n, k = shapes[0]
    x = torch.empty(rows, k, dtype=torch.bfloat16, device="cuda")
    a = variant_attributes(x, torch.empty(n, k, dtype=torch.bfloat16, device="cuda"), config)
    return f"{a['registers']} / {a['blocks an SM']}" if a else "-"


def mlp_chain(args) -> int:
    bandwidth = copy_bandwidth()
    (n_gu, k), (_, k_down) = SHAPES["gate_up"], SHAPES["down"]
    layers = [(torch.randn(n_gu, k, dtype=torch.bfloat16, device="cuda") / k ** 0.5,
               torch.randn(k, k_down, dtype=torch.bfloat16, device="cuda") * 0.01 / k_down ** 0.5)  # h stays O(1)
              for _ in range(args.layers)]
    floor_ms = sum(a.numel() * 2 + b.numel() * 2 for a, b in layers) / bandwidth * 1e3
    gate = [0, n_gu // 2, n_gu // 2]

    def eager_gate(y):
        return torch.nn.functional.silu(y[:, :n_gu // 2]) * y[:, n_gu // 2:]

    variants = {
        "cuBLAS": lambda h, wgu, wd: torch.addmm(h, eager_gate(torch.mm(h, wgu.t())), wd.t()),
        "mma pdl, eager gate": lambda h, wgu, wd: decode_linear_mma(
            eager_gate(decode_linear_mma(h, wgu, None, True)), wd, None, True, residual=h),
        "mma pdl gate": lambda h, wgu, wd: decode_linear_mma(
            decode_linear_mma(h, wgu, None, True, gate=gate), wd, None, True, residual=h),
    }
    for pad in (int(p) for p in args.gate_pads.split(",") if p):  # up's rows `pad` rows further on
        padded = {id(wgu): torch.cat([wgu[:n_gu // 2], wgu.new_zeros(pad, k), wgu[n_gu // 2:]]) for wgu, _ in layers}
        variants[f"mma pdl gate, up {pad} rows on"] = lambda h, wgu, wd, padded=padded, pad=pad: decode_linear_mma(
            decode_linear_mma(h, padded[id(wgu)], None, True, gate=[0, n_gu // 2 + pad, n_gu // 2]), wd, None, True,
            residual=h)
    for c in (c for c in args.mma_configs.split(",") if c):  # configs for the gated gate/up kernel
        cfg = tuple(int(v) for v in c.split("x"))
        variants[f"mma pdl gate, gate/up {c}"] = lambda h, wgu, wd, cfg=cfg: decode_linear_mma(
            decode_linear_mma(h, wgu, None, True, gate=gate, config=cfg), wd, None, True, residual=h)
    table = []
    for rows in [int(r) for r in args.rows.split(",")]:
        start = torch.randn(rows, k, dtype=torch.bfloat16, device="cuda")
        graphs, outs = {}, {}
        for name, mlp in variants.items():
            def chain(mlp=mlp):
                h = start
                for wgu, wd in layers:
                    h = mlp(h, wgu, wd)
                return h
            graphs[name], outs[name] = capture(chain)
        times = interleaved(graphs, args.rounds)
        for name in graphs:
            graphs[name].replay()
            err = ((outs[name].double() - outs["cuBLAS"].double()).norm() / outs["cuBLAS"].double().norm()).item()
            table.append([rows, name, *ratio_cells(times, name, "cuBLAS", floor_ms), f"{err:.1e}"])
    print(f"\n{args.layers} gated MLPs 2048 -> 2x5632 -> 2048, bf16, {torch.cuda.get_device_name()}, torch "
          f"{torch.__version__}; copy bandwidth {bandwidth / 1e12:.2f} TB/s; floor {floor_ms:.3f} ms; {args.rounds} "
          f"interleaved rounds")
    print_table(["rows", "variant", "ms", "x floor", "x cuBLAS", "spread", "rel err (vs cuBLAS)"], table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
