"""Inputs of a captured piece that repeat along a dim (stride 0: a mask expanded over the batch)
are captured, not left to run without a graph: the static buffer is expanded too and a call's copy
fills its one row; a tensor that an earlier graph returned expanded is read where it is. Graphs are
simulated on the CPU (cudagraph_models.SimulatedCudaGraphs); pieces run as FX graphs."""
from __future__ import annotations

import pytest
import torch

import cudagraph_models as cm
from torch_ext.backend import CompileConfig, make_backend
from torch_ext.backend.runtime.cudagraph.manager import cudagraph_stats
from torch_ext.backend.runtime.cudagraph.padding import one_row
from torch_ext.hops.splitting_op import splitting_op

OP = "torch_ext_expanded::attn"


@splitting_op(OP, fake=lambda x: torch.empty_like(x))
def attn(x: torch.Tensor) -> torch.Tensor:
    return x.tanh()


def made_inside(x, w):
    mask = (w.sum(0, keepdim=True) > 0).expand(x.shape[0], -1)  # an earlier piece's output, stride 0
    h = x
    for _ in range(3):
        h = torch.ops.torch_ext_expanded.attn(h)
        h = torch.where(mask, h * 2, h)
    return h


def passed_in(x, mask):
    h = torch.ops.torch_ext_expanded.attn(x)
    return torch.where(mask, h * 2, h) + mask.sum(-1, keepdim=True)


@pytest.fixture(autouse=True)
def fx_pieces(monkeypatch):
    from torch_ext.backend.compile.compiler import InductorCompiler

    monkeypatch.setattr(InductorCompiler, "compile", lambda self, gm, example_inputs, variant, name="": gm)
    cudagraph_stats.reset()


def compiled(fn, sizes, dynamic):
    cfg = CompileConfig(splitting_ops=[OP], cache_dir=None, cudagraph_mode="piecewise", cudagraph_capture_sizes=sizes)
    backend = make_backend(cfg)
    backend.cudagraphs = cm.SimulatedCudaGraphs(cfg)
    torch._dynamo.reset()
    return torch.compile(fn, backend=backend, dynamic=dynamic)


def test_pieces_reading_an_expanded_output_are_captured():
    c = compiled(made_inside, (4,), dynamic=False)
    w = torch.randn(5, 16)
    with torch.no_grad():
        for step in range(5):
            x = torch.randn(4, 16)
            torch.testing.assert_close(c(x, w), made_inside(x, w))
            if step == 0:
                warm_up = cudagraph_stats.uncaptured_runs
    assert cudagraph_stats.captures == 4  # every piece: the mask's and the three that read it
    assert cudagraph_stats.uncaptured_runs == warm_up and cudagraph_stats.replays >= 12


def test_an_expanded_input_is_copied_one_row_and_padded():
    c = compiled(passed_in, (2, 4), dynamic=None)
    torch.manual_seed(0)
    with torch.no_grad():
        for n in (4, 3, 4, 3, 2):
            x = torch.randn(n, 16)
            mask = (torch.randn(1, 16) > 0).expand(n, 16)
            torch._dynamo.mark_dynamic(x, 0)
            torch._dynamo.mark_dynamic(mask, 0)
            torch.testing.assert_close(c(x, mask), passed_in(x, mask))
    # The piece after the op: warmed up at 4, captured by the call of 3 (padded), replayed by 4 and 3;
    # the call of 2 is size 2's warm-up.
    assert (cudagraph_stats.captures, cudagraph_stats.replays, cudagraph_stats.uncaptured_runs) == (1, 2, 2)


def test_one_row_refuses_a_tensor_whose_rows_differ():
    t = torch.arange(4.0).view(1, 4)
    assert one_row(t.expand(3, 4), (0,)).shape == (1, 4)
    assert one_row(t, (0,)).shape == (1, 4)  # one row: nothing repeats, nothing differs
    assert one_row(torch.arange(12.0).view(3, 4), (0,)) is None
