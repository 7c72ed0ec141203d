"""Host cost of calling a splitting op, by how it is declared (CPU; no GPU needed).

    python bench/dev/splitting_op_cost.py [--calls 20000] [--rounds 5]

Under piecewise CUDA graphs every splitting op runs eagerly on every step (16 calls per step for a
16-layer decoder), so what the dispatcher adds per call is paid on the host each step. Peers, all
wrapping the same Python function, timed in interleaved rounds (median of the rounds):
  python fn            the function called directly (the floor)
  Library (vLLM)       torch.library.Library define + impl, no autograd kernel (vLLM's
                       direct_register_custom_op; gradients through it are not checked)
  autograd=False       torch_ext's splitting_op(..., autograd=False)
  custom_op            torch_ext's splitting_op(...) (torch.library.custom_op)
  custom_op direct     that op through torch_ext's direct caller (backend/runtime/direct_call.py), as the
                       piecewise CUDA-graph runner calls it between replays
Ops: "out", writes its result into a buffer it mutates (returns None); "ret", returns a new tensor.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # bench/: the harness, the benchmarks
sys.path.insert(0, BENCH)
sys.path.insert(0, os.path.join(BENCH, ".."))

from harness import print_table  # noqa: E402
from torch_ext.backend.runtime.direct_call import direct_caller  # noqa: E402
from torch_ext.hops.splitting_op import splitting_op  # noqa: E402


def write_into(x: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(x)


def returning(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


def declare():
    """{(peer, op kind): callable}, every peer over the same two functions."""
    lib = torch.library.Library("cost_lib", "DEF")
    lib.define("write_into(Tensor x, Tensor(a!) out) -> ()")
    lib.impl("write_into", write_into, "CompositeExplicitAutograd")
    lib.define("returning(Tensor x) -> Tensor")
    lib.impl("returning", returning, "CompositeExplicitAutograd")
    torch.library.register_fake("cost_lib::returning", lambda x: torch.empty_like(x), lib=lib)
    ops = {("python fn", "out"): write_into, ("python fn", "ret"): returning,
           ("Library (vLLM)", "out"): torch.ops.cost_lib.write_into, ("Library (vLLM)", "ret"): torch.ops.cost_lib.returning}
    for peer, ns, autograd in (("autograd=False", "cost_fast", False), ("custom_op", "cost_custom", True)):
        ops[(peer, "out")] = splitting_op(f"{ns}::write_into", mutates_args=("out",), autograd=autograd)(write_into)
        ops[(peer, "ret")] = splitting_op(f"{ns}::returning", fake=lambda x: torch.empty_like(x),
                                          autograd=autograd)(returning)
    for kind, name in (("out", "write_into"), ("ret", "returning")):
        ops[("custom_op direct", kind)] = direct_caller(getattr(torch.ops.cost_custom, name).default)
    return ops, lib


def per_call_us(fn, args, calls: int) -> float:
    for _ in range(200):
        fn(*args)
    start = time.perf_counter()
    for _ in range(calls):
        fn(*args)
    return (time.perf_counter() - start) / calls * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    ops, _lib = declare()
    peers = list(dict.fromkeys(peer for peer, _ in ops))
    modes = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}
    times = {}
    for mode, context in modes.items():
        with context():
            x, out = torch.randn(8, 64), torch.empty(8, 64)
            operands = {"out": (x, out), "ret": (x,)}
            for _ in range(args.rounds):
                for (peer, kind), fn in ops.items():
                    times.setdefault((mode, peer, kind), []).append(per_call_us(fn, operands[kind], args.calls))
    print(f"Host us per call (median of {args.rounds} interleaved rounds of {args.calls} calls; torch "
          f"{torch.__version__}, {os.cpu_count()} CPUs); in brackets: minus the python fn call")
    header = ["context", "op"] + peers
    rows = []
    for mode in modes:
        for kind in ("out", "ret"):
            base = statistics.median(times[(mode, "python fn", kind)])
            row = [mode, kind]
            for peer in peers:
                t = statistics.median(times[(mode, peer, kind)])
                row.append(f"{t:.2f}" if peer == "python fn" else f"{t:.2f} (+{t - base:.2f})")
            rows.append(row)
    print_table(header, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
