"""Regional compilation under CUDA graphs: identical decoder MLP blocks compiled one by one (the
pattern PyTorch recommends to cut compile time), one decode-sized step through all of them.

    python bench/dev/regional_cudagraphs.py [--layers 16] [--batch 8] [--rounds 3] [--iters 20]

Blocks: RMSNorm + gate/up/down MLP, hidden 2048, MLP 5632, bf16 (a Llama layer without attention).
Columns, ms per step (CUDA events, median of interleaved rounds) and x floor (weight bytes / copy
bandwidth):
  eager        the blocks as written
  ro           each block torch.compile(mode="reduce-overhead") (CUDA graph trees record one graph
               per set of parameter addresses)
  ext-none     each block torch_ext.compile(block, cfg), one CompileConfig(cudagraph_mode="none")
  ext-full     the same with cudagraph_mode="full": one graph per weight set (runtime/cudagraph/group.py)
  ext-full-1   ext-full keeping one weight set (MAX_WEIGHT_SETS=1): a layer switch captures again,
               what torch_ext did before weight sets
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # bench/: the harness, the benchmarks
sys.path.insert(0, BENCH)
sys.path.insert(0, os.path.dirname(BENCH))

from harness import print_table  # noqa: E402


class Block(torch.nn.Module):
    def __init__(self, hidden=2048, mlp=5632):
        super().__init__()
        self.norm = torch.nn.RMSNorm(hidden)
        self.gate, self.up = torch.nn.Linear(hidden, mlp, bias=False), torch.nn.Linear(hidden, mlp, bias=False)
        self.down = torch.nn.Linear(mlp, hidden, bias=False)

    def forward(self, h):
        x = self.norm(h)
        return h + self.down(torch.nn.functional.silu(self.gate(x)) * self.up(x))


def build(column: str, blocks):
    import torch_ext
    from torch_ext.backend import CompileConfig
    from torch_ext.backend.runtime.cudagraph import group

    if column == "eager":
        return list(blocks)
    if column == "ro":
        return [torch.compile(b, mode="reduce-overhead") for b in blocks]
    mode = "none" if column == "ext-none" else "full"
    cfg = CompileConfig(cache_dir=None, cudagraph_mode=mode, cudagraph_capture_sizes=(1, 8, 32), progress_bar=False)
    fns = [torch_ext.compile(b, cfg) for b in blocks]
    if column == "ext-full-1":
        limit = group.MAX_WEIGHT_SETS

        def step_with_one_set(fn):
            def call(h):
                group.MAX_WEIGHT_SETS = 1
                try:
                    return fn(h)
                finally:
                    group.MAX_WEIGHT_SETS = limit
            return call
        fns = [step_with_one_set(fn) for fn in fns]
    return fns


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--columns", default="eager,ro,ext-none,ext-full,ext-full-1")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench/dev/regional_cudagraphs.py needs a CUDA GPU.")
        return 0
    from harness import copy_bandwidth
    from torch_ext.backend.runtime.cudagraph.stats import cudagraph_stats

    torch.manual_seed(0)
    blocks = [Block().cuda().to(torch.bfloat16).eval() for _ in range(args.layers)]
    x = torch.randn(args.batch, 2048, device="cuda", dtype=torch.bfloat16)
    columns = args.columns.split(",")
    with torch.no_grad():
        reference = x
        for b in blocks:
            reference = b(reference)
        fns, errors = {}, {}

        def step(column):
            if column == "ro":  # a new step: CUDA graph trees may reuse the last step's outputs
                torch.compiler.cudagraph_mark_step_begin()
            h = x
            for fn in fns[column]:
                h = fn(h)
            return h

        for column in columns:
            fns[column] = build(column, blocks)
            for _ in range(3):  # warm-up and capture
                h = step(column)
            errors[column] = (h.float() - reference.float()).abs().max().item()
        times = {c: [] for c in columns}
        cudagraph_stats.reset()
        for _ in range(args.rounds):
            for column in columns:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(args.iters):
                    step(column)
                end.record()
                end.synchronize()
                times[column].append(start.elapsed_time(end) / args.iters)
    weight_bytes = sum(p.numel() * p.element_size() for b in blocks for p in b.parameters())
    floor = weight_bytes / copy_bandwidth() * 1e3
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; {args.layers} blocks 2048x5632 bf16 compiled one "
          f"by one, batch {args.batch}; floor {floor:.3f} ms (weights / copy bandwidth); {args.rounds} interleaved "
          f"rounds of {args.iters} steps; captures during timing: {cudagraph_stats.captures}")
    rows = []
    for column in columns:
        ms = statistics.median(times[column])
        rows.append([column, f"{ms:.3f}", f"{ms / floor:.2f}", f"{errors[column]:.1e}"])
    print_table(["column", "ms per step", "x floor", "max |out - eager|"], rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
