"""cudagraph_mode="full_and_piecewise" (full graphs where they serve a call, piecewise graphs
otherwise), sizes no batch can reach, pieces with expanded outputs. Runs on the CPU with simulated
graphs (tests/cudagraph_models.py), like test_cudagraph.py."""
from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import cudagraph_models as cm
from test_cudagraph import backend, fresh_stats, fx_pieces, run_against_eager  # noqa: F401 (fixtures)
from torch_ext.backend import CompileConfig, ConfigError, make_backend
from torch_ext.backend.runtime.cudagraph.manager import CudaGraphCaptureError, cudagraph_stats
from torch_ext.hops.splitting_op import splitting_op


def full_and_piecewise(**kwargs):
    return backend("full_and_piecewise", cudagraph_capture_sizes=(2, 4, 8), **kwargs)


def captured(be, full: bool) -> list[int]:
    """Sizes captured by the full graph (full=True) or by the first piece (full=False), in order."""
    return [size for name, size in be.cudagraphs.captured
            if ("(full graph)" in name) == full and (full or name.endswith("/submod_0"))]


def test_small_batches_replay_the_full_graph_larger_ones_the_pieces(fx_pieces):
    model = cm.TinyDecoder(layers=2)
    be = full_and_piecewise(full_cudagraph_max_size=4)
    compiled = torch.compile(model, backend=be)
    # Full graphs pad their splitting ops too: cache rows past the batch may differ from eager.
    caches = run_against_eager(model, compiled, [3, 3, 3, 2, 2, 2, 5, 5, 5, 8, 9, 2, 3], full_cache=False)
    assert captured(be, full=True) == [4, 2]
    assert captured(be, full=False) == [8]  # 5 pads to 8, above the full graphs' sizes
    replays = cudagraph_stats.replays
    with torch.no_grad():
        compiled(torch.randn(3, cm.D_MODEL), *caches, 3)
    assert cudagraph_stats.replays == replays + 1  # one graph for the whole forward


def test_without_a_limit_every_capture_size_is_full_and_larger_batches_run_piecewise(fx_pieces):
    model = cm.TinyDecoder(layers=2)
    be = full_and_piecewise()
    compiled = torch.compile(model, backend=be)
    run_against_eager(model, compiled, [3, 3, 3, 8, 8, 8, 9, 9, 12], full_cache=False)
    assert captured(be, full=True) == [4, 8]
    assert captured(be, full=False) == []  # 9 and 12 are above every capture size: no graphs at all
    assert cudagraph_stats.uncaptured_runs > 0


def test_a_full_graph_that_fails_to_capture_is_warned_once_and_the_pieces_take_over(fx_pieces):
    class FullCaptureFails(cm.SimulatedCudaGraphs):
        def capture(self, fn, args, device, name, size):
            if "(full graph)" in name:  # e.g. a splitting op that reads a value on the host
                raise CudaGraphCaptureError(f"torch_ext could not capture a CUDA graph of {name}")
            return super().capture(fn, args, device, name, size)

    model = cm.TinyDecoder(layers=2)
    be = full_and_piecewise()
    be.cudagraphs = FullCaptureFails(be.config)
    compiled = torch.compile(model, backend=be)
    with pytest.warns(UserWarning, match=r"could not capture a CUDA graph of graph 0 \(full graph\).*\n"
                                         r"The piecewise CUDA graphs serve every call"):
        run_against_eager(model, compiled, [3, 3, 3], full_cache=False)  # the full graph's warm-up padded
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        run_against_eager(model, compiled, [3, 3, 3, 5, 5, 5, 2, 2, 2], full_cache=False)
    assert captured(be, full=True) == []
    assert captured(be, full=False) == [4, 8, 2]
    full_runner = [r for r in be.cudagraphs.runners() if "(full graph)" in r.name]
    assert len(full_runner) == 1 and not full_runner[0].capturable


def test_calls_recording_autograd_run_the_pieces_without_graphs(fx_pieces):
    model = cm.TinyDecoder(layers=2)
    be = full_and_piecewise()
    run_against_eager(model, torch.compile(model, backend=be), [3, 3, 3], grad=True)
    assert be.cudagraphs.captured == []


def test_full_cudagraph_max_size_is_checked():
    with pytest.raises(ConfigError, match="full_cudagraph_max_size.*only to cudagraph_mode='full_and_piecewise'"):
        CompileConfig(cudagraph_mode="piecewise", cudagraph_capture_sizes=(8,), full_cudagraph_max_size=8)
    with pytest.raises(ConfigError, match="full_cudagraph_max_size.*below every capture size"):
        CompileConfig(cudagraph_mode="full_and_piecewise", cudagraph_capture_sizes=(8, 16), full_cudagraph_max_size=4)
    with pytest.raises(ConfigError, match="full_cudagraph_max_size.*positive int"):
        CompileConfig(cudagraph_mode="full_and_piecewise", cudagraph_capture_sizes=(8,), full_cudagraph_max_size=0)


def test_sizes_no_batch_can_reach_are_said_once(fx_pieces, caplog):
    """A batch bounded by mark_dynamic(max=16): compile size 64 and capture sizes 32, 64 are never
    used (16 pads to 16); 16 itself is used. Said once per field, not per graph."""
    be = backend(compile_sizes=(4, 64), cudagraph_capture_sizes=(8, 16, 32, 64))
    compiled = torch.compile(lambda x: (x * 2).sum(-1), backend=be)
    with caplog.at_level("WARNING", logger="torch_ext.backend"):
        for n in (8, 12):
            x = torch.randn(n, 3)
            torch._dynamo.mark_dynamic(x, 0, min=2, max=16)
            torch.testing.assert_close(compiled(x), (x * 2).sum(-1))
    said = [r.getMessage() for r in caplog.records if "never used" in r.getMessage()]
    assert len(said) == 2, said
    assert "compile_sizes [64] are never used" in said[0] and "up to 16" in said[0]
    assert "cudagraph_capture_sizes [32, 64] are never used" in said[1]


@splitting_op("torch_ext_cgm::masked_scale", fake=lambda h, mask: torch.empty_like(h))
def masked_scale(h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return h * mask.sum(-1, keepdim=True)


class MaskedModel(nn.Module):
    """Its first piece returns a mask expanded over the batch (stride 0), as HF models build theirs."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        mask = (self.lin.weight[:1, :4] > 0).float().expand(x.shape[0], 4)
        return self.lin(torch.ops.torch_ext_cgm.masked_scale(self.lin(x), mask))


def test_a_piece_returning_an_expanded_tensor_is_captured(fx_pieces):
    model = MaskedModel()
    cfg = CompileConfig(splitting_ops=("torch_ext_cgm::masked_scale",), cache_dir=None, cudagraph_mode="piecewise",
                        cudagraph_capture_sizes=(2, 4, 8))
    be = make_backend(cfg)
    be.cudagraphs = cm.SimulatedCudaGraphs(cfg)
    compiled = torch.compile(model, backend=be)
    with torch.no_grad():
        for i, n in enumerate([3, 3, 3, 5, 5, 5, 3]):
            x = torch.randn(n, 8)
            if i == 0:
                torch._dynamo.mark_dynamic(x, 0)
            torch.testing.assert_close(compiled(x), model(x), msg=f"batch {n}")
    first = [r for r in be.cudagraphs.runners() if r.name.endswith("submod_0")]
    assert first and first[0].capturable, first[0].reason
    assert ("graph 0/submod_0", 4) in be.cudagraphs.captured and ("graph 0/submod_0", 8) in be.cudagraphs.captured
