"""Configuration a graph cannot use, said once: a splitting op that matches no call, sizes no batch
can reach, compile sizes pieces cannot be specialized for.

A model with graph breaks hands the backend several graphs, and the first one often holds no
attention at all (Hugging Face models break on a logging call before their layers): a splitting op
is said to match nothing only when no graph has matched it and a second graph, or the second call
of the first one, still does not.
"""
from __future__ import annotations

import logging

import torch
import torch.fx as fx

from torch_ext import compat
from torch_ext.backend.runtime.piece_group import PieceGroup
from torch_ext.backend.config import CompileConfig
from torch_ext.backend.runtime.piecewise import batch_size_of, free_symbols
from torch_ext.backend.split.matcher import SplittingOpMatcher
from torch_ext.backend.split.splitter import unmatched_splitting_ops

log = logging.getLogger("torch_ext.backend")


class UnusedConfigReporter:
    """One per backend: remembers what it said and which splitting ops some graph matched."""

    def __init__(self, config: CompileConfig, matcher: SplittingOpMatcher):
        self.config = config
        self.matcher = matcher
        self._said: set[str] = set()
        self._matched: set[str] = set()
        self._pending: dict[str, tuple[int, list[str]]] = {}  # op -> (first graph lacking it, nearest names)

    def graph(self, gm: fx.GraphModule, index: int, group: PieceGroup, runs: torch.nn.Module) -> None:
        """Check Dynamo graph `index` before its pieces compile; `runs`: the module that runs it."""
        self._splitting_ops(gm, index, runs)
        self._unreachable_sizes(gm, index)
        self._sizes_not_specializable(gm, group, index)

    def training_graph(self, gm: fx.GraphModule, index: int, runs: torch.nn.Module) -> None:
        """Check a training graph differentiated once (joint.py): it is compiled for every size at once."""
        self._splitting_ops(gm, index, runs)
        self._unreachable_sizes(gm, index)
        sized = [f for f in ("compile_sizes", "compile_ranges_split_points") if getattr(self.config, f)]
        if sized and "training/sizes" not in self._said:
            self._said.add("training/sizes")
            log.warning("torch_ext: %s apply to inference graphs; training graph %d is compiled once for every "
                        "size, as Inductor compiles it (CompileConfig.differentiate_once).", " and ".join(sized), index)
        if self.config.cudagraph_mode != "none" and not self.config.training_cudagraphs \
                and "training/cudagraphs" not in self._said:
            self._said.add("training/cudagraphs")
            log.warning("torch_ext: cudagraph_mode=%r applies to inference graphs; training graph %d runs without "
                        "CUDA graphs (CompileConfig.training_cudagraphs=\"whole\" replays it with Inductor's "
                        "CUDA-graph trees, one graph per direction; \"pieces\" where the splitting ops cannot be "
                        "captured).", self.config.cudagraph_mode, index)

    def _splitting_ops(self, gm: fx.GraphModule, index: int, runs: torch.nn.Module) -> None:
        unmatched = unmatched_splitting_ops(gm, self.matcher)
        self._matched.update(name for name in self.matcher.names if name not in unmatched)
        first_seen = []
        for name, nearest in unmatched.items():
            if name in self._matched or name in self._said:
                continue
            if name in self._pending:
                self._say_unmatched(name, f"graphs {self._pending[name][0]} and {index}", nearest)
            else:
                self._pending[name] = (index, nearest)
                first_seen.append(name)
        if first_seen:
            self._say_at_second_call(runs, first_seen)

    def _say_at_second_call(self, runs: torch.nn.Module, names: list[str]) -> None:
        """By a graph's second call, the graphs after its graph breaks have been compiled."""
        calls = []

        def hook(module, args):
            calls.append(None)
            if len(calls) == 2:
                handle.remove()
                for name in names:
                    if name in self._pending and name not in self._matched and name not in self._said:
                        self._say_unmatched(name, f"graph {self._pending[name][0]}")

        handle = runs.register_forward_pre_hook(hook)

    def _say_unmatched(self, name: str, where: str, nearest: list[str] = ()) -> None:
        self._said.add(name)
        nearest = list(dict.fromkeys([*nearest, *self._pending.pop(name)[1]]))[:3]
        hint = f"; calls in the graph with the nearest names: {', '.join(nearest)}" if nearest else ""
        log.warning("torch_ext: splitting op %s matches no call in %s (nor in any graph so far), so the model "
                    "is not split there%s (docs/guide/backend.md: which names match).", name, where, hint)

    def _unreachable_sizes(self, gm: fx.GraphModule, index: int) -> None:
        """Sizes no batch the graph accepts can reach (its batch has an upper bound from
        mark_dynamic(max=...) or torch._check): said once per kind."""
        size = batch_size_of(gm)
        upper = compat.symbol_upper_bound(size) if size is not None else None
        if upper is None:
            return
        capture = self.config.cudagraph_capture_sizes
        never = {"compile_sizes": [n for n in self.config.compile_sizes if n > upper],
                 # a capture size serves the batches above the one before it (they pad up to it)
                 "cudagraph_capture_sizes": [n for i, n in enumerate(capture) if i > 0 and capture[i - 1] >= upper]}
        for field, above in never.items():
            if above and field not in self._said:
                self._said.add(field)
                log.warning("torch_ext: %s %s are never used: graph %d accepts batches up to %d (its shape "
                            "constraints). Drop them, or raise the bound.", field, above, index, upper)

    def _sizes_not_specializable(self, gm: fx.GraphModule, group: PieceGroup, index: int) -> None:
        """compile_sizes apply only to pieces whose one dynamic dim is the batch (a size variant
        specializes every shape); pieces with other dynamic dims (dynamic=True makes the sequence
        dim dynamic too) run their range/general compile instead."""
        if not self.config.compile_sizes or "compile_sizes/dims" in self._said:
            return
        skipped = [p for p in group.pieces.values() if p.locator is not None and not p.size_specializable]
        if not skipped:
            return
        self._said.add("compile_sizes/dims")
        others = set().union(*(free_symbols(p.example_inputs) for p in skipped)) - {group.symbol}
        log.warning("torch_ext: compile_sizes %s do not apply to %d of %d pieces of graph %d: besides the batch "
                    "(%s) they have dynamic dims (%s), and a size variant would specialize them; those pieces "
                    "run their range/general compile. Sizes apply where only the batch dim is dynamic: mark it "
                    "(torch._dynamo.mark_dynamic(x, 0)) rather than passing dynamic=True, and keep the other "
                    "dims fixed (pad them; torch._dynamo.mark_static(x, 1) stops Dynamo making them dynamic).", list(self.config.compile_sizes), len(skipped), len(group.pieces), index,
                    _where_symbols(gm, {group.symbol}), _where_symbols(gm, others))


def _where_symbols(gm: fx.GraphModule, symbols: set) -> str:
    """Each symbol with the first graph input dim that carries it, e.g. "s1: L['x'].size(1)"."""
    where: dict = {}
    for node in gm.graph.nodes:
        value = node.meta.get("example_value", node.meta.get("val"))
        if node.op != "placeholder" or not isinstance(value, torch.Tensor):
            continue
        name = compat.placeholder_source(node) or node.name
        for dim, size in enumerate(value.shape):
            if isinstance(size, torch.SymInt) and size.node.expr in symbols:
                where.setdefault(size.node.expr, f"{name}.size({dim})")
    return ", ".join(f"{s}: {where[s]}" if s in where else str(s) for s in sorted(symbols, key=str))
