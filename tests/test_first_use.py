"""First-use libraries (backend/compile/first_use.py): a graph whose SDPA calls cuDNN gets cuDNN's
engines loaded where it compiles or loads (the compile thread, with background compile) rather than at
its first call (1.5 s on an H200). CPU side: which graphs need it, the arguments read from example
values, the names a warm-start entry keeps, loading once and never failing a compile.
tests/test_first_use_gpu.py checks the real choice and the load on a GPU."""
from __future__ import annotations

import json
import logging
import pickle

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch._subclasses import FakeTensorMode

from torch_ext.backend.compile import first_use


def _sdpa_graph(device="cuda", mask=True, **kwargs) -> fx.GraphModule:
    graph = fx.Graph()
    mode = FakeTensorMode()
    names = ["q", "k", "v"] + (["mask"] if mask else [])
    nodes = []
    with mode:
        for name in names:
            node = graph.placeholder(name)
            shape = (1, 4, 16, 32) if name != "mask" else (1, 1, 16, 16)
            node.meta["example_value"] = torch.empty(shape, device=device, dtype=torch.bfloat16)
            nodes.append(node)
    args = tuple(nodes[:3])
    call_kwargs = dict(kwargs, **({"attn_mask": nodes[3]} if mask else {}))
    out = graph.call_function(torch._C._nn.scaled_dot_product_attention, args, call_kwargs)
    graph.output(out)
    return fx.GraphModule(torch.nn.Module(), graph)


@pytest.fixture
def sdpa_picks(monkeypatch):
    """A CUDA machine where SDPA picks `choice`: records what it was asked."""
    from torch.nn.attention import SDPBackend

    asked = []
    monkeypatch.setattr(first_use, "_cudnn_sdpa_possible", lambda: True)

    def pick(choice):
        monkeypatch.setattr(first_use, "_sdpa_choice", lambda *call: asked.append(call) or int(choice))
        return asked

    pick.cudnn = SDPBackend.CUDNN_ATTENTION
    pick.flash = SDPBackend.FLASH_ATTENTION
    return pick


def test_a_graph_whose_sdpa_picks_cudnn_needs_it(sdpa_picks):
    asked = sdpa_picks(sdpa_picks.cudnn)
    (name,) = first_use.libraries_needed(_sdpa_graph(scale=0.5, is_causal=False))
    assert name.split(" ", 1)[0] == first_use.CUDNN_SDPA
    spec = json.loads(name.split(" ", 1)[1])  # what the loader repeats: the graph's own configuration
    assert spec == {"q": [1, 4, 16, 32], "k": [1, 4, 16, 32], "v": [1, 4, 16, 32], "dtype": "bfloat16",
                    "mask": [[1, 1, 16, 16], "bfloat16"], "causal": False, "scale": 0.5, "gqa": False}
    device, shapes, options = asked[0]
    assert device.type == "cuda"
    assert shapes["query"] == ((1, 4, 16, 32), (2048, 512, 32, 1), torch.bfloat16)
    assert shapes["attn_mask"][0] == (1, 1, 16, 16)
    assert options == {"scale": 0.5, "is_causal": False}


def test_a_graph_whose_sdpa_picks_another_backend_needs_nothing(sdpa_picks):
    sdpa_picks(sdpa_picks.flash)
    assert first_use.libraries_needed(_sdpa_graph(mask=False, is_causal=True)) == ()


def test_cpu_graphs_and_graphs_without_example_values_need_nothing(sdpa_picks):
    sdpa_picks(sdpa_picks.cudnn)
    assert first_use.libraries_needed(_sdpa_graph(device="cpu")) == ()  # the real choice: not a CUDA tensor
    gm = _sdpa_graph()
    for node in gm.graph.find_nodes(op="placeholder"):
        del node.meta["example_value"]  # as inside a loaded graph's pieces
    assert first_use.libraries_needed(gm) == ()


def test_without_cuda_nothing_is_probed(monkeypatch):
    monkeypatch.setattr(first_use, "_cudnn_sdpa_possible", lambda: False)
    monkeypatch.setattr(first_use, "_sdpa_choice", lambda *a: pytest.fail("probed"))
    assert first_use.libraries_needed(_sdpa_graph()) == ()


