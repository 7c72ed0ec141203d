"""CUDA-graph runner logic on the CPU: capture-size choice, padding and slicing, static inputs,
in-place inputs, address checks, one-call capture order, refusals. Graphs are simulated
(cudagraph_models.SimulatedCudaGraphs); pieces run as FX graphs unless a test asks for Inductor."""
from __future__ import annotations

import logging
import sys
import warnings

import pytest
import torch
from torch import nn

import cudagraph_models as cm
from torch_ext.backend import CompileConfig, make_backend
from torch_ext.backend.runtime.cudagraph.group import GraphKey
from torch_ext.backend.runtime.cudagraph.manager import (
    CudaGraphAddressError,
    capture_sizes,
    cudagraph_stats,
    padded_size,
    written_placeholders,
)

SIZES = (2, 4, 8)


@pytest.fixture(autouse=True)
def fresh_stats():
    cudagraph_stats.reset()
    yield


@pytest.fixture
def fx_pieces(monkeypatch):
    """Run pieces as their FX graphs: the runner's logic does not depend on Inductor, and the CPU is slow."""
    from torch_ext.backend.compile.compiler import InductorCompiler

    monkeypatch.setattr(InductorCompiler, "compile", lambda self, gm, example_inputs, variant, name="": gm)


def backend(mode="piecewise", simulated=True, **kwargs):
    kwargs.setdefault("cudagraph_capture_sizes", SIZES)
    cfg = CompileConfig(splitting_ops=cm.SPLITTING_OPS, cache_dir=None, cudagraph_mode=mode, **kwargs)
    be = make_backend(cfg)
    if simulated:
        be.cudagraphs = cm.SimulatedCudaGraphs(cfg)
    return be


def run_against_eager(model, compiled, sizes, *, full_cache=True, pos=3, grad=False, seed=0):
    """Eager and compiled on the same inputs, each with its own copy of the caches; outputs (and
    caches: all of them, or the rows of the batch in full mode) must agree."""
    ek, ev = model.caches()
    ck, cv = [t.clone() for t in ek], [t.clone() for t in ev]
    torch.manual_seed(seed)
    for i, n in enumerate(sizes):
        x = torch.randn(n, cm.D_MODEL)
        if i == 0:
            torch._dynamo.mark_dynamic(x, 0)
        with torch.set_grad_enabled(grad):
            expected = model(x, ek, ev, pos)
            actual = compiled(x, ck, cv, pos)
        assert actual.shape == expected.shape
        torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5, msg=f"output at batch {n}")
        for a, e in zip(ck + cv, ek + ev):
            torch.testing.assert_close(a if full_cache else a[:n], e if full_cache else e[:n],
                                       msg=f"KV cache at batch {n}")
    return ck, cv


# -- pure logic --------------------------------------------------------------------------------


def test_padded_size_is_the_next_capture_size():
    sizes = (1, 2, 4, 8, 16)
    assert [padded_size(n, sizes) for n in (1, 2, 3, 4, 5, 9, 16, 17, 1000)] == [1, 2, 4, 4, 8, 16, 16, None, None]
    assert padded_size(1, ()) is None


def _graph_of(fn, *args):
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm

    torch.compile(fn, backend=capture, fullgraph=True)(*args)
    return graphs[0]


def test_written_placeholders_sees_views_methods_setitem_and_op_schemas():
    def f(x, cache, out, y, kc, vc):
        cache[: x.shape[0]].copy_(x)  # through a view
        out[0] = 1.0  # setitem
        y.add_(1)  # in-place method
        q = x.view(x.shape[0], cm.HEADS, cm.HEAD_DIM)
        torch.ops.torch_ext_cg.decode_attention(q, q, q, kc, vc, 0)  # mutates_args of a custom op
        return x * 2

    x, cache, out, y = torch.randn(2, cm.D_MODEL), torch.zeros(4, cm.D_MODEL), torch.zeros(3), torch.zeros(3)
    kc, vc = cm.TinyDecoder(1).caches()
    gm = _graph_of(f, x, cache, out, y, kc[0], vc[0])
    written = written_placeholders(gm)
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    assert sorted(names[i] for i in written) == sorted(["l_cache_", "l_out_", "l_y_", "l_kc_", "l_vc_"])
    # Without the splitting op, the caches are no longer written.
    skip = lambda node: node.op == "call_function" and "decode_attention" in str(node.target)  # noqa: E731
    assert sorted(names[i] for i in written_placeholders(gm, skip)) == ["l_cache_", "l_out_", "l_y_"]


