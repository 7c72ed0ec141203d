"""Get compiled variants of pieces: from the in-process memo, else the disk cache, else Inductor.

`PieceGroup` holds the pieces of one Dynamo graph (deduplicated by fingerprint) and shows a tqdm
bar while it builds several of them; `VariantBuilder` (one per backend) turns (piece, variant)
into a callable, compiling each distinct artifact once per process and, with a cache, once per
cache directory across processes.
"""
from __future__ import annotations

import hashlib
import logging
import operator
from typing import Any, Callable

import torch
import torch.fx as fx
import tqdm

from torch_ext.backend import inductor_keys
from torch_ext.backend.cache import ArtifactStore
from torch_ext.backend.compiler import GENERAL, InductorCompiler, Variant
from torch_ext.backend.config import CompileConfig
from torch_ext.backend.counters import counters
from torch_ext.backend.fingerprint import graph_fingerprint
from torch_ext.backend.piecewise import CompiledPiece

log = logging.getLogger(__name__)


class VariantBuilder:
    def __init__(self, compiler: InductorCompiler):
        self.compiler = compiler
        self._memo: dict[str, tuple[Callable, bytes | None]] = {}  # artifact name -> (callable, bytes)

    def artifact_name(self, piece: CompiledPiece, variant: Variant) -> str:
        factors = f"{piece.fingerprint}|{self.compiler.key_factors(variant)}"
        return hashlib.sha256(factors.encode()).hexdigest()

    def build(self, piece: CompiledPiece, variant: Variant, example_inputs, store: ArtifactStore | None) -> Callable:
        name = self.artifact_name(piece, variant)
        if name in self._memo:
            fn, blob = self._memo[name]
            if store is not None and blob is not None and not store.has(name):
                _write(store, name, blob)  # shared with another graph: keep each graph's cache whole
            return fn
        fn, blob = self._load_or_compile(piece, variant, example_inputs, store, name)
        self._memo[name] = (fn, blob)
        return fn

    def _load_or_compile(self, piece, variant, example_inputs, store, name) -> tuple[Callable, bytes | None]:
        if store is None:
            return self.compiler.compile(piece.graph_module, example_inputs, variant, name=piece.name), None
        inductor_keys.prime(self.compiler.config.cache_dir)  # before Inductor computes it
        result = self._load_or_compile_cached(piece, variant, example_inputs, store, name)
        inductor_keys.remember(self.compiler.config.cache_dir)  # computed by now
        return result

    def _load_or_compile_cached(self, piece, variant, example_inputs, store, name) -> tuple[Callable, bytes | None]:
        with store.lock(name):
            blob = store.read(name)
            if blob is not None:
                try:
                    fn = self.compiler.deserialize(blob)
                except Exception as e:  # passes the checksum but Inductor cannot use it
                    store.discard(name, f"cannot be loaded: {type(e).__name__}: {e}")
                else:
                    counters.cache_hits += 1
                    return fn, blob
            counters.cache_misses += 1
            artifact = self.compiler.compile(piece.graph_module, example_inputs, variant, name=piece.name)
            blob = self.compiler.serialize(artifact)
            if blob is not None:
                _write(store, name, blob)
            return artifact, blob


def _write(store: ArtifactStore, name: str, blob: bytes) -> None:
    try:
        store.write(name, blob)
    except OSError as e:  # a full disk costs the next process a compile, not this one its run
        log.warning("torch_ext cache: cannot write %s (%s); continuing without it", store.path(name), e)


def is_trivial(gm: fx.GraphModule) -> bool:
    """Nothing for Inductor to do: only tuple unpacking and integer arithmetic on sizes."""
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if node.op == "call_function" and node.target is operator.getitem:
            continue
        value = node.meta.get("example_value", node.meta.get("val"))
        if isinstance(value, (int, float, bool, torch.SymInt, torch.SymFloat, torch.SymBool)):
            continue
        return False
    return True


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
        fn = self.builder.build(piece, variant, example_inputs, self.store)
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
