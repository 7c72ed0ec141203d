"""Compile the pieces of an ATen graph (a forward or backward graph AOTAutograd made of a training
graph: backend/joint.py) with Inductor, once per distinct piece: identical layers share one compile.

Pieces here are compiled by `compile_fx_inner`, as Inductor compiles a whole forward or backward
graph: no AOTAutograd of their own and no autograd.Function per piece (the one around the whole
graph is AOTAutograd's). Inductor's FX-graph cache serves them across processes.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Callable

import torch
import torch.fx as fx

from torch_ext import compat
from torch_ext.backend.compile.fingerprint import graph_fingerprint
from torch_ext.backend.counters import counters

log = logging.getLogger(__name__)


@dataclasses.dataclass
class CompiledAtenPiece:
    """A compiled piece, called with a list of its arguments that it clears (boxed, as Inductor's code:
    each input is freed once read); `output_strides`: what Inductor chose per output."""

    fn: Callable[[list], Any]
    single_output: bool
    output_strides: list | None
    _boxed_call = True

    def __call__(self, args: list):
        out = self.fn(args)
        return out[0] if self.single_output else out


def _as_tuple_output(gm: fx.GraphModule) -> bool:
    """Make gm return a flat tuple whose every output keeps its traced layout (a splitting op or the
    next piece reads it as traced); True if it returned one value."""
    output = gm.graph.output_node()
    single = not isinstance(output.args[0], (tuple, list))
    if single:
        output.args = ((output.args[0],),)
    output.meta["user_visible_output_idxs"] = list(range(len(output.args[0])))
    gm.recompile()
    return single


class AtenPieceCompiler:
    """One per backend: pieces with one fingerprint (and direction) are compiled once per process."""

    def __init__(self, dedup: bool = True):
        self.dedup = dedup
        self._memo: dict[str, CompiledAtenPiece] = {}

    def compile_whole(self, gm: fx.GraphModule, example_inputs, kwargs: dict, label: str) -> Callable:
        """A graph with nothing to split at, compiled as Inductor's own inner compile would (its arguments)."""
        start = time.perf_counter()
        fn = compat.compile_whole_aten_graph(gm, example_inputs, kwargs)
        self._count(time.perf_counter() - start, label)
        return fn

    def _count(self, elapsed: float, label: str) -> None:
        counters.compile_seconds += elapsed
        counters.inductor_compiles += 1
        counters.compiles_by_variant["general"] += 1
        log.debug("compiled %s in %.2f s", label, elapsed)

    def compile(self, gm: fx.GraphModule, *, is_backward: bool, is_inference: bool, label: str,
                cudagraphs: dict | None = None) -> CompiledAtenPiece:
        """`cudagraphs`: Inductor's CUDA-graph arguments for this piece (joint.py), None for Inductor's
        defaults."""
        single = _as_tuple_output(gm)
        graphed = bool(cudagraphs and cudagraphs.get("cudagraphs"))  # False: kept off graphs (replayed whole)
        static = tuple(cudagraphs.get("static_input_idxs", ())) if graphed else None
        key = f"{graph_fingerprint(gm)}|backward={is_backward}|inference={is_inference}|cudagraphs={static}"
        if self.dedup and key in self._memo:
            return self._memo[key]
        example_inputs = [n.meta.get("val") for n in gm.graph.find_nodes(op="placeholder")]
        start = time.perf_counter()
        fn, strides = compat.compile_aten_graph(gm, example_inputs, is_backward=is_backward, is_inference=is_inference,
                                                cudagraphs=cudagraphs)
        self._count(time.perf_counter() - start, label)
        piece = CompiledAtenPiece(fn, single, strides)
        if self.dedup:
            self._memo[key] = piece
        counters.unique_pieces += 1  # a distinct piece compiled (one per fingerprint and direction)
        return piece


def value_strides(value: Any) -> tuple | None:
    """The strides of a traced value (a tensor the eager code makes, e.g. a splitting op's output)."""
    return tuple(value.stride()) if isinstance(value, torch.Tensor) else None
