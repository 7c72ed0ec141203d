"""Splitting and fingerprints on Dynamo graphs, without Inductor."""
from __future__ import annotations

import operator

import pytest
import torch
import torch.fx as fx

import backend_models as bm
from torch_ext.backend.compile.fingerprint import graph_fingerprint
from torch_ext.backend.split.matcher import SplittingOpMatcher
from torch_ext.backend.split.splitter import SplitError, split_graph

MATCH = SplittingOpMatcher(("torch_ext_test::attention",))


def dynamo_graph(model, *args, dynamic_batch=True) -> fx.GraphModule:
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm

    torch._dynamo.reset()
    if dynamic_batch:
        torch._dynamo.mark_dynamic(args[0], 0)
    with torch.no_grad():
        torch.compile(model, backend=capture, fullgraph=True)(*args)
    torch._dynamo.reset()
    (gm,) = graphs
    return gm


def decoder_graph(layers=3, nested=False):
    model = bm.Decoder(layers=layers, nested=nested)
    return dynamo_graph(model, bm.batch(4), model.caches())


def kinds(split):
    return [p.kind for p in split.pieces]


@pytest.mark.parametrize("nested", [False, True])
def test_split_alternates_compute_and_splitting_pieces(nested):
    split = split_graph(decoder_graph(nested=nested), MATCH, "inline")
    assert kinds(split) == ["compute", "splitting"] * 3 + ["compute"]
    assert not any(isinstance(n.target, torch._ops.HigherOrderOperator) for n in split.split_gm.graph.nodes)
    prints = [graph_fingerprint(p.graph_module) for p in split.compute_pieces()]
    assert prints[1] == prints[2]  # the two middle pieces: the same code on differently named weights
    assert len(set(prints)) == 3


def test_in_body_split_keeps_one_shared_split_body():
    split = split_graph(decoder_graph(nested=True), MATCH, "in_body")
    assert kinds(split) == ["compute", "hop", "hop", "hop", "compute"]
    bodies = {id(p.body) for p in split.pieces if p.kind == "hop"}
    assert len(bodies) == 1  # three call sites, one body split once
    body = split.pieces[1].body
    assert kinds(body) == ["compute", "splitting", "compute"]
    assert len(split.all_compute_pieces()) == 2 + 3 * 2


def test_outputs_of_splitting_ops_are_unpacked_with_them():
    @torch.library.custom_op("torch_ext_test::split_two", mutates_args=())
    def split_two(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x * 2, x + 1

    split_two.register_fake(lambda x: (torch.empty_like(x), torch.empty_like(x)))

    def f(x):
        a, b = torch.ops.torch_ext_test.split_two(x.sin())
        return a.cos() + b

    gm = dynamo_graph(f, torch.randn(4, 3))
    split = split_graph(gm, SplittingOpMatcher(("torch_ext_test::split_two",)), "inline")
    assert kinds(split) == ["compute", "splitting", "compute"]
    opaque = split.pieces[1].graph_module
    assert [n.target for n in opaque.graph.nodes if n.op == "call_function"].count(operator.getitem) == 2
    # Pieces never receive tuples: every piece input is a tensor or a size.
    for piece in split.compute_pieces():
        for node in piece.graph_module.graph.find_nodes(op="placeholder"):
            assert isinstance(node.meta["example_value"], (torch.Tensor, torch.SymInt))


def test_fingerprint_ignores_names_but_not_code_shapes_or_constants():
    def f(x, w):
        return torch.nn.functional.layer_norm(x @ w, (8,), eps=1e-5)

    def g(y, v):
        return torch.nn.functional.layer_norm(y @ v, (8,), eps=1e-5)

    def h(x, w):
        return torch.nn.functional.layer_norm(x @ w, (8,), eps=1e-6)

    def fp(fn, dtype=torch.float32, dynamic_batch=True):
        x, w = torch.randn(4, 8, dtype=dtype), torch.randn(8, 8, dtype=dtype)  # fresh: mark_dynamic sticks
        return graph_fingerprint(dynamo_graph(fn, x, w, dynamic_batch=dynamic_batch))

    assert fp(f) == fp(g)  # other names, other symbol names: same piece
    assert fp(f) != fp(h)
    assert fp(f) != fp(f, dynamic_batch=False)
    assert fp(f) != fp(f, dtype=torch.float64)


def test_splitting_op_inside_an_unsupported_hop_is_refused():
    true_body = fx.symbolic_trace(lambda x: torch.ops.torch_ext_test.attention(x, x, x, x))
    false_body = fx.symbolic_trace(lambda x: x.clone())
    graph = fx.Graph()
    root = torch.nn.Module()
    root.true_graph, root.false_graph = true_body, false_body
    pred, x = graph.placeholder("pred"), graph.placeholder("x")
    cond = graph.call_function(torch.ops.higher_order.cond,
                               (pred, graph.get_attr("true_graph"), graph.get_attr("false_graph"), (x,)))
    graph.output(graph.call_function(operator.getitem, (cond, 0)))
    gm = fx.GraphModule(root, graph)
    with pytest.raises(SplitError, match=r"inside the body of the higher-order op 'cond'.*Move the splitting op"):
        split_graph(gm, MATCH, "inline")


@pytest.mark.parametrize("region", ["wrap", "checkpoint"])
def test_splitting_ops_inside_wrap_and_checkpoint_bodies_are_found(region):
    from torch._higher_order_ops.wrap import wrap

    layer = bm.Layer()

    def f(x, cache):
        if region == "wrap":
            return wrap(layer, x, cache)
        return torch.utils.checkpoint.checkpoint(layer, x, cache, use_reentrant=False)

    gm = dynamo_graph(f, bm.batch(4), torch.zeros(bm.CACHE_ROWS, bm.D_MODEL))
    hop = {"wrap": "wrap", "checkpoint": "tag_activation_checkpoint"}[region]
    assert any(isinstance(n.target, torch._ops.HigherOrderOperator) and n.target.name() == hop
               for n in gm.graph.nodes)
    split = split_graph(gm, MATCH, "inline")
    assert kinds(split) == ["compute", "splitting", "compute"]


class SdpaLayer(torch.nn.Module):
    """Attention through F.scaled_dot_product_attention, as Hugging Face models write it."""

    def __init__(self, d: int = 16, heads: int = 2):
        super().__init__()
        self.heads = heads
        self.qkv, self.out = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).transpose(1, 3).unbind(2)
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.out(a.transpose(1, 2).reshape(b, s, d)).softmax(-1)


