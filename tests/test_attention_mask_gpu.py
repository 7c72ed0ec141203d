"""On CUDA (bf16, SDPA's default backend there: cuDNN on Hopper with torch 2.11): a splitting-op SDPA
call given its bool mask in additive form (rewrite/attention_mask.py) computes what the eager call
computes, bit for bit, for every row that sees a key; a row that sees none gets SDPA's zeros."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from torch_ext.backend import CompileConfig, counters, make_backend

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def two_layers(q, k, v, mask):
    a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return F.scaled_dot_product_attention(a, k, v, attn_mask=mask)


@pytest.mark.parametrize("cudagraph_mode", ["none", "piecewise"])
@pytest.mark.parametrize("batch,queries", [(1, 1), (8, 1), (2, 16)])
def test_additive_mask_equals_the_eager_bool_mask(batch, queries, cudagraph_mode):
    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    q = torch.randn(batch, 16, queries, 128, device=dev, dtype=dt)
    k, v = (torch.randn(batch, 16, 384, 128, device=dev, dtype=dt) for _ in range(2))
    mask = torch.rand(batch, 1, queries, 384, device=dev) > 0.3
    mask[..., 0] = True
    if queries > 1:
        mask[0, 0, queries - 1] = False  # a row that sees no key
    torch._dynamo.reset()
    before = counters.additive_attention_masks
    backend = make_backend(CompileConfig(splitting_ops=["aten::scaled_dot_product_attention"], cache_dir=None,
                                         cudagraph_mode=cudagraph_mode, cudagraph_capture_sizes=(batch,)))
    compiled = torch.compile(two_layers, backend=backend, fullgraph=True, dynamic=False)
    with torch.no_grad():
        for _ in range(3):  # warm-up, capture, replay
            actual = compiled(q, k, v, mask).clone()
        expected = two_layers(q, k, v, mask)
    assert counters.additive_attention_masks - before == 2
    seen = mask.any(-1, keepdim=True).expand(batch, 16, queries, 128)
    assert torch.equal(actual[seen], expected[seen])
    if queries > 1:
        row = actual[0, :, queries - 1]
        print(f"row without keys: compiled max |x| {row.abs().max().item():.3g}, "
              f"eager (bool mask) max |x| {expected[0, :, queries - 1].abs().max().item():.3g}")
        assert torch.equal(row, torch.zeros_like(row))