def test_a_real_cpu_model_traced_by_dynamo_needs_nothing():
    seen = []

    def backend(gm, example_inputs):
        seen.append(first_use.libraries_needed(gm))
        return gm

    q = torch.randn(1, 2, 8, 16)
    out = torch.compile(lambda q: F.scaled_dot_product_attention(q, q, q, is_causal=True), backend=backend)(q)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, q, q, is_causal=True))
    assert seen == [()]


def _decode_attention_graph(device) -> fx.GraphModule:
    import torch_ext.kernels.decode_attention  # noqa: F401  (registers the op)

    graph = fx.Graph()
    with FakeTensorMode():
        q = graph.placeholder("q")
        q.meta["example_value"] = torch.empty(1, 4, 1, 32, device=device, dtype=torch.bfloat16)
    node = graph.call_function(torch.ops.torch_ext.decode_attention.default, (q, q, q))
    graph.output(node)
    return fx.GraphModule(torch.nn.Module(), graph)


def test_our_decode_attention_on_cuda_needs_its_triton_imports(monkeypatch):
    monkeypatch.setattr(first_use, "_cudnn_sdpa_possible", lambda: False)
    names = first_use.libraries_needed(_decode_attention_graph("cuda"))
    assert names[0] == first_use.TRITON_DECODE_ATTENTION
    assert [n.split(" ", 1)[0] for n in names[1:]] == [first_use.TORCH_EXT_OP]  # and the call itself
    assert first_use.libraries_needed(_decode_attention_graph("cpu")) == ()
    gm = _decode_attention_graph("cuda")
    for node in gm.graph.nodes:
        node.meta.pop("example_value", None)  # a loaded graph's piece: the op is there only for CUDA graphs
    assert first_use.libraries_needed(gm) == (first_use.TRITON_DECODE_ATTENTION,)


def _decode_linear_graph(layers: int, rows: int = 1, out_features: int = 48) -> fx.GraphModule:
    """`layers` decode_linear calls of one layout on CUDA example values, and a CPU-side linear."""
    import torch_ext.kernels.decode_linear  # noqa: F401  (registers the op)

    graph = fx.Graph()
    with FakeTensorMode():
        x = graph.placeholder("x")
        x.meta["example_value"] = torch.empty(rows, 32, device="cuda", dtype=torch.bfloat16)
        w = graph.placeholder("w")
        w.meta["example_value"] = torch.empty(out_features, 32, device="cuda", dtype=torch.bfloat16)
        outs = [graph.call_function(torch.ops.torch_ext.decode_linear.default, (x, w, None, True),
                                    {"eps": 1e-6, "gate": [0, 24, 24]}) for _ in range(layers)]
        outs.append(graph.call_function(torch.ops.aten.mm.default, (x, w)))  # not ours: never repeated
    graph.output(tuple(outs))
    return fx.GraphModule(torch.nn.Module(), graph)


def test_our_ops_are_repeated_once_per_distinct_call_with_the_graphs_layouts(monkeypatch):
    monkeypatch.setattr(first_use, "_cudnn_sdpa_possible", lambda: False)
    (name,) = first_use.libraries_needed(_decode_linear_graph(layers=3))  # three layers, one layout: one call
    kind, spec = name.split(" ", 1)
    assert kind == first_use.TORCH_EXT_OP
    assert json.loads(spec) == {"op": "decode_linear", "overload": "default",
                                "args": [{"tensor": [[1, 32], [32, 1], "bfloat16"]},
                                         {"tensor": [[48, 32], [32, 1], "bfloat16"]}, None, True],
                                "kwargs": {"eps": 1e-6, "gate": [0, 24, 24]}}
    # The loader's call is the graph's: same op, layouts and options (on the CPU here: its reference).
    op, args, kwargs = first_use.torch_ext_op_call(json.loads(spec), "cpu")
    assert op is torch.ops.torch_ext.decode_linear.default
    assert [(a.shape, a.stride(), a.dtype) for a in args[:2]] == [((1, 32), (32, 1), torch.bfloat16),
                                                                  ((48, 32), (32, 1), torch.bfloat16)]
    assert args[2:] == [None, True] and kwargs == {"eps": 1e-6, "gate": [0, 24, 24]}
    assert op(*args, **kwargs).shape == (1, 24)


