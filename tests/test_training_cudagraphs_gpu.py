"""training_cudagraphs on a GPU: a model split at attention trains with every compiled piece of its
forward and backward graphs replayed by Inductor's CUDA-graph trees, and each step's loss and
updated weights equal eager's (float32), with and without activation checkpointing; the weights are
read in place (no re-recording as they change), and a splitting op's results, which live outside
the graphs' pool, are copied in each replay."""
from __future__ import annotations

import copy

import pytest
import torch

import checkpoint_models as cm
from torch_ext.backend import CompileConfig, make_backend

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _train(model, run, x, steps):
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = run(x)
        loss.backward()
        opt.step()
        losses.append(loss.detach().clone())
    return losses


@pytest.mark.parametrize("checkpointing", [True, False])
@pytest.mark.parametrize("attention", [cm.SDPA, cm.CUSTOM])
def test_split_training_with_cudagraph_trees_matches_eager(attention, checkpointing):
    from torch._dynamo.utils import counters
    from torch._inductor import cudagraph_trees

    torch._dynamo.reset()
    counters.clear()
    model = cm.CheckpointedModel(layers=3, d=32, attention=attention, checkpointing=checkpointing).cuda()
    reference = copy.deepcopy(model)
    x = torch.randn(2, 16, 32, device="cuda")
    backend = make_backend(CompileConfig(cache_dir=None, splitting_ops=[attention], training_cudagraphs=True))
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    steps = 5
    actual = _train(model, compiled, x, steps)
    expected = _train(reference, reference, x, steps)
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-5)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)
    manager = cudagraph_trees.get_container(torch.cuda.current_device()).tree_manager
    assert manager is not None and manager.roots, "no piece was recorded as a CUDA graph"
    assert counters["inductor"]["cudagraph_skips"] == 0
    recorded = len(list(manager.ids_to_funcs))
    assert recorded >= 3  # forward and backward pieces (distinct compiles; layers share theirs)
    print(f"{attention} checkpointing={checkpointing}: {recorded} functions under CUDA-graph trees, "
          f"{counters['inductor'].get('cudagraph_recorded_non_static_inputs', 0)} non-static inputs recorded")