def test_capture_sizes_runs_the_largest_first_warmups_plus_capture():
    calls = []
    cfg = CompileConfig(cache_dir=None, cudagraph_capture_sizes=(1, 8, 4), cudagraph_num_warmup=2,
                        progress_bar=False)
    capture_sizes(calls.append, cfg)
    assert calls == [8, 8, 8, 4, 4, 4, 1, 1, 1]


def test_compile_sizes_that_calls_are_padded_past_are_named_once(caplog):
    with caplog.at_level("WARNING", logger="torch_ext.backend.cudagraph"):
        backend(simulated=False, compile_sizes=(1, 3, 4, 6, 16))  # capture sizes 2, 4, 8
        backend(simulated=False, compile_sizes=(2, 4, 8, 16))
    (record,) = [r for r in caplog.records if "compile_sizes" in r.getMessage()]
    assert "compile_sizes [1, 3, 6] are not cudagraph_capture_sizes" in record.getMessage()


# -- piecewise, simulated graphs -----------------------------------------------------------------


def test_piecewise_pads_replays_and_slices_back_like_eager(fx_pieces):
    model = cm.TinyDecoder(layers=3)
    be = backend()
    compiled = torch.compile(model, backend=be)
    # 3 and 5 pad to 4 and 8; 8 is exact; 9 is above every capture size; 6 reuses the graph for 8.
    run_against_eager(model, compiled, [5, 3, 5, 3, 8, 9, 6, 7, 4, 2, 2])
    captured = be.cudagraphs.captured
    # 4 pieces (embed+layer0 head, 2 middle, tail+head) per size, captured at each size's 2nd call.
    assert [size for _, size in captured] == [8] * 4 + [4] * 4 + [2] * 4
    assert cudagraph_stats.replays > 0 and cudagraph_stats.uncaptured_runs > 0


def test_every_piece_of_a_size_captures_in_the_same_forward_call(fx_pieces):
    model = cm.TinyDecoder(layers=2)
    be = backend(cudagraph_num_warmup=2)
    compiled = torch.compile(model, backend=be)
    ek, ev = model.caches()
    seen = []
    for i, n in enumerate([7, 3, 7, 8, 6, 7]):
        x = torch.randn(n, cm.D_MODEL)
        if i == 0:
            torch._dynamo.mark_dynamic(x, 0)
        with torch.no_grad():
            compiled(x, ek, ev, 1)
        seen.append(len(be.cudagraphs.captured))
    # Size 8: calls 1, 3 warm up, call 4 captures all three pieces at once; 3 never reaches 3 calls.
    assert seen == [0, 0, 0, 3, 3, 3]


def test_residual_stream_is_read_in_place_and_attention_output_copied(fx_pieces, caplog):
    model = cm.TinyDecoder(layers=3)
    be = backend()
    with caplog.at_level("INFO", logger="torch_ext.backend.cudagraph"):
        run_against_eager(model, torch.compile(model, backend=be), [5, 5, 5, 6])
    # The copy is named once per piece after an attention, with the op that made the tensor and the way out.
    hints = [r.getMessage() for r in caplog.records if "copies input" in r.getMessage()]
    assert len(hints) == 3 and all("(from torch_ext_cg::decode_attention)" in h and "empty_like" in h
                                   for h in hints), hints
    middle = [r for r in be.cudagraphs.runners() if r.name.endswith(("submod_2", "submod_4"))]
    assert len(middle) == 2
    for runner in middle:
        entry = runner._entries[GraphKey(8)]
        # Inputs: the attention output (from the eager splitting op: copied) and the residual
        # stream (the previous graph's output: read where it is); weights read in place.
        copied = {runner.inputs[i].name for i in entry.buffers}
        reused = {runner.inputs[i].name for i in entry.reused}
        assert len(copied) == 1 and len(reused) == 1, (copied, reused)


