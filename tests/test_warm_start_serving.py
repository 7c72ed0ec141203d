"""Warm start with the serving configuration: piecewise CUDA graphs (on a CPU the pieces run without
graphs, every other code path of the runner is built) and guard-free dispatch."""
from __future__ import annotations

import pytest
import torch

import cudagraph_models as cm
import torch_ext
from torch_ext import compat
from torch_ext.backend import CompileConfig, counters
from torch_ext.backend.runtime.cudagraph.manager import CudaGraphBufferMutationError

pytestmark = [pytest.mark.skipif(not compat.HAS_AOT_COMPILE, reason="this torch has no AOT compile: no warm start"),
              pytest.mark.filterwarnings("ignore:torch_ext. cudagraph_mode")]


@pytest.fixture(autouse=True)
def fx_pieces(monkeypatch):
    from torch_ext.backend.compile.compiler import InductorCompiler

    monkeypatch.setattr(InductorCompiler, "compile", lambda self, gm, example_inputs, variant, name="": gm)
    monkeypatch.setattr(InductorCompiler, "serialize", staticmethod(lambda artifact: None))


def serving(cache_dir, **kwargs) -> CompileConfig:
    return CompileConfig(splitting_ops=cm.SPLITTING_OPS, cache_dir=str(cache_dir), cudagraph_mode="piecewise",
                         cudagraph_capture_sizes=(1, 4, 8), guard_free_dispatch=True, progress_bar=False, **kwargs)


def decode_steps(compiled, model, sizes=(4, 1, 7, 8, 2)):
    ek, ev = model.caches()
    ck, cv = [t.clone() for t in ek], [t.clone() for t in ev]
    outs = []
    for i, n in enumerate(sizes):
        x = torch.randn(n, cm.D_MODEL)
        if i == 0:
            torch._dynamo.mark_dynamic(x, 0)
        with torch.no_grad():
            out = compiled(x, ck, cv, 2)
            torch.testing.assert_close(out, model(x, ek, ev, 2))
        outs.append(out.clone())
        for a, e in zip(ck + cv, ek + ev):
            torch.testing.assert_close(a, e)
    return outs


def test_serving_config_loads_without_tracing_and_runs_every_size(tmp_path):
    model = cm.TinyDecoder(layers=2)
    torch.manual_seed(0)
    cold = decode_steps(torch_ext.compile(model, serving(tmp_path)), model)
    assert counters.warm_start_saves == 1
    torch._dynamo.reset()
    torch.manual_seed(0)
    compiled = torch_ext.compile(model, serving(tmp_path))
    warm = decode_steps(compiled, model)
    assert counters.warm_start_loads == 1 and counters.warm_start_fallbacks == 0
    assert compiled.calls == 0  # no call went through torch.compile: batch 1 too runs the symbolic program
    for a, b in zip(warm, cold):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_buffer_assignment_under_cuda_graphs_is_still_refused(tmp_path):
    model = cm.AssignsBuffer()
    k, v = model.caches()
    x = torch.randn(3, cm.D_MODEL)
    torch._dynamo.mark_dynamic(x, 0)
    with pytest.raises(CudaGraphBufferMutationError, match="assigns module buffers"), torch.no_grad():
        torch_ext.compile(model, serving(tmp_path))(x, k, v, 1)
    assert counters.warm_start_saves == 0
