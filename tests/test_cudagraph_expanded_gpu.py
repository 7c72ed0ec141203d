"""Real CUDA graphs and Inductor pieces for inputs expanded over a dim (test_cudagraph_expanded.py
simulates the graphs on the CPU): the expanded piece inputs are captured and replayed, and the
outputs equal eager's, also when a later call's mask differs (the static buffer's one row is copied
every call) and when a padded call runs at a capture size above its batch."""
from __future__ import annotations

import pytest
import torch

from torch_ext.backend import CompileConfig, make_backend
from torch_ext.backend.runtime.cudagraph.manager import cudagraph_stats
from test_cudagraph_expanded import OP, made_inside, passed_in  # the same models, real graphs here

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def compiled(fn, sizes, dynamic):
    torch._dynamo.reset()
    cudagraph_stats.reset()
    backend = make_backend(CompileConfig(splitting_ops=[OP], cache_dir=None, cudagraph_mode="piecewise",
                                         cudagraph_capture_sizes=sizes))
    return torch.compile(fn, backend=backend, dynamic=dynamic)


def test_pieces_reading_an_expanded_output_replay_on_the_gpu():
    c = compiled(made_inside, (4,), dynamic=False)
    with torch.no_grad():
        for _ in range(5):
            x, w = torch.randn(4, 64, device="cuda"), torch.randn(5, 64, device="cuda")  # a new mask each call
            torch.testing.assert_close(c(x, w), made_inside(x, w))
    assert cudagraph_stats.captures == 4 and cudagraph_stats.replays >= 12


def test_an_expanded_input_is_copied_one_row_on_the_gpu():
    c = compiled(passed_in, (2, 4), dynamic=None)
    torch.manual_seed(0)
    with torch.no_grad():
        for n in (4, 3, 4, 3, 2, 2, 4):
            x = torch.randn(n, 64, device="cuda")
            mask = (torch.randn(1, 64, device="cuda") > 0).expand(n, 64)
            torch._dynamo.mark_dynamic(x, 0)
            torch._dynamo.mark_dynamic(mask, 0)
            torch.testing.assert_close(c(x, mask), passed_in(x, mask))
    assert cudagraph_stats.captures == 2 and cudagraph_stats.replays >= 3
