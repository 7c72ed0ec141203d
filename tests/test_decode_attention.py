"""torch_ext::decode_attention (kernels/decode_attention.py) and the rewrite that puts it in place of a
decode step's SDPA (backend/rewrite/decode_attention.py).

On the CPU the op runs SDPA itself, so the model tests check the rewrite (which calls it replaces,
that the compiled model still equals eager); the Triton kernels are checked against a float64
reference under TRITON_INTERPRET=1 (a subprocess: the variable must be set before Triton loads),
and on a GPU in tests/test_decode_attention_gpu.py."""
from __future__ import annotations

import os

import pytest
import torch

import hf_models as hf
import torch_ext
from torch_ext.backend import CompileConfig, counters
from torch_ext.testing import capture_graphs
from test_hf_decode import SDPA, decode_matches_eager, fx_pieces  # noqa: F401  (fixture)
from triton_interpreter import run_in_interpreter

HERE = os.path.dirname(os.path.abspath(__file__))
# The rewrite runs by default only where CUDA graphs replay its launches; these CPU tests ask for it.
ON = {"decode_attention": True, "cache_dir": None}

KERNEL_CHECK = r'''
import itertools, sys, torch
from torch_ext.kernels import decode_attention as module
from torch_ext.kernels.decode_attention import decode_attention_reference as ref, decode_attention_triton as tri
torch.manual_seed(0)
cases = [(1, 4, 4, 100, 64, None), (2, 8, 2, 300, 128, "bool"), (3, 4, 1, 64, 32, "float"),
         (2, 4, 4, 513, 80, "bool_one"), (1, 2, 2, 17, 16, "float_heads"), (2, 2, 2, 9, 8, "none_masked"),
         (3, 96, 8, 70, 16, "bool"), (2, 136, 136, 9, 8, "none_masked"),  # b * h >= 264: one split, no combine
         (3, 4, 2, 50, 16, "shared_cache"),  # k and v of batch 1, broadcast over q's batch as SDPA does
         (2, 8, 2, 77, 24, "float_heads"), (134, 4, 2, 9, 8, "bool"),  # grouped: per-head mask; b * hkv >= 264
         (2, 40, 2, 130, 16, "none_masked")]  # 20 heads a group: 32 rows of one tl.dot
worst = 0.0
for (b, h, hkv, L, d, kind), tc in itertools.product(cases, (False, True)):  # MHA on both of its kernels
    if tc and h != hkv:
        continue
    module.MHA_ON_TENSOR_CORES = tc
    kv_b = 1 if kind == "shared_cache" else b
    q = torch.randn(b, h, 1, d)
    k = torch.randn(kv_b, hkv, L + 5, d)[:, :, :L]  # a slice of a longer cache
    v = torch.randn(kv_b, L, hkv, d).transpose(1, 2)  # another layout
    mask = {None: None, "bool": torch.rand(b, 1, 1, L) > 0.3, "float": torch.randn(b, 1, 1, L),
            "bool_one": torch.rand(1, 1, 1, L) > 0.5, "float_heads": torch.randn(b, h, 1, L),
            "none_masked": torch.zeros(b, 1, 1, L, dtype=torch.bool), "shared_cache": None}[kind]
    out = torch.full((b, h, 1, d), float("nan"))
    out = tri(q, k, v, mask, 0.7 / d ** 0.5)
    m64 = mask if mask is None or mask.dtype == torch.bool else mask.double()
    expected = ref(q.double(), k.double(), v.double(), m64, 0.7 / d ** 0.5)
    assert not out.isnan().any(), kind
    err = ((out.double() - expected).norm() / expected.norm().clamp_min(1e-30)).item()
    assert err < 1e-5 or (kind == "none_masked" and out.abs().max() == 0), (b, h, hkv, L, d, kind, tc, err)
    worst = max(worst, err if kind != "none_masked" else 0.0)
empty = tri(torch.randn(2, 4, 1, 8), torch.randn(2, 2, 0, 8), torch.randn(2, 2, 0, 8), None, 0.3)
assert empty.shape == (2, 4, 1, 8) and not empty.any()  # an empty cache: zeros, as SDPA
print("WORST", worst)
'''


@pytest.mark.slow
def test_triton_kernels_equal_a_float64_reference_in_the_interpreter():
    run_in_interpreter(KERNEL_CHECK)