def test_aten_name_splits_where_dynamo_records_the_torch_function():
    """Dynamo records torch._C._nn.scaled_dot_product_attention, not the aten op; naming the aten op
    splits there (and at no other call)."""
    gm = dynamo_graph(torch.nn.Sequential(*(SdpaLayer() for _ in range(3))), torch.randn(2, 5, 16))
    split = split_graph(gm, SplittingOpMatcher(("aten::scaled_dot_product_attention",)), "inline")
    assert kinds(split).count("splitting") == 3
    methods = SplittingOpMatcher(("aten::softmax",))  # a Tensor method of an aten op's name
    assert sum(methods(n) for n in gm.graph.nodes) == 3
    assert not any(SplittingOpMatcher(("torch_ext_test::attention",))(n) for n in gm.graph.nodes)


def test_sdpa_model_split_by_aten_name_matches_eager_with_dynamic_sizes():
    import torch_ext
    from torch_ext.backend import counters

    model = torch.nn.Sequential(*(SdpaLayer() for _ in range(3)))
    config = torch_ext.CompileConfig(splitting_ops=["aten::scaled_dot_product_attention"], cache_dir=None)
    compiled = torch.compile(model, backend=torch_ext.backend(config), dynamic=True)
    with torch.no_grad():
        for batch, seq in ((2, 5), (3, 7), (1, 4)):
            x = torch.randn(batch, seq, 16)
            torch.testing.assert_close(compiled(x), model(x), atol=1e-5, rtol=1e-5)
    graphs = counters.splitting_op_calls // 3  # Dynamo may compile a second, more dynamic graph
    assert graphs >= 1 and (counters.splitting_op_calls, counters.pieces) == (3 * graphs, 4 * graphs)


def test_inference_split_graph_runs_straight_line_code_and_still_runs_hooks():
    """Without CUDA graphs an inference split graph is one generated function (runtime/split_runner.py);
    a forward hook on it (the config reporter's) still runs."""
    import torch_ext

    model = torch.nn.Sequential(*(SdpaLayer() for _ in range(2)))
    backend = torch_ext.backend(torch_ext.CompileConfig(splitting_ops=["aten::scaled_dot_product_attention"],
                                                        cache_dir=None))
    returned = []

    def record(gm, example_inputs):
        returned.append(backend(gm, example_inputs))
        return returned[-1]

    compiled = torch.compile(model, backend=record)
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), atol=1e-5, rtol=1e-5)
        (split_gm,) = returned
        assert split_gm.straight_line_source.startswith("def run(")
        calls = []
        split_gm.register_forward_pre_hook(lambda module, args: calls.append(len(args)))
        torch.testing.assert_close(compiled(x), model(x), atol=1e-5, rtol=1e-5)
    assert len(calls) == 1


