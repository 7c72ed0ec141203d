"""Merged projections on a GPU under every CUDA-graph mode (run through the device tool); skipped without CUDA."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import hf_models as hf
import torch_ext
from torch_ext.backend import CompileConfig, counters

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


class Projections(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o = nn.Linear(64, 64), nn.Linear(64, 32), nn.Linear(64, 32), nn.Linear(64, 64)

    def forward(self, x):
        q, k, v = self.q(x), self.k(x), self.v(x)
        return self.o(q * torch.cat([k, v], -1).relu())


@pytest.mark.parametrize("mode", ["none", "piecewise", "full"])
def test_merged_projections_follow_weight_updates_under_cuda_graphs(mode):
    torch._dynamo.reset()
    model = Projections().cuda().eval()
    compiled = torch_ext.compile(model, CompileConfig(cache_dir=None, cudagraph_mode=mode, cudagraph_capture_sizes=(4, 8),
                                                      progress_bar=False), dynamic=True)

    def check(b):
        x = torch.randn(b, 64, device="cuda")
        torch.testing.assert_close(compiled(x), model(x), atol=1e-4, rtol=1e-4)

    with torch.no_grad():
        for b in (3, 4, 8, 3, 4, 8):
            check(b)
        model.q.weight.add_(1)  # in place: the buffer itself
        check(4)
        model.load_state_dict({k: v * 0.5 for k, v in model.state_dict().items()}, assign=True)  # new tensors
        for b in (3, 4, 8):
            check(b)
    assert counters.merged_projection_groups == 1


def test_hf_llama_piecewise_with_merged_projections():
    torch._dynamo.reset()
    model = hf.build("llama").cuda().eval()
    ids = hf.token_ids(2, 8).cuda()
    compiled = torch_ext.compile(model, CompileConfig(cache_dir=None, cudagraph_mode="piecewise",
                                                      cudagraph_capture_sizes=(2,), progress_bar=False), dynamic=True)
    with torch.no_grad():
        for _ in range(3):
            out = compiled(input_ids=ids, use_cache=False).logits.clone()
        torch.testing.assert_close(out, model(input_ids=ids, use_cache=False).logits, atol=1e-4, rtol=1e-4)
    assert counters.merged_projection_groups >= 2


@pytest.mark.parametrize("mode", ["none", "piecewise", "full"])
def test_layers_compiled_one_by_one_under_cuda_graphs(mode):
    """Regional compilation: three identical layers share one graph, each with its own merged
    buffers, under each CUDA-graph mode (the buffers' addresses change from layer to layer)."""
    torch._dynamo.reset()
    layers = [Projections().cuda().eval() for _ in range(3)]
    reference = [Projections().cuda().eval() for _ in range(3)]
    for layer, ref in zip(layers, reference):
        ref.load_state_dict(layer.state_dict())
    config = CompileConfig(cache_dir=None, cudagraph_mode=mode, cudagraph_capture_sizes=(4,), progress_bar=False)
    compiled = [torch_ext.compile(layer, config, dynamic=True) for layer in layers]
    with torch.no_grad():
        for b in (4, 3, 4, 4):
            x = torch.randn(b, 64, device="cuda")
            h, expected = x, x
            for fn, ref in zip(compiled, reference):
                h, expected = fn(h), ref(expected)  # as a user writes it: no clone between layers
            torch.testing.assert_close(h, expected, atol=1e-4, rtol=1e-4)
    for layer, ref in zip(layers, reference):
        torch.testing.assert_close(layer.state_dict(), ref.state_dict(), atol=0, rtol=0)
