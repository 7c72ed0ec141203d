"""Where the time of a decode step goes (the model of bench/decode.py), for hand-graph, ext-full and
ext-piecewise: host (CPU) cost per step and per component, GPU time of the captured graphs, and the
kernels each variant runs.

    python bench/dev/decode_profile.py [--batches 1,128] [--layers 16] [--attention triton]

Host cost: the GPU is kept busy by a queued sleep kernel while the host issues a few steps, so the
host never waits on the GPU; host time per step is then what the CPU spends issuing it.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # bench/: the harness, the benchmarks
sys.path.insert(0, BENCH)
sys.path.insert(0, os.path.join(BENCH, ".."))

import decode as D  # noqa: E402


def host_us(fn, inner: int = 3, reps: int = 15) -> float:
    """Median host microseconds per fn() while the GPU is busy with a queued sleep."""
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        torch.cuda._sleep(40_000_000)  # ~20 ms of GPU time: the host never blocks meanwhile
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        times.append((time.perf_counter() - start) / inner)
    torch.cuda.synchronize()
    return statistics.median(times) * 1e6


def gpu_us(fn, inner: int = 20, reps: int = 15) -> float:
    """Median GPU microseconds per fn() over back-to-back calls (CUDA events)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / inner)
    return statistics.median(times)


