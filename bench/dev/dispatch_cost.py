"""Host cost of a guard-free call, with and without the per-call signature check (CPU; no GPU needed).

    python bench/dev/dispatch_cost.py [--calls 200] [--rounds 200] [--layers 16]

Two models compiled by the torch_ext backend (Inductor pieces, disk cache in a temp dir), called at
batch 4 under torch.no_grad() after their first call (batch dim marked dynamic):
  tiny      forward(x): Linear, GELU, Linear (one tensor argument)
  decode    forward(x, k_caches, v_caches, pos) with one K and one V cache per layer (the decode
            benchmark's signature: 2 * layers + 1 tensors and an int); each layer reads one element
            of its caches, so the compiled code is small and the host cost is mostly dispatch
Peers, timed in interleaved rounds (median of the rounds; one intra-op thread):
  torch.compile   the same backend through torch.compile: Dynamo's guards on every call
  unchecked       the guard-free fast path before the signature check: Dynamo's transformed code
                  called directly (what GuardFreeDispatcher.__call__ did)
  checked         GuardFreeDispatcher now: the generated signature check, then that code
  check alone     the generated check by itself
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
from torch import nn

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # bench/: the harness, the benchmarks
sys.path.insert(0, BENCH)
sys.path.insert(0, os.path.join(BENCH, ".."))

from harness import print_table  # noqa: E402
from torch_ext.backend import CompileConfig, make_backend  # noqa: E402
from torch_ext.backend.dispatch.dispatcher import GuardFreeDispatcher  # noqa: E402

HIDDEN, MAX_BATCH, MAX_POS = 64, 8, 16


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(HIDDEN, 2 * HIDDEN), nn.Linear(2 * HIDDEN, HIDDEN)

    def forward(self, x):
        return self.down(torch.nn.functional.gelu(self.up(x)))


class Decode(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x, k_caches, v_caches, pos: int):
        h = self.lin(x)
        for kc, vc in zip(k_caches, v_caches):
            h = h + kc[0, pos, 0] * vc[0, pos, 0]
        return h


class Unchecked:
    """The guard-free fast path before the check: the armed code, called directly."""

    def __init__(self, dispatcher: GuardFreeDispatcher):
        self._fast = dispatcher._variants[0][1]

    def __call__(self, *args, **kwargs):
        fast = self._fast
        if fast is not None:
            return fast(*args, **kwargs)


def per_call_us(fn, args, calls: int) -> float:
    for _ in range(10):
        fn(*args)
    start = time.perf_counter()
    for _ in range(calls):
        fn(*args)
    return (time.perf_counter() - start) / calls * 1e6


def peers(model, first_args, args, cache_dir):
    """{peer: (callable, args)} for one model, each compiled with its first call."""
    config = CompileConfig(cache_dir=cache_dir, progress_bar=False)
    plain = torch.compile(model, backend=make_backend(config))
    guard_free = GuardFreeDispatcher(model, make_backend(config))
    with torch.no_grad():
        for fn in (plain, guard_free):
            torch._dynamo.mark_dynamic(first_args[0], 0)
            fn(*first_args)
            fn(*args)
    assert guard_free.calls == 1, "the timed calls must match the first call's signature"
    return {"torch.compile": (plain, args), "unchecked": (Unchecked(guard_free), args),
            "checked": (guard_free, args), "check alone": (guard_free.signatures[0].check, args)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--layers", type=int, default=16)
    args = parser.parse_args()
    torch.set_num_threads(1)  # host cost, not kernel speed: one thread is steadier on a shared CPU
    torch.manual_seed(0)
    cache_dir = tempfile.mkdtemp(prefix="torch_ext_dispatch_cost_")
    caches = lambda: [torch.randn(MAX_BATCH, MAX_POS, 2, HIDDEN) for _ in range(args.layers)]  # noqa: E731
    k, v = caches(), caches()
    models = {
        "tiny": peers(Tiny(), (torch.randn(4, HIDDEN),), (torch.randn(4, HIDDEN),), cache_dir),
        f"decode, {args.layers} layers": peers(Decode(), (torch.randn(4, HIDDEN), k, v, 3),
                                               (torch.randn(4, HIDDEN), k, v, 3), cache_dir),
    }
    times: dict = {}
    with torch.no_grad():
        for _ in range(args.rounds):
            for name, fns in models.items():
                for peer, (fn, fn_args) in fns.items():
                    times.setdefault((name, peer), []).append(per_call_us(fn, fn_args, args.calls))
    names = list(next(iter(models.values())))
    print(f"Host us per call (median of {args.rounds} interleaved rounds of {args.calls} calls; torch "
          f"{torch.__version__}, {os.cpu_count()} CPUs)")
    rows = []
    for name in models:
        t = {peer: statistics.median(times[(name, peer)]) for peer in names}
        rows.append([name] + [f"{t[p]:.2f}" for p in names] + [f"{t['checked'] - t['unchecked']:+.2f}"])
    print_table(["model"] + names + ["checked - unchecked"], rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
