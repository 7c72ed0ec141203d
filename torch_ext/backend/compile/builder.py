"""Get compiled variants of pieces: from the in-process memo, else the disk cache, else Inductor.

`VariantBuilder` (one per backend) turns (piece graph, fingerprint, variant) into a callable,
compiling each distinct artifact once per process and, with a cache, once per cache directory
across processes.
"""
from __future__ import annotations

import hashlib
import logging
from typing import Callable

import torch.fx as fx

from torch_ext import compat
from torch_ext.backend.compile import inductor_keys
from torch_ext.backend.compile.cache import ArtifactStore
from torch_ext.backend.compile.compiler import InductorCompiler, Variant
from torch_ext.backend.counters import counters

log = logging.getLogger(__name__)


class VariantBuilder:
    def __init__(self, compiler: InductorCompiler):
        self.compiler = compiler
        self._memo: dict[str, tuple[Callable, bytes | None]] = {}  # artifact name -> (callable, bytes)

    def artifact_name(self, fingerprint: str, variant: Variant, options: dict[str, str] | None = None) -> str:
        """The artifact's name: the piece, the variant, and the Inductor options it compiles with (ours by
        its graph and the GPU: PDL, combo kernels, the launch-order pass), so that a process whose torch_ext
        chooses other options never loads code compiled with the old ones."""
        factors = f"{fingerprint}|{self.compiler.key_factors(variant)}|{sorted((options or {}).items())}"
        return hashlib.sha256(factors.encode()).hexdigest()

    def build(self, piece_name: str, gm: fx.GraphModule, fingerprint: str, variant: Variant, example_inputs,
              store: ArtifactStore | None) -> Callable:
        """The callable of `gm` (named `piece_name` in messages) compiled for `variant`. Thread-safe:
        threads whose first calls need the same variant get one compile."""
        with compat.compile_lock():
            return self._build(piece_name, gm, fingerprint, variant, example_inputs, store)

    def _build(self, piece_name, gm, fingerprint, variant, example_inputs, store) -> Callable:
        name = self.artifact_name(fingerprint, variant, self.compiler.options_of(gm, variant))
        if name in self._memo:
            fn, blob = self._memo[name]
            if store is not None and blob is not None and not store.has(name):
                _write(store, name, blob)  # shared with another graph: keep each graph's cache whole
            return fn
        fn, blob = self._load_or_compile(piece_name, gm, variant, example_inputs, store, name)
        self._memo[name] = (fn, blob)
        return fn

    def _load_or_compile(self, piece_name, gm, variant, example_inputs, store, name) -> tuple[Callable, bytes | None]:
        if store is None or not self.compiler.disk_cacheable():
            return self.compiler.compile(gm, example_inputs, variant, name=piece_name), None
        inductor_keys.prime(self.compiler.config.cache_dir)  # before Inductor computes it
        result = self._load_or_compile_cached(piece_name, gm, variant, example_inputs, store, name)
        inductor_keys.remember(self.compiler.config.cache_dir)  # computed by now
        return result

    def _load_or_compile_cached(self, piece_name, gm, variant, example_inputs, store, name) -> tuple[Callable, bytes | None]:
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
            artifact = self.compiler.compile(gm, example_inputs, variant, name=piece_name)
            blob = self.compiler.serialize(artifact)
            if blob is not None:
                _write(store, name, blob)
            return artifact, blob


def _write(store: ArtifactStore, name: str, blob: bytes) -> None:
    try:
        store.write(name, blob)
    except OSError as e:  # a full disk costs the next process a compile, not this one its run
        log.warning("torch_ext cache: cannot write %s (%s); continuing without it", store.path(name), e)
