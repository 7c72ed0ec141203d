"""The compiled pieces of one Dynamo graph, deduplicated by fingerprint.

`PieceGroup` makes one `CompiledPiece` runner per distinct piece graph (identical layers share one),
builds their variants through the backend's `VariantBuilder`, and shows a tqdm bar while it builds
several of them.
"""
from __future__ import annotations

import hashlib
from typing import Any, Callable

import torch.fx as fx
import tqdm

from torch_ext.backend.compile.builder import VariantBuilder
from torch_ext.backend.compile.cache import ArtifactStore
from torch_ext.backend.compile.compiler import GENERAL, Variant
from torch_ext.backend.compile.fingerprint import graph_fingerprint
from torch_ext.backend.config import CompileConfig
from torch_ext.backend.split.checkpoint import carries_policy
from torch_ext.backend.split.splitter import is_trivial
from torch_ext.backend.runtime.piecewise import CompiledPiece


def _flatten_output(gm: fx.GraphModule) -> bool:
    """Make gm return a flat tuple (what Inductor returns, fresh or loaded); True if it returned one value."""
    output = gm.graph.output_node()
    result = output.args[0]
    if isinstance(result, (tuple, list)):
        return False
    output.args = ((result,),)
    gm.recompile()
    return True


class PieceGroup:
    """The deduplicated compiled pieces of one Dynamo graph."""

    def __init__(self, name: str, config: CompileConfig, builder: VariantBuilder, store: ArtifactStore | None,
                 symbol):
        self.name = name
        self.config = config
        self.builder = builder
        self.store = store
        self.symbol = symbol
        self.pieces: dict[str, CompiledPiece] = {}
        self.occurrences = 0  # compute pieces in the graph, trivial ones included
        self.splitting_ops = 0
        self.checkpoint_regions = 0  # kept checkpoint regions (split/checkpoint.py)
        self.bounded_ranges = [r for r in config.compile_ranges() if r[1] is not None]
        self.range_starts = [lo for lo, _ in self.bounded_ranges]
        self._bars: dict[Variant, Any] = {}

    def piece_for(self, name: str, gm: fx.GraphModule, position: int) -> CompiledPiece | None:
        """The shared CompiledPiece for this piece graph, or None if it needs no compiling."""
        if is_trivial(gm):
            return None
        fingerprint = graph_fingerprint(gm)
        if not self.config.dedup:
            fingerprint = hashlib.sha256(f"{fingerprint}|{self.name}|{position}".encode()).hexdigest()
        piece = self.pieces.get(fingerprint)
        if piece is None:
            single = _flatten_output(gm)
            piece = self.pieces[fingerprint] = CompiledPiece(name, gm, fingerprint, single, self.symbol, self)
        piece.occurrences += 1
        return piece

    def build(self, piece: CompiledPiece, variant: Variant, args) -> Callable:
        example_inputs = args if variant.kind == "size" else piece.example_inputs
        bar = self._bar(variant)
        # A checkpoint policy is Python code the disk cache cannot key: such pieces compile in each process.
        store = None if carries_policy(piece.graph_module) else self.store
        fn = self.builder.build(piece.name, piece.graph_module, piece.fingerprint, variant, example_inputs, store)
        if bar is not None:
            bar.update(1)
            if bar.n >= bar.total:
                bar.close()
        return fn

    def compile_general(self) -> None:
        for piece in self.pieces.values():
            piece.build(GENERAL, piece.example_inputs)

    def _bar(self, variant: Variant):
        if variant not in self._bars:
            total = sum(1 for p in self.pieces.values() if p.eligible(variant))
            disable = {True: False, False: True, None: None}[self.config.progress_bar]  # None: tty only
            self._bars[variant] = None if total < 2 else tqdm.tqdm(
                total=total, desc=f"torch_ext {self.name} {variant.label}", unit="piece", leave=False,
                disable=disable)
        return self._bars[variant]
