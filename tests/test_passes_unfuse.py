"""UnfuseOutputAddmm: a residual sum that is a piece output goes back to mm + add (see its module)."""
import pytest
import torch

from torch_ext.backend import CompileConfig, Variant, make_backend
from torch_ext.backend.passes import Pass, UnfuseOutputAddmm

aten = torch.ops.aten


class Spy(Pass):
    """Records the post-grad graph's call targets (runs last)."""

    def __init__(self):
        self.graphs = []

    def __call__(self, graph):
        self.graphs.append([n.target for n in graph.nodes if n.op == "call_function"])


def rms(r, w):
    h = r.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(r.dtype) * w


def residual_block(h, a, w_o, w_down, w_norm):
    """Two residual sums; the second leaves the graph and also feeds a norm (as at a piece's end)."""
    h = h + a @ w_o
    h = h + torch.relu(rms(h, w_norm)) @ w_down
    return h, rms(h, w_norm)


def mm_user(h, a, w_o, w_down, w_norm):
    h = h + a @ w_o  # its only user besides the output is another matmul: addmm is right here
    return h, h @ w_down


def bias(h, a, w_o, w_down, w_norm):
    b = w_norm[:8]
    s = a @ w_o + b  # a broadcast bias: cuBLAS puts it in the epilogue, no copy to save
    return s, rms(s, w_norm)


def inputs():
    torch.manual_seed(0)
    return (torch.randn(6, 8), torch.randn(6, 16), torch.randn(16, 8), torch.randn(8, 8), torch.rand(8) + 0.5)


def compile_and_run(fn, passes, unfuse_default=False):
    spy = Spy()
    # No Inductor FX-graph cache: a hit would skip the passes (and the spy).
    config = CompileConfig(cache_dir=None, post_grad_passes=(*passes, spy), unfuse_output_addmm=unfuse_default,
                           progress_bar=False, inductor_options={"fx_graph_cache": False})
    out = torch.compile(fn, backend=make_backend(config), fullgraph=True)(*inputs())
    return out, spy.graphs[-1]


def test_vanilla_inductor_folds_the_output_residual_into_addmm():
    _, targets = compile_and_run(residual_block, ())
    assert targets.count(aten.addmm.default) == 2  # the output sum, then the one feeding it


def test_unfused_back_to_mm_and_add_and_matches_eager():
    unfuse = UnfuseOutputAddmm(devices=("cpu",))  # Inductor folds on CPU too; the pass acts on GPU by default
    out, targets = compile_and_run(residual_block, (unfuse,))
    assert aten.addmm.default not in targets
    assert unfuse.unfused == 2  # last first: unfolding the second makes the first's users pointwise
    expected = residual_block(*inputs())
    for got, want in zip(out, expected):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("fn", [mm_user, bias], ids=["non-pointwise-user", "broadcast-bias"])
def test_left_alone(fn):
    unfuse = UnfuseOutputAddmm(devices=("cpu",))
    out, targets = compile_and_run(fn, (unfuse,))
    assert unfuse.unfused == 0
    for got, want in zip(out, fn(*inputs())):
        torch.testing.assert_close(got, want)


def test_default_devices_leave_cpu_graphs_alone():
    unfuse = UnfuseOutputAddmm()
    _, targets = compile_and_run(residual_block, (unfuse,))
    assert unfuse.unfused == 0 and targets.count(aten.addmm.default) == 2


def test_on_by_default_in_the_backend():
    config = CompileConfig(cache_dir=None)
    assert config.unfuse_output_addmm
    pm = make_backend(config).builder.compiler.pass_manager(Variant("general"))
    assert [type(p) for p in pm.passes] == [UnfuseOutputAddmm]
    with pytest.raises(Exception, match="unfuse_output_addmm"):
        CompileConfig(unfuse_output_addmm="yes")


def test_gradients_match_eager_with_the_pass_on_forward_and_backward():
    unfuse = UnfuseOutputAddmm(devices=("cpu",))
    config = CompileConfig(cache_dir=None, post_grad_passes=(unfuse,), unfuse_output_addmm=False,
                           progress_bar=False, inductor_options={"fx_graph_cache": False})
    compiled = torch.compile(residual_block, backend=make_backend(config), fullgraph=True)
    eager_in = [t.requires_grad_() for t in inputs()]
    compiled_in = [t.detach().clone().requires_grad_() for t in eager_in]
    for outs in (residual_block(*eager_in), compiled(*compiled_in)):
        (outs[0].square().sum() + outs[1].sum()).backward()
    assert unfuse.unfused >= 2  # the forward's two residual addmms at least
    for got, want in zip(compiled_in, eager_in):
        torch.testing.assert_close(got.grad, want.grad)
