"""What avoiding torch's region-gradient bug costs (torch_ext/workarounds.py, bug 1), on the CPU.

    python bench/dev/workaround_cost.py [--blocks 8] [--dim 512] [--batch 64] [--steps 20] [--rounds 5]

A training step (forward + backward) of a chain of residual nested_compile_region blocks, compiled
with Inductor twice in one process, each compile in a fresh Inductor cache:
  torch default      allow_buffer_reuse / inplace_buffers on: what vanilla torch does (its input
                     gradient is WRONG for chains of 4+ such blocks on 2.13 and 2.14.1; the table
                     shows the error)
  torch_ext          the same graph with torch_ext.install(): both off for graphs that call regions
Step times are medians over interleaved rounds; ratios are to the torch default column.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
from torch import nn

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # bench/: the harness, the benchmarks
sys.path.insert(0, BENCH)
sys.path.insert(0, os.path.join(BENCH, ".."))

import torch_ext  # noqa: E402
from harness import print_table  # noqa: E402


class Block(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.up, self.down = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    @torch.compiler.nested_compile_region
    def forward(self, h, residual):
        r = h + residual
        return self.down(torch.relu(self.up(r))).relu(), r


class Chain(nn.Module):
    def __init__(self, blocks: int, dim: int):
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim) for _ in range(blocks))

    def forward(self, x):
        h, residual = x, torch.zeros_like(x)
        for block in self.blocks:
            h, residual = block(h, residual)
        return (h + residual).sum()


def step(fn, model, x):
    loss = fn(x)
    return torch.autograd.grad(loss, [x, *model.parameters()])


def compiled_step(model, x, with_torch_ext: bool):
    """Compile in a fresh Inductor cache; returns (step fn, compile seconds, max error of x's grad)."""
    torch._dynamo.reset()
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="torch_ext_bench_")
    (torch_ext.install if with_torch_ext else torch_ext.uninstall)()
    compiled = torch.compile(model, fullgraph=True)
    start = time.perf_counter()
    grads = step(compiled, model, x)
    seconds = time.perf_counter() - start
    expected = step(model, model, x)
    error = ((grads[0] - expected[0]).abs().max() / expected[0].abs().max()).item()
    return (lambda: step(compiled, model, x)), seconds, error


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--torch-ext-first", action="store_true", help="compile the torch_ext column first "
                        "(the second compile of a process is faster: run both orders)")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = Chain(args.blocks, args.dim)
    x = torch.randn(args.batch, args.dim, requires_grad=True)
    torch.compile(lambda t: t.relu() + 1)(x.detach())  # Inductor's one-time start-up, outside the columns
    peers = {}
    order = [("torch default", False), ("torch_ext", True)]
    for name, with_torch_ext in (order[::-1] if args.torch_ext_first else order):
        peers[name] = compiled_step(model, x, with_torch_ext)
    peers = {name: peers[name] for name, _ in order}
    times = {name: [] for name in peers}
    for _ in range(args.rounds):
        for name, (run, _, _) in peers.items():
            run()
            start = time.perf_counter()
            for _ in range(args.steps):
                run()
            times[name].append((time.perf_counter() - start) / args.steps * 1e3)
    base = statistics.median(times["torch default"])
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {args.blocks} blocks, dim {args.dim}, "
          f"batch {args.batch}; {args.rounds} interleaved rounds of {args.steps} steps; compiled "
          f"{'torch_ext' if args.torch_ext_first else 'torch default'} first")
    rows = []
    for name, (_, seconds, error) in peers.items():
        ms = statistics.median(times[name])
        rows.append([name, f"{seconds:.1f}", f"{ms:.2f}", f"{ms / base:.2f}", f"{error:.1e}"])
    print_table(["peer", "compile s", "step ms", "x default", "x.grad error (rel.)"], rows)


if __name__ == "__main__":
    main()