def test_static_shapes_read_the_residual_stream_in_place_too(fx_pieces):
    # dynamic=False (one graph per batch size, as for HF's StaticCache): no batch symbol, the same
    # reads in place (they were copies on every replay: 3 of 4 copies per piece of an HF Llama).
    model = cm.TinyDecoder(layers=3)
    be = backend()
    compiled = torch.compile(model, backend=be, dynamic=False)
    ek, ev = model.caches()
    ck, cv = [t.clone() for t in ek], [t.clone() for t in ev]
    for step in range(4):
        x = torch.randn(5, cm.D_MODEL)
        with torch.no_grad():
            torch.testing.assert_close(compiled(x, ck, cv, 3), model(x, ek, ev, 3), atol=1e-5, rtol=1e-5)
        for a, e in zip(ck + cv, ek + ev):
            torch.testing.assert_close(a, e)
    middle = [r for r in be.cudagraphs.runners() if r.name.endswith(("submod_2", "submod_4"))]
    assert len(middle) == 2 and cudagraph_stats.replays > 0
    for runner in middle:
        assert runner.symbol is None
        entry = runner._entries[GraphKey(None)]
        assert len(entry.buffers) == 1 and len(entry.reused) == 1  # attention output copied, residual read


def test_a_splitting_op_writing_into_a_buffer_of_the_graph_before_it_costs_no_copy(fx_pieces, caplog):
    # The attention-with-output shape: the model allocates the result (torch.empty_like) before
    # the op, so the buffer is an output of the graph before it; the graph after reads it there.
    model = cm.TinyDecoder(layers=3, attention="into")
    be = backend()
    with caplog.at_level("INFO", logger="torch_ext.backend.cudagraph"):
        run_against_eager(model, torch.compile(model, backend=be), [5, 5, 5, 6, 7, 2, 2, 2, 3])
    assert not [r for r in caplog.records if "copies input" in r.getMessage()]
    middle = [r for r in be.cudagraphs.runners() if r.name.endswith(("submod_2", "submod_4"))]
    assert len(middle) == 2
    for runner in middle:
        for size in (8, 2):
            entry = runner._entries[GraphKey(size)]
            assert entry.graph is not None and not entry.buffers, {runner.inputs[i].name for i in entry.buffers}
            assert len(entry.reused) == 2  # the residual stream and the attention result
    first = next(r for r in be.cudagraphs.runners() if r.name.endswith("submod_0"))
    assert set(first._entries[GraphKey(8)].buffers) == {0}  # only the model's input is copied
    assert cudagraph_stats.replays > 0


@pytest.mark.parametrize("mode", ["piecewise", "full"])
def test_inference_mode_replays_match_eager(fx_pieces, mode):
    model = cm.TinyDecoder(layers=2, attention="into")
    compiled = torch.compile(model, backend=backend(mode))
    ek, ev = model.caches()
    ck, cv = [t.clone() for t in ek], [t.clone() for t in ev]
    with torch.inference_mode():
        for i, n in enumerate([5, 5, 5, 3, 3, 7]):
            x = torch.randn(n, cm.D_MODEL)
            if i == 0:
                torch._dynamo.mark_dynamic(x, 0)
            torch.testing.assert_close(compiled(x, ck, cv, 3), model(x, ek, ev, 3), msg=f"batch {n}")
    assert cudagraph_stats.replays > 0


