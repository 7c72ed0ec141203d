"""Per-piece runners: pick the compiled variant of a piece by the runtime size of the dynamic dim.

A `CompiledPiece` stands for every piece with one fingerprint (identical layers share one), and is
what the split graph calls. On each call it reads the dynamic size from one argument (an int
SymInt input, or a dimension of a tensor input) and runs, in this order of preference:
the variant compiled for exactly that size (CompileConfig.compile_sizes, and where the decode
rewrites want the shapes known: rewrite/per_size.py), the variant of the
bounded range holding it (compile_ranges_split_points), or the general symbolic compile.
Size and range variants are built at the first call that needs them.

A size variant is specialized on every input shape, so it is used only when the dynamic dim is
the piece's only symbol; a piece with other dynamic dims runs its range/general variants.
"""
from __future__ import annotations

import bisect
from typing import Any, Callable

import torch
import torch.fx as fx

from torch_ext.backend.runtime import layout
from torch_ext.backend.compile.compiler import GENERAL, Variant
from torch_ext.backend.rewrite.per_size import wants_size_variant

_MAX_MEMO_SIZES = 4096  # runtime sizes remembered per piece (beyond: resolved on every call)


def example_inputs_of(gm: fx.GraphModule) -> list[Any]:
    return [n.meta.get("example_value", n.meta.get("val")) for n in gm.graph.nodes if n.op == "placeholder"]


def batch_symbol(gm: fx.GraphModule):
    """The symbol of the dynamic dimension compile sizes and capture sizes refer to: dim 0 of the first
    input tensor whose dim 0 is symbolic; None where no tensor has one. Never a symbolic int alone: an
    int that sizes no tensor (a position passed as a Python int) is no batch size, and padding it up
    to a capture size would change what the graph computes (such a graph runs without CUDA graphs)."""
    for v in example_inputs_of(gm):
        if isinstance(v, torch.Tensor) and v.dim() > 0 and isinstance(v.shape[0], torch.SymInt):
            expr = v.shape[0].node.expr
            if expr.is_Symbol:
                return expr
    return None


def batch_size_of(gm: fx.GraphModule) -> torch.SymInt | None:
    """The SymInt whose symbol is batch_symbol(gm) (for its bounds), or None."""
    symbol = batch_symbol(gm)
    for v in example_inputs_of(gm):
        sizes = v.shape if isinstance(v, torch.Tensor) else (v,) if isinstance(v, torch.SymInt) else ()
        for size in sizes:
            if isinstance(size, torch.SymInt) and size.node.expr == symbol:
                return size
    return None


def free_symbols(values: list[Any]) -> set:
    out: set = set()

    def add(x):
        if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            out.update(x.node.expr.free_symbols)

    for v in values:
        if isinstance(v, torch.Tensor):
            for x in (*v.shape, *v.stride(), v.storage_offset()):
                add(x)
        else:
            add(v)
    return out


def size_locator(values: list[Any], symbol) -> tuple[int, int | None] | None:
    """Where the runtime value of `symbol` can be read: (arg index, None) for an int argument,
    (arg index, dim) for a tensor dimension; None if no input carries it."""
    if symbol is None:
        return None
    for i, v in enumerate(values):
        if isinstance(v, torch.SymInt) and v.node.expr == symbol:
            return (i, None)
    for i, v in enumerate(values):
        if isinstance(v, torch.Tensor):
            for d, s in enumerate(v.shape):
                if isinstance(s, torch.SymInt) and s.node.expr == symbol:
                    return (i, d)
    return None


class CompiledPiece:
    """All pieces with one fingerprint; callable with the piece's arguments."""

    def __init__(self, name: str, gm: fx.GraphModule, fingerprint: str, single_output: bool,
                 symbol, group):
        self.name = name
        self.graph_module = gm  # output rewritten to a flat tuple; kept for lazy compiles
        self.fingerprint = fingerprint
        self.single_output = single_output
        self.group = group  # PieceGroup: config, builder, store, progress bars
        self.example_inputs = example_inputs_of(gm)
        self.locator = size_locator(self.example_inputs, symbol)
        self.size_specializable = self.locator is not None and free_symbols(self.example_inputs) == {symbol}
        self.occurrences = 0
        self.variants: dict[Variant, Callable] = {}
        self._by_runtime_size: dict[int, Callable] = {}
        self._general: Callable | None = None
        self.layout_checks: tuple[layout.LayoutCheck, ...] = ()
        self.input_sources: dict[int, str] = {}  # argument index -> what makes it (for messages)
        self.label = f"{group.name}/{name}"

    def check_layouts(self, sources: dict[int, str]) -> None:
        """Check the layout of the arguments at these indices on every call (layout.py): a call site
        passes them from inside the graph; `sources` names what makes each."""
        for index, source in sources.items():
            self.input_sources.setdefault(index, source)
        self.layout_checks = layout.checks_for(self.example_inputs, self.input_sources)

    def eligible(self, variant: Variant) -> bool:
        if variant.kind == "size":
            return self.size_specializable
        if variant.kind == "range":
            return self.locator is not None
        return True

    def build(self, variant: Variant, args) -> Callable:
        fn = self.variants.get(variant)
        if fn is None:
            fn = self.variants[variant] = self.group.build(self, variant, args)
            if variant == GENERAL:
                self._general = fn
        return fn

    def __call__(self, *args):
        if self.layout_checks:  # before a size variant is compiled from these args
            args = layout.with_layouts(args, self.layout_checks, self.label, self.input_sources)
        locator = self.locator
        if locator is None:
            fn = self._general
        else:
            index, dim = locator
            n = args[index] if dim is None else args[index].shape[dim]
            fn = self._by_runtime_size.get(n)
            if fn is None:
                fn = self._resolve(int(n), args)
        out = fn(*args)
        return out[0] if self.single_output else out

    def _resolve(self, n: int, args) -> Callable:
        config = self.group.config
        variant = GENERAL
        if self.size_specializable and wants_size_variant(config, n, self.graph_module):  # else: said by the backend, once
            variant = Variant("size", size=n)
        if variant == GENERAL:
            ranges = self.group.bounded_ranges
            i = bisect.bisect_right(self.group.range_starts, n) - 1
            if 0 <= i < len(ranges) and n < ranges[i][1]:
                variant = Variant("range", lo=ranges[i][0], hi=ranges[i][1])
        fn = self.build(variant, args) if variant != GENERAL else self._general
        if len(self._by_runtime_size) < _MAX_MEMO_SIZES:
            self._by_runtime_size[n] = fn
        return fn
