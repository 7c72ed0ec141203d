"""Throughput of one compiled model called from 1, 2, 4, 8 threads (tests/concurrency_models.py:
4 blocks with SDPA, batch 1..8 at random, every output checked against eager on the thread's input).

    python bench/concurrency.py [--device cuda] [--streams] [--calls 50] [--columns ...]

Columns: eager; torch.compile default and reduce-overhead; torch_ext.compile with
cudagraph_mode none / piecewise / full / full_and_piecewise (split at SDPA, capture sizes 1..8,
guard-free dispatch). Cells: calls per second (x the same column with 1 thread) from calls without a
check, then the wrong outputs and errors of a quarter as many calls checked against eager, where there
were any. Each column is warmed on the main thread at every batch size first.
"""
from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

import torch  # noqa: E402

import concurrency_models as cm  # noqa: E402
from table import print_table  # noqa: E402

COLUMNS = ("eager", "compile", "reduce-overhead", "ext-none", "ext-piecewise", "ext-full", "ext-full_and_piecewise")


def build(column: str, model):
    import torch_ext
    from torch_ext.backend import CompileConfig

    if column == "eager":
        return model
    if column == "compile":
        return torch.compile(model)
    if column == "reduce-overhead":
        return torch.compile(model, mode="reduce-overhead")
    mode = column.split("-", 1)[1]
    return torch_ext.compile(model, CompileConfig(splitting_ops=(cm.SPLIT_AT,), cache_dir=None, cudagraph_mode=mode,
                                                  cudagraph_capture_sizes=tuple(range(1, 9)),
                                                  guard_free_dispatch=True, progress_bar=False))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", default="1,2,4,8")
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--streams", action="store_true", help="each thread on its own CUDA stream")
    p.add_argument("--columns", default=",".join(COLUMNS))
    args = p.parse_args()
    counts = [int(t) for t in args.threads.split(",")]
    model = cm.Blocks().to(args.device).eval()
    rows = {t: [f"{t} thread{'s' if t > 1 else ''}"] for t in counts}
    columns = args.columns.split(",")
    for column in columns:
        torch._dynamo.reset()
        compiled = build(column, model)
        try:
            with torch.no_grad():
                first = cm.batch(3, args.device, seed=0)
                torch._dynamo.mark_dynamic(first, 0)
                compiled(first)
                for n in range(1, 9):
                    for _ in range(3):
                        compiled(cm.batch(n, args.device, seed=n))
        except Exception as e:  # noqa: BLE001  (a column that cannot run says why)
            for t in counts:
                rows[t].append(f"failed: {type(e).__name__}")
            continue
        base = None
        for t in counts:
            # Checked calls (each output against eager on the thread's input), then timed calls without
            # the check (the eager reference would dominate the time, and its host work the GIL).
            r = cm.hammer(compiled, model, threads=t, calls=max(5, args.calls // 4), max_batch=8,
                          device=args.device, streams=args.streams)
            if not r["errors"]:
                timed = cm.hammer(compiled, model, threads=t, calls=args.calls, max_batch=8, device=args.device,
                                  streams=args.streams, check=False)
                r["calls_per_s"], r["errors"] = timed["calls_per_s"], timed["errors"]
            base = base or r["calls_per_s"]
            cell = f"{r['calls_per_s']:.0f} ({r['calls_per_s'] / base:.2f}x)"
            if r["wrong"]:
                cell += f", {r['wrong']} wrong"
            if r["errors"]:
                cell += f", {len(r['errors'])} errors ({r['errors'][0][:60]})"
            rows[t].append(cell)
            print(f"  {column} x{t}: {cell}", file=sys.stderr, flush=True)
    print(f"\ncalls/s, {args.calls} calls per thread, batch 1..8, {args.device}"
          f"{', a CUDA stream per thread' if args.streams else ''}, torch {torch.__version__}")
    print_table(["threads", *columns], [rows[t] for t in counts])


if __name__ == "__main__":
    main()
