"""On a GPU: a compiled graph whose SDPA picks cuDNN gets cuDNN's engines loaded at compile time and
when its warm-start entry loads (backend/compile/first_use.py), and computes what eager does."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import torch_ext
from torch_ext import compat
from torch_ext.backend import CompileConfig
from torch_ext.backend.compile import first_use

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]


class MaskedAttention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(128, 128)

    def forward(self, q, k, v, mask):
        return self.proj(F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).flatten(2))


def _inputs():
    torch.manual_seed(0)
    q = torch.randn(1, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 1, 48, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(1, 1, 48, 128, device="cuda", dtype=torch.bfloat16)
    mask = torch.zeros(1, 1, 32, 48, device="cuda", dtype=torch.bfloat16)
    mask[..., 40:] = float("-inf")
    return q, k, v, mask


def test_cudnn_attention_is_loaded_when_the_graph_compiles_and_when_it_loads(tmp_path, monkeypatch):
    from torch.nn.attention import SDPBackend

    inputs = _inputs()
    if torch._fused_sdp_choice(*inputs, 0.0, False) != int(SDPBackend.CUDNN_ATTENTION):
        pytest.skip("SDPA does not pick cuDNN for these inputs on this GPU")
    model = MaskedAttention().to("cuda", torch.bfloat16)
    loads = []
    real_load = first_use.load_libraries
    monkeypatch.setattr(first_use, "_loaded", set())
    from torch_ext.backend import backend as backend_module
    from torch_ext.backend.warm_start import saved_graph

    def record(names, device=None):
        loads.append(tuple(names))
        real_load(names, device)

    monkeypatch.setattr(backend_module, "load_libraries", record)
    monkeypatch.setattr(saved_graph, "load_libraries", record)
    config = CompileConfig(cache_dir=str(tmp_path), progress_bar=False, cudagraph_mode="none")
    with torch.no_grad():
        expected = model(*inputs)
        torch.testing.assert_close(torch_ext.compile(model, config)(*inputs), expected, atol=2e-2, rtol=2e-2)
        cudnn = [names for names in loads if any(n.startswith(first_use.CUDNN_SDPA) for n in names)]
        assert cudnn, loads
        assert any(name.startswith(first_use.CUDNN_SDPA) and device == torch.cuda.current_device()
                   for name, device in first_use._loaded)
        if compat.HAS_AOT_COMPILE:  # warm start: the loaded entry names it
            loads.clear()
            again = torch_ext.compile(model, config)
            torch.testing.assert_close(again(*inputs), expected, atol=2e-2, rtol=2e-2)
            assert any(n.startswith(first_use.CUDNN_SDPA) for names in loads for n in names), loads


def _decode_attention_inputs(dtype):
    torch.manual_seed(0)
    q = torch.randn(1, 6, 1, 64, device="cuda", dtype=dtype)
    k, v = (torch.randn(1, 3, 77, 64, device="cuda", dtype=dtype) for _ in range(2))
    return q, k, v, None, 0.125


def test_our_triton_kernels_compile_where_the_graph_compiles_not_at_its_first_call(monkeypatch):
    """A cold process compiled our decode kernels at the program's first call (1.5 s, serving thread); the
    loader repeats the call on zeros of its layouts. Half-precision layouts here: in-process fresh."""
    triton_jit = pytest.importorskip("triton.runtime.jit")
    import torch_ext.kernels.decode_attention as op_module

    if not hasattr(triton_jit.JITFunction, "_do_compile"):
        pytest.skip("this Triton has no JITFunction._do_compile to count compiles with")
    if not op_module._triton_takes(*_decode_attention_inputs(torch.float16)[:4]):
        pytest.skip("decode attention runs its reference here")
    compiles = []
    real = triton_jit.JITFunction._do_compile

    def counted(self, *args, **kwargs):
        compiles.append(self)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(triton_jit.JITFunction, "_do_compile", counted)
    op = torch.ops.torch_ext.decode_attention.default

    def graph(dtype):
        gm = torch.fx.symbolic_trace(lambda q, k, v: op(q, k, v, None, 0.125))
        for node, value in zip(gm.graph.find_nodes(op="placeholder"), _decode_attention_inputs(dtype)):
            node.meta["example_value"] = value
        return gm

    # Without the loader the first call compiles (the counter sees it): a layout not run before.
    q, k, v, mask, scale = _decode_attention_inputs(torch.float32)
    torch.testing.assert_close(op(q, k, v, mask, scale), op_module.decode_attention_reference(q, k, v, mask, scale),
                               atol=2e-3, rtol=2e-3)
    assert compiles
    # With it, the call the graph names compiles there, and the first real call compiles nothing.
    monkeypatch.setattr(first_use, "_loaded", set())
    names = [n for n in first_use.libraries_needed(graph(torch.float16)) if n.startswith(first_use.TORCH_EXT_OP)]
    assert len(names) == 1, names
    compiles.clear()
    first_use.load_libraries(names)
    assert compiles
    compiles.clear()
    q, k, v, mask, scale = _decode_attention_inputs(torch.float16)
    torch.testing.assert_close(op(q, k, v, mask, scale), op_module.decode_attention_reference(q, k, v, mask, scale),
                               atol=2e-2, rtol=2e-2)
    assert not compiles, [f.__name__ for f in compiles]
