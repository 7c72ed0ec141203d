"""Residual add + RMSNorm fusion: the custom op, the pass on a traced graph, and through Inductor."""
import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters
from torch._higher_order_ops.auto_functionalize import auto_functionalized
from torch._subclasses.fake_tensor import FakeTensorMode

from torch_ext.backend.passes import FuseAddRMSNormPass, PassManager
from torch_ext.backend.passes.fusion_add_rms_norm import COUNTER
from torch_ext.kernels.fused_add_rms_norm import fused_add_rms_norm_reference

OP = torch.ops.torch_ext.fused_add_rms_norm.default


def rms_norm(r, weight, eps, weight_first=False):
    h = r.float()
    var = h.pow(2).mean(-1, keepdim=True)
    normed = (h * torch.rsqrt(var + eps)).to(r.dtype)
    return weight * normed if weight_first else normed * weight


def fused_count():
    return counters["torch_ext"][COUNTER]


@pytest.fixture(autouse=True)
def _clear_counters():
    counters.clear()


# -- the custom op ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(5, 64), (2, 3, 64)])
def test_op_is_the_reference_in_place(dtype, shape):
    x, res = torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype)
    w = torch.rand(64, dtype=dtype) + 0.5
    y_ref, r_ref = rms_norm(x + res, w, 1e-5), x + res
    assert all(torch.equal(a, b) for a, b in zip(fused_add_rms_norm_reference(x, res, w, 1e-5), (y_ref, r_ref)))
    x_ptr, res_ptr = x.data_ptr(), res.data_ptr()
    assert OP(x, res, w, 1e-5) is None
    assert torch.equal(x, y_ref) and torch.equal(res, r_ref)
    assert (x.data_ptr(), res.data_ptr()) == (x_ptr, res_ptr)


def test_op_fake_and_errors():
    with FakeTensorMode():
        x = torch.empty(4, 8)
        OP(x, torch.empty(4, 8), torch.empty(8), 1e-6)  # the fake impl: shapes only
    with pytest.raises(ValueError, match="one dtype"):
        OP(torch.randn(4, 8), torch.randn(4, 8), torch.randn(8, dtype=torch.float64), 1e-6)
    with pytest.raises(ValueError, match="one shape"):
        OP(torch.randn(4, 8), torch.randn(1, 8), torch.randn(8), 1e-6)


# -- the pass on a traced post-grad-like graph --------------------------------------------------


def _two_forms(x, residual, w1, w2, mat1, mat2, folded):
    r1 = x + residual  # plain add
    y1 = rms_norm(r1, w1, 1e-6)
    # The form Inductor folds `mm + add` into. The replacement computes the product on its own and
    # adds it in the op: the eager rounding (`folded=False`), which a bf16 addmm does not share.
    r2 = torch.addmm(r1, mat1, mat2) if folded else mat1 @ mat2 + r1
    y2 = rms_norm(r2, w2, 1e-5, weight_first=True)  # HF Llama's order
    return y1, y2, r2


def two_forms(x, residual, w1, w2, mat1, mat2):
    return _two_forms(x, residual, w1, w2, mat1, mat2, folded=True)


def near_misses(x, residual, w, w32, row):
    outs = []
    r = x + residual
    outs += [r, rms_norm(r, w32, 1e-6)]  # fp32 weight promotes: the op would not
    r = x + row
    outs += [r, rms_norm(r, w, 1e-6)]  # broadcasting add
    r = torch.add(x, residual, alpha=2.0)
    outs += [r, rms_norm(r, w, 1e-6)]  # add with alpha
    r = x + residual
    h = r.float()
    outs += [r, (h * torch.rsqrt(h.pow(2).mean(0, keepdim=True) + 1e-6)).to(r.dtype) * w]
    return outs


