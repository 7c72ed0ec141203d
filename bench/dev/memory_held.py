"""What a compiled decode model holds on the GPU beyond its weights and caches, and who allocated it.

    python bench/dev/memory_held.py [--model llama-1b] [--columns ro,ext,ext-nocg] [--top 15]

Each column in a fresh process (the caching allocator's state is per process): the model and one
StaticCache per capture size (1, 2, 4, 8, 16, 32, as generate makes them), then one dynamic compile
warmed up at every batch (graphs captured). Printed per column: allocated and reserved MiB beyond the
weights and caches. For torch_ext columns the allocator's history says which allocations are alive
at the end (grouped by the innermost frame in torch_ext, Inductor or transformers) and how much of
the reserved memory is cached but free.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

CAPTURE = (1, 2, 4, 8, 16, 32)
MiB = 2**20


def _frame(frames) -> str:
    for f in frames:
        name = f.get("filename", "")
        if any(k in name for k in ("torch_ext/", "_inductor/", "transformers/", "_dynamo/", "cudagraph")):
            return f"{name.split('site-packages/')[-1].split('/work/')[-1]}:{f.get('line')} {f.get('name')}"
    return "?"


def one(column: str, model: str, top: int) -> dict:
    import hf_decode as H
    import inference_floor as F

    setup = H.Setup(argparse.Namespace(batches=list(CAPTURE), smoke=False, model=model, context=256))
    torch.cuda.synchronize()
    base_alloc, base_reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    record = column.startswith("ext")
    if record:
        torch.cuda.memory._record_memory_history(max_entries=200000)
    fn = F.make(column.replace("ext-nocg", "ext-nocg"), setup.model, tempfile.mkdtemp(), serving=True)
    for b in sorted(CAPTURE, reverse=True):
        for _ in range(3):
            setup.reset(b)
            with torch.no_grad():
                setup.step(fn, b)
    torch.cuda.synchronize()
    out = {"column": column, "allocated": (torch.cuda.memory_allocated() - base_alloc) / MiB,
           "reserved": (torch.cuda.memory_reserved() - base_reserved) / MiB, "groups": []}
    if record:
        snap = torch.cuda.memory._snapshot()
        groups = collections.Counter()
        for seg in snap["segments"]:
            for block in seg["blocks"]:
                if block["state"] == "active_allocated":
                    groups[_frame(block.get("frames", []))] += block["size"]
                elif block["state"] == "inactive":
                    groups["(cached, free)"] += block["size"]
        out["groups"] = [(k, v / MiB) for k, v in groups.most_common(top)]
        try:
            from torch_ext.backend.runtime.cudagraph.stats import cudagraph_stats

            out["stats"] = {k: v for k, v in vars(cudagraph_stats).items() if isinstance(v, (int, float))}
        except Exception as e:  # noqa: BLE001 - a dev tool: print what is there
            out["stats"] = repr(e)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama-1b")
    parser.add_argument("--columns", default="ro,ext,ext-nocg")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--child", default=None)
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(one(args.child, args.model, args.top)))
        return 0
    for column in args.columns.split(","):
        proc = subprocess.run([sys.executable, __file__, "--child", column, "--model", args.model, "--top",
                               str(args.top)], capture_output=True, text=True)
        lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
        if not lines:
            print(f"{column}: failed\n{proc.stderr[-3000:]}")
            continue
        r = json.loads(lines[0][7:])
        print(f"\n{args.model} {column}: +{r['allocated']:.0f} MiB allocated, +{r['reserved']:.0f} MiB reserved "
              f"beyond weights and caches")
        for name, mib in r["groups"]:
            print(f"  {mib:9.1f} MiB  {name}")
        if r.get("stats"):
            print(f"  cudagraph stats: {r['stats']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
