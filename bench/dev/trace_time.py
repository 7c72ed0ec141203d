"""Dynamo trace time of a 32-region model: torch's own HOP tracing beside torch_ext.install().

Each region returns a dataclass holding tensors (what wrap semantics is for). Times the first call
of torch.compile(backend="eager") after a Dynamo reset — tracing, guards, no codegen — as the
median of several runs. On torch < 2.10 torch's own tracing breaks the graph, so its column reports
the graph count instead.

    python bench/dev/trace_time.py [--layers 32] [--repeats 5]
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch
import torch.nn as nn
from torch._dynamo.testing import CompileCounter
from torch._higher_order_ops.wrap import wrap
from torch.utils.checkpoint import checkpoint

import torch_ext


@dataclasses.dataclass
class Hidden:
    h: torch.Tensor
    gate: torch.Tensor
    depth: int


class RegionLayer(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    @torch.compiler.nested_compile_region
    def forward(self, x):
        y = self.lin(x)
        return Hidden(y.relu(), torch.sigmoid(y), 1)


class CheckpointLayer(RegionLayer):
    def forward(self, x):
        return checkpoint(self._body, x, use_reentrant=False)

    def _body(self, x):
        y = self.lin(x)
        return Hidden(y.relu(), torch.sigmoid(y), 1)


class WrapLayer(CheckpointLayer):
    def forward(self, x):
        return wrap(self._body, x)


class Model(nn.Module):
    def __init__(self, layer_cls, layers, dim=16):
        super().__init__()
        self.layers = nn.ModuleList(layer_cls(dim) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            out = layer(x)
            x = out.h * out.gate + out.depth
        return x


def trace_once(model, x):
    torch._dynamo.reset()
    counter = CompileCounter()
    start = time.perf_counter()
    torch.compile(model, backend=counter)(x)
    return time.perf_counter() - start, counter.frame_count


def trace_or_fail(model, x):
    try:
        return trace_once(model, x)
    except Exception as e:  # torch's own tracing fails on torch < 2.10: report it, don't time it
        return float("nan"), f"fails: {type(e).__name__}"


def measure_side_by_side(model, x, repeats):
    """Alternate torch and torch_ext runs so drift (caches, GC, the other core) hits both alike."""
    trace_or_fail(model, x)  # warm imports and caches
    with torch_ext.installed():
        trace_once(model, x)
    torch_times, ext_times = [], []
    for _ in range(repeats):
        t, torch_graphs = trace_or_fail(model, x)
        torch_times.append(t)
        with torch_ext.installed():
            t, ext_graphs = trace_once(model, x)
        ext_times.append(t)
    return statistics.median(torch_times), torch_graphs, statistics.median(ext_times), ext_graphs


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.manual_seed(0)
    x = torch.randn(4, 16)
    rows = []
    for kind, layer_cls in [("nested_compile_region", RegionLayer), ("checkpoint", CheckpointLayer),
                            ("wrap", WrapLayer)]:
        model = Model(layer_cls, args.layers)
        rows.append((kind, *measure_side_by_side(model, x, args.repeats)))

    print(f"Dynamo trace time, {args.layers} regions, torch {torch.__version__}, median of {args.repeats}")
    print(f"{'HOP':<24}{'torch (ms)':>12}{'torch graphs':>40}{'torch_ext (ms)':>16}{'graphs':>8}{'ext/torch':>11}")
    for kind, torch_s, torch_graphs, ext_s, ext_graphs in rows:
        ratio = f"{ext_s / torch_s:.2f}x" if torch_graphs == 1 else "n/a"
        print(f"{kind:<24}{torch_s * 1e3:>12.1f}{str(torch_graphs):>40}{ext_s * 1e3:>16.1f}{ext_graphs:>8}{ratio:>11}")


if __name__ == "__main__":
    main()
