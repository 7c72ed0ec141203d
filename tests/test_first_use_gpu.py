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