def trace(fn, *args):
    """Functional, decomposed, FakeTensor-annotated: the shape of a post-grad graph."""
    from torch._inductor.decomposition import select_decomp_table
    from torch.fx.experimental.proxy_tensor import make_fx

    return make_fx(fn, select_decomp_table(), tracing_mode="fake")(*args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pass_on_traced_graph(dtype):
    t = lambda *s: torch.randn(*s, dtype=dtype)  # noqa: E731
    args = (t(6, 32), t(6, 32), t(32), t(32), t(6, 16), t(16, 32))
    gm = trace(two_forms, *args)
    FuseAddRMSNormPass(dtypes=[dtype])(gm.graph)
    gm.graph.lint()
    gm.recompile()
    assert fused_count() == 2
    fused = gm.graph.find_nodes(op="call_function", target=auto_functionalized)
    assert [n.args[0] for n in fused] == [OP, OP]
    assert sorted(n.kwargs["eps"] for n in fused) == [1e-6, 1e-5]
    assert all("val" in n.meta for n in gm.graph.nodes if n.op == "call_function")
    assert not gm.graph.find_nodes(op="call_function", target=torch.ops.aten.rsqrt.default)
    # auto_functionalized runs eagerly (on clones): the graph still computes the same values.
    for got, want in zip(gm(*args), _two_forms(*args, folded=False)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_pass_leaves_near_misses_alone():
    args = (torch.randn(6, 32), torch.randn(6, 32), torch.randn(32), torch.randn(32).double(),
            torch.randn(1, 32))
    gm = trace(near_misses, *args)
    before = str(gm.graph)
    FuseAddRMSNormPass()(gm.graph)
    assert fused_count() == 0 and str(gm.graph) == before


def test_dtype_gate():
    args = tuple(torch.randn(*s, dtype=torch.bfloat16) for s in ((6, 32), (6, 32), (32,), (32,), (6, 16), (16, 32)))
    gm = trace(two_forms, *args)
    FuseAddRMSNormPass(dtypes=[torch.float32])(gm.graph)
    assert fused_count() == 0


# -- through a real Inductor compile ------------------------------------------------------------


class Layer(torch.nn.Module):
    def __init__(self, hidden, dtype, act):
        super().__init__()
        self.proj = torch.nn.Linear(hidden, hidden, bias=False, dtype=dtype)
        self.weight = torch.nn.Parameter(torch.rand(hidden, dtype=dtype) + 0.5)
        self.act = act

    def forward(self, x, residual):
        x = self.proj(x)
        if self.act:
            x = F.silu(x)  # the add stays an add; without it Inductor folds it into addmm
        r = x + residual
        h = r.float()
        var = h.pow(2).mean(-1, keepdim=True)
        y = (h * torch.rsqrt(var + 1e-5)).to(x.dtype) * self.weight
        return y, r


class Decoder(torch.nn.Module):
    def __init__(self, hidden=32, dtype=torch.float32):
        super().__init__()
        self.layers = torch.nn.ModuleList([Layer(hidden, dtype, True), Layer(hidden, dtype, False)])

    def forward(self, x):
        h, residual = x, x * 0.5
        for layer in self.layers:
            h, residual = layer(h, residual)
        return h, residual


def compile_with_fusion(model, **kwargs):
    from torch._inductor import config

    patch = config.patch(
        post_grad_custom_post_pass=PassManager([FuseAddRMSNormPass()]),
        fx_graph_cache=False,
    )
    return patch, torch.compile(model, backend="inductor", **kwargs)


@pytest.mark.slow
def test_inductor_fp32_matches_eager():
    from torch._inductor.utils import run_and_get_code

    model, x = Decoder(), torch.randn(4, 32)
    patch, compiled = compile_with_fusion(model)
    with torch.no_grad(), patch:
        (out, res), code = run_and_get_code(compiled, x)
        want_out, want_res = model(x)
    assert fused_count() == 2
    assert "".join(code).count("torch.ops.torch_ext.fused_add_rms_norm.default(") == 2
    torch.testing.assert_close(out, want_out)
    torch.testing.assert_close(res, want_res)


@pytest.mark.slow
def test_inductor_bf16_symbolic_batch_matches_eager():
    model = Decoder(dtype=torch.bfloat16)
    patch, compiled = compile_with_fusion(model, dynamic=False)
    with torch.no_grad(), patch:
        for batch in (3, 5):  # one general (symbolic batch) compile serves both
            x = torch.randn(batch, 32, dtype=torch.bfloat16)
            torch._dynamo.mark_dynamic(x, 0)
            for got, want in zip(compiled(x), model(x)):
                torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    assert fused_count() == 2 and counters["stats"]["unique_graphs"] == 1


@pytest.mark.slow
def test_training_grads_match_eager():
    # Saved activations give the pattern's inner nodes extra users: the pass must leave such
    # graphs intact, and gradients must stay right.
    model, x = Decoder(), torch.randn(4, 32, requires_grad=True)
    patch, compiled = compile_with_fusion(model)
    with patch:
        out, res = compiled(x)
        (out.sum() + res.square().sum()).backward()
    assert fused_count() == 0  # norm internals are saved for backward: no match
    grads = [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]
    model.zero_grad()
    x.grad = None
    out, res = model(x)
    (out.sum() + res.square().sum()).backward()
    for got, want in zip(grads, [p.grad for p in model.parameters()] + [x.grad]):
        torch.testing.assert_close(got, want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_inductor_cuda_bf16_matches_eager():
    model = Decoder(hidden=2048, dtype=torch.bfloat16).cuda()
    x = torch.randn(8, 2048, dtype=torch.bfloat16, device="cuda")
    patch, compiled = compile_with_fusion(model)
    with torch.no_grad(), patch:
        got = compiled(x)
        want = model(x)
    assert fused_count() == 2
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=5e-2, rtol=2e-2)
