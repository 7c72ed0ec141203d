"""A training graph differentiated once (backend/joint.py) compiles each distinct layer once: the
partitioner's choices at the model's ends (RoPE tables recomputed inside the last layer's backward
piece, the first layer saving another tensor than its siblings) do not make a layer's piece unique."""
from __future__ import annotations

import operator

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


# --- pieces unlike their siblings only at their ends (compile/siblings.py), on hand-made ATen graphs ---

def _piece(body, n_inputs: int) -> fx.GraphModule:
    """A piece: inputs x0..x{n-1} (4-float tensors), `body(graph, inputs) -> outputs`, a tuple returned."""
    graph = fx.Graph()
    inputs = [graph.placeholder(f"x{i}") for i in range(n_inputs)]
    graph.output(tuple(body(graph, inputs)))
    gm = fx.GraphModule(torch.nn.Module(), graph)
    for node in gm.graph.nodes:
        if node.op != "output":
            node.meta["val"] = torch.empty(4)
    return gm


def _layer(graph, h, w, scale=2.0):
    """norm-like ops on h: what siblings share."""
    a = graph.call_function(torch.ops.aten.mul.Tensor, (h, w))
    b = graph.call_function(torch.ops.aten.mul.Tensor, (a, scale))
    return [graph.call_function(torch.ops.aten.add.Tensor, (b, h)), a]


def _eager_peel(graph, name):
    from torch_ext.backend.runtime.straight_line import straight_line

    return straight_line(graph, {}, name, boxed=False)


def test_piece_that_recomputes_a_siblings_input_runs_that_eagerly_and_shares_its_compile():
    from torch_ext.backend.compile.fingerprint import graph_fingerprint
    from torch_ext.backend.compile.siblings import PeeledPiece, peel_prologues

    sibling = lambda: _piece(lambda g, x: _layer(g, x[0], x[1]), 2)  # noqa: E731
    # The first layer's piece: h = e + m from two saved inputs, where its siblings are handed h.
    first = _piece(lambda g, x: _layer(g, g.call_function(torch.ops.aten.add.Tensor, (x[0], x[1])), x[2]), 3)
    odd = _piece(lambda g, x: _layer(g, g.call_function(torch.ops.aten.add.Tensor, (x[0], x[1])), x[2], 3.0), 3)
    pieces = {"a": sibling(), "b": sibling(), "first": first, "odd": odd}
    peels = peel_prologues(pieces, _eager_peel)
    assert set(peels) == {"first"}  # "odd" also scales by 3.0: nothing peeled makes it a twin
    assert graph_fingerprint(peels["first"].remainder) == graph_fingerprint(pieces["a"])
    e, m, w = torch.randn(4), torch.randn(4), torch.randn(4)
    want = first(e, m, w)

    class Compiled:  # the sibling's compile, called boxed
        output_strides = None

        def __call__(self, args):
            out = pieces["a"](*args)
            args.clear()
            return out

    got = PeeledPiece(peels["first"], Compiled())([e, m, w])
    for g, x in zip(got, want, strict=True):
        torch.testing.assert_close(g, x)


def test_pieces_equal_but_for_their_outputs_return_the_union():
    from torch_ext.backend.compile.fingerprint import graph_fingerprint
    from torch_ext.backend.compile.siblings import share_outputs

    def returns(index):  # its first output, and the other output of the layer or the first again
        def body(g, x):
            outs = _layer(g, x[0], x[1])
            return [outs[0], outs[index]]
        return _piece(body, 2)

    pieces = {"submod_0": returns(0), "submod_2": returns(1), "submod_4": returns(0)}
    split = fx.Graph()
    x, w = split.placeholder("x"), split.placeholder("w")
    outs = []
    for name in pieces:
        call = split.call_module(name, (x, w))
        outs.append(split.call_function(operator.getitem, (call, 1)))
    split.output(tuple(outs))
    root = torch.nn.Module()
    for name, gm in pieces.items():
        setattr(root, name, gm)
    split_gm = fx.GraphModule(root, split)
    x, w = torch.randn(4), torch.randn(4)
    want = [pieces[name](x, w)[1] for name in pieces]
    assert share_outputs(split_gm, pieces) == 3
    assert len({graph_fingerprint(gm) for gm in pieces.values()}) == 1
    for got, expected in zip(split_gm(x, w), want, strict=True):
        torch.testing.assert_close(got, expected)
