"""Where the host time of a piecewise decode step of the HF Llama of bench/hf_decode.py goes.

    python bench/dev/hf_decode_profile.py [--batch 1] [--columns ext-piecewise,ext-full]

Per column: host us per step (the GPU kept busy by a queued sleep, so the host never waits) and GPU
us per step (events, back to back); each step includes hf_decode's position reset (one foreach copy).
Then a cProfile of 20 piecewise steps (own time), and per CUDA-graph runner its copies per replay.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import tempfile

import torch

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # bench/: the harness, the benchmarks
sys.path.insert(0, BENCH)

import hf_decode as H  # noqa: E402  (puts the repository on sys.path)
from decode_profile import gpu_us, host_us  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--columns", default="ext-piecewise,ext-full")
    args = parser.parse_args()
    b = args.batch
    setup = H.Setup(argparse.Namespace(batches=[b], smoke=False))
    os.environ.setdefault("TORCH_EXT_BENCH_CACHE_ROOT", tempfile.mkdtemp(prefix="hf_profile_"))
    fns, _ = H.first_calls(setup, args.columns.split(","), [b])

    def step(fn):
        def run():
            setup.step(fn, b)
            setup.reset(b)
        return run

    setup.reset(b)  # the first calls advanced the position: the cache has no room for another step
    with torch.no_grad():
        for fn in fns.values():
            for _ in range(3):  # capture and first replays
                step(fn)()
        reset_host, reset_gpu = host_us(lambda: setup.reset(b)), gpu_us(lambda: setup.reset(b))
        print(f"B={b}: position reset alone: host {reset_host:.1f} us, gpu {reset_gpu:.1f} us")
        for round_ in range(2):
            cells = [f"{name} host {host_us(step(fn)):7.1f} gpu {gpu_us(step(fn)):7.1f}" for name, fn in fns.items()]
            print(f"  round {round_}: " + " | ".join(cells))

        piecewise = fns.get("ext-piecewise")
        if piecewise is None:
            return 0
        prof = cProfile.Profile()
        torch.cuda.synchronize()
        prof.enable()
        for _ in range(20):
            step(piecewise)()
        prof.disable()
        torch.cuda.synchronize()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(30)
    print("\ncProfile of 20 piecewise steps (own time):")
    print("\n".join(line[:170] for line in buf.getvalue().splitlines()[4:] if line.strip()))
    backend = getattr(piecewise, "backend", None)
    if backend is not None and backend.cudagraphs is not None:
        print(f"\nPiecewise runners at B={b}: copies per replay (input position: shape, made by)")
        for runner in backend.cudagraphs.runners():
            for plan in runner._plans.values():
                if plan.replay is None:
                    continue
                copies = ", ".join(f"{i}: {tuple(dst.shape)} {runner.made_by_splitting_op.get(i, '')}"
                                   for i, dst in plan.copies)
                print(f"  {runner.name}: {len(plan.copies)} copies [{copies}], {len(plan.reused)} reused, "
                      f"{len(plan.copy_back)} copied back")
    return 0


if __name__ == "__main__":
    sys.exit(main())