@pytest.mark.parametrize("attention, direct", [("into", True), ("into_inference", False)])
def test_a_custom_op_splitting_op_is_called_without_its_python_layers(fx_pieces, caplog, monkeypatch, attention,
                                                                      direct):
    """Between replays a torch.library.custom_op splitting op calls its kernel directly (no grads,
    modes or autocast here); an op registered straight with the dispatcher is left alone."""
    from torch._library.custom_ops import OPDEFS

    name = f"torch_ext_cg::decode_attention_{attention}"
    callers = []
    if direct:
        kernel = OPDEFS[name]._backend_fns[None]

        def spy(*args, **kwargs):
            callers.append(sys._getframe(1).f_code.co_name)  # backend_impl: through the op's layers
            return kernel(*args, **kwargs)

        monkeypatch.setitem(OPDEFS[name]._backend_fns, None, spy)
    model = cm.TinyDecoder(layers=2, attention=attention)
    compiled = torch.compile(model, backend=backend())
    with caplog.at_level("INFO", logger="torch_ext.backend.cudagraph"):
        run_against_eager(model, compiled, [3, 3, 3, 5])
    notes = [r.getMessage() for r in caplog.records if "without its Python dispatch layers" in r.getMessage()]
    assert len(notes) == (1 if direct else 0), notes
    if direct:
        assert name in notes[0]
        # 2 layers x 4 forward calls each: eager's through the op's layers, the compiled graph's direct.
        assert callers.count("call") == 2 * 4 and callers.count("backend_impl") == 2 * 4, callers


def test_a_reused_input_found_elsewhere_runs_without_the_graph(fx_pieces, monkeypatch):
    from torch_ext.backend.runtime.cudagraph.manager import CudaGraphRunner

    model = cm.TinyDecoder(layers=3)
    be = backend()
    run_against_eager(model, torch.compile(model, backend=be), [5, 5, 5])  # warm-up, capture, replay
    runner = next(r for r in be.cudagraphs.runners() if r.name.endswith("submod_2"))
    (reused,) = runner._plans[5].reused
    position, _, _, seen = reused
    assert seen is not None  # the replay remembered the tensor the previous piece handed over

    recorded = {}
    original = CudaGraphRunner.__call__

    def record(self, *a):
        recorded.setdefault(self, a)
        return original(self, *a)

    monkeypatch.setattr(CudaGraphRunner, "__call__", record)
    ek, ev = model.caches()
    with torch.no_grad():  # same backend object: Dynamo's cache entry, the same runners
        torch.compile(model, backend=be)(torch.randn(5, cm.D_MODEL), ek, ev, 3)
    args = list(recorded[runner])
    monkeypatch.setattr(CudaGraphRunner, "__call__", original)
    with torch.no_grad():
        expected = [t.clone() for t in runner.runnable(*args)]
        args[position] = args[position].clone()  # same values, not in the graph's output any more
        before = cudagraph_stats.uncaptured_runs
        actual = runner(*args)
    assert cudagraph_stats.uncaptured_runs == before + 1
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e)


def test_outputs_that_leave_the_graph_stay_owned(fx_pieces):
    model = cm.TinyDecoder(layers=2)
    be = backend()
    run_against_eager(model, torch.compile(model, backend=be), [3, 3, 3])
    last = [r for r in be.cudagraphs.runners() if r.keep]
    assert len(last) == 1 and last[0].keep == {0}
    entry = last[0]._entries[GraphKey(4)]
    # Owned: the caching allocator knows its memory (a non-owning view would not count in it).
    assert entry.outputs[0].untyped_storage().data_ptr() == entry.outputs[0].data_ptr() - \
        entry.outputs[0].storage_offset() * entry.outputs[0].element_size()
    first = [r for r in be.cudagraphs.runners() if not r.keep][0]
    assert len(first._entries[GraphKey(4)].outputs) == 4  # q, k, v and the residual: all non-owning


def test_calls_recording_autograd_run_without_graphs(fx_pieces):
    model = cm.TinyDecoder(layers=2)
    be = backend()
    run_against_eager(model, torch.compile(model, backend=be), [3, 3, 3], grad=True)
    assert be.cudagraphs.captured == []


# -- full mode --------------------------------------------------------------------------------


