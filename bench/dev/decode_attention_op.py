"""torch_ext::decode_attention's kernels on grouped-query shapes: one program per kv head (the cache
read once) against one per query head over the repeated cache (what the kernel did before: the same
math, each cache byte read `groups` times), and SDPA over HF's repeat_kv.

    python bench/dev/decode_attention_op.py [--shapes 8x16x4x2048,...] [--sweep]
    python bench/dev/decode_attention_op.py --grid [--head-dim 128] [--tuned]   # beside FlashInfer (issue 47)

Shapes are batch x heads x kv heads x cache length, head dim 128, bf16, a bool mask over the cache.
--grid: batch 1, 8, 32 x cache length 256-8192 x GQA ratio 1-8 (32 query heads), our op against
FlashInfer's decode kernel and its tensor-core path (bench/dev/flashinfer_peer.py; the cache is its one-page-per-sequence HND
layout, so both read the same tensors; our op also reads a bool mask, all true, as HF's static cache
passes one) and the max difference between the two. --tuned adds the launch the compile-time tuner
(kernels/decode_attention_tuning.py) picks for each shape, timed here like the table's.
Microseconds per call (CUDA events over replays of a CUDA graph of 48 calls, cycling through copies of
the cache that together pass any L2), and x floor: the cache bytes (k and v, read once) /
device-to-device copy bandwidth. --sweep times every (target programs, tile, warps, stages) of each
shape's kernel against the op's default (kernels/decode_attention.py's _TARGET_PROGRAMS and _CONFIG),
MHA shapes also through the grouped (tensor-core) kernel.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # bench/: the harness, the benchmarks
sys.path.insert(0, BENCH)
sys.path.insert(0, os.path.dirname(BENCH))


def per_call_us(fns, calls: int = 48, replays: int = 20) -> float:
    """GPU time per call: `calls` calls captured in one CUDA graph (as the op runs inside a model's
    graph), replayed; eager timing would measure Python and Triton's launch path (~70-120 us). The
    calls cycle through `fns` (one per copy of the cache, together larger than L2)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in fns:
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fns[i % len(fns)]()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (calls * replays)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="8x16x4x2048,1x16x4x2048,32x32x8x1024,32x16x16x256,1x16x16x256")
    parser.add_argument("--sweep", action="store_true", help="every tile / warps / stages config of each kernel")
    parser.add_argument("--grid", action="store_true", help="batches x lengths x GQA ratios, beside FlashInfer")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--lengths", default="256,1024,2048,4096,8192")
    parser.add_argument("--alt-grouped", default=None, help="--grid: also the grouped kernel (both its configs) at tile,warps,stages")
    parser.add_argument("--tuned", action="store_true",
                        help="--grid: also the launch the compile-time tuner picks (kernels/decode_attention_tuning.py)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench/dev/decode_attention_op.py needs a CUDA GPU.")
        return 0
    from harness import copy_bandwidth
    from harness import print_table
    from torch_ext.kernels.decode_attention import decode_attention_triton

    bandwidth = copy_bandwidth()
    if args.grid:
        return grid(args, bandwidth, decode_attention_triton)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, head dim 128; copy bandwidth "
          f"{bandwidth / 1e12:.2f} TB/s; us per call (x floor)")
    rows = []
    for shape in args.shapes.split(","):
        b, h, hkv, length = (int(x) for x in shape.split("x"))
        d, n = 128, h // hkv
        q = torch.randn(b, h, 1, d, device="cuda", dtype=torch.bfloat16)
        cache_bytes = 2 * b * hkv * length * d * 2
        copies = max(1, -(-256 * 2**20 // cache_bytes))  # 256 MiB in all: beyond any L2
        caches = [[torch.randn(b, hkv, length, d, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
                  for _ in range(copies)]
        mask = torch.rand(b, 1, 1, length, device="cuda") > 0.1
        floor = cache_bytes / bandwidth * 1e6

        def op(k, v):
            return lambda: decode_attention_triton(q, k, v, mask, d ** -0.5)

        if args.sweep:
            sweep(shape, floor, q, caches, mask, op)
            continue
        repeated = [[t.repeat_interleave(n, dim=1) for t in c] for c in caches[:max(1, copies // n)]]
        grouped = per_call_us([op(k, v) for k, v in caches])
        per_head = per_call_us([op(k, v) for k, v in repeated])
        sdpa = per_call_us([lambda k=k, v=v: torch.nn.functional.scaled_dot_product_attention(
            q, k[:, :, None].expand(b, hkv, n, length, d).reshape(b, h, length, d),
            v[:, :, None].expand(b, hkv, n, length, d).reshape(b, h, length, d), attn_mask=mask, scale=d ** -0.5)
            for k, v in caches])
        (k, v), (kr, vr) = caches[0], repeated[0]
        err = (op(k, v)().float() - op(kr, vr)().float()).abs().max().item()
        rows.append([shape, f"{floor:.1f}", f"{grouped:.1f} ({grouped / floor:.2f})",
                     f"{per_head:.1f} ({per_head / floor:.2f})", f"{sdpa:.1f} ({sdpa / floor:.2f})", f"{err:.1e}"])
    if rows:
        print_table(["b x h x hkv x L", "floor us", "the op (grouped where hkv < h)", "per query head",
                     "SDPA + repeat_kv", "max |grouped - per head|"], rows)
    return 0


def grid(args, bandwidth, op) -> int:
    """Our op beside FlashInfer's decode kernel over the issue's grid; a row per shape."""
    from flashinfer_peer import decode_calls, flashinfer_status
    from harness import print_table

    from torch_ext.kernels import decode_attention as module

    d, h = args.head_dim, 32
    peers = {"FlashInfer": False, "FlashInfer tc": True}  # its decode kernel; its prefill kernel on tensor cores
    missing = {name: flashinfer_status(d, tc) for name, tc in peers.items()}
    status = "; ".join(f"{name}: {why}" for name, why in missing.items() if why) or f"FlashInfer {_version()}"
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, head dim {d}, {h} query heads; copy "
          f"bandwidth {bandwidth / 1e12:.2f} TB/s; us per call (x floor); {status}")
    rows, tuning_s = [], 0.0
    for b in (int(x) for x in args.batches.split(",")):
        for length in (int(x) for x in args.lengths.split(",")):
            for ratio in (1, 2, 4, 8):
                hkv = h // ratio
                q = torch.randn(b, h, 1, d, device="cuda", dtype=torch.bfloat16)
                cache_bytes = 2 * b * hkv * length * d * 2
                copies = max(1, -(-256 * 2**20 // cache_bytes))
                caches = [[torch.randn(b, hkv, length, d, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
                          for _ in range(copies)]
                mask = torch.ones(b, 1, 1, length, device="cuda", dtype=torch.bool)
                floor = cache_bytes / bandwidth * 1e6

                def ours_us():  # our op over every copy of the cache, as the module's switches stand
                    return per_call_us([lambda k=k, v=v: op(q, k, v, mask, d ** -0.5) for k, v in caches])

                ours = ours_us()
                expected = op(q, *caches[0], mask, d ** -0.5)[:, :, 0].float()
                cells = [f"{b}x{h}x{hkv}x{length}", f"{floor:.1f}", f"{ours:.1f} ({ours / floor:.2f})"]
                if ratio == 1:  # MHA: also its other kernel
                    saved, module.MHA_ON_TENSOR_CORES = module.MHA_ON_TENSOR_CORES, not module.grouped(b, h, hkv)
                    try:
                        other = ours_us()
                    finally:
                        module.MHA_ON_TENSOR_CORES = saved
                    tag = "tc" if not module.grouped(b, h, hkv) else "per head"
                    cells.append(f"{other:.1f} ({other / floor:.2f}) {tag}")
                else:
                    cells.append("-")
                if args.tuned:
                    tuned, label, tune_s = _tuned_us(b, h, hkv, length, d, q, caches, mask, op)
                    tuning_s += tune_s
                    cells.append(f"{tuned:.1f} ({tuned / floor:.2f}) {label}")
                if args.alt_grouped:  # the grouped kernel under another config (ours where it takes that kernel)
                    saved = dict(module._CONFIG)
                    alt_config = tuple(int(x) for x in args.alt_grouped.split(","))
                    module._CONFIG.update(grouped=alt_config, grouped_few_rows=alt_config)
                    try:
                        alt = ours_us()
                    finally:
                        module._CONFIG.update(saved)
                    cells.append(f"{alt:.1f} ({alt / floor:.2f})" if module.grouped(b, h, hkv) else "-")
                best, err = None, 0.0
                for name, tc in peers.items():
                    if missing[name]:
                        cells.append("-")
                        continue
                    calls = decode_calls(q, caches, length, tc)
                    theirs = per_call_us(calls)
                    err = max(err, (expected - calls[0]().float()).abs().max().item())
                    best = theirs if best is None else min(best, theirs)
                    cells.append(f"{theirs:.1f} ({theirs / floor:.2f})")
                cells += [f"{ours / best:.2f}" if best else "-"]
                if args.tuned:
                    cells += [f"{tuned / best:.2f}" if best else "-", f"{tuned / ours:.2f}"]
                cells.append(f"{err:.1e}")
                rows.append(cells)
                del caches
                print(" | ".join(cells), file=sys.stderr, flush=True)
    alt = [f"torch_ext, grouped {args.alt_grouped}"] if args.alt_grouped else []
    tuned = ["torch_ext tuned (its choice)"] if args.tuned else []
    print_table(["b x h x hkv x L", "floor us", "torch_ext", "torch_ext, its other MHA kernel", *tuned, *alt, *peers,
                 "torch_ext / best FlashInfer", *(["tuned / best FlashInfer", "tuned / table"] if args.tuned else []),
                 "max |difference|"], rows)
    if args.tuned:
        print(f"tuning: {tuning_s:.1f} s over {len(rows)} shapes (Triton compiles included)")
    return 0


def _tuned_us(b, h, hkv, length, d, q, caches, mask, op):
    """(us per call of the launch the tuner picks, its label, seconds the tuner took)."""
    import time

    from torch_ext.kernels import decode_attention as module, decode_attention_tuning as tuning

    shape = tuning.Shape(b, h, hkv, length, d, q.dtype, "bool", False)
    start = time.perf_counter()
    choice = tuning.Tuner(None).choose(shape, q.device)
    seconds = time.perf_counter() - start
    if choice.path == "sdpa":
        calls = [lambda k=k, v=v: tuning._sdpa(q, k, v, mask, d ** -0.5) for k, v in caches]
    else:
        launch = module.checked_config(choice.encode())
        calls = [lambda k=k, v=v: op(q, k, v, mask, d ** -0.5, launch) for k, v in caches]
    return per_call_us(calls), choice.label(), seconds


def _version() -> str:
    import flashinfer

    return getattr(flashinfer, "__version__", "?")


def sweep(shape, floor, q, caches, mask, op) -> None:
    """Every (tile, warps, stages) of the kernel this shape runs, against the op's default; for MHA
    shapes the default against the other MHA kernel ("tc": kernels/decode_attention.py's
    MHA_ON_TENSOR_CORES) over programs x tiles x 4/8 warps x 2/3 stages."""
    import itertools

    from torch_ext.kernels import decode_attention as module

    reference = module.decode_attention_reference(q, *caches[0], mask, q.shape[-1] ** -0.5).float()
    target, rule, saved = module._TARGET_PROGRAMS, module.MHA_ON_TENSOR_CORES, dict(module._CONFIG)
    shape_of = (q.shape[0], q.shape[1], caches[0][0].shape[1], q.shape[-1])  # b, h, hkv, d
    on_tc = module.grouped(*shape_of[:3])
    default_kind = module.config_kind(*shape_of)
    default = (on_tc, target, *saved[default_kind])
    timed = []
    configs = list(itertools.product(sorted({target, 16, 64, 132, 528}), [32, 64, 128], [2, 4, 8], [1, 2, 3]))
    candidates = [(on_tc, p, (n, w, st)) for p, n, w, st in configs]
    if q.shape[1] == caches[0][0].shape[1]:  # MHA: the default against the other kernel's narrower sweep
        candidates = [default[:2] + (default[2:],)] + [
            (not on_tc, p, (n, w, st)) for p, n, w, st in configs if p in (target, 132, 528) and w in (4, 8)
            and st in (2, 3)]
    try:  # also the programs the cache is split over (fewer: fewer splits, one split = no combine kernel)
        for tc, programs, config in candidates:
            module.MHA_ON_TENSOR_CORES, module._TARGET_PROGRAMS = tc, programs
            module._CONFIG[module.config_kind(*shape_of)] = config
            err = (op(*caches[0])().float() - reference).abs().max().item()
            us = per_call_us([op(k, v) for k, v in caches], calls=24, replays=10)
            timed.append((us, (tc, programs, *config), err))
    finally:
        module._CONFIG.update(saved)
        module._TARGET_PROGRAMS, module.MHA_ON_TENSOR_CORES = target, rule
    timed.sort()
    now = next(t for t in timed if t[1] == default)
    print(f"{shape} ({default_kind}): floor {floor:.1f} us; default (tc, programs, tile, warps, stages) {default}: "
          f"{now[0]:.1f} us; best: " + ", ".join(f"{us:.1f} {config} (err {err:.0e})" for us, config, err in timed[:6]),
          flush=True)


if __name__ == "__main__":
    sys.exit(main())
