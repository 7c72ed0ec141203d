"""Inputs of compiled pieces laid out otherwise than the fakes Inductor compiled them for
(torch_ext/backend/runtime/layout.py): copied into the compiled layout, said once, results equal eager.

Without the check the piece fails on Inductor's stride assert (shown side by side): Inductor returns
`torch.cat([q * 2, q[..., 16:]], -1)` (an empty second part) as `q * 2` in q's transposed layout,
not the fake's contiguous one, and the eager `F.scaled_dot_product_attention` after it lays its
output out the same way (Hugging Face's Phi-3 does exactly this).
"""
from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn.functional as F

import hf_models as hf
import torch_ext
from torch_ext.backend.runtime import layout
from torch_ext.backend.runtime.piecewise import CompiledPiece
from torch_ext.hops.splitting_op import splitting_op

SDPA = "aten::scaled_dot_product_attention"


@pytest.fixture(autouse=True)
def _fresh_messages():
    layout._said.clear()


def attention_block(x, w, mask):
    b, s, _ = x.shape
    q, k, v = (x @ w).view(b, s, 3, 4, 16).permute(2, 0, 3, 1, 4).unbind(0)
    q = torch.cat([q * 2, q[..., 16:]], dim=-1)  # partial rotary with nothing left over (Phi-3)
    a = F.scaled_dot_product_attention(q, k.contiguous(), v.contiguous(), attn_mask=mask)
    return a.transpose(1, 2).reshape(b, s, 64) + x


def block_inputs(batch, seq=8, grad=False):
    torch.manual_seed(batch)
    x = torch.randn(batch, seq, 64, requires_grad=grad)
    w = (torch.randn(64, 192) / 8).requires_grad_(grad)
    return x, w, torch.ones(seq, seq, dtype=torch.bool).tril()


def backend(**kwargs):
    return torch_ext.backend(torch_ext.CompileConfig(cache_dir=None, **kwargs))


def symbolic_fakes():
    """Fake values (dynamic sizes) of a contiguous input and of views of it, by name."""
    values = {}

    def capture(gm, example_inputs):
        for node in gm.graph.nodes:
            values[node.name] = node.meta.get("example_value")
        return gm

    def f(x):
        return x.transpose(1, 2) * 1, x[:, :, ::2], x.expand(2, -1, -1, -1), x[:1]

    torch.compile(f, backend=capture, dynamic=True)(torch.randn(3, 5, 7))
    return values


def test_dense_order_reads_symbolic_strides():
    fakes = {name: v for name, v in symbolic_fakes().items() if isinstance(v, torch.Tensor)}
    orders = {name: layout.dense_order(v) for name, v in fakes.items()}
    assert orders["l_x_"] == (2, 1, 0)  # contiguous
    assert orders["mul"] == (1, 2, 0)  # the transpose's layout, kept by the product
    assert orders["getitem"] is None  # every other element: not dense
    assert orders["expand"] is None  # stride 0: not dense
    assert orders["getitem_1"] == (2, 1)  # x[:1]: a dim of static size 1 has no place in the order


def test_size_one_strides_are_free():
    check = layout.checks_for([torch.empty(2, 3, 4)], [0])[0]
    assert check.contiguous
    odd = torch.empty(2, 1, 4).as_strided((2, 1, 4), (4, 100, 1))  # Inductor's assert ignores dim 1 too
    assert layout.has_layout(odd, layout.checks_for([torch.empty(2, 1, 4)], [0])[0])
    transposed = layout.checks_for([torch.empty(2, 4, 3).transpose(1, 2)], [0])[0]
    assert not transposed.contiguous
    assert layout.has_layout(torch.empty(5, 4, 3).transpose(1, 2), transposed)
    assert not layout.has_layout(torch.empty(5, 3, 4), transposed)


@pytest.mark.parametrize("dynamic", [True, False])
def test_piece_inputs_laid_out_otherwise_are_copied(caplog, monkeypatch, dynamic):
    cfg = dict(splitting_ops=[SDPA], compile_sizes=[2])
    with monkeypatch.context() as m:  # without the check: Inductor's stride assert fails the piece
        m.setattr(CompiledPiece, "check_layouts", lambda self, sources: None)
        compiled = torch.compile(attention_block, backend=backend(**cfg), dynamic=dynamic)
        with pytest.raises(AssertionError, match="stride"):
            compiled(*block_inputs(3))
    torch._dynamo.reset()
    compiled = torch.compile(attention_block, backend=backend(**cfg), dynamic=dynamic)
    with caplog.at_level(logging.INFO, logger="torch_ext.backend"):
        for batch in (3, 2, 2, 5):  # the general compile and the size-2 variant
            inputs = block_inputs(batch)
            torch.testing.assert_close(compiled(*inputs), attention_block(*inputs))
    said = [r.getMessage() for r in caplog.records if "not the layout the piece was compiled for" in r.getMessage()]
    assert len(said) == 1 and f"made by {SDPA}" in said[0], said


def test_gradients_flow_through_the_copy():
    compiled = torch.compile(attention_block, backend=backend(splitting_ops=[SDPA]), dynamic=True)
    grads = []
    for fn in (attention_block, compiled):
        x, w, mask = block_inputs(3, grad=True)
        fn(x, w, mask).square().sum().backward()
        grads.append((x.grad, w.grad))
    torch.testing.assert_close(grads[1], grads[0])


@splitting_op("torch_ext_test_layout::scale", fake=lambda q: torch.empty_like(q))
def scale_heads(q: torch.Tensor) -> torch.Tensor:
    # The real kernel returns (batch, seq, heads, dim) memory; the fake says q's own layout.
    return (q * 0.5).transpose(1, 2).contiguous().transpose(1, 2)


def user_op_block(x):
    b, s, _ = x.shape
    q = (x * 3).view(b, s, 4, 16).transpose(1, 2).contiguous()
    return torch.ops.torch_ext_test_layout.scale(q).sum(-1) + 1


def test_a_splitting_op_whose_fake_disagrees_is_named(caplog):
    compiled = torch.compile(user_op_block, backend=backend(splitting_ops=["torch_ext_test_layout::scale"]),
                             dynamic=True)
    with caplog.at_level(logging.INFO, logger="torch_ext.backend"):
        for batch in (2, 3):
            x = torch.randn(batch, 8, 64)
            torch.testing.assert_close(compiled(x), user_op_block(x))
    said = [r for r in caplog.records if "not the layout the piece was compiled for" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING
    assert "torch_ext_test_layout::scale" in said[0].getMessage() and "fake kernel" in said[0].getMessage()


@pytest.mark.slow
def test_phi3_trains_through_the_backend_like_eager():
    """Hugging Face's Phi-3 (tiny, random weights), split at its attention: failed on Inductor's
    stride assert before layout.py; loss, logits and every gradient now equal eager's."""
    model = hf.build("phi3").train()
    twin = copy.deepcopy(model)
    ids = hf.token_ids(2, 8)
    compiled = torch.compile(twin, backend=backend(splitting_ops=[SDPA]), dynamic=True)
    results = []
    for m, call in ((model, model), (twin, compiled)):
        out = call(input_ids=ids, labels=ids, use_cache=False)
        out.loss.backward()
        results.append((out.loss, out.logits, {n: p.grad for n, p in m.named_parameters()}))
    torch.testing.assert_close(results[1][:2], results[0][:2], atol=1e-5, rtol=1e-5)
    for name, grad in results[0][2].items():
        torch.testing.assert_close(results[1][2][name], grad, atol=1e-5, rtol=1e-5, msg=lambda m: f"{name}: {m}")