def kernels(fn, steps: int = 5) -> dict[str, tuple[int, float]]:
    """Kernel name -> (launches per step, device us per step), from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    out = {}
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", None)
        if t is None:
            t = e.self_cuda_time_total
        if t > 0 and e.device_type == torch.autograd.DeviceType.CUDA:
            out[e.key] = (e.count // steps, t / steps)
    return out


def print_kernels(title: str, table: dict) -> None:
    total = sum(t for _, t in table.values())
    print(f"  {title}: {sum(c for c, _ in table.values())} kernels, {total:.1f} us device time per step")
    for name, (count, t) in sorted(table.items(), key=lambda kv: -kv[1][1])[:14]:
        print(f"    {t:8.1f} us  x{count:<3d} {name[:110]}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,128")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--attention", default=D.attention_impl, choices=D.ATTENTION)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench/dev/decode_profile.py needs a CUDA GPU")
        return 0
    D.set_attention(args.attention)
    D.define_attention()

    from torch_ext.backend import make_backend
    from torch_ext.backend.runtime.cudagraph.manager import CudaGraphRunner, capture_sizes
    from torch_ext.backend.dispatch.dispatcher import GuardFreeDispatcher

    batches = [int(b) for b in args.batches.split(",")]
    model, caches = D.build(args.layers, max(batches))
    pos = D.POS
    inputs = {b: torch.randn(b, D.HIDDEN, dtype=D.DTYPE, device="cuda") for b in batches}
    cache_dir = tempfile.mkdtemp(prefix="torch_ext_profile_")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {args.layers} layers, attention {args.attention}")

    # -- components, batch 1 ------------------------------------------------------------------------
    b = 1
    q = torch.randn(b, D.HEADS, D.HEAD_DIM, dtype=D.DTYPE, device="cuda")
    kv = torch.randn(b, 2, D.HEADS, D.HEAD_DIM, dtype=D.DTYPE, device="cuda")
    small = torch.randn(b, D.HIDDEN, dtype=D.DTYPE, device="cuda")
    dst = torch.empty_like(small)
    out = torch.empty_like(q)
    cache = caches[0]
    op = torch.ops.decode_bench.attention.default
    comp = {}
    for name in D.ATTENTION:
        comp[f"attention op, {name}"] = (name, lambda: op(q, kv, cache, pos, out))
        if name in D.SDPA:
            comp[f"  its sdpa alone ({name})"] = (name, lambda n=name: D.SDPA[n](q[:, :, None], cache[:b, 0], cache[:b, 1]))
    comp["cache write (one setitem)"] = (args.attention, lambda: cache.__setitem__((slice(None, b), slice(None), slice(None), pos), kv))
    comp["copy_ (b x hidden)"] = (args.attention, lambda: dst.copy_(small))
    comp["view (x[:b])"] = (args.attention, lambda: small[:b])
    print(f"\nHost cost of components at batch 1 (us per call); op output vs {D.ATTENTION[0]}:")
    with torch.no_grad():
        reference = None
        for name, (backend, fn) in comp.items():
            D.set_attention(backend)
            try:
                fn()
                if name.startswith("attention op"):
                    reference = out.clone() if reference is None else reference
                    err = f"  rel err {((out.float() - reference.float()).norm() / reference.float().norm()).item():.1e}"
                else:
                    err = ""
                print(f"  {name:36s} {host_us(lambda: [fn() for _ in range(16)], inner=2) / 16:7.2f}{err}")
            except Exception as e:  # a backend this GPU or build lacks
                print(f"  {name:36s} unavailable: {type(e).__name__}: {str(e).splitlines()[0][:100]}")
    D.set_attention(args.attention)

    # -- the variants -------------------------------------------------------------------------------
    hand = D.HandGraphs(model, caches, batches)
    with torch.no_grad():
        hand.setup()
    ext = {}
    for mode in ("piecewise", "full"):
        torch._dynamo.reset()
        cfg = D.ext_config(mode, batches, cache_dir)
        backend = make_backend(cfg)
        fn = GuardFreeDispatcher(model, backend)
        first = inputs[max(batches)].clone()
        torch._dynamo.mark_dynamic(first, 0)
        with torch.no_grad():
            fn(first, caches, pos)
            capture_sizes(lambda s: fn(inputs[s], caches, pos), cfg)
        ext[mode] = (fn, backend)
    steps = {"hand-graph": lambda x: hand(x, caches, pos),
             "ext-full": lambda x: ext["full"][0](x, caches, pos),
             "ext-piecewise": lambda x: ext["piecewise"][0](x, caches, pos)}

    print("\nPer step (us): host = CPU cost of issuing it; gpu = event time, steps back to back:")
    with torch.no_grad():
        for b in batches:
            x = inputs[b]
            for round_ in range(2):  # twice, interleaved: the spread between rounds is the noise
                cells = []
                for name, step in steps.items():
                    cells.append(f"{name} host {host_us(lambda: step(x)):7.1f} gpu {gpu_us(lambda: step(x)):7.1f}")
                print(f"  B={b:<4d} round {round_}: " + " | ".join(cells))

    # raw replays: is the full graph itself slower than the hand-captured one?
    full_runner = next(r for r in ext["full"][1].cudagraphs.runners())

    def full_entry(size):  # the runner keeps its graphs under GraphKey(size, padded, weights)
        return next(e for k, e in full_runner._entries.items() if k.size == size and not k.padded)
    print("\nRaw graph.replay() GPU us (interleaved rounds): hand vs ext-full")
    with torch.no_grad():
        for b in batches:
            entry = full_entry(b)
            cells = [f"hand {gpu_us(hand.graphs[b].replay):7.1f} ext-full {gpu_us(entry.graph.replay):7.1f}"
                     for _ in range(3)]
            print(f"  B={b:<4d} " + " | ".join(cells))

    # -- piecewise host profile ---------------------------------------------------------------------
    runners = ext["piecewise"][1].cudagraphs.runners()
    print(f"\nPiecewise: {len(runners)} runners; cProfile of 30 steps at B={batches[0]} (sorted by own time):")
    step = steps["ext-piecewise"]
    x = inputs[batches[0]]
    with torch.no_grad():
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(30):
            step(x)
        prof.disable()
        torch.cuda.synchronize()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
    print("\n".join(line for line in buf.getvalue().splitlines()[4:] if line.strip()))

    # one runner alone: its host cost, and raw replay of its graph
    recorded = {}
    original = CudaGraphRunner.__call__

    def record(self, *a):
        recorded.setdefault(self, a)
        return original(self, *a)

    CudaGraphRunner.__call__ = record
    with torch.no_grad():
        step(x)
    CudaGraphRunner.__call__ = original
    runner = runners[len(runners) // 2]
    a = recorded[runner]
    plan = runner._plans[batches[0]]
    with torch.no_grad():
        print(f"\nOne middle piece at B={batches[0]}: runner call host {host_us(lambda: [runner(*a) for _ in range(16)]) / 16:.2f} us, "
              f"raw graph.replay host {host_us(lambda: [plan.graph.replay() for _ in range(16)]) / 16:.2f} us, "
              f"graph GPU {gpu_us(plan.graph.replay):.1f} us; copies per replay {len(plan.copies)}, "
              f"reused inputs {len(plan.reused)}")
    # Last: once torch.profiler has run, CUPTI slows every later launch on the host.
    print("\nKernels of the replayed graphs (CUPTI traces a graph's kernels one by one):")
    with torch.no_grad():
        for b in batches:
            for name in ("hand-graph", "ext-full"):
                print_kernels(f"B={b} {name}", kernels(lambda: steps[name](inputs[b])))

    return 0


if __name__ == "__main__":
    sys.exit(main())