def test_unmatched_splitting_op_is_said_once_with_the_nearest_names(caplog):
    import torch_ext

    model = torch.nn.Sequential(SdpaLayer(), SdpaLayer())
    config = torch_ext.CompileConfig(splitting_ops=["aten::_scaled_dot_product_flash_attention"], cache_dir=None)
    compiled = torch.compile(model, backend=torch_ext.backend(config))
    with torch.no_grad(), caplog.at_level("WARNING", logger="torch_ext.backend"):
        compiled(torch.randn(2, 5, 16))
        compiled(torch.randn(3, 6, 16))  # a recompile: another graph, not another warning
    said = [r.getMessage() for r in caplog.records if "matches no call" in r.getMessage()]
    assert len(said) == 1, said
    assert "aten::_scaled_dot_product_flash_attention" in said[0]
    assert "nearest names: aten::scaled_dot_product_attention" in said[0]


class EmbedThenBreak(torch.nn.Module):
    """A graph break before the attention (Hugging Face models break on a logging call there):
    Dynamo's first graph holds no attention, the second does."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(16, 16)
        self.layer = SdpaLayer()

    def forward(self, x):
        h = self.embed(x)
        torch._dynamo.graph_break()
        return self.layer(h)


@pytest.mark.parametrize("op, said", [("aten::scaled_dot_product_attention", False),
                                      ("aten::_scaled_dot_product_flash_attention", True)])
def test_a_graph_without_the_splitting_op_is_not_said_when_a_later_graph_has_it(caplog, op, said):
    """The first graph lacks the op; only if no later graph (nor the first graph's second call)
    matches it is it said, once."""
    import torch_ext
    from torch_ext.backend import counters

    model = EmbedThenBreak()
    config = torch_ext.CompileConfig(splitting_ops=[op], cache_dir=None)
    compiled = torch.compile(model, backend=torch_ext.backend(config))
    with torch.no_grad(), caplog.at_level("WARNING", logger="torch_ext.backend"):
        for _ in range(3):
            x = torch.randn(2, 5, 16)
            torch.testing.assert_close(compiled(x), model(x), atol=1e-5, rtol=1e-5)
    messages = [r.getMessage() for r in caplog.records if "matches no call" in r.getMessage()]
    assert len(messages) == int(said), messages
    assert counters.splitting_op_calls == (0 if said else 1)
    if said:
        assert op in messages[0] and "graphs 0 and 1" in messages[0]
        assert "nearest names: aten::scaled_dot_product_attention" in messages[0]  # from graph 1


def test_unmatched_splitting_op_in_a_single_graph_is_said_at_its_second_call(caplog):
    import torch_ext

    model = torch.nn.Sequential(torch.nn.Linear(16, 16))
    config = torch_ext.CompileConfig(splitting_ops=["aten::softmax"], cache_dir=None)
    compiled = torch.compile(model, backend=torch_ext.backend(config))
    with torch.no_grad(), caplog.at_level("WARNING", logger="torch_ext.backend"):
        compiled(torch.randn(2, 5, 16))
        assert not [r for r in caplog.records if "matches no call" in r.getMessage()]
        for _ in range(3):
            compiled(torch.randn(2, 5, 16))
    messages = [r.getMessage() for r in caplog.records if "matches no call" in r.getMessage()]
    assert len(messages) == 1 and "aten::softmax matches no call in graph 0" in messages[0], messages


def test_split_at_a_python_function_dynamo_keeps_as_one_call(caplog):
    """torch.nn.TransformerEncoder: Dynamo records nn.MultiheadAttention as one call of
    F.multi_head_attention_forward, never SDPA. Naming SDPA says so and points at that function;
    naming the function splits there, training and eval match eager."""
    import copy

    import torch_ext
    from torch_ext.backend import counters

    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(d_model=16, nhead=2, dim_feedforward=32, batch_first=True, dropout=0.0)
    model = torch.nn.TransformerEncoder(layer, num_layers=3, enable_nested_tensor=False)
    reference = copy.deepcopy(model)
    sdpa = torch_ext.CompileConfig(splitting_ops=["aten::scaled_dot_product_attention"], cache_dir=None)
    with torch.no_grad(), caplog.at_level("WARNING", logger="torch_ext.backend"):
        compiled = torch.compile(model, backend=torch_ext.backend(sdpa))
        for _ in range(2):
            compiled(torch.randn(2, 5, 16))
    said = [r.getMessage() for r in caplog.records if "matches no call" in r.getMessage()]
    assert len(said) == 1 and "torch.nn.functional.multi_head_attention_forward" in said[0], said

    torch._dynamo.reset()
    counters.reset()
    config = torch_ext.CompileConfig(splitting_ops=[torch.nn.functional.multi_head_attention_forward], cache_dir=None)
    compiled = torch.compile(model, backend=torch_ext.backend(config))
    for batch in (2, 3):
        x = torch.randn(batch, 5, 16)
        out, expected = compiled(x), reference(x)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
        out.square().sum().backward()
        expected.square().sum().backward()
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-5, msg=name)
        model.zero_grad()
        reference.zero_grad()
    assert counters.splitting_op_calls == 3 * counters.graphs_seen
