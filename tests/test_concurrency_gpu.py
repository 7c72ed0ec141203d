"""Many threads, on the default stream or each on its own, calling one model compiled with CUDA
graphs (every mode, with and without guard-free dispatch): every output equals eager's on the
thread's own input, no error, no hang. Run through the device tool (bash bench/gpu_check.sh gpu)."""
from __future__ import annotations

import pytest
import torch

import concurrency_models as cm
import torch_ext
from torch_ext.backend import CompileConfig

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("guard_free", [False, True])
@pytest.mark.parametrize("mode", ["none", "piecewise", "full", "full_and_piecewise"])
def test_threads_and_streams_each_get_their_own_right_answer(mode, guard_free):
    torch._dynamo.reset()
    model = cm.Blocks().cuda().eval()
    config = CompileConfig(splitting_ops=(cm.SPLIT_AT,), cache_dir=None, cudagraph_mode=mode,
                           cudagraph_capture_sizes=tuple(range(1, 9)), guard_free_dispatch=guard_free,
                           progress_bar=False)
    compiled = torch_ext.compile(model, config)
    with torch.no_grad():  # warm up on this thread: compile and capture every size
        first = cm.batch(3, "cuda", seed=0)
        torch._dynamo.mark_dynamic(first, 0)
        compiled(first)
        for n in range(1, 9):
            for _ in range(3):
                compiled(cm.batch(n, "cuda", seed=n))
    for streams in (False, True):
        result = cm.hammer(compiled, model, threads=8, calls=25, max_batch=8, device="cuda", streams=streams)
        assert result["errors"] == [] and result["wrong"] == 0, (streams, result)
