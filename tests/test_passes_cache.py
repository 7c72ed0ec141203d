"""Post-grad passes and the backend's compile cache: an unchanged pass keeps cache hits, a changed
one (its config, or its code) misses and recompiles."""
import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters as dynamo_counters
from torch._inductor.utils import fresh_inductor_cache

from torch_ext.backend import CompileConfig, counters, make_backend
from torch_ext.backend.passes import FuseAddRMSNormPass


class AddNorm(torch.nn.Module):
    def __init__(self, dim=16):
        super().__init__()
        self.proj = torch.nn.Linear(dim, dim)
        self.weight = torch.nn.Parameter(torch.rand(dim) + 0.5)

    def forward(self, x, residual):
        r = self.proj(x) + residual
        h = r.float()
        y = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * self.weight
        return y, r


class EditedFusePass(FuseAddRMSNormPass):
    """The same fusion with one more line of code: its source, so its uuid, differs."""

    def __call__(self, graph):
        return super().__call__(graph)


def _run(model, inputs, cache_dir, passes):
    torch._dynamo.reset()
    counters.reset()
    dynamo_counters.clear()
    config = CompileConfig(cache_dir=str(cache_dir), post_grad_passes=passes)
    # A fresh Inductor cache: its own FX-graph cache (shared with other tests) would skip the pass
    # run and hide whether ours hit.
    with torch.no_grad(), fresh_inductor_cache():
        out = torch.compile(model, backend=make_backend(config), fullgraph=True)(*inputs)
        ref = model(*inputs)
    torch.testing.assert_close(out, ref)
    return counters.snapshot(), dynamo_counters["torch_ext"]["fuse_add_rms_norm"]


@pytest.fixture
def case(tmp_path):
    torch.manual_seed(0)
    return AddNorm(), (torch.randn(4, 16), torch.randn(4, 16)), tmp_path


@pytest.mark.slow
def test_unchanged_pass_hits_and_changed_pass_misses(case):
    model, inputs, cache_dir = case
    cold, fused = _run(model, inputs, cache_dir, (FuseAddRMSNormPass(),))
    assert cold["cache_hits"] == 0 and cold["inductor_compiles"] >= 1 and fused >= 1

    warm, fused_again = _run(model, inputs, cache_dir, (FuseAddRMSNormPass(),))
    assert warm["inductor_compiles"] == 0 and warm["cache_hits"] == cold["cache_misses"]
    assert fused_again == 0  # loaded from disk: the pass did not even run

    changed_config, _ = _run(model, inputs, cache_dir, (FuseAddRMSNormPass(skip_graph_inputs=True),))
    assert changed_config["cache_hits"] == 0 and changed_config["inductor_compiles"] >= 1

    changed_code, fused_edited = _run(model, inputs, cache_dir, (EditedFusePass(),))
    assert changed_code["cache_hits"] == 0 and changed_code["inductor_compiles"] >= 1 and fused_edited >= 1

    no_pass, _ = _run(model, inputs, cache_dir, ())
    assert no_pass["cache_hits"] == 0  # the unfused artifact is a different entry too
