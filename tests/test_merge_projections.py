"""Merged projections (backend/rewrite/merge_projections.py, backend/runtime/merged_params.py): linears
reading one input run as one GEMM in inference graphs, their parameters views of one buffer per group,
never stale. CPU; outputs compared with eager."""
from __future__ import annotations

import collections
import copy
import os

import pytest
import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

import hf_models as hf
import torch_ext
from torch_ext.backend import CompileConfig, ConfigError, counters
from torch_ext.testing import capture_graphs

LINEAR = (torch._C._nn.linear, torch.nn.functional.linear)


class Projections(nn.Module):
    """Three projections of one input with bias (q/k/v-like rows 8, 4, 4), and one of another input."""

    def __init__(self, bias: bool = True):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(16, 8, bias=bias), nn.Linear(16, 4, bias=bias), nn.Linear(16, 4, bias=bias)
        self.o = nn.Linear(8, 16)

    def forward(self, x):
        q, k, v = self.q(x), self.k(x), self.v(x)
        return self.o(q * torch.cat([k, v], dim=-1).relu())


def config(**fields) -> CompileConfig:
    return CompileConfig(cache_dir=None, **fields)


def linear_calls(pieces: dict[str, torch.fx.GraphModule]) -> int:
    return sum(1 for gm in pieces.values() for n in gm.graph.nodes if n.op == "call_function" and n.target in LINEAR)


def assert_matches(compiled, model, *inputs, **kwargs):
    with torch.no_grad():
        actual, expected = compiled(*inputs, **kwargs), model(*inputs, **kwargs)
    if hasattr(expected, "logits"):
        actual, expected = actual.logits, expected.logits
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


def storage_bytes(model: nn.Module) -> int:
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}
    return sum(storages.values())


@pytest.mark.parametrize("merge", [True, False])
@pytest.mark.parametrize("rank", [2, 3])
def test_hand_written_matches_eager_with_dynamic_batch(merge, rank):
    model = Projections().eval()
    compiled = torch_ext.compile(model, config(merge_projections=merge), dynamic=True)
    shape = lambda batch: (batch, 16) if rank == 2 else (batch, 5, 16)  # noqa: E731
    for batch in (3, 7, 2):
        assert_matches(compiled, model, torch.randn(shape(batch)))
    assert counters.merged_projection_groups == (1 if merge else 0)
    assert counters.graphs_seen == 1  # no recompile for the other batch sizes


@pytest.mark.parametrize("bias", [True, False])
def test_split_graph_has_fewer_linears(bias):
    model = Projections(bias=bias).eval()
    x = torch.randn(4, 16)
    with torch.no_grad():
        merged = capture_graphs(model, x, backend_config=config())
        plain = capture_graphs(model, x, backend_config=config(merge_projections=False))
    assert linear_calls(merged.pieces[0]) == 2 and linear_calls(plain.pieces[0]) == 4
    torch.testing.assert_close(merged.outputs, plain.outputs)


@pytest.mark.parametrize("cudagraph_mode", ["none", "piecewise", "full"])
def test_backend_string_and_cudagraph_modes_on_cpu(cudagraph_mode):
    """backend="torch_ext" with its defaults merges too; CUDA-graph modes (no graphs on a CPU) wrap the
    same call."""
    model = Projections().eval()
    options = {"cache_dir": None} if cudagraph_mode == "none" else {"cache_dir": None, "cudagraph_mode": cudagraph_mode}
    compiled = torch.compile(model, backend="torch_ext", options=options, dynamic=True)
    for batch in (2, 5):
        assert_matches(compiled, model, torch.randn(batch, 3, 16))
    assert counters.merged_projection_groups == 1