def test_full_mode_pads_the_whole_graph_and_matches_eager_rows(fx_pieces):
    model = cm.TinyDecoder(layers=2)
    be = backend("full")
    compiled = torch.compile(model, backend=be)
    # Padding rows go through the splitting op too: cache rows past the batch may differ.
    run_against_eager(model, compiled, [5, 3, 5, 3, 5, 8, 9, 7], full_cache=False)
    assert [size for _, size in be.cudagraphs.captured] == [8, 4]
    (runner,) = be.cudagraphs.runners()
    roles = {spec.name: spec.role for spec in runner.inputs if spec.kind == "tensor"}
    assert roles["l_x_"] == "copied"
    assert roles["l_k_caches_0_"] == "pinned"  # written in place by the graph: read where it is
    assert roles["l_self_modules_head_parameters_weight_"] == "static"


def test_full_mode_captures_again_where_a_cache_written_in_place_moved(fx_pieces, caplog):
    """generate makes a new cache per call: the whole-graph runner captures again for its address
    (after a warm-up), as CUDA graph trees re-record; outputs and caches equal eager's."""
    model = cm.TinyDecoder(layers=2)
    compiled = torch.compile(model, backend=backend("full"))
    run_against_eager(model, compiled, [3, 3, 3], full_cache=False)
    captures = cudagraph_stats.captures
    with caplog.at_level(logging.INFO, logger="torch_ext.backend.cudagraph"):
        run_against_eager(model, compiled, [3, 3, 3, 3], full_cache=False)  # new caches
    assert cudagraph_stats.recaptures == 1 and cudagraph_stats.captures == captures + 1
    assert sum("moved since the capture" in r.getMessage() for r in caplog.records) == 1


def test_check_addresses_catches_a_replaced_parameter(fx_pieces):
    model = cm.TinyDecoder(layers=2)
    compiled = torch.compile(model, backend=backend(cudagraph_check_addresses=True))
    ck, cv = run_against_eager(model, compiled, [3, 3, 3])
    with torch.no_grad():
        model.head.weight.data = model.head.weight.data.clone()
    with pytest.raises(CudaGraphAddressError, match="parameters_weight_.*a parameter or buffer"):
        with torch.no_grad():
            compiled(torch.randn(3, cm.D_MODEL), ck, cv, 3)


@pytest.mark.parametrize("mode", ["piecewise", "full"])
@pytest.mark.parametrize("merge", [True, False])
def test_new_parameters_capture_the_graphs_again(fx_pieces, mode, merge):
    """load_state_dict(assign=True) puts new tensors in the module: a graph reading the old ones would
    be silently stale. Their addresses are checked on every replay: new parameters are a new weight
    set, captured anew (the old set's graphs go with its tensors); new caches capture again."""
    model = cm.TinyDecoder(layers=2)
    be = backend(mode, merge_projections=merge)
    compiled = torch.compile(model, backend=be)
    rows = mode == "piecewise"  # full graphs pad the splitting op: cache rows past the batch may differ
    run_against_eager(model, compiled, [3, 3, 3], full_cache=rows)
    captures = cudagraph_stats.captures
    with torch.no_grad():
        model.load_state_dict({k: v * 0.5 for k, v in model.state_dict().items()}, assign=True)
        model.head.weight.data = model.head.weight.data.clone()
    for seed in range(3):
        run_against_eager(model, compiled, [3, 3, 3], full_cache=rows, seed=seed + 1)
    # Full graphs also read the caches in place: run_against_eager brings new ones each time (the first
    # time with the new weights: a new weight set, not a recapture).
    assert cudagraph_stats.recaptures == (0 if rows else 2) and cudagraph_stats.captures > captures
    groups = {r.group for r in be.cudagraphs.runners()}
    assert [len(g._weight_sets) for g in groups] == [1] * len(groups)  # the old weights' graphs dropped


