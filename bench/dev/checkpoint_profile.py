"""Where a checkpointed training step's time goes: torch.profiler over a few steps per column of
bench/checkpoint_training.py (same models and flags), top ops by device time and host time.

    python bench/dev/checkpoint_profile.py --device cuda --columns inductor,ext-split [--model hf-llama]
"""
from __future__ import annotations

import argparse
import os
import sys

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # bench/: the harness, the benchmarks
sys.path.insert(0, BENCH)

import torch  # noqa: E402

import checkpoint_training as ct  # noqa: E402  (puts the repository and tests/ on sys.path)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda")
    p.add_argument("--model", default="hf-llama")
    p.add_argument("--columns", default="inductor,ext-split")
    ct.model_arguments(p, layers=8, hidden=1024, heads=16, vocab=32000, batch=8, seq=512)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--top", type=int, default=18)
    p.add_argument("--host", action="store_true", help="cProfile the host side instead (Python frames)")
    args = p.parse_args()
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model, batch, op, loss_of = ct.build(args.model, args)
    model = model.to(args.device, dtype).train()
    batch = batch.to(args.device, dtype) if batch.is_floating_point() else batch.to(args.device)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if args.device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    for column in args.columns.split(","):
        run = ct.compiled(column, model, op)

        def step():
            model.zero_grad(set_to_none=True)
            loss_of(run, batch).backward()

        for _ in range(3):
            step()
        ct.sync(args.device)
        if args.host:
            _host_profile(column, step, args)
            continue
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(args.steps):
                step()
            ct.sync(args.device)
        sort = "self_cuda_time_total" if args.device == "cuda" else "self_cpu_time_total"
        events = prof.key_averages()
        kernels = sum(e.count for e in events if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA)
        print(f"\n== {column}: {args.steps} steps, {kernels / args.steps:.0f} device kernels per step")
        print(events.table(sort_by=sort, row_limit=args.top, max_name_column_width=60))
        sys.stdout.flush()


def _host_profile(column, step, args):
    import cProfile
    import pstats
    import time

    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    ct.sync(args.device)
    print(f"\n== {column}: {(time.perf_counter() - start) / args.steps * 1e3:.2f} ms per step (host + device)")
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(args.steps):
        step()
    ct.sync(args.device)
    profile.disable()
    stats = pstats.Stats(profile)
    stats.sort_stats("tottime").print_stats(args.top)
    stats.sort_stats("cumtime").print_stats(args.top)


if __name__ == "__main__":
    main()
