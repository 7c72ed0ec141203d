"""CompileConfig.training_cudagraphs on the CPU (tests/test_training_cudagraphs_gpu.py replays the
graphs): the option is checked, a CPU graph trains as without it and says once that nothing is
captured, and the arguments handed to Inductor for a piece mark exactly the parameters static;
"whole" refuses what a single capture could not replay, and hands the trees one graph per direction."""
from __future__ import annotations

import copy

import pytest
import torch

import checkpoint_models as cm
from torch_ext import compat
from torch_ext.backend import CompileConfig, make_backend


def test_it_needs_the_training_graph_differentiated_once():
    with pytest.raises(ValueError, match="training_cudagraphs.*differentiate_once"):
        CompileConfig(training_cudagraphs=True, differentiate_once=False)


@pytest.mark.parametrize("mode", [True, "whole"])
def test_a_cpu_graph_trains_as_without_it_and_says_so_once(caplog, monkeypatch, mode):
    from torch_ext.backend.counters import counters

    counters.reset()
    seen = []
    original = compat.compile_aten_graph

    def spy(gm, example_inputs, **kwargs):
        seen.append(([(n.name, tuple(n.meta["val"].shape)) for n in gm.graph.find_nodes(op="placeholder")],
                     kwargs.get("cudagraphs")))
        return original(gm, example_inputs, **kwargs)

    monkeypatch.setattr(compat, "compile_aten_graph", spy)
    torch._dynamo.reset()
    model = cm.CheckpointedModel(layers=2, d=16, attention=cm.CUSTOM)
    reference = copy.deepcopy(model)
    x = torch.randn(2, 8, 16)
    backend = make_backend(CompileConfig(cache_dir=None, splitting_ops=[cm.CUSTOM], training_cudagraphs=mode))
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    with caplog.at_level("WARNING", logger="torch_ext.backend"):
        for _ in range(2):
            compiled(x).backward()
    reference(x).backward()
    reference(x).backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
    said = [r.getMessage() for r in caplog.records if "training_cudagraphs" in r.getMessage()]
    assert len(said) == 1 and "['cpu']" in said[0]  # "whole" adds nothing: nothing is captured
    assert counters.graphed_whole == 0
    # The first piece was handed the CUDA-graph arguments (Inductor turns them off for the rest on a
    # CPU): static are the parameters, by their forward names, and nothing else.
    placeholders, arguments = seen[0]
    assert arguments is not None
    static = {placeholders[i] for i in arguments["static_input_idxs"]}
    # Forward inputs are named primals_*; x is the one of x's shape, every other a parameter.
    params = {(name, shape) for name, shape in placeholders if name.startswith("primals_") and shape != tuple(x.shape)}
    assert params and static == params


def test_a_graph_drawing_random_numbers_in_its_pieces_keeps_its_graphs(caplog, monkeypatch):
    """Dropout inside the pieces: each piece is still handed the CUDA-graph arguments (the masks drawn
    in replays, and the checkpoint's recompute of them, are checked on a GPU in
    test_training_cudagraphs_gpu.py), and nothing is said beyond the CPU note."""
    handed = []
    original = compat.compile_aten_graph

    def spy(gm, example_inputs, **kwargs):
        handed.append(kwargs.get("cudagraphs"))
        return original(gm, example_inputs, **kwargs)

    monkeypatch.setattr(compat, "compile_aten_graph", spy)
    torch._dynamo.reset()
    model = cm.CheckpointedModel(layers=2, d=16, attention=cm.CUSTOM, dropout=0.2)
    backend = make_backend(CompileConfig(cache_dir=None, splitting_ops=[cm.CUSTOM], training_cudagraphs=True))
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    with caplog.at_level("WARNING", logger="torch_ext.backend"):
        compiled(torch.randn(2, 8, 16)).backward()
    assert handed and handed[0] is not None  # Inductor turns the box off on a CPU, after the first piece
    said = [r.getMessage() for r in caplog.records if "training_cudagraphs" in r.getMessage()]
    assert len(said) == 1 and "['cpu']" in said[0]


