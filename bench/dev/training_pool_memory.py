"""Where a training step's reserved GPU memory goes, by allocator pool (issue 46: training_cudagraphs).

    python bench/dev/training_pool_memory.py [--columns inductor,ext-split,ext-split-cg] [--batch 8 --seq 512]

Each column in a fresh process (one caching allocator and one CUDA-graph pool per column), the model of
bench/checkpoint_training.py (HF Llama, gradient checkpointing on unless --checkpoint off), a few steps
with zero_grad() between them. Printed per column, in MiB above what the process held with the model
loaded: peak reserved; the peak of two more steps after `torch.cuda.empty_cache()` (what the steps need
once compiled and recorded; the first steps' compiles and the trees' warm-up runs are behind it); the
reserved memory at the end by pool (the ordinary allocator; CUDA-graph pools, which keep their size once
recorded), with how much of each is in use then; and torch_ext's counter of gradients copied out of the pool.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

MiB = 2**20


def one(args) -> dict:
    import checkpoint_training as T
    from torch_ext.backend.counters import counters

    model, batch, run, loss_of = T.on_gpu(args, getattr(torch, args.dtype), args.model, args.checkpoint == "on",
                                          args.column)
    torch.cuda.synchronize()
    base = torch.cuda.memory_reserved()
    torch.cuda.reset_peak_memory_stats()
    T.train_steps(model, run, batch, loss_of, args.steps)
    peak = (torch.cuda.max_memory_reserved() - base) / MiB
    # Steady state: what the steps need once compiled and recorded (compiles, Inductor's benchmarking
    # and the trees' warm-up runs happen in the first steps, some in the ordinary allocator).
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    if args.history:
        torch.cuda.memory._record_memory_history(max_entries=200000, stacks="python")
    T.train_steps(model, run, batch, loss_of, 2)
    snapshot = torch.cuda.memory._snapshot()
    at_peak = ordinary_at_peak(snapshot, args.history) if args.history else []
    pools: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    for segment in snapshot["segments"]:
        pool = tuple(segment.get("segment_pool_id", (0, 0)))
        name = "ordinary" if pool == (0, 0) else f"graph pool {pool}"
        pools[name][0] += segment["total_size"]
        pools[name][1] += segment["active_size"]
    return {"peak_reserved": peak, "steady_peak_reserved": (torch.cuda.max_memory_reserved() - base) / MiB,
            "pools": {k: [v[0] / MiB, v[1] / MiB] for k, v in sorted(pools.items())},
            "gradients_moved": counters.pool_gradients_moved, "ordinary_at_peak": at_peak}


def _where(frames) -> str:
    for f in frames:
        name = f.get("filename", "")
        if any(k in name for k in ("torch_ext/", "transformers/", "checkpoint_models", "_inductor/", "autograd/")):
            return f"{name.split('site-packages/')[-1].split('/work/')[-1]}:{f.get('line')} {f.get('name')}"
    return f"{frames[0].get('filename', '?')}:{frames[0].get('line')} {frames[0].get('name')}" if frames else "?"


def ordinary_at_peak(snapshot: dict, top: int) -> list:
    """The ordinary allocator's live blocks at its highest point in the recorded steps, by where
    they were allocated (the largest `top` groups, MiB)."""
    ordinary = [(s["address"], s["address"] + s["total_size"]) for s in snapshot["segments"]
                if tuple(s.get("segment_pool_id", (0, 0))) == (0, 0)]
    # Only blocks allocated while recording count: the weights, allocated before, are left out.
    live: dict[int, tuple[int, str]] = {}
    best, best_live, total = -1, {}, 0
    for event in snapshot["device_traces"][torch.cuda.current_device()]:
        addr = event["addr"]
        if not any(lo <= addr < hi for lo, hi in ordinary):
            continue
        if event["action"] == "alloc":
            live[addr] = (event["size"], _where(event.get("frames", [])))
            total += event["size"]
            if total > best:
                best, best_live = total, dict(live)
        elif event["action"] == "free_completed" and addr in live:
            total -= live.pop(addr)[0]
    groups: dict[str, int] = collections.Counter()
    for size, where in best_live.values():
        groups[where] += size
    return [(where, size / MiB) for where, size in groups.most_common(top)]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--columns", default="inductor,ext-split,ext-split-cg")
    p.add_argument("--model", default="hf-llama", choices=("hf-llama", "custom-op"))
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--checkpoint", default="on", choices=("on", "off"))
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--history", type=int, default=0,
                   help="also print the N largest groups of ordinary-allocator blocks live at its peak")
    p.add_argument("--column", default=None, help=argparse.SUPPRESS)  # the child process
    args = p.parse_args()
    if args.column:
        print(json.dumps(one(args)))
        return
    print(f"# {' '.join(sys.argv)}; torch {torch.__version__}, {torch.cuda.get_device_name()}")
    print("| column | peak reserved MiB | after empty_cache(), 2 more steps | pool: reserved MiB (in use at the end) "
          "| gradients moved |")
    print("|---|---|---|---|---|")
    for column in args.columns.split(","):
        argv = [sys.executable, os.path.abspath(__file__), "--column", column] + sys.argv[1:]
        done = subprocess.run(argv, stdout=subprocess.PIPE, text=True)
        lines = done.stdout.strip().splitlines()
        if done.returncode or not lines:
            print(f"| {column} | failed ({done.returncode}) | | | |")
            continue
        r = json.loads(lines[-1])
        pools = "; ".join(f"{k}: {v[0]:.0f} ({v[1]:.0f})" for k, v in r["pools"].items())
        print(f"| {column} | {r['peak_reserved']:.0f} | {r['steady_peak_reserved']:.0f} | {pools} | "
              f"{r['gradients_moved']} |")
        for where, mib in r["ordinary_at_peak"]:
            print(f"|   ordinary at its peak | {mib:.1f} MiB | {where} | | |")


if __name__ == "__main__":
    main()