def test_a_views_storage_offset_is_repeated(monkeypatch):
    """Triton specializes on a pointer's alignment: a view at an offset is repeated at that offset."""
    monkeypatch.setattr(first_use, "_cudnn_sdpa_possible", lambda: False)
    gm = _decode_linear_graph(layers=1)
    with FakeTensorMode():
        x = next(iter(gm.graph.find_nodes(op="placeholder")))
        x.meta["example_value"] = torch.empty(70, device="cuda", dtype=torch.bfloat16).as_strided((1, 32), (32, 1), 3)
    (name,) = first_use.libraries_needed(gm)
    spec = json.loads(name.split(" ", 1)[1])
    assert spec["args"][0] == {"tensor": [[1, 32], [32, 1], "bfloat16"], "offset": 3}
    _, args, _ = first_use.torch_ext_op_call(spec, "cpu")
    assert (args[0].storage_offset(), args[0].shape, args[0].stride()) == (3, (1, 32), (32, 1))
    assert not args[0].any()


def test_a_call_too_large_to_repeat_or_of_unknown_layout_is_left_to_its_first_call(monkeypatch):
    monkeypatch.setattr(first_use, "_cudnn_sdpa_possible", lambda: False)
    monkeypatch.setattr(first_use, "MAX_PROBE_BYTES", 48 * 32 * 2)  # the weight alone: x does not fit beside it
    assert first_use.libraries_needed(_decode_linear_graph(layers=1)) == ()
    monkeypatch.undo()
    monkeypatch.setattr(first_use, "_cudnn_sdpa_possible", lambda: False)
    gm = _decode_linear_graph(layers=1)
    del next(iter(gm.graph.find_nodes(op="placeholder"))).meta["example_value"]  # a loaded graph's piece
    assert first_use.libraries_needed(gm) == ()


def test_libraries_load_once_per_device_and_a_failure_is_only_logged(monkeypatch, caplog):
    calls = []
    monkeypatch.setattr(first_use, "_loaded", set())
    monkeypatch.setattr(first_use.torch.cuda, "is_available", lambda: True)

    def fail(device, spec):
        calls.append(device)
        raise RuntimeError("no cuDNN here")

    monkeypatch.setitem(first_use._LOADERS, first_use.CUDNN_SDPA, fail)
    with caplog.at_level(logging.INFO, logger=first_use.__name__):
        first_use.load_libraries((first_use.CUDNN_SDPA + ' {"q": [1]}',), device=0)
        first_use.load_libraries((first_use.CUDNN_SDPA + ' {"q": [1]}',), device=0)
        first_use.load_libraries((first_use.CUDNN_SDPA + ' {"q": [1]}', "unknown"), device=1)
    assert calls == [0, 1]
    assert "no cuDNN here" in caplog.text


def test_a_warm_start_entry_keeps_the_names_and_loading_it_loads_them(monkeypatch):
    from torch_ext.backend.warm_start import saved_graph

    loaded = []
    monkeypatch.setattr(saved_graph, "load_libraries", lambda names: loaded.append(tuple(names)))
    gm = _sdpa_graph(device="cpu")
    kept = saved_graph.SavedGraph(None, b"", None, [], gm, None, (first_use.CUDNN_SDPA,))
    state = pickle.loads(saved_graph.SavedGraph.serialize_compile_artifacts(kept))
    assert state["libraries"] == (first_use.CUDNN_SDPA,)

    class Backend:
        def __call__(self, gm, example_inputs, **kwargs):
            return gm

    state["graph"] = saved_graph.dump_graph(gm, lambda node: False)
    token = saved_graph.loading_backend.set(Backend())
    try:
        loaded_graph = saved_graph.SavedGraph.deserialize_compile_artifacts(pickle.dumps(state))
    finally:
        saved_graph.loading_backend.reset(token)
    assert loaded == [(first_use.CUDNN_SDPA,)] and loaded_graph.libraries == (first_use.CUDNN_SDPA,)
    del state["libraries"]  # an entry saved before the names were kept loads as before
    token = saved_graph.loading_backend.set(Backend())
    try:
        assert saved_graph.SavedGraph.deserialize_compile_artifacts(pickle.dumps(state)).libraries == ()
    finally:
        saved_graph.loading_backend.reset(token)


def test_a_probe_that_fails_needs_nothing_and_does_not_raise(sdpa_picks, monkeypatch):
    def broken(*call):
        raise RuntimeError("no such choice")

    sdpa_picks(sdpa_picks.cudnn)
    monkeypatch.setattr(first_use, "_sdpa_choice", broken)
    assert first_use.libraries_needed(_sdpa_graph()) == ()