def test_mha_takes_the_tensor_core_kernel_where_its_rows_fill_the_gpu():
    """MHA rows go to the grouped kernel (one real row of a 16-row tl.dot) from 128 rows on; grouped
    heads always; the module switch forces either (the benches compare both)."""
    from torch_ext.kernels import decode_attention as op

    assert op.MHA_ON_TENSOR_CORES is None
    assert op.grouped(8, 32, 32) and op.grouped(4, 32, 32) and op.grouped(1, 32, 8)
    assert not op.grouped(1, 32, 32) and not op.grouped(2, 32, 32) and not op.grouped(8, 12, 12)
    assert op.config_kind(8, 32, 32) == "grouped" and op.config_kind(1, 32, 32) == "per_head"
    # grouped heads over few rows take the three-stage config, MHA rows on tensor cores never do
    assert op.config_kind(32, 32, 4) == "grouped_few_rows" and op.config_kind(32, 32, 8) == "grouped"
    assert op.config_kind(4, 32, 32) == "grouped"
    assert op.config_kind(1, 8, 1, d=256) == "grouped"  # three stages of 256-wide tiles: too much shared memory
    try:
        op.MHA_ON_TENSOR_CORES = True
        assert op.grouped(1, 32, 32)
        op.MHA_ON_TENSOR_CORES = False
        assert not op.grouped(8, 32, 32) and op.grouped(8, 32, 8)
    finally:
        op.MHA_ON_TENSOR_CORES = None


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_hf_decode_steps_use_it_and_match_eager(fx_pieces, arch):  # noqa: F811
    model = hf.build(arch).eval()
    compiled = torch_ext.compile(model, CompileConfig(cache_dir=None, guard_free_dispatch=True, decode_attention=True), dynamic=False)
    decode_matches_eager(model, compiled)
    layers = model.config.num_hidden_layers
    assert counters.decode_attention_calls == layers  # the decode graph's SDPA calls; the prefill is eager


