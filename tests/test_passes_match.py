"""MultiOutputMatch on hand-built graphs: order, rebinding, meta["val"], de-functionalization."""
import operator

import pytest
import torch
import torch.fx
from torch._higher_order_ops.auto_functionalize import auto_functionalized
from torch._subclasses.fake_tensor import FakeTensorMode

from torch_ext.backend.passes import MultiOutputMatch

aten = torch.ops.aten


@torch.library.custom_op("torch_ext_test::add_mul_", mutates_args=("a", "b"))
def add_mul_(a: torch.Tensor, b: torch.Tensor) -> None:
    s = a + b
    b.copy_(s * b)
    a.copy_(s)


@add_mul_.register_fake
def _(a, b):
    return None


@torch.library.custom_op("torch_ext_test::pure", mutates_args=())
def pure(a: torch.Tensor) -> torch.Tensor:
    return a.clone()


@pure.register_fake
def _(a):
    return torch.empty_like(a)


class Builder:
    """A graph whose nodes carry FakeTensor meta["val"], as post-grad graphs do."""

    def __init__(self):
        self.mode = FakeTensorMode()
        self.graph = torch.fx.Graph()

    def input(self, name, *shape):
        n = self.graph.placeholder(name)
        with self.mode:
            n.meta["val"] = torch.empty(*shape)
        return n

    def op(self, target, *args):
        n = self.graph.call_function(target, args)
        vals = torch.fx.node.map_arg(args, lambda a: a.meta["val"])
        with self.mode:
            n.meta["val"] = target(*vals)
        return n


def build():
    """r = a + b and s = r * b are the match (outputs r, s); u = neg(r) and v = sin(u) sit between
    the two matched nodes, so rebinding r's users to the replacement must move them after it."""
    B = Builder()
    a, b = B.input("a", 4, 8), B.input("b", 4, 8)
    r = B.op(aten.add.Tensor, a, b)
    u = B.op(aten.neg.default, r)
    v = B.op(aten.sin.default, u)
    w = B.op(aten.cos.default, b)  # unrelated: keeps its place
    s = B.op(aten.mul.Tensor, r, b)
    B.graph.output((v, s, w))
    return B.graph, dict(a=a, b=b, r=r, u=u, v=v, w=w, s=s)


def run(graph, a, b):
    return torch.fx.GraphModule(torch.nn.Module(), graph)(a.clone(), b.clone())


def replace_with_op(graph, n, nodes):
    m = MultiOutputMatch(nodes, graph)
    af = m.insert_auto_functionalized(torch.ops.torch_ext_test.add_mul_.default, a=n["a"], b=n["b"])
    r_new, s_new = m.insert_getitems(af, (1, 2))
    m.replace({n["r"]: r_new, n["s"]: s_new})
    return af, r_new, s_new


def test_replacement_out_of_graph_order_is_valid_and_equal():
    a, b = torch.randn(4, 8), torch.randn(4, 8)
    graph, n = build()
    expected = run(graph, a, b)
    # Matched nodes listed backwards: the helper must find the last one in graph order.
    af, r_new, s_new = replace_with_op(graph, n, [n["s"], n["r"]])
    graph.lint()

    order = list(graph.nodes)
    assert n["r"] not in order and n["s"] not in order  # matched nodes erased
    assert order.index(af) > order.index(n["w"])  # inserted after the last matched node
    assert order.index(r_new) < order.index(n["u"]) < order.index(n["v"])  # early users moved
    assert n["u"].args == (r_new,)
    assert list(graph.find_nodes(op="output"))[0].args[0][1] is s_new

    assert af.target is auto_functionalized
    assert af.meta["val"][0] is None and len(af.meta["val"]) == 3
    for x in (r_new, s_new):
        assert x.target is operator.getitem
        assert x.meta["val"].shape == (4, 8) and x.meta["val"].dtype == torch.float32

    for got, want in zip(run(graph, a, b), expected):
        torch.testing.assert_close(got, want)


def test_defunctionalization_reads_the_meta():
    """Inductor's re-inplacing and auto_functionalized decomposition run on the result."""
    from torch._inductor.fx_passes.post_grad import decompose_auto_functionalized
    from torch._inductor.fx_passes.reinplace import reinplace_inplaceable_ops_core

    a, b = torch.randn(4, 8), torch.randn(4, 8)
    graph, n = build()
    expected = run(graph, a, b)
    replace_with_op(graph, n, [n["s"], n["r"]])
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    # The core of reinplace_inplaceable_ops (whose FakeTensorUpdater argument differs by version).
    reinplace_inplaceable_ops_core(gm.graph)
    decompose_auto_functionalized(gm.graph)
    gm.recompile()
    targets = [x.target for x in gm.graph.nodes]
    assert auto_functionalized not in targets
    assert torch.ops.torch_ext_test.add_mul_.default in targets
    # a and b are graph inputs: the in-place op must work on clones, never on the caller's tensors.
    a_in, b_in = a.clone(), b.clone()
    got = gm(a_in, b_in)
    assert torch.equal(a_in, a) and torch.equal(b_in, b)
    for g, w in zip(got, expected):
        torch.testing.assert_close(g, w)


def test_insert_computes_meta_and_keeps_order():
    graph, n = build()
    m = MultiOutputMatch([n["r"], n["s"]])
    first = m.insert(aten.mul.Tensor, (n["a"], 2.0))
    second = m.insert(aten.add.Tensor, (first, n["b"]))
    nodes = list(graph.nodes)
    assert nodes.index(n["s"]) < nodes.index(first) < nodes.index(second)
    assert second.meta["val"].shape == (4, 8)
    assert m.last_node() is n["s"]
    assert m.nodes_in_graph_order() == [n["r"], n["s"]]


def test_errors_are_clear():
    graph, n = build()
    m = MultiOutputMatch([n["r"], n["s"]])
    with pytest.raises(ValueError, match="cannot be auto-functionalized"):
        m.insert_auto_functionalized(torch.ops.torch_ext_test.pure.default, a=n["a"])
    with pytest.raises(ValueError, match="no arguments"):
        m.insert_auto_functionalized(
            torch.ops.torch_ext_test.add_mul_.default, a=n["a"], b=n["b"], c=n["a"]
        )
    with pytest.raises(ValueError, match="pass \\['b'\\]"):
        m.insert_auto_functionalized(torch.ops.torch_ext_test.add_mul_.default, a=n["a"])
    with pytest.raises(ValueError, match="not a node of this match"):
        m.replace({n["u"]: n["a"]})
    bare = graph.call_function(aten.neg.default, (n["a"],))  # no meta["val"]
    with pytest.raises(ValueError, match="no meta\\['val'\\]"):
        m.insert(aten.neg.default, (bare,))
    with pytest.raises(ValueError, match="placeholder"):
        MultiOutputMatch([n["a"]])


def test_replacement_depending_on_moved_user_is_refused():
    """A replacement reading u (which reads the replaced r) would have to precede itself."""
    graph, n = build()
    before = [x.name for x in graph.nodes]
    m = MultiOutputMatch([n["r"], n["s"]])
    bad = m.insert(aten.mul.Tensor, (n["u"], n["b"]))
    with pytest.raises(RuntimeError, match="used before it is defined"):
        m.replace({n["r"]: bad})
    graph.erase_node(bad)
    assert [x.name for x in graph.nodes] == before
    graph.lint()