@pytest.mark.parametrize("mode", ["piecewise", "full"])
def test_layers_compiled_one_by_one_replay_graphs_of_their_own(fx_pieces, mode):
    """Regional compilation: identical layers compiled one by one share one Dynamo graph, each passing
    its own parameters, which graphs read in place. Each layer's weights are a weight set with graphs
    of its own: after warm-up every call replays (capturing again at each layer switch replayed nothing),
    and a layer that is gone takes its graphs with it."""
    layers = [cm.Layer(cm.D_MODEL) for _ in range(3)] if mode == "piecewise" else [Mlp() for _ in range(3)]
    be = backend(mode)
    compiled = [torch.compile(layer, backend=be, dynamic=True) for layer in layers]
    ek, ev = cm.TinyDecoder(layers=3).caches()
    ck, cv = [t.clone() for t in ek], [t.clone() for t in ev]

    def step(fns, caches, x):
        h = x
        for i, fn in enumerate(fns):
            h = fn(h, caches[0][i], caches[1][i], 3) if mode == "piecewise" else fn(h)
        return h

    with torch.no_grad():
        for n in (4, 4, 4, 4, 3):
            x = torch.randn(n, cm.D_MODEL)
            torch.testing.assert_close(step(compiled, (ck, cv), x), step(layers, (ek, ev), x))
    runners = [r for r in be.cudagraphs.runners() if r.capturable]
    assert cudagraph_stats.captures == 3 * len(runners) and cudagraph_stats.recaptures == 0
    assert cudagraph_stats.replays == 3 * 3 * len(runners)  # steps 3 to 5 (3 rows: padded to 4)
    (group,) = {r.group for r in runners}
    assert len(group._weight_sets) == 3
    del compiled[1], layers[1]
    with torch.no_grad():
        step(compiled, (ck[::2], cv[::2]), torch.randn(4, cm.D_MODEL))
        step([torch.compile(Mlp() if mode == "full" else cm.Layer(cm.D_MODEL), backend=be, dynamic=True)],
             (ck, cv), torch.randn(4, cm.D_MODEL))  # a new set: the gone layer's set is dropped
    assert len(group._weight_sets) == 3 and all(len(r._entries) <= 3 for r in runners)


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(cm.D_MODEL, 2 * cm.D_MODEL), nn.Linear(2 * cm.D_MODEL, cm.D_MODEL)

    def forward(self, h):
        return h + self.down(torch.relu(self.up(h)))


# -- regions we do not pad or capture ----------------------------------------------------------


class WritesScratch(nn.Module):
    """Writes rows of a user tensor without the batch dim in compiled code (not a splitting op)."""

    def __init__(self):
        super().__init__()
        self.inner = cm.TinyDecoder(layers=1)

    def forward(self, x, k_caches, v_caches, pos, scratch):
        out = self.inner(x, k_caches, v_caches, pos)
        scratch[: out.shape[0]] = out * 2
        return out + 1


def test_region_writing_a_tensor_without_the_batch_dim_is_captured_only_at_exact_sizes(fx_pieces):
    model = WritesScratch()
    be = backend()
    compiled = torch.compile(model, backend=be)
    ek, ev = model.inner.caches()
    ck, cv = [t.clone() for t in ek], [t.clone() for t in ev]
    es, cs = torch.zeros(16, cm.D_MODEL), torch.zeros(16, cm.D_MODEL)
    # The group captures size 4 at the 2nd call, at exact size: the tail is captured with the rest;
    # batch 3 later replays the other pieces padded to 4, while the tail runs at 3 without a graph.
    for i, n in enumerate([4, 4, 4, 3, 3]):
        x = torch.randn(n, cm.D_MODEL)
        if i == 0:
            torch._dynamo.mark_dynamic(x, 0)
        with torch.no_grad():
            torch.testing.assert_close(compiled(x, ck, cv, 2, cs), model(x, ek, ev, 2, es))
        torch.testing.assert_close(cs, es)  # padding rows never reach the scratch tensor
    (tail,) = [r for r in be.cudagraphs.runners() if r.exact_only]
    assert list(tail._entries) == [GraphKey(4)] and tail._entries[GraphKey(4)].graph is not None
    assert tail._plans[3].graph is None
    assert [size for _, size in be.cudagraphs.captured] == [4, 4]


