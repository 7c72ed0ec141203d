"""Post-grad passes and the backend's compile cache: an unchanged pass keeps cache hits, a changed
one (its config, or its code) misses and recompiles."""
import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters as dynamo_counters
from torch._inductor.custom_graph_pass import CustomGraphPass
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


class RecordingPass(CustomGraphPass):
    """A user's own post-grad pass (inductor_options): appends its key to `calls` when it runs."""

    def __init__(self, key, calls: list):
        self.key, self.calls = key, calls

    def __call__(self, graph):
        self.calls.append(self.key)

    def uuid(self):
        return f"recording-{self.key}"


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


def test_a_users_own_post_pass_runs_beside_ours_and_is_cached_by_its_uuid(case, caplog):
    """inductor_options' post_grad_custom_post_pass used to be replaced by our PassManager wherever torch_ext
    has passes (the default unfuse_output_addmm). Now it runs after them; with a uuid it keys the disk cache,
    without one nothing compiled with it is written there (said once)."""
    model, inputs, cache_dir = case
    calls = []

    def Counting(version):  # noqa: N802
        return RecordingPass(version, calls)

    def run(user_pass):
        torch._dynamo.reset()
        counters.reset()
        config = CompileConfig(cache_dir=str(cache_dir), inductor_options={"post_grad_custom_post_pass": user_pass})
        assert config.unfuse_output_addmm  # a pass of ours is configured
        with torch.no_grad(), fresh_inductor_cache():
            torch.testing.assert_close(torch.compile(model, backend=make_backend(config))(*inputs), model(*inputs))
        return counters.snapshot()

    cold = run(Counting(1))
    assert calls == [1] * cold["inductor_compiles"] and cold["inductor_compiles"] >= 1
    assert run(Counting(1))["cache_hits"] == cold["cache_misses"]  # same uuid: loaded
    changed = run(Counting(2))
    assert changed["cache_hits"] == 0 and 2 in calls  # another uuid: compiled again, with it

    plain_calls = []
    plain = lambda graph: plain_calls.append(len(graph.nodes))  # noqa: E731
    with caplog.at_level("WARNING", logger="torch_ext"):
        for user_pass in (plain, plain, [Counting(1), plain]):  # a list of passes, as newer torch takes
            stats = run(user_pass)
            assert stats["cache_hits"] == 0 and stats["cache_misses"] == 0 and stats["inductor_compiles"] >= 1
    assert len(plain_calls) >= 3
    assert sum("without a uuid()" in r.getMessage() for r in caplog.records) == 3  # once per backend


def test_a_list_of_user_passes_runs_on_every_torch_with_no_passes_of_ours(case):
    """Newer torch takes a list as post_grad_custom_post_pass, older calls the list itself (a TypeError deep
    in Inductor); torch_ext runs the list through its PassManager on every torch, ours or none before it."""
    model, inputs, _ = case
    calls = []
    torch._dynamo.reset()
    config = CompileConfig(cache_dir=None, unfuse_output_addmm=False, inductor_options={
        "post_grad_custom_post_pass": [RecordingPass("a", calls), RecordingPass("b", calls)]})
    with torch.no_grad(), fresh_inductor_cache():
        torch.testing.assert_close(torch.compile(model, backend=make_backend(config))(*inputs), model(*inputs))
    assert calls[:2] == ["a", "b"]
