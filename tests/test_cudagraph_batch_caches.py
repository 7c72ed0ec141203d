"""KV caches with the batch dim (one per batch size, as HF's StaticCache) under CUDA graphs, on the
CPU with simulated graphs: read in place by calls at a capture size (no static buffer, no copies),
copied only by padded calls, and a moved cache captures the graphs of its forward again."""
from __future__ import annotations

import logging

import pytest
import torch

import cudagraph_models as cm
from torch_ext.backend import CompileConfig, make_backend
from torch_ext.backend.runtime.cudagraph.manager import cudagraph_stats
from torch_ext.backend.runtime.cudagraph.group import GraphKey
from test_cudagraph import fresh_stats, fx_pieces  # noqa: F401  (fixtures: fresh stats, pieces as FX graphs)

SIZES = (2, 4, 8)


def backend(mode):
    cfg = CompileConfig(splitting_ops=cm.SPLITTING_OPS, cache_dir=None, cudagraph_mode=mode,
                        cudagraph_capture_sizes=SIZES)
    be = make_backend(cfg)
    be.cudagraphs = cm.SimulatedCudaGraphs(cfg)
    return be


class Caches:
    """One pair of cache lists per batch size, for eager and for the compiled model."""

    def __init__(self, model):
        self.model, self.eager, self.compiled = model, {}, {}

    def renew(self, n):
        k, v = self.model.caches_for(n)
        self.eager[n] = (k, v)
        self.compiled[n] = ([t.clone() for t in k], [t.clone() for t in v])

    def run(self, compiled, n, pos=3, first=False):
        if n not in self.eager:
            self.renew(n)
        (ek, ev), (ck, cv) = self.eager[n], self.compiled[n]
        x = torch.randn(n, cm.D_MODEL)
        if first:
            for t in [x, *ck, *cv]:
                torch._dynamo.mark_dynamic(t, 0)
        with torch.no_grad():
            expected, actual = self.model(x, ek, ev, pos), compiled(x, ck, cv, pos)
        torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5, msg=f"output at batch {n}")
        for a, e in zip(ck + cv, ek + ev):
            torch.testing.assert_close(a, e, msg=f"cache at batch {n}")


def pinned_inputs(runner):
    return {s.name for s in runner.inputs if s.kind == "tensor" and s.role == "pinned"}


@pytest.mark.parametrize("mode", ["piecewise", "full"])
def test_caches_with_the_batch_dim_are_read_in_place_at_capture_sizes(fx_pieces, mode):
    model = cm.BatchCacheDecoder(layers=2)
    be = backend(mode)
    compiled = torch.compile(model, backend=be)
    caches = Caches(model)
    for i, n in enumerate([4, 4, 4, 4, 8, 8, 8, 8, 2, 2, 2]):
        caches.run(compiled, n, first=i == 0)
    runners = [r for r in be.cudagraphs.runners() if r.pins_rows]
    assert runners, "no runner reads a cache with the batch dim in place"
    assert all(len(pinned_inputs(r)) >= 2 for r in runners)
    for runner in runners:
        for size in SIZES:
            entry = runner._entries[GraphKey(size)]
            assert entry.graph is not None
            assert not set(entry.buffers) & {i for i, s in enumerate(runner.inputs) if s.role == "pinned"}
    # Only the model's input and eager attention results are copied: a few KiB, no cache.
    cache_bytes = sum(t.untyped_storage().nbytes() for k, v in caches.compiled.values() for t in k + v)
    assert cudagraph_stats.static_input_bytes < cache_bytes / 10, (cudagraph_stats.static_input_bytes, cache_bytes)
    assert cudagraph_stats.replays > 0


@pytest.mark.parametrize("mode", ["piecewise", "full"])
def test_padded_calls_copy_the_cache_in_graphs_of_their_own(fx_pieces, mode):
    model = cm.BatchCacheDecoder(layers=2)
    be = backend(mode)
    compiled = torch.compile(model, backend=be)
    caches = Caches(model)
    for i, n in enumerate([4, 4, 4, 3, 3, 3, 3, 4, 3, 4]):
        caches.run(compiled, n, first=i == 0)
    runner = next(r for r in be.cudagraphs.runners() if r.pins_rows)
    exact, padded = runner._entries[GraphKey(4)], runner._entries[GraphKey(4, padded=True)]
    assert exact.graph is not None and padded.graph is not None
    pinned = {i for i, s in enumerate(runner.inputs) if s.role == "pinned"}
    assert not pinned & set(exact.buffers) and pinned <= set(padded.buffers) and pinned <= padded.copy_back


@pytest.mark.parametrize("mode", ["piecewise", "full"])
def test_a_new_cache_captures_the_graphs_of_its_forward_again(fx_pieces, mode, caplog):
    """generate makes a new cache per call: every graph of the forward is captured again for it
    (in a piecewise group the graphs of one size are captured together)."""
    model = cm.BatchCacheDecoder(layers=2)
    be = backend(mode)
    compiled = torch.compile(model, backend=be)
    caches = Caches(model)
    for i in range(4):
        caches.run(compiled, 4, first=i == 0)
    captures = cudagraph_stats.captures
    with caplog.at_level(logging.INFO, logger="torch_ext.backend.cudagraph"):
        for _ in range(2):
            caches.renew(4)
            for _ in range(4):
                caches.run(compiled, 4)
    graphs = sum(r.capturable for r in be.cudagraphs.runners())
    assert cudagraph_stats.recaptures == 2
    assert cudagraph_stats.captures == captures + 2 * graphs
    assert sum("moved since the capture" in r.getMessage() for r in caplog.records) == 1
    assert all(len(r._retired) == 0 for r in be.cudagraphs.runners())  # replaced graphs were let go