def test_tiny_llama_matches_eager_and_merges_qkv_and_gate_up():
    model = hf.build("llama").eval()
    ids = hf.token_ids(2, 8)
    with torch.no_grad():
        merged = capture_graphs(model, input_ids=ids, use_cache=False, backend_config=config())
        plain = capture_graphs(model, input_ids=ids, use_cache=False, backend_config=config(merge_projections=False))
        expected = model(input_ids=ids, use_cache=False).logits
    torch.testing.assert_close(merged.outputs.logits, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(plain.outputs.logits, expected, atol=1e-5, rtol=1e-5)
    assert counters.merged_projection_groups == 2 * hf.LAYERS  # q/k/v and gate/up per layer
    per_layer_saved = (3 - 1) + (2 - 1)
    assert sum(map(linear_calls, merged.pieces)) == sum(map(linear_calls, plain.pieces)) - per_layer_saved * hf.LAYERS


def _mm_events(fn, *args, **kwargs) -> int:
    with torch.no_grad():
        fn(*args, **kwargs)  # compile and warm up
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            fn(*args, **kwargs)
    names = collections.Counter(e.name for e in prof.events())
    return names["aten::mm"] + names["aten::addmm"]


@pytest.mark.slow
def test_profiler_shows_fewer_gemms_than_inductor():
    model = hf.build("llama").eval()
    ids = hf.token_ids(1, 8)
    inductor = _mm_events(torch.compile(model, dynamic=True), input_ids=ids, use_cache=False)
    torch._dynamo.reset()
    ours = _mm_events(torch_ext.compile(model, config(), dynamic=True), input_ids=ids, use_cache=False)
    assert inductor > 0
    assert ours == inductor - 3 * hf.LAYERS  # q/k/v: 3 -> 1, gate/up: 2 -> 1


@pytest.mark.slow
def test_no_second_copy_of_the_weights():
    model = hf.build("llama").eval()
    grouped = [p for layer in model.model.layers for m in (layer.self_attn.q_proj, layer.self_attn.k_proj,
               layer.self_attn.v_proj, layer.mlp.gate_proj, layer.mlp.up_proj) for p in m.parameters()]
    old = [StorageWeakRef(p.untyped_storage()) for p in grouped]
    before = storage_bytes(model)
    compiled = torch_ext.compile(model, config(), dynamic=True)
    assert_matches(compiled, model, input_ids=hf.token_ids(2, 8), use_cache=False)
    assert storage_bytes(model) <= 1.1 * before
    assert all(ref.expired() for ref in old)  # the parameters' old storages are freed
    assert len({p.untyped_storage().data_ptr() for p in grouped}) == 2 * hf.LAYERS  # one buffer per group
    # What the buffers hold is counted: the grouped parameters' bytes, once.
    assert counters.merged_buffer_bytes == sum(p.numel() * p.element_size() for p in grouped)


def test_updates_and_rebinds_are_seen_on_the_next_call():
    model = Projections().eval()
    compiled = torch_ext.compile(model, config(), dynamic=True)
    x = torch.randn(3, 5, 16)
    assert_matches(compiled, model, x)
    with torch.no_grad():
        model.q.weight.add_(1)  # in place: writes the buffer
    assert_matches(compiled, model, x)
    model.load_state_dict({k: v * 0.5 for k, v in model.state_dict().items()})  # copy_ into the buffer
    assert_matches(compiled, model, x)
    model.load_state_dict({k: v + 1 for k, v in model.state_dict().items()}, assign=True)  # new Parameters
    assert_matches(compiled, model, x)
    model.k.weight.data = torch.randn(4, 16)  # rebound
    assert_matches(compiled, model, x)
    model.v.bias = nn.Parameter(torch.randn(4))  # a new Parameter
    assert_matches(compiled, model, x)
    storage = model.q.weight.untyped_storage().data_ptr()
    assert {p.untyped_storage().data_ptr() for p in (model.k.weight, model.v.weight)} == {storage}
    assert counters.graphs_seen == 1


def test_layers_compiled_one_by_one_keep_their_own_weights():
    """Regional compilation: identical layers each compiled, one graph serving them all. Each layer's
    parameters get buffers of their own; one shared buffer had every layer run (and, its parameters
    being views, eagerly hold) the last layer's weights."""
    layers = [Projections().eval() for _ in range(3)]
    reference = copy.deepcopy(layers)
    for layer in layers:
        layer.compile(backend="torch_ext")
    x = torch.randn(2, 16)
    with torch.no_grad():
        for _ in range(3):
            for layer, ref in zip(layers, reference):
                torch.testing.assert_close(layer(x), ref(x), atol=1e-5, rtol=1e-5)
    for layer, ref in zip(layers, reference):
        torch.testing.assert_close(layer.state_dict(), ref.state_dict(), atol=0, rtol=0)
    assert counters.merged_projection_groups >= 1
    assert len({layer.q.weight.untyped_storage().data_ptr() for layer in layers}) == 3


def test_a_replaced_parameter_kept_by_the_user_keeps_its_values():
    """A parameter swapped for a new one: the new one's values go into the merged buffer; the old one,
    still a view of it, gets storage of its own first."""
    model = Projections().eval()
    compiled = torch_ext.compile(model, config(), dynamic=True)
    x = torch.randn(3, 16)
    assert_matches(compiled, model, x)
    old = model.k.weight
    kept = old.detach().clone()
    model.k.weight = nn.Parameter(torch.randn(4, 16))
    assert_matches(compiled, model, x)
    torch.testing.assert_close(old.detach(), kept, atol=0, rtol=0)
    assert old.untyped_storage().data_ptr() != model.k.weight.untyped_storage().data_ptr()


def test_moving_the_model_after_a_call_keeps_no_copy_of_the_old_weights():
    """model.to(dtype) after a compiled call: Dynamo compiles again, and the new graph's buffers take
    the parameters; the old graph's buffers (the old dtype's weights) must not stay alive with it."""
    model = Projections().eval()
    compiled = torch_ext.compile(model, config(), dynamic=True)
    x = torch.randn(3, 16)
    assert_matches(compiled, model, x)
    old = StorageWeakRef(model.q.weight.untyped_storage())
    model.to(torch.float64)
    assert_matches(compiled, model, x.double())
    assert old.expired()


def test_graphs_of_one_model_share_its_buffers():
    """Two graphs grouping the same parameters (two input ranks here; prefill and decode in a model)
    use one buffer: alternating between them copies nothing."""
    model = Projections().eval()
    compiled = torch_ext.compile(model, config(), dynamic=False)
    a, b = torch.randn(3, 16), torch.randn(2, 5, 16)
    assert_matches(compiled, model, a)
    storage = model.q.weight.untyped_storage().data_ptr()
    for _ in range(3):
        assert_matches(compiled, model, b)
        assert_matches(compiled, model, a)
    assert counters.graphs_seen == 2
    assert {p.untyped_storage().data_ptr() for p in (model.q.weight, model.k.weight, model.v.weight)} == {storage}


def test_tensor_subclass_weights_are_left_alone():
    """Weights of a tensor subclass (torch's TwoTensor here; quantized weights or DTensors in the wild)
    compute their linear their own way: no merge (the merge had crashed reading their storage)."""
    from torch.testing._internal.two_tensor import TwoTensor

    model = Projections(bias=False).eval()
    for m in (model.q, model.k, model.v):
        w = m.weight.detach()
        m.weight = nn.Parameter(TwoTensor(w, w * 2), requires_grad=False)
    x = torch.randn(3, 16)
    with torch.no_grad():
        expected, actual = model(x), torch.compile(model, backend="torch_ext")(x)
    assert counters.merged_projection_groups == 0
    torch.testing.assert_close(actual.a, expected.a)
    torch.testing.assert_close(actual.b, expected.b)


def test_optimizer_step_is_seen():
    model = Projections().eval()
    compiled = torch_ext.compile(model, config(), dynamic=True)
    x = torch.randn(4, 16)
    assert_matches(compiled, model, x)
    model(x).sum().backward()  # eager training step on the same (now merged) parameters
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    assert_matches(compiled, model, x)


def test_grad_enabled_compile_is_left_alone_and_gradients_match():
    model = Projections()
    twin = copy.deepcopy(model)
    x = torch.randn(4, 16)
    out = capture_graphs(twin, x, backend_config=config())
    # Differentiated once (backend/joint.py): the forward graph in ATen ops, each linear a matmul of its own.
    matmuls = sum(1 for gm in out.pieces[0].values() for n in gm.graph.nodes
                  if n.target in (torch.ops.aten.addmm.default, torch.ops.aten.mm.default))
    assert counters.merged_projection_groups == 0 and matmuls == 4
    compiled = torch_ext.compile(twin, config(), dynamic=True)
    compiled(x).sum().backward()
    model(x).sum().backward()
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(q.grad, p.grad, msg=name)
    assert counters.merged_projection_groups == 0


class Apart(nn.Module):
    """Projections of different inputs, and one weight used by two linears of one input."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.shared = nn.Linear(16, 8), nn.Linear(16, 8), nn.Linear(16, 8)

    def forward(self, x, y):
        return self.a(x) + self.b(y) + self.shared(x) * torch.nn.functional.linear(x, self.shared.weight)


def test_projections_not_sharing_an_input_are_left_alone():
    x, y = torch.randn(4, 16), torch.randn(4, 16)
    with torch.no_grad():
        out = capture_graphs(Apart().eval(), x, y, backend_config=config())
    assert counters.merged_projection_groups == 0 and linear_calls(out.pieces[0]) == 4


class MutatedBetween(nn.Module):
    """Two projections of x with an in-place update of x between them (add_, +=, x[...] =, a view's
    relu_): merged, the second would read x before the update."""

    def __init__(self, how: str = "add_"):
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)
        self.how = how

    def forward(self, x):
        x = x * 2
        y = self.a(x)
        if self.how == "add_":
            x.add_(1.0)
        elif self.how == "iadd":
            x += 1.0
        elif self.how == "setitem":
            x[:, :4] = 0.0
        else:
            x[1:].relu_()
        return y + self.b(x)


class AutocastBetween(nn.Module):
    """One projection under autocast, one of the same input outside it (fp32)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = self.a(x)
        return y, self.b(x)


@pytest.mark.parametrize("make", [lambda: MutatedBetween("add_"), lambda: MutatedBetween("iadd"),
                                  lambda: MutatedBetween("setitem"), lambda: MutatedBetween("view_relu_"),
                                  AutocastBetween], ids=["add_", "iadd", "setitem", "view_relu_", "autocast"])
def test_no_group_spans_a_mutation_or_an_autocast_region(make):
    model = make().eval()
    x = torch.randn(4, 16)
    with torch.no_grad():
        expected = model(x.clone())
        actual = torch.compile(model, backend="torch_ext")(x.clone())
    assert counters.merged_projection_groups == 0
    torch.testing.assert_close(actual, expected, atol=0, rtol=0)  # same dtypes, same ops


class ReturnsProjections(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 8)

    def forward(self, x):
        return self.a(x).unsqueeze(0), self.b(x)


def test_projections_leaving_the_graph_are_left_alone():
    """Merged, the caller (or the code after a graph break) would get slices: `.view` would fail."""
    model = ReturnsProjections().eval()
    x = torch.randn(4, 16)
    with torch.no_grad():
        a, b = torch.compile(model, backend="torch_ext")(x)
        expected = model(x)
    assert counters.merged_projection_groups == 0
    assert a.is_contiguous() and b.is_contiguous() and b.view(-1).shape == (32,)
    torch.testing.assert_close((a, b), expected)


def test_switch_off_leaves_all_alone():
    model = Projections().eval()
    storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    compiled = torch_ext.compile(model, config(merge_projections=False), dynamic=True)
    assert_matches(compiled, model, torch.randn(3, 16))
    assert counters.merged_projection_groups == 0
    assert {p.untyped_storage().data_ptr() for p in model.parameters()} == storages


def test_debug_dump_lists_the_groups(tmp_path):
    model = Projections().eval()
    compiled = torch_ext.compile(model, config(debug_dump_dir=str(tmp_path)), dynamic=True)
    assert_matches(compiled, model, torch.randn(3, 16))
    (path,) = [os.path.join(d, f) for d, _, files in os.walk(tmp_path) for f in files if f == "merged_projections.txt"]
    text = open(path).read()
    assert "rows [8, 4, 4]" in text and "with bias" in text
    assert all(f"_modules['{name}']" in text for name in ("q", "k", "v")), text


def test_config_switch_is_validated_and_keyed():
    with pytest.raises(ConfigError, match="merge_projections"):
        CompileConfig(merge_projections="yes")
    assert CompileConfig().artifact_hash() != CompileConfig(merge_projections=False).artifact_hash()
