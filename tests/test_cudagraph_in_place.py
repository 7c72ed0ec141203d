"""A splitting op's result is read by the graph after it where the op left it, without a copy per
replay, while every call finds it at the captured address (a steady decode loop: the allocator hands
the op the same memory each step). A result elsewhere makes the group copy every splitting op's result
from then on, after one more capture; padded calls always copy. Graphs are simulated on the CPU
(cudagraph_models.SimulatedCudaGraphs); the op's result memory is chosen by the test."""
from __future__ import annotations

import pytest
import torch

import cudagraph_models as cm
from torch_ext.backend import CompileConfig, make_backend
from torch_ext.backend.runtime.cudagraph.manager import cudagraph_stats
from torch_ext.hops.splitting_op import splitting_op

OP = "torch_ext_in_place::attn"
RESULTS = {"buffers": [], "calls": 0, "rotate": 1}  # where the op writes its result: chosen by each test


def _result_memory(x: torch.Tensor) -> torch.Tensor:
    """One of RESULTS["rotate"] tensors of x's shape, in turn: the same memory every call with 1."""
    buffers = RESULTS["buffers"]
    if not buffers or buffers[0].shape != x.shape:
        buffers[:] = [torch.empty_like(x) for _ in range(RESULTS["rotate"])]
    RESULTS["calls"] += 1
    return buffers[RESULTS["calls"] % len(buffers)]


@splitting_op(OP, fake=lambda x: torch.empty_like(x))
def attn(x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x, out=_result_memory(x))


def layers(x, w):
    h = x
    for _ in range(3):
        h = torch.ops.torch_ext_in_place.attn(h @ w) * 0.5 + h
    return h


@pytest.fixture(autouse=True)
def fx_pieces(monkeypatch):
    from torch_ext.backend.compile.compiler import InductorCompiler

    monkeypatch.setattr(InductorCompiler, "compile", lambda self, gm, example_inputs, variant, name="": gm)
    cudagraph_stats.reset()
    RESULTS.update(buffers=[], calls=0, rotate=1)


def compiled(sizes=(4,), dynamic=False):
    cfg = CompileConfig(splitting_ops=[OP], cache_dir=None, cudagraph_mode="piecewise", cudagraph_capture_sizes=sizes)
    backend = make_backend(cfg)
    backend.cudagraphs = cm.SimulatedCudaGraphs(cfg)
    torch._dynamo.reset()
    return torch.compile(layers, backend=backend, dynamic=dynamic), backend


def run(c, steps, batch=4):
    w = torch.randn(16, 16) / 4
    with torch.no_grad():
        for _ in range(steps):
            x = torch.randn(batch, 16)  # new values each step: a graph reading stale memory would differ
            torch.testing.assert_close(c(x, w), layers(x, w))


def test_a_result_at_the_same_address_is_read_in_place():
    c, backend = compiled()
    run(c, 6)
    runners = [r for r in backend.cudagraphs.runners() if r.made_by_splitting_op]
    assert len(runners) == 3 and cudagraph_stats.in_place_inputs == 3
    for r in runners:
        (i,) = r.made_by_splitting_op
        assert all(i in e.in_place and i not in e.buffers for e in r._entries.values())
    assert cudagraph_stats.recaptures == 0 and cudagraph_stats.replays >= 4 * 3


def test_a_result_elsewhere_makes_the_group_copy_after_one_more_capture(caplog):
    RESULTS["rotate"] = 5  # six calls a step (compiled, eager): each layer's result moves every step
    c, backend = compiled()
    with caplog.at_level("INFO", logger="torch_ext.backend.cudagraph"):
        run(c, 8)
    runners = [r for r in backend.cudagraphs.runners() if r.made_by_splitting_op]
    assert cudagraph_stats.recaptures == 1 and runners[0].group.copies_splitting_results
    for r in runners:
        (i,) = r.made_by_splitting_op
        assert all(i in e.buffers and not e.in_place for e in r._entries.values())
    replays = cudagraph_stats.replays
    run(c, 2)
    assert cudagraph_stats.replays == replays + 2 * 4 and cudagraph_stats.recaptures == 1
    said = [r.getMessage() for r in caplog.records if "lies elsewhere" in r.getMessage()]
    assert len(said) == 1 and OP in said[0]


def test_padded_calls_copy_the_result():
    c, backend = compiled(sizes=(2, 4), dynamic=None)
    w = torch.randn(16, 16) / 4
    with torch.no_grad():
        for n in (4, 3, 3, 3, 4, 4):
            x = torch.randn(n, 16)
            torch._dynamo.mark_dynamic(x, 0)
            torch.testing.assert_close(c(x, w), layers(x, w))
    assert cudagraph_stats.in_place_inputs == 0 and cudagraph_stats.replays > 0