def test_cudagraph_mode_without_it_says_that_training_graphs_run_without_graphs(caplog):
    torch._dynamo.reset()
    model = cm.CheckpointedModel(layers=1, d=16, attention=cm.CUSTOM)
    backend = make_backend(CompileConfig(cache_dir=None, splitting_ops=[cm.CUSTOM], cudagraph_mode="piecewise"))
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    with caplog.at_level("WARNING", logger="torch_ext.backend"):
        compiled(torch.randn(2, 8, 16)).backward()
        compiled(torch.randn(2, 8, 16)).backward()
    said = [r.getMessage() for r in caplog.records if "applies to inference graphs" in r.getMessage()]
    assert len(said) == 1 and 'training_cudagraphs="whole"' in said[0]


def test_gradients_left_in_the_pool_are_moved_out_before_the_next_forward_only():
    """A .grad that still holds a graphed backward's output at the next forward (accumulation over
    micro-batches) is replaced by a copy; other gradients, and later forwards, copy nothing."""
    from torch_ext.backend.counters import counters
    from torch_ext.backend.runtime.pool_gradients import PoolGradients

    pool = PoolGradients()
    kept, cleared, own = (torch.nn.Parameter(torch.randn(2, 3)) for _ in range(3))
    frozen = torch.randn(4)
    pool.note_leaves([kept, 1, cleared, frozen, own, kept * 2])
    backward_outputs = [torch.randn(3, 2).t(), None, torch.randn(2, 3)]
    kept.grad, cleared.grad, own.grad = backward_outputs[0], None, torch.randn(2, 3)
    own_grad = own.grad
    pool.after_backward(backward_outputs)
    counters.reset()
    pool.before_forward()
    assert counters.pool_gradients_moved == 1 and own.grad is own_grad and cleared.grad is None
    moved = kept.grad
    assert moved.untyped_storage().data_ptr() != backward_outputs[0].untyped_storage().data_ptr()
    assert torch.equal(moved, backward_outputs[0]) and moved.stride() == backward_outputs[0].stride()
    pool.before_forward()  # nothing new from a backward: nothing to move
    assert kept.grad is moved and counters.pool_gradients_moved == 1


def test_a_leaf_that_dies_is_forgotten():
    from torch_ext.backend.runtime.pool_gradients import PoolGradients

    pool = PoolGradients()
    leaf = torch.nn.Parameter(torch.randn(2))
    pool.note_leaves([leaf])
    pool.note_leaves([leaf])
    assert len(pool._leaves) == 1
    del leaf
    assert not pool._leaves


def test_a_graph_called_with_the_same_leaves_skips_the_scan_and_any_change_rescans():
    """The per-forward scan is skipped while the graph's leaves are the same objects (new activations
    do not count); a leaf that died, or a leaf where a non-leaf was, makes it scan again."""
    from torch_ext.backend.runtime.pool_gradients import LeafScan, PoolGradients

    pool, last = PoolGradients(), LeafScan()
    weights = [torch.nn.Parameter(torch.randn(2)) for _ in range(3)]
    hidden = torch.randn(2, requires_grad=True) * 2  # requires grad, not a leaf (a layer's input)

    def call(*extra):
        pool.note_leaves([*weights, hidden, torch.randn(2), *extra], last)

    call()
    call()
    call()
    assert pool.scans == 1 and len(pool._leaves) == 3
    weights[1] = torch.nn.Parameter(torch.randn(2))  # the old one dies: its id may come back
    call()
    assert pool.scans == 2 and any(ref() is weights[1] for ref in pool._leaves.values())
    call()
    assert pool.scans == 2
    hidden = torch.randn(2, requires_grad=True)  # a leaf now where a non-leaf was
    call()
    assert pool.scans == 3 and any(ref() is hidden for ref in pool._leaves.values())
    call(weights[0])  # another arity: scanned
    assert pool.scans == 4


def test_a_graphed_backward_notes_its_outputs_only_while_the_graphs_are_on(monkeypatch):
    from torch._inductor.utils import BoxedBool

    from torch_ext.backend.runtime import pool_gradients

    noted = []
    monkeypatch.setattr(pool_gradients.POOL_GRADIENTS, "after_backward", noted.append)
    grads = (torch.ones(3), None)
    graphed = pool_gradients.GraphedBackward(lambda args: grads, BoxedBool(True))
    assert graphed([]) is grads and noted == [grads] and graphed._boxed_call
    assert pool_gradients.GraphedBackward(lambda args: grads, BoxedBool(False))([]) is grads and len(noted) == 1


