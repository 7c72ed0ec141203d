"""Demo part `backend`: nested_compile_region layers whose attention writes a KV cache in place.

Every run is a new process (`python -m torch_ext.demo.piecewise_backend RUN ...`, findings as
JSON), since only a fresh process shows a cold or warm start as a user meets it:
  plain   torch.compile(backend="inductor"), empty Inductor cache; whether torch refuses the
          model is found out, not assumed;
  cold    the torch_ext backend with empty torch_ext and Inductor caches (both in a temp dir, or
          an earlier demo would make "cold" warm);
  warm    the torch_ext backend on the caches the cold run left, as a restarted server finds them.
Each run checks its outputs and KV caches against eager at every batch size.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import torch

from torch_ext.demo import show
from torch_ext.demo.models import ATTENTION, D_MODEL, LAYERS, Decoder
from torch_ext.demo.worker import run_worker
from torch_ext.graph_summary import format_counts, op_counts

BATCHES = (4, 7, 16)  # the first call compiles for a symbolic batch; the others reuse it


def _batch(n: int, seed: int) -> torch.Tensor:
    torch.manual_seed(seed)
    return torch.randn(n, D_MODEL)


def compile_and_compare(backend) -> dict:
    """Compile the model with `backend`, run it at every batch size; the first call's seconds and
    whether every output and KV cache equals eager's. Raises what torch raises."""
    torch._dynamo.reset()
    model = Decoder()
    compiled = torch.compile(model, backend=backend)
    eager_caches, compiled_caches = model.caches(), model.caches()
    equal, seconds = True, []
    with torch.no_grad():
        for i, n in enumerate(BATCHES):
            x = _batch(n, seed=i)
            if i == 0:
                torch._dynamo.mark_dynamic(x, 0)
            start = time.perf_counter()
            out = compiled(x, compiled_caches)
            seconds.append(time.perf_counter() - start)
            equal &= torch.allclose(out, model(x, eager_caches), atol=1e-5)
            equal &= all(torch.allclose(a, b, atol=1e-5) for a, b in zip(compiled_caches, eager_caches))
    return {"first_call_s": seconds[0], "equal_eager": bool(equal)}


def plain_inductor() -> dict:
    ok, result = show.attempt(lambda: compile_and_compare("inductor"), width=show.WIDTH - 4)
    return {"compiled": ok, **(result if ok else {"reason": result})}


def torch_ext_backend(cache_dir: str) -> dict:
    from torch_ext.backend import CompileConfig, counters, make_backend

    ext = make_backend(CompileConfig(splitting_ops=[ATTENTION], cache_dir=cache_dir, progress_bar=False))
    split = {}

    def backend(gm, example_inputs):  # keep the split graph for the summary
        split["gm"] = ext(gm, example_inputs)
        return split["gm"]

    counters.reset()
    result = compile_and_compare(backend)
    c = counters.snapshot()
    return {**result, "backend_s": c["backend_seconds"], "pieces": c["pieces"], "unique_pieces": c["unique_pieces"],
            "inductor_compiles": c["inductor_compiles"], "cache_hits": c["cache_hits"],
            "split": split_lines(split["gm"])}


def split_lines(split_gm: torch.fx.GraphModule) -> list[str]:
    """The split graph as a sequence: a letter per distinct compiled piece, the op's name for a
    splitting op (it runs eagerly); then each compiled piece's ops."""
    sequence, compiled = [], {}
    for node in split_gm.graph.nodes:
        if node.op != "call_module":
            continue
        piece = getattr(split_gm, node.target)  # a CompiledPiece, or a GraphModule run as Python
        if isinstance(piece, torch.fx.GraphModule):
            sequence.append(", ".join(name.split(".")[-1] for name in op_counts(piece)))
        else:
            label = compiled.setdefault(piece.fingerprint, (chr(ord("A") + len(compiled)), piece))[0]
            sequence.append(label)
    last = chr(ord("A") + len(compiled) - 1)
    lines = [f"split graph: {' > '.join(sequence)}   (A-{last}: compiled pieces)"]
    lines += [f"  {label}: {format_counts(op_counts(piece.graph_module))}" for label, piece in compiled.values()]
    return lines


def _worker(run: str, inductor_dir: str, cache_dir: str = "") -> dict:
    args = [run] + (["--cache-dir", cache_dir] if cache_dir else [])
    return run_worker(sys.executable, "torch_ext.demo.piecewise_backend", *args, env={"TORCHINDUCTOR_CACHE_DIR": inductor_dir})


def run() -> dict:
    show.header("backend", "nested_compile_region layers, in-place attention (KV cache)")
    print(f"  model: {LAYERS} layers of norm, qkv, {ATTENTION} (writes kv_cache in place), proj; "
          f"d={D_MODEL}")
    print(f"  each run: a new process, batches {', '.join(map(str, BATCHES))}; outputs and KV caches "
          "checked against eager")
    show.flush()
    root = tempfile.mkdtemp(prefix="torch_ext_demo_")
    inductor_dir, cache_dir = os.path.join(root, "inductor"), os.path.join(root, "torch_ext")
    try:
        plain = _worker("plain", os.path.join(root, "inductor_plain"))
        if plain["compiled"]:
            print(f"  plain torch.compile (inductor), empty cache: compiled, 1st call "
                  f"{plain['first_call_s']:.1f} s; equal eager: {plain['equal_eager']}")
        else:
            print(f"  plain torch.compile (inductor): refused\n    {plain['reason']}")
        print(f"  torch_ext.backend(CompileConfig(splitting_ops=[{ATTENTION!r}])):")
        show.flush()
        cold = _worker("torch_ext", inductor_dir, cache_dir)
        warm = _worker("torch_ext", inductor_dir, cache_dir)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    runs = {"cold, empty caches": cold, "warm, new process": warm}
    show.table([(name, f"{r['first_call_s']:.1f}", f"{r['backend_s']:.1f}", r["pieces"], r["unique_pieces"],
                 r["inductor_compiles"], r["cache_hits"], r["equal_eager"]) for name, r in runs.items()],
               head=("run", "1st call s", "backend s", "pieces", "unique", "compiles", "hits", "equal eager"),
               indent="    ")
    print("    (warm: on both caches the cold run left, torch_ext's and Inductor's; on CPU,\n"
          "     torch_ext's alone would still rebuild the C++ kernels)")
    for line in cold["split"]:
        print(f"  {line}"[: show.WIDTH])
    return {"plain_inductor": plain, "cold": cold, "warm": warm}


def _worker_main() -> None:
    parser = argparse.ArgumentParser(description="one run of the demo's backend part, in a new process")
    parser.add_argument("run", choices=("plain", "torch_ext"))
    parser.add_argument("--cache-dir", default="")
    args = parser.parse_args()
    result = plain_inductor() if args.run == "plain" else torch_ext_backend(args.cache_dir)
    print(json.dumps(result))


if __name__ == "__main__":
    _worker_main()
