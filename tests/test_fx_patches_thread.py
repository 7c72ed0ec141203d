"""fx's trace-time patches (nn.Module.__call__, __getattr__, module globals) kept to the tracing thread
(compat.confine_fx_patches_to_their_thread, installed by background compile): a thread that runs a
model while another thread traces gets the model's own behaviour."""
from __future__ import annotations

import threading

import pytest
import torch

from torch_ext import compat


def _run_model_while_another_thread_traces(model, x):
    started, release = threading.Event(), threading.Event()
    traced = {}

    def slow_function(y):
        started.set()
        release.wait(10)  # the model runs on the main thread meanwhile
        return y + 1

    def trace():
        traced["gm"] = torch.fx.symbolic_trace(slow_function)

    tracer = threading.Thread(target=trace)
    tracer.start()
    assert started.wait(10)
    try:
        return model(x)
    finally:
        release.set()
        tracer.join()
        assert "gm" in traced and torch.equal(traced["gm"](x), x + 1)  # the trace itself is unchanged


@pytest.fixture
def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())


def test_torch_alone_a_model_call_during_a_trace_on_another_thread_fails(model):
    confined = compat.fx_patches_confined()
    compat.restore_fx_patches()
    try:
        with pytest.raises(NameError, match="not installed as a submodule"):
            _run_model_while_another_thread_traces(model, torch.randn(2, 4))
    finally:
        if confined:
            compat.confine_fx_patches_to_their_thread()


def test_confined_the_call_runs_the_model_and_the_trace_is_unchanged(model):
    compat.confine_fx_patches_to_their_thread()
    x = torch.randn(2, 4)
    torch.testing.assert_close(_run_model_while_another_thread_traces(model, x), model(x))


def test_confined_a_trace_on_this_thread_still_sees_module_calls_as_leaves(model):
    compat.confine_fx_patches_to_their_thread()
    gm = torch.fx.symbolic_trace(model)
    targets = [n.target for n in gm.graph.nodes if n.op == "call_module"]
    assert targets == ["0", "1"]
    x = torch.randn(2, 4)
    torch.testing.assert_close(gm(x), model(x))


def test_confined_make_fx_and_torch_compile_trace_as_before(model):
    from torch.fx.experimental.proxy_tensor import make_fx

    compat.confine_fx_patches_to_their_thread()
    x = torch.randn(2, 4)
    gm = make_fx(model)(x)
    assert any(n.target == torch.ops.aten.relu.default for n in gm.graph.nodes)
    torch.testing.assert_close(gm(x), model(x))
    torch.testing.assert_close(torch.compile(model, backend="aot_eager")(x), model(x))


@pytest.mark.skipif(not compat.HAS_AOT_COMPILE, reason="background compile needs AOT compile (torch >= 2.10)")
def test_background_compile_confines_them(monkeypatch, tmp_path):
    import torch_ext
    from torch_ext.backend import CompileConfig

    compat.restore_fx_patches()
    m = torch.nn.Linear(4, 4)
    compiled = torch_ext.compile(m, CompileConfig(cache_dir=str(tmp_path), background_compile=True,
                                                 progress_bar=False))
    x = torch.randn(2, 4)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), m(x))
        assert torch_ext.wait_compiled(120)
        torch.testing.assert_close(compiled(x), m(x))
    assert compat.fx_patches_confined()
