"""A training graph differentiated once (backend/joint.py) compiles each distinct layer once: the
partitioner's choices at the model's ends (RoPE tables recomputed inside the last layer's backward
piece, the first layer saving another tensor than its siblings) do not make a layer's piece unique."""
from __future__ import annotations

import pytest
import torch
import torch.fx as fx

import hf_models
from torch_ext.backend import CompileConfig, counters, make_backend
from torch_ext.backend.split.hoist import hoist_shared_values

LAYERS = 4


def _llama(layers: int):
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=hf_models.VOCAB, hidden_size=hf_models.HIDDEN,
                                      intermediate_size=2 * hf_models.HIDDEN, num_hidden_layers=layers,
                                      num_attention_heads=hf_models.HEADS, num_key_value_heads=hf_models.KV_HEADS,
                                      max_position_embeddings=hf_models.MAX_POSITIONS, attn_implementation="sdpa")
    return transformers.LlamaForCausalLM(config).train()


def _step(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.slow
def test_identical_layers_share_their_compiles():
    model = _llama(LAYERS)
    ids = hf_models.token_ids(2, 16)
    eager = _step(model, ids)
    torch._dynamo.reset()
    counters.reset()
    config = CompileConfig(cache_dir=None, splitting_ops=("aten::scaled_dot_product_attention",))
    compiled = torch.compile(model, backend=make_backend(config), fullgraph=True)
    ext = _step(compiled, ids)
    # Forward: the first piece (embedding, RoPE, layer 0 to its attention), one per layer boundary,
    # the last (norm, head, loss); backward the same, reversed: 3 + 3 distinct of 2 * (LAYERS + 1).
    assert counters.joint_graphs == 1
    assert (counters.pieces, counters.unique_pieces, counters.inductor_compiles) == (2 * (LAYERS + 1), 6, 6)
    torch.testing.assert_close(ext[0], eager[0], rtol=1e-4, atol=1e-5)
    for got, want in zip(ext[1], eager[1], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    again = _step(compiled, ids)  # the steady step (peeled prologues and shared outputs at run time)
    for got, want in zip(again[1], eager[1], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def _graph(build) -> fx.GraphModule:
    graph = fx.Graph()
    build(graph)
    for node in graph.nodes:  # meta vals the hoist reads
        if node.op == "placeholder":
            node.meta["val"] = torch.empty(4)
        elif node.op == "call_function":
            node.meta["val"] = torch.empty(4)
    return fx.GraphModule(torch.nn.Module(), graph)


SPLIT = torch.ops.aten.sigmoid.default  # stands for the splitting op


def _three_layers(graph: fx.Graph, make):
    """x -> [v = make(); layer k: x = split(x * v)] for three layers: v is read by three pieces."""
    x = graph.placeholder("x")
    cur = graph.call_function(SPLIT, (x,))
    v = None
    for _ in range(3):
        if v is None:
            v = make(graph)
        cur = graph.call_function(SPLIT, (graph.call_function(torch.ops.aten.mul.Tensor, (cur, v)),))
    graph.output((cur,))


def _piece_of(gm: fx.GraphModule, node_name: str) -> int:
    piece = 0
    for node in gm.graph.nodes:
        if node.target is SPLIT:
            piece += 1
        if node.name == node_name:
            return piece
    raise KeyError(node_name)


def test_model_wide_value_moves_before_the_splitting_op_ahead_of_its_first_reader():
    gm = _graph(lambda g: _three_layers(g, lambda g: g.call_function(
        torch.ops.aten.full.default, ([4], 1.0), {"dtype": torch.float32})))
    assert _piece_of(gm, "full_default") == 1  # computed in the first layer's piece
    assert hoist_shared_values(gm, lambda n: n.target is SPLIT) == 1
    assert _piece_of(gm, "full_default") == 0  # now in the piece before it


def test_random_values_stay_where_they_are_drawn():
    gm = _graph(lambda g: _three_layers(g, lambda g: g.call_function(
        torch.ops.aten.rand.default, ([4],), {"dtype": torch.float32})))
    assert hoist_shared_values(gm, lambda n: n.target is SPLIT) == 0
    assert _piece_of(gm, "rand_default") == 1
