"""Splitting-op SDPA calls given a bool mask take it in additive form, made in the graph
(rewrite/attention_mask.py): the calls that run eagerly between pieces skip SDPA's own conversion.

  * the rewrite on Dynamo's graph: one conversion shared by calls that read one mask, another after a
    node that may write it, none for float masks, non-splitting calls or with the option off;
  * through the backend: outputs equal eager exactly (CPU), rows that mask every key included;
  * an HF model split at SDPA decoding from a StaticCache: every layer's call converted, logits equal eager.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import hf_models as hf
import torch_ext
from torch_ext.backend import CompileConfig, counters, make_backend
from torch_ext.backend.rewrite.attention_mask import additive_attention_masks
from torch_ext.backend.rewrite.decode_attention import SDPA_TARGETS

SDPA = "aten::scaled_dot_product_attention"


def two_layers(q, k, v, mask):
    a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    # a piece between the calls whose result is exact under any vectorization (Inductor's tanh differed
    # from eager's by an ulp on an AVX-512 host): what the test compares is the mask's two forms
    return F.scaled_dot_product_attention(a * 0.5 + q, k, v, mask)  # positional mask too


def write_between(q, k, v, mask):
    a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    mask[..., 0] = False  # the second call must see the write
    return F.scaled_dot_product_attention(a, k, v, attn_mask=mask)


def write_through_a_view(q, k, v, mask):
    a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    mask.transpose(-1, -2)[..., 1, :].logical_not_()  # a view of the mask, written in place
    return F.scaled_dot_product_attention(a, k, v, attn_mask=mask)


def inputs(mask_rows_all_false: bool = False):
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 3, 8), torch.randn(2, 4, 5, 8), torch.randn(2, 4, 5, 8)
    mask = torch.rand(2, 1, 3, 5) > 0.4
    mask[..., 1] = True
    if mask_rows_all_false:
        mask[0, 0, 2] = False  # a query row that sees no key
    return q, k, v, mask


def dynamo_graph(fn, *args) -> torch.fx.GraphModule:
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(fn, backend=keep, fullgraph=True)(*args)
    return graphs[0]


def is_sdpa(node) -> bool:
    return node.op == "call_function" and node.target in SDPA_TARGETS


def wheres(gm) -> int:
    return sum(n.op == "call_function" and n.target is torch.where for n in gm.graph.nodes)


def test_one_conversion_serves_calls_that_share_a_mask():
    gm = dynamo_graph(two_layers, *inputs())
    assert additive_attention_masks(gm, is_sdpa) == 2
    assert wheres(gm) == 1
    masks = [n.kwargs.get("attn_mask", n.args[3] if len(n.args) > 3 else None) for n in gm.graph.nodes if is_sdpa(n)]
    assert masks[0] is masks[1] and masks[0].meta["example_value"].dtype == torch.float32
    q, k, v, mask = inputs()
    torch.testing.assert_close(gm(q, k, v, mask)[0], two_layers(q, k, v, mask), atol=0, rtol=0)


@pytest.mark.parametrize("fn", [write_between, write_through_a_view])
def test_a_possible_write_between_calls_gets_its_own_conversion(fn):
    gm = dynamo_graph(fn, *inputs())
    assert additive_attention_masks(gm, is_sdpa) == 2
    assert wheres(gm) == 2
    q, k, v, mask = inputs()
    expected = fn(q, k, v, mask.clone())
    assert not torch.equal(expected, two_layers(q, k, v, mask.clone()))  # the write matters
    torch.testing.assert_close(gm(q, k, v, mask.clone())[0], expected, atol=0, rtol=0)


def test_float_masks_and_calls_that_do_not_split_are_left_alone():
    q, k, v, mask = inputs()
    gm = dynamo_graph(two_layers, q, k, v, torch.where(mask, 0.0, float("-inf")))
    assert additive_attention_masks(gm, is_sdpa) == 0
    gm = dynamo_graph(two_layers, q, k, v, mask)
    assert additive_attention_masks(gm, lambda n: False) == 0
    assert wheres(gm) == 0


@pytest.mark.parametrize("fully_masked_row", [False, True])
@pytest.mark.parametrize("enabled", [True, False])
def test_backend_split_at_sdpa_matches_eager(fully_masked_row, enabled):
    args = inputs(fully_masked_row)
    before = counters.additive_attention_masks
    torch._dynamo.reset()
    backend = make_backend(CompileConfig(splitting_ops=[SDPA], cache_dir=None, additive_attention_masks=enabled))
    with torch.no_grad():
        actual = torch.compile(two_layers, backend=backend, fullgraph=True)(*args)
        expected = two_layers(*args)
    assert counters.additive_attention_masks - before == (2 if enabled else 0)
    torch.testing.assert_close(actual, expected, atol=0, rtol=0)
    if fully_masked_row:  # SDPA's convention for a row that sees no key: zeros
        assert torch.equal(actual[0, :, 2], torch.zeros_like(actual[0, :, 2]))


def test_training_graphs_keep_the_bool_mask():
    q, k, v, mask = inputs()
    q.requires_grad_(True)
    before = counters.additive_attention_masks
    torch._dynamo.reset()
    backend = make_backend(CompileConfig(splitting_ops=[SDPA], cache_dir=None))
    torch.compile(two_layers, backend=backend, fullgraph=True)(q, k, v, mask).sum().backward()
    assert counters.additive_attention_masks == before
    grad = q.grad.clone()
    q.grad = None
    two_layers(q, k, v, mask).sum().backward()
    torch.testing.assert_close(grad, q.grad)


@pytest.mark.parametrize("arch", [pytest.param("llama", marks=pytest.mark.slow), "qwen2", "gpt2", "phi3"])
def test_hf_static_cache_decode_split_at_sdpa_converts_every_layer(request, arch):
    """Every layer's SDPA call gets the additive mask; logits equal eager's at every step."""
    import transformers

    if arch != "llama":  # pieces as FX graphs: the rewrite is before the split, the CPU is slow
        from torch_ext.backend.compile.compiler import InductorCompiler

        monkeypatch = request.getfixturevalue("monkeypatch")
        monkeypatch.setattr(InductorCompiler, "compile", lambda self, gm, example_inputs, variant, name="": gm)
    model = hf.build(arch).eval()
    ids = hf.token_ids(2, 6)
    caches = [transformers.StaticCache(config=model.config, max_cache_len=16) for _ in range(2)]
    with torch.no_grad():
        token = model(input_ids=ids, past_key_values=caches[0], use_cache=True).logits[:, -1:].argmax(-1)
        model(input_ids=ids, past_key_values=caches[1], use_cache=True)
        before = counters.additive_attention_masks
        config = CompileConfig(splitting_ops=[SDPA], cache_dir=None)
        compiled = torch_ext.compile(model, config, dynamic=False)
        for _ in range(3):
            expected = model(input_ids=token, past_key_values=caches[0], use_cache=True).logits
            actual = compiled(input_ids=token, past_key_values=caches[1], use_cache=True).logits
            torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
            token = expected[:, -1:].argmax(-1)
    assert counters.additive_attention_masks - before == model.config.num_hidden_layers


def cache_write_between(q, k, v, mask, cache):
    a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    cache.index_copy_(2, torch.tensor([0]), a[:, :, :1])  # a write to other storage (a KV cache)
    return F.scaled_dot_product_attention(a, cache, cache, attn_mask=mask)


def test_writes_to_other_storage_keep_one_conversion():
    q, k, v, mask = inputs()
    gm = dynamo_graph(cache_write_between, q, k, v, mask, v.clone())
    assert additive_attention_masks(gm, is_sdpa) == 2
    assert wheres(gm) == 1
    cache_a, cache_b = v.clone(), v.clone()
    torch.testing.assert_close(gm(q, k, v, mask, cache_a)[0], cache_write_between(q, k, v, mask, cache_b),
                               atol=0, rtol=0)
    torch.testing.assert_close(cache_a, cache_b, atol=0, rtol=0)
