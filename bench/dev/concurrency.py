"""Throughput of one compiled model called from 1, 2, 4, 8 threads (tests/concurrency_models.py:
4 blocks with SDPA, batch 1..8 at random, every output checked against eager on the thread's input).

    python bench/dev/concurrency.py [--device cuda] [--streams] [--calls 50] [--columns ...]

Columns: eager; torch.compile default and reduce-overhead; torch_ext.compile with
cudagraph_mode none / piecewise / full / full_and_piecewise (split at SDPA, capture sizes 1..8,
guard-free dispatch). Cells: calls per second (x the same column with 1 thread) from calls without a
check, then the wrong outputs and errors of a quarter as many calls checked against eager, where there
were any. Each column is warmed on the main thread at every batch size first.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # bench/: the harness, the benchmarks
sys.path.insert(0, BENCH)
sys.path.insert(0, os.path.join(BENCH, ".."))
sys.path.insert(0, os.path.join(BENCH, "..", "tests"))

import torch  # noqa: E402

import concurrency_models as cm  # noqa: E402
from harness import print_table  # noqa: E402

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


def run_column(column: str, args) -> list[str]:
    """Cells of one column, in this process."""
    counts = [int(t) for t in args.threads.split(",")]
    model = cm.Blocks().to(args.device).eval()
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
        return [f"failed: {type(e).__name__}"] * len(counts)
    cells, base = [], None
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
        cells.append(cell)
        print(f"  {column} x{t}: {cell}", file=sys.stderr, flush=True)
    return cells


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", default="1,2,4,8")
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--streams", action="store_true", help="each thread on its own CUDA stream")
    p.add_argument("--columns", default=",".join(COLUMNS))
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # run one column, print its cells as JSON
    args = p.parse_args()
    if args.one:
        print(json.dumps(run_column(args.one, args)))
        return
    counts = [int(t) for t in args.threads.split(",")]
    columns = args.columns.split(",")
    cells = {}
    for column in columns:  # a process each: a column that crashes the process (it happens) is one column
        argv = [sys.executable, os.path.abspath(__file__), "--one", column, "--device", args.device,
                "--threads", args.threads, "--calls", str(args.calls)] + (["--streams"] if args.streams else [])
        out = subprocess.run(argv, stdout=subprocess.PIPE, text=True)
        lines = out.stdout.strip().splitlines()
        if out.returncode == 0 and lines:
            cells[column] = json.loads(lines[-1])
        else:
            cells[column] = [f"process died (exit {out.returncode})"] * len(counts)
    print(f"\ncalls/s, {args.calls} calls per thread, batch 1..8, {args.device}"
          f"{', a CUDA stream per thread' if args.streams else ''}, torch {torch.__version__}")
    rows = [[f"{t} thread{'s' if t > 1 else ''}"] + [cells[c][i] for c in columns] for i, t in enumerate(counts)]
    print_table(["threads", *columns], rows)


if __name__ == "__main__":
    main()
