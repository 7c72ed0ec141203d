"""The decode ops' kernels run where a CUDA graph replays them; a call of the same compiled code that
runs without a graph (a batch above the largest capture size) has the ops left to their default run
their reference instead (kernels/launch_policy.py), and an op the user turned on keeps its kernel. Run
through the device tool; skipped without CUDA."""
from __future__ import annotations

import collections

import pytest
import torch

import hf_models as hf
from torch_ext.backend.runtime.cudagraph.stats import cudagraph_stats

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _count_kernel_launches(monkeypatch) -> collections.Counter:
    """Counts of the ops' kernel launches (the module globals their CUDA kernels call), by op."""
    import torch_ext.kernels.decode_attention as attention
    import torch_ext.kernels.decode_linear as linear
    import torch_ext.kernels.decode_linear_mma as linear_mma

    launches = collections.Counter()
    for module, name in ((attention, "decode_attention_triton"), (linear, "decode_linear_triton"),
                         (linear_mma, "decode_linear_mma")):
        def counted(*args, _run=getattr(module, name), _name=name, **kwargs):
            launches[_name] += 1
            return _run(*args, **kwargs)
        monkeypatch.setattr(module, name, counted)
    return launches


@pytest.mark.parametrize("forced", [None, True])
def test_uncaptured_batches_run_the_reference_unless_the_user_turned_the_ops_on(monkeypatch, forced):
    import torch_ext
    from torch_ext.backend import CompileConfig

    torch._dynamo.reset()
    model = hf.build("llama").to(device="cuda", dtype=torch.bfloat16).eval()  # batch 3: the linear's CUDA path
    config = CompileConfig(cache_dir=None, cudagraph_mode="full", cudagraph_capture_sizes=(1,), progress_bar=False,
                           compile_sizes=(3,), decode_attention=forced, decode_linear=forced)
    compiled = torch_ext.compile(model, config, dynamic=True)
    launches = _count_kernel_launches(monkeypatch)
    hf.decode_steps_match(model, compiled, 1, steps=3, tol=3e-2)  # captured: warm-up, capture, replays
    assert launches["decode_attention_triton"] > 0 and launches["decode_linear_triton"] > 0
    launches.clear()
    cudagraph_stats.reset()
    hf.decode_steps_match(model, compiled, 3, steps=3, tol=3e-2)  # above the largest capture size: no graph
    assert cudagraph_stats.uncaptured_runs >= 3 and cudagraph_stats.replays == 0
    if forced:
        assert launches["decode_attention_triton"] > 0 and launches["decode_linear_mma"] > 0
    else:
        assert launches == {}, launches