class RepeatedKV(torch.nn.Module):
    """Decode attention over k/v of 2 heads repeated to 4, in one of four ways."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how

    def forward(self, q, k, v, mask):
        if self.how == "hf":  # transformers' repeat_kv: each kv head twice in a row
            k = k[:, :, None, :, :].expand(2, 2, 2, 10, 16).reshape(2, 4, 10, 16)
            v = v[:, :, None, :, :].expand(2, 2, 2, 10, 16).reshape(2, 4, 10, 16)
        elif self.how == "repeat_interleave":
            k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
        elif self.how == "repeat":  # tiled: head h reads kv head h % 2, not h // 2
            k, v = k.repeat(1, 2, 1, 1), v.repeat(1, 2, 1, 1)
        else:  # tiled through expand at dim 1
            k = k[:, None].expand(2, 2, 2, 10, 16).reshape(2, 4, 10, 16)
            v = v[:, None].expand(2, 2, 2, 10, 16).reshape(2, 4, 10, 16)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask) * 2


@pytest.mark.parametrize("how,kv_heads", [("hf", 2), ("repeat_interleave", 2), ("repeat", 4), ("tiled_expand", 4)])
def test_repeated_kv_is_passed_unrepeated_only_where_heads_repeat_in_a_row(how, kv_heads):
    """HF repeats k/v for grouped heads whenever a mask is given: a copy of the whole cache per layer.
    The op takes the unrepeated tensors; tiled repeats (another head mapping) stay as they are."""
    q, k, v = torch.randn(2, 4, 1, 16), torch.randn(2, 2, 10, 16), torch.randn(2, 2, 10, 16)
    mask = torch.rand(2, 1, 1, 10) > 0.3
    model = RepeatedKV(how)
    with torch.no_grad():
        out = capture_graphs(model, q, k, v, mask, backend_config=CompileConfig(cache_dir=None, decode_attention=True))
        expected = model(q, k, v, mask)
    torch.testing.assert_close(out.outputs, expected)
    (call,) = [n for gm in out.pieces[0].values() for n in gm.graph.nodes
               if n.target is torch.ops.torch_ext.decode_attention.default]
    assert [a.meta.get("example_value", a.meta.get("val")).shape[1] for a in call.args[1:3]] == [kv_heads, kv_heads]


def test_a_cache_written_after_its_repeat_is_read_repeated():
    """The repeat copied the cache before the write; the op would read the cache after it: the call keeps
    the repeated copy (and still runs the op)."""
    def attend(q, k, v):
        kr = k[:, :, None].expand(2, 2, 2, 10, 16).reshape(2, 4, 10, 16)
        vr = v[:, :, None].expand(2, 2, 2, 10, 16).reshape(2, 4, 10, 16)
        k.mul_(2)  # e.g. the next step's slot written early
        return torch.nn.functional.scaled_dot_product_attention(q, kr, vr) + k.sum()

    q, k, v = torch.randn(2, 4, 1, 16), torch.randn(2, 2, 10, 16), torch.randn(2, 2, 10, 16)
    counters.reset()
    with torch.no_grad():
        expected = attend(q, k.clone(), v)
        actual = torch.compile(attend, backend="torch_ext", dynamic=False, options=ON)(q, k.clone(), v)
    assert counters.decode_attention_calls == 1
    torch.testing.assert_close(actual, expected)


@pytest.mark.parametrize("q_batch,kv_batch,replaced", [(3, 1, True), (1, 3, False), (3, 3, True)])
def test_batch_of_one_broadcast_by_sdpa(q_batch, kv_batch, replaced):
    """SDPA broadcasts a batch of one: a cache shared by every sequence is read once per sequence
    (the kernels must not index past it); a single query against three caches gives three outputs,
    which the op (output of q's shape) cannot, so that call keeps SDPA."""
    def attend(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    q, k, v = torch.randn(q_batch, 4, 1, 16), torch.randn(kv_batch, 2, 10, 16), torch.randn(kv_batch, 2, 10, 16)
    counters.reset()
    with torch.no_grad():
        expected, actual = attend(q, k, v), torch.compile(attend, backend="torch_ext", dynamic=False, options=ON)(q, k, v)
    assert counters.decode_attention_calls == int(replaced)
    torch.testing.assert_close(actual, expected)


def test_tensor_subclass_inputs_keep_sdpa():
    """A tensor subclass (here torch's TwoTensor; in the wild a quantized KV cache) computes SDPA its
    own way; the op would be handed its inner tensors."""
    from torch.testing._internal.two_tensor import TwoTensor

    def attend(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)

    q, k, v = torch.randn(2, 4, 1, 16), torch.randn(2, 4, 10, 16), torch.randn(2, 4, 10, 16)
    k, v = TwoTensor(k, k * 2), TwoTensor(v, v + 1)
    counters.reset()
    with torch.no_grad():
        expected, actual = attend(q, k, v), torch.compile(attend, backend="torch_ext", options=ON)(q, k, v)
    assert counters.decode_attention_calls == 0 and type(actual) is TwoTensor
    torch.testing.assert_close(actual.a, expected.a)
    torch.testing.assert_close(actual.b, expected.b)


def test_sdpa_under_autocast_is_left_alone():
    """Autocast runs SDPA in bf16 on fp32 inputs; the op would compute (and return) fp32."""
    def attend(q, k, v):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v)

    q, k, v = torch.randn(2, 4, 1, 16), torch.randn(2, 4, 10, 16), torch.randn(2, 4, 10, 16)
    with torch.no_grad():
        expected, actual = attend(q, k, v), torch.compile(attend, backend="torch_ext", options=ON)(q, k, v)
    assert counters.decode_attention_calls == 0 and actual.dtype == expected.dtype == torch.bfloat16
    torch.testing.assert_close(actual, expected)


def test_on_by_default_only_where_cuda_graphs_replay_the_launches():
    """Without graphs a decode step would wait on the op's Python launch (bench/inference_floor.py,
    ext-nocg-forced): the default (None) leaves SDPA; True runs the op, also without graphs."""
    def attend(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)

    q, k, v = torch.randn(2, 4, 1, 16), torch.randn(2, 4, 10, 16), torch.randn(2, 4, 10, 16)
    for options, calls in ((None, 0), ({"cache_dir": None}, 0), (ON, 1)):
        torch._dynamo.reset()
        counters.reset()
        with torch.no_grad():
            torch.testing.assert_close(torch.compile(attend, backend="torch_ext", options=options)(q, k, v),
                                       attend(q, k, v))
        assert counters.decode_attention_calls == calls, options
    assert not CompileConfig().uses("decode_attention") and not CompileConfig().uses("decode_linear")
    full = CompileConfig(cudagraph_mode="full")
    assert full.uses("decode_attention") and full.uses("decode_linear")
    assert not CompileConfig(cudagraph_mode="full", decode_linear=False).uses("decode_linear")
    assert CompileConfig(decode_linear=True).artifact_hash() != CompileConfig().artifact_hash()
    with pytest.raises(ValueError, match="decode_attention.*True, False or None"):
        CompileConfig(decode_attention="yes")


def test_off_switch_prefill_training_and_splitting_ops_keep_sdpa(fx_pieces):  # noqa: F811
    model = hf.build("llama").eval()
    for config in (CompileConfig(cache_dir=None, decode_attention=False),
                   CompileConfig(cache_dir=None, splitting_ops=[SDPA])):
        torch._dynamo.reset()
        counters.reset()
        decode_matches_eager(model, torch_ext.compile(model, config, dynamic=False))
        assert counters.decode_attention_calls == 0
    torch._dynamo.reset()
    compiled = torch_ext.compile(model, CompileConfig(cache_dir=None, decode_attention=True))
    ids = hf.token_ids(2, 6)
    with torch.no_grad():  # a prefill: more than one query token
        torch.testing.assert_close(compiled(input_ids=ids).logits, model(input_ids=ids).logits)
    out = compiled(input_ids=ids).logits  # grad on: training graphs keep SDPA
    out.sum().backward()
    assert counters.decode_attention_calls == 0
