"""Tensor-parallel decode step on 2 GPUs (NCCL): bench/decode.py's model split over 2 ranks.

    python bench/tp_decode.py [--batches 1,8,32,128] [--iters 200] [--layers 16] [--rounds 3]
                              [--attention triton|auto|...]

Each rank holds half of every layer (Megatron-style): the qkv and gate/up projections split by
output (heads, MLP columns), the output and down projections by input, and a functional
all-reduce (torch.distributed._functional_collectives, traceable by Dynamo) after each of the two;
the KV cache holds the rank's 8 heads. The attention op (the splitting op) is bench/decode.py's.
Columns, each measured on 1 GPU (this process, GPU 0) and on 2 (two spawned ranks):
  eager          the model as written
  compile        torch.compile(dynamic=True)
  ext-piecewise  torch_ext, cudagraph_mode="piecewise": all-reduces captured inside the pieces
  ext-full       torch_ext, cudagraph_mode="full": the whole step, all-reduces included, one graph
Cells: median ms per step (rank 0's CUDA events; the ranks run in lockstep). Speed-up = 1-GPU ms /
2-GPU ms of the same column. Columns of one phase are timed in interleaved rounds; the two phases
run one after the other (host speed may drift between them). Every column's output is checked
against the 1-GPU eager model. NVLink multicast stays off (NCCL_NVLS_ENABLE=0: the device tool's rule).
"""
from __future__ import annotations

import argparse
import datetime
import faulthandler
import json
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import decode as D  # noqa: E402
from harness import print_table  # noqa: E402

COLUMNS = ("eager", "compile", "ext-piecewise", "ext-full")
WORLD = 2


def all_reduce(t: torch.Tensor) -> torch.Tensor:
    import torch.distributed._functional_collectives as fc

    return fc.all_reduce(t, "sum", dist.group.WORLD)


class TPLayer(nn.Module):
    """Rank `rank`'s half of a decode.Layer (same weights as the 1-GPU model)."""

    def __init__(self, full: D.Layer, rank: int):
        super().__init__()
        heads, mlp = D.HEADS // WORLD, D.MLP // WORLD
        self.heads = heads
        self.input_norm, self.post_norm = full.input_norm, full.post_norm
        qkv = full.qkv.weight.view(3, D.HEADS, D.HEAD_DIM, D.HIDDEN)[:, rank * heads:(rank + 1) * heads]
        self.qkv = nn.Parameter(qkv.reshape(-1, D.HIDDEN).clone(), requires_grad=False)
        cols = slice(rank * heads * D.HEAD_DIM, (rank + 1) * heads * D.HEAD_DIM)
        self.o = nn.Parameter(full.o.weight[:, cols].clone(), requires_grad=False)
        gate, up = full.gate_up.weight.chunk(2, dim=0)
        rows = slice(rank * mlp, (rank + 1) * mlp)
        self.gate_up = nn.Parameter(torch.cat((gate[rows], up[rows])).clone(), requires_grad=False)
        self.down = nn.Parameter(full.down.weight[:, rows].clone(), requires_grad=False)

    def forward(self, h, kv_cache, cos, sin, pos: int):
        b = h.shape[0]
        q, k, v = F.linear(self.input_norm(h), self.qkv).view(b, 3, self.heads, D.HEAD_DIM).unbind(1)
        kv = torch.stack((D.rotate(k, cos, sin), v), dim=1)
        q = D.rotate(q, cos, sin)
        a = torch.empty_like(q)
        torch.ops.decode_bench.attention(q, kv, kv_cache, pos, a)
        h = h + all_reduce(F.linear(a.reshape(b, -1), self.o))
        gate, up = F.linear(self.post_norm(h), self.gate_up).chunk(2, dim=-1)
        return h + all_reduce(F.linear(F.silu(gate) * up, self.down))


class TPDecoder(nn.Module):
    def __init__(self, full: D.Decoder, rank: int):
        super().__init__()
        self.layers = nn.ModuleList(TPLayer(layer, rank) for layer in full.layers)
        self.norm = full.norm
        self.cos, self.sin = full.cos, full.sin

    forward = D.Decoder.forward