@pytest.mark.parametrize("value, mode", [(True, "pieces"), ("pieces", "pieces"), ("whole", "whole"), (False, False)])
def test_its_modes(value, mode):
    assert CompileConfig(cache_dir=None, training_cudagraphs=value).training_cudagraphs == mode


@pytest.mark.parametrize("value", [1, 0, "full", None])
def test_another_value_is_refused_with_the_modes_named(value):
    with pytest.raises(ValueError, match="training_cudagraphs.*'pieces', 'whole'"):
        CompileConfig(cache_dir=None, training_cudagraphs=value)


def _aten_graph(fn, *args):
    from torch.fx.experimental.proxy_tensor import make_fx

    return make_fx(fn)(*args)


def test_whole_capture_refuses_rng_state_hops_cpu_work_and_written_inputs():
    """What the graph shows that a single capture could not replay: the RNG state read and set from
    Python around a splitting op, work on the CPU, an input that is not static written in place."""
    from torch._prims.rng_prims import run_and_save_rng_state

    from torch_ext.backend.runtime.graphed_whole import mutated_inputs, whole_capture_refusal

    def fn(x, w):
        return torch.mm(x, w)

    plain = _aten_graph(fn, torch.randn(2, 2), torch.randn(2, 2))
    assert "is on cpu" in whole_capture_refusal(plain, ())

    def writes(x, w):
        x.add_(1)
        return torch.mm(x, w)

    written = _aten_graph(writes, torch.randn(2, 2), torch.randn(2, 2))
    assert mutated_inputs(written.graph) == [0]

    def writes_a_list(x, w, b):
        torch._foreach_add_([w, b], 1.0)
        return x + 1

    assert mutated_inputs(_aten_graph(writes_a_list, torch.randn(2), torch.randn(2), torch.randn(2)).graph) == [1, 2]
    for node in written.graph.nodes:  # no device to refuse: only the write is left
        node.meta.pop("val", None)
    reason = whole_capture_refusal(written, ())
    assert reason is not None and "[0]" in reason and "in place" in reason
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    saved = graph.call_function(run_and_save_rng_state, (torch.ops.aten.rand_like.default, x))
    graph.output(saved)
    assert "RNG state" in whole_capture_refusal(torch.fx.GraphModule({}, graph), ())


def test_whole_hands_the_trees_one_graph_per_direction_with_its_pieces_off_graphs(monkeypatch):
    """The "whole" wiring, on the CPU with the trees stood in for by a pass-through: every piece is
    compiled off CUDA graphs, the forward's and the backward's straight-line code are each handed to
    the trees once (parameters static in the forward), and training equals eager."""
    from torch_ext.backend import joint
    from torch_ext.backend.counters import counters

    handed, boxes = [], []
    original = compat.compile_aten_graph

    def spy(gm, example_inputs, **kwargs):
        boxes.append((kwargs.get("cudagraphs") or {}).get("cudagraphs"))
        return original(gm, example_inputs, **kwargs)

    def trees(run, graph, **kwargs):
        handed.append({**kwargs, "inputs": [n.name for n in graph.graph.find_nodes(op="placeholder")]})

        def replay(args):
            return run(args)

        replay._boxed_call = True
        return replay

    monkeypatch.setattr(compat, "compile_aten_graph", spy)
    monkeypatch.setattr(compat, "cudagraph_trees_whole", trees)
    monkeypatch.setattr(joint.JointCompiler, "_replayed_whole",  # as on a GPU, where the graph can be one
                        lambda self, graph, kwargs, label: bool(kwargs.get("cudagraphs")))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    torch._dynamo.reset()
    counters.reset()
    model = cm.CheckpointedModel(layers=2, d=16, attention=cm.CUSTOM)
    reference = copy.deepcopy(model)
    x = torch.randn(2, 8, 16)
    backend = make_backend(CompileConfig(cache_dir=None, splitting_ops=[cm.CUSTOM], training_cudagraphs="whole"))
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    for _ in range(2):
        compiled(x).backward()
        reference(x).backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
    assert boxes and all(box is not None and not box for box in boxes)  # every piece off graphs
    assert [h["is_backward"] for h in handed] == [False, True] and counters.graphed_whole == 2
    forward = handed[0]
    static = {forward["inputs"][i] for i in forward["static_input_idxs"]}
    assert len(static) == len(list(model.parameters())) and list(forward["mutated_input_idxs"]) == []
