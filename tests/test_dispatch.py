"""Guard-free dispatch: its contract (no guards, no recompiles, batch 1 on the symbolic graph), the
depyf dump, and the refusal of module-state assignments under CUDA graphs (CPU)."""
from __future__ import annotations

import glob
import os

import pytest
import torch
from torch import nn

import cudagraph_models as cm
import torch_ext
from torch_ext.backend import CompileConfig, counters
from torch_ext.backend.runtime.cudagraph.errors import CudaGraphBufferMutationError
from torch_ext.backend.dispatch import GuardFreeDispatcher, GuardFreeDispatchWarning
from torch_ext.backend.runtime.cudagraph.buffer_stores import buffer_assignments


@pytest.fixture(autouse=True)
def fx_pieces(monkeypatch):
    """Pieces run as FX graphs (what is tested here is around them)."""
    from torch_ext.backend.compile.compiler import InductorCompiler

    monkeypatch.setattr(InductorCompiler, "compile", lambda self, gm, example_inputs, variant, name="": gm)
    counters.reset()


def config(**kwargs) -> CompileConfig:
    kwargs.setdefault("guard_free_dispatch", True)
    return CompileConfig(splitting_ops=cm.SPLITTING_OPS, cache_dir=None, **kwargs)


class Scaled(nn.Module):
    """Reads a Python float attribute: Dynamo guards on it (a change recompiles)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.scale = 2.0

    def forward(self, x):
        return self.lin(x) * self.scale


def test_later_calls_run_the_transformed_code_without_guards():
    model = Scaled()
    compiled = torch_ext.compile(model, config())
    assert isinstance(compiled, GuardFreeDispatcher)
    x = torch.randn(4, 8)
    torch._dynamo.mark_dynamic(x, 0)
    torch.testing.assert_close(compiled(x), model(x))
    y = torch.randn(5, 8)
    torch.testing.assert_close(compiled(y), model(y))
    assert compiled.calls == 1 and counters.graphs_seen == 1  # no guards: the armed code ran
    # A plain attribute of the module changed: that call goes through the guards (said once), which
    # recompile, as plain torch.compile does.
    model.scale = 3.0
    with pytest.warns(GuardFreeDispatchWarning, match="scale = 3.0"):
        torch.testing.assert_close(compiled(y), model.lin(y) * 3.0)
    torch.testing.assert_close(compiled(y), model.lin(y) * 3.0)
    assert compiled.calls == 2 and counters.graphs_seen == 2
    torch._dynamo.reset()
    other = Scaled()
    plain = torch.compile(other, backend=torch_ext.backend(config(guard_free_dispatch=False)))
    plain(x)
    other.scale = 3.0
    torch.testing.assert_close(plain(y), other.lin(y) * 3.0)
    assert counters.graphs_seen == 4


def test_batch_one_and_other_sizes_reuse_the_first_symbolic_graph():
    model = cm.TinyDecoder(layers=2)
    compiled = torch_ext.compile(model, config())
    ek, ev = model.caches()
    ck, cv = [t.clone() for t in ek], [t.clone() for t in ev]
    for i, n in enumerate([4, 1, 7, 1, 2]):
        x = torch.randn(n, cm.D_MODEL)
        if i == 0:
            torch._dynamo.mark_dynamic(x, 0)
        with torch.no_grad():
            torch.testing.assert_close(compiled(x, ck, cv, 2), model(x, ek, ev, 2))
        for a, e in zip(ck + cv, ek + ev):
            torch.testing.assert_close(a, e)
    # torch.compile would have specialized batch 1 into a second graph.
    assert counters.graphs_seen == 1 and compiled.calls == 1


def test_transformed_code_is_decompiled_into_the_debug_dir(tmp_path):
    compiled = torch_ext.compile(Scaled(), config(debug_dump_dir=str(tmp_path)))
    compiled(torch.randn(3, 8))
    (path,) = glob.glob(os.path.join(tmp_path, "guard_free_*_forward.py"))
    text = open(path).read()
    assert "def forward(self, x)" in text and "__compiled_fn" in text


def test_plain_functions_and_the_default_path():
    def f(x, y):
        return torch.sin(x) + y

    compiled = torch_ext.compile(f, config())
    x = torch.randn(3)
    for _ in range(3):
        torch.testing.assert_close(compiled(x, x), f(x, x))
    assert compiled.calls == 1
    not_guard_free = torch_ext.compile(Scaled(), config(guard_free_dispatch=False))
    assert isinstance(not_guard_free, torch._dynamo.eval_frame.OptimizedModule)


def _call(compiled, model):
    k, v = model.caches()
    x = torch.randn(3, cm.D_MODEL)
    torch._dynamo.mark_dynamic(x, 0)
    with torch.no_grad():
        return compiled(x, k, v, 1)


@pytest.mark.filterwarnings("ignore:torch_ext. cudagraph_mode")
def test_buffer_assignment_with_cuda_graphs_shows_the_offending_code():
    model = cm.AssignsBuffer()
    compiled = torch_ext.compile(model, config(cudagraph_mode="piecewise"))
    with pytest.raises(CudaGraphBufferMutationError, match=r"(?s)assigns module buffers.*>>> [^\n]*_buffers[^\n]*\.update\("):
        _call(compiled, model)
    # Through plain torch.compile, Dynamo wraps the error; the message is still ours.
    torch._dynamo.reset()
    plain = torch.compile(model, backend=torch_ext.backend(config(cudagraph_mode="full", guard_free_dispatch=False)))
    with pytest.raises(Exception, match="assigns module buffers"):
        _call(plain, model)
    # Without CUDA graphs the assignment is fine.
    torch._dynamo.reset()
    model = cm.AssignsBuffer()
    _call(torch_ext.compile(model, config()), model)


def test_buffer_assignments_reads_bytecode():
    def assigns(self, t):
        self._buffers.update({"b": t})

    def reads(self):
        return self._buffers["b"]

    assert len(buffer_assignments(assigns.__code__)) == 1
    assert buffer_assignments(reads.__code__) == []


def test_an_aborted_compile_leaves_no_check_behind():
    from test_cudagraph import MutatesBuffer

    model = MutatesBuffer()
    with pytest.raises(Exception, match="mutates the module buffer"):
        _call(torch.compile(model, backend=torch_ext.backend(config(cudagraph_mode="piecewise"))), model)
    torch._dynamo.reset()
    model = cm.AssignsBuffer()  # assigning a buffer is fine without CUDA graphs
    _call(torch.compile(model, backend=torch_ext.backend(config())), model)