def columns(model, batches, cache_dir, skip):
    """{name: (make, config)}: the ext columns first, then the plain ones (see measure)."""
    import torch_ext.backend.dispatch as dispatch

    cfgs = {name: D.ext_config(mode, batches, cache_dir) for name, mode in
            (("ext-piecewise", "piecewise"), ("ext-full", "full"))}
    made = {name: (lambda cfg=cfg: dispatch.compile(model, cfg), cfg) for name, cfg in cfgs.items()}
    made["eager"] = (lambda: model, None)
    made["compile"] = (lambda: torch.compile(model, dynamic=True), None)
    return {name: v for name, v in made.items() if name not in skip}


def measure(model, caches, batches, args, refs, cache_dir, label: str) -> dict:
    """{column: {"ms": {b: ms}, "err": max rel err vs refs}}, from interleaved rounds over the columns.
    Dynamo is reset before each column (as in bench/decode.py); guard-free torch_ext columns stay
    valid after a reset, so plain torch.compile comes last."""
    from torch_ext.backend.runtime.cudagraph.manager import capture_sizes

    torch.manual_seed(1)  # the same inputs on every rank and in the 1-GPU phase
    inputs = {b: [torch.randn(b, D.HIDDEN, dtype=D.DTYPE, device="cuda") for _ in range(4)] for b in batches}
    ready, out = {}, {}
    for name, (make, cfg) in columns(model, batches, cache_dir, set(args.skip.split(","))).items():
        start = time.perf_counter()
        print(f"[{label}] {name}: compiling and capturing", flush=True)
        torch._dynamo.reset()
        fn = make()
        first = inputs[max(batches)][0]
        torch._dynamo.mark_dynamic(first, 0)
        with torch.no_grad():
            fn(first, caches, D.POS)  # compile at the largest batch (0/1 specialization)
            if cfg is not None:
                capture_sizes(lambda b: fn(inputs[b][1], caches, D.POS), cfg)
            for b in batches:
                fn(inputs[b][0], caches, D.POS)
            err = max(D.rel_err(fn(refs[b][0].to("cuda"), caches, D.POS), refs[b][1].to("cuda")) for b in batches)
        ready[name] = fn
        out[name] = {"ms": {b: [] for b in batches}, "err": err}
        print(f"[{label}] {name} ready in {time.perf_counter() - start:.1f} s, rel err {err:.1e}", flush=True)
    print(f"[{label}] timing {args.rounds} interleaved rounds", flush=True)
    with torch.no_grad():
        for round_ in range(args.rounds):
            for b in batches:
                for name, fn in ready.items():
                    # A rank stuck here for `--timeout` s prints every thread's stack (then NCCL's own
                    # timeout fails the collective).
                    faulthandler.dump_traceback_later(args.timeout, exit=False)
                    out[name]["ms"][b].append(D.time_steps(lambda x: fn(x, caches, D.POS), inputs[b], args.iters))
                    faulthandler.cancel_dump_traceback_later()
            print(f"[{label}] round {round_ + 1}/{args.rounds} timed", flush=True)
    for name in out:
        out[name]["ms"] = {b: statistics.median(v) for b, v in out[name]["ms"].items()}
    return out