class MutatesBuffer(cm.TinyDecoder):
    def __init__(self):
        super().__init__(layers=1)
        self.register_buffer("steps", torch.zeros(()))

    def forward(self, x, k_caches, v_caches, pos):
        self.steps.add_(1)
        return super().forward(x, k_caches, v_caches, pos)


@pytest.mark.parametrize("mode", ["piecewise", "full"])
def test_in_place_update_of_a_module_buffer_is_refused_with_its_source_line(fx_pieces, mode):
    model = MutatesBuffer()
    compiled = torch.compile(model, backend=backend(mode))
    with pytest.raises(Exception, match=r"(?s)mutates the module buffer 'l_self_buffers_steps_'.*self\.steps\.add_\(1\)"):
        run_against_eager(model, compiled, [3])


def test_without_cuda_the_pieces_run_without_graphs_and_warn_once(fx_pieces):
    model = cm.TinyDecoder(layers=2)
    compiled = torch.compile(model, backend=backend(simulated=False))
    with pytest.warns(UserWarning, match="without CUDA graphs") as record:
        run_against_eager(model, compiled, [3, 5, 3, 3, 8])
    assert len([w for w in record if "CUDA graphs" in str(w.message)]) == 1
    assert cudagraph_stats.captures == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run_against_eager(model, compiled, [3])


@pytest.mark.slow
def test_piecewise_over_inductor_pieces_matches_eager():
    """Static buffers have the strides Inductor compiled the pieces for."""
    model = cm.TinyDecoder(layers=2)
    be = backend(compile_sizes=(4,))
    run_against_eager(model, torch.compile(model, backend=be), [3, 3, 3, 4, 2, 9])
    assert [size for _, size in be.cudagraphs.captured] == [4] * 3


def test_a_failed_capture_is_a_clear_error_then_the_region_runs_without_graphs(fx_pieces):
    from torch_ext.backend.runtime.cudagraph.manager import CudaGraphCaptureError

    class FailingOnce(cm.SimulatedCudaGraphs):
        failed = False

        def capture(self, fn, args, device, name, size):
            if not FailingOnce.failed:
                FailingOnce.failed = True
                raise CudaGraphCaptureError(f"could not capture {name}")
            return super().capture(fn, args, device, name, size)

    model = cm.TinyDecoder(layers=2)
    be = backend()
    be.cudagraphs = FailingOnce(be.config)
    compiled = torch.compile(model, backend=be)
    with pytest.raises(CudaGraphCaptureError, match="could not capture graph 0/submod_0"):
        run_against_eager(model, compiled, [3, 3])
    run_against_eager(model, compiled, [3, 3, 3])  # correct, without graphs for that size
    assert not be.cudagraphs.runners()[0].capturable


@pytest.mark.parametrize("mode", ["piecewise", "full"])
def test_an_int_that_sizes_no_tensor_is_not_padded_as_a_batch_size(mode):
    """Padding replaces an int equal to the batch size by the capture size: an int that sizes no tensor
    (a position) taken for the batch size ran position 3 as 4 (a wrong result). Now the graph runs
    without CUDA graphs and says why once, with the fix; later calls say nothing more."""
    torch._dynamo.reset()
    model = cm.PositionStep()
    compiled = torch.compile(model, backend=backend(mode))
    x = torch.randn(3, cm.D_MODEL)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with torch.no_grad():
            for pos in [1, 2, 3, 5, 6, 7, 9, 3]:
                torch.testing.assert_close(compiled(x, pos), model(x, pos), msg=lambda m: f"pos {pos}: {m}")
    said = [str(w.message) for w in record if "runs without CUDA graphs" in str(w.message)]
    assert len(said) == 1 and "mark_dynamic" in said[0] and "'l_pos_'" in said[0], said
    assert cudagraph_stats.replays == 0