def rank_main(rank: int, args, batches, init_file: str, refs_path: str, result_path: str, cache_dir: str):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=args.timeout), device_id=torch.device("cuda", rank))
    try:
        D.set_attention(args.attention)
        D.define_attention()
        full, caches = D.build(args.layers, max(batches))  # seeded: the same weights and caches on every rank
        heads = D.HEADS // WORLD
        caches = [c[:, :, rank * heads:(rank + 1) * heads].contiguous() for c in caches]
        model = TPDecoder(full, rank).eval()
        del full
        torch.cuda.empty_cache()
        refs = torch.load(refs_path)
        # One cache dir for both ranks: graphs with collectives are keyed by rank (backend/compile/environment.py).
        result = measure(model, caches, batches, args, refs, cache_dir, f"2 GPUs, rank {rank}")
        print(f"[2 GPUs, rank {rank}] ms: " + "; ".join(
            f"{c}: " + ", ".join(f"B={b} {result[c]['ms'][b]:.3f}" for b in batches) for c in result), flush=True)
        if rank == 0:
            with open(result_path, "w") as f:
                json.dump(result, f)
        torch.cuda.synchronize()
        dist.barrier()
    except BaseException:
        dist.destroy_process_group()
        raise
    # destroy_process_group hung here with NCCL kernels still captured in CUDA graphs (H200 x2,
    # torch 2.11): leave without it, the results are written.
    os._exit(0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,8,32,128")
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--attention", default="triton", choices=[a for a in D.ATTENTION if a != "custom_op"])
    parser.add_argument("--skip", default="", help="comma-separated columns to leave out")
    parser.add_argument("--timeout", type=int, default=120, help="seconds a collective may hang before it fails")
    args = parser.parse_args()
    if torch.cuda.device_count() < WORLD:
        print(f"bench/tp_decode.py needs {WORLD} CUDA GPUs; this machine has {torch.cuda.device_count()}.")
        return 0
    batches = [int(b) for b in args.batches.split(",")]
    D.set_attention(args.attention)
    D.define_attention()
    work = tempfile.mkdtemp(prefix="torch_ext_tp_")

    # Phase 1: the 1-GPU model on GPU 0, and the reference outputs every column is checked against.
    model, caches = D.build(args.layers, max(batches))
    torch.manual_seed(2)
    refs = {}
    with torch.no_grad():
        for b in batches:
            x = torch.randn(b, D.HIDDEN, dtype=D.DTYPE, device="cuda")
            refs[b] = (x.cpu(), model(x, caches, D.POS).float().cpu())
    refs_path = os.path.join(work, "refs.pt")
    torch.save(refs, refs_path)
    one = measure(model, caches, batches, args, refs, os.path.join(work, "one"), "1 GPU")
    del model, caches
    torch._dynamo.reset()
    torch.cuda.empty_cache()
    print("[1 GPU] ms: " + "; ".join(f"{c}: " + ", ".join(f"B={b} {one[c]['ms'][b]:.3f}" for b in batches)
                                 for c in one), flush=True)

    # Phase 2: two ranks.
    result_path = os.path.join(work, "tp.json")
    torch.multiprocessing.spawn(rank_main, args=(args, batches, os.path.join(work, "init"), refs_path, result_path,
                                                 os.path.join(work, "tp")), nprocs=WORLD, join=True)
    with open(result_path) as f:
        two = json.load(f)

    print(f"\nDecode step, {args.layers} layers (hidden {D.HIDDEN}, {D.HEADS} heads, MLP {D.MLP}, context "
          f"{D.CONTEXT}, bf16, attention {args.attention}), {torch.cuda.get_device_name()} x{WORLD} "
          f"(torch {torch.__version__}, NCCL, NVLS off). Cells: 2-GPU ms (1-GPU ms, speed-up).")
    rows = []
    shown = [c for c in COLUMNS if c in two]
    for b in batches:
        row = [str(b)]
        for c in shown:
            t2, t1 = two[c]["ms"][str(b)], one[c]["ms"][b]
            row.append(f"{t2:.3f} ({t1:.3f}, {t1 / t2:.2f}x)")
        rows.append(row)
    print_table(["batch"] + shown, rows)
    print("Max rel err vs 1-GPU eager: " + ", ".join(f"{c}: 1 GPU {one[c]['err']:.1e} / 2 GPUs {two[c]['err']:.1e}"
                                                    for c in shown))
    bad = [c for c in shown if not (one[c]["err"] < 3e-2 and two[c]["err"] < 3e-2)]
    if bad:
        print(f"OUTPUT MISMATCH vs eager (rel err >= 3e-2): {bad}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
