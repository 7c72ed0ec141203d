"""training_cudagraphs on a GPU: a model split at attention trains with every compiled piece of its
forward and backward graphs replayed by Inductor's CUDA-graph trees, and each step's loss and
updated weights equal eager's (float32), with and without activation checkpointing; the weights are
read in place (no re-recording as they change), and a splitting op's results, which live outside
the graphs' pool, are copied in each replay. Dropout inside the replayed pieces draws new masks each
step, and a checkpoint's recompute draws the forward's; a new process loads the pieces from Inductor's
cache and replays them the same."""
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


MODES = ["pieces", "whole"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("checkpointing", [True, False])
@pytest.mark.parametrize("attention", [cm.SDPA, cm.CUSTOM])
def test_split_training_with_cudagraph_trees_matches_eager(attention, checkpointing, mode):
    from torch._dynamo.utils import counters
    from torch._inductor import cudagraph_trees

    from torch_ext.backend.counters import counters as ext_counters

    torch._dynamo.reset()
    counters.clear()
    ext_counters.reset()
    model = cm.CheckpointedModel(layers=3, d=32, attention=attention, checkpointing=checkpointing).cuda()
    reference = copy.deepcopy(model)
    x = torch.randn(2, 16, 32, device="cuda")
    backend = make_backend(CompileConfig(cache_dir=None, splitting_ops=[attention], training_cudagraphs=mode))
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
    assert ext_counters.pool_gradients_moved == 0  # zero_grad() freed them: the gradients were never copied
    recorded = len(list(manager.ids_to_funcs))
    if mode == "whole":  # the forward and the backward, splitting ops inside: one graph each
        # (a direction with no splitting op in it, the custom op's backward without checkpointing, is
        # Inductor's own whole compile, graphed by Inductor)
        assert recorded == 2 and ext_counters.graphed_whole == (1 if attention == cm.CUSTOM and not checkpointing else 2)
    else:
        assert recorded >= 3 and ext_counters.graphed_whole == 0  # forward and backward pieces (layers share theirs)
    print(f"{attention} checkpointing={checkpointing} {mode}: {recorded} functions under CUDA-graph trees, "
          f"{counters['inductor'].get('cudagraph_recorded_non_static_inputs', 0)} non-static inputs recorded")


class ParallelDropout(torch.nn.Module):
    """Blocks side by side on one input, each checkpointed: dropout, attention (the splitting op),
    dropout, times a scale. Each block's contribution c_i has d loss / d s_i == c_i / s_i only if the
    backward's recompute drew the forward's second mask, whatever the RNG."""

    def __init__(self, blocks: int = 3, d: int = 32):
        super().__init__()
        self.lins = torch.nn.ModuleList(torch.nn.Linear(d, d) for _ in range(blocks))
        self.scales = torch.nn.Parameter(torch.linspace(1.0, 2.0, blocks))

    def body(self, i, x):
        h = torch.nn.functional.dropout(self.lins[i](x), 0.3, True)
        a = torch.ops.torch_ext_test.attention_fn(h, h, h)
        return (torch.nn.functional.dropout(a, 0.5, True) * self.scales[i]).sum()

    def forward(self, x):
        parts = [torch.utils.checkpoint.checkpoint(self.body, i, x, use_reentrant=False)
                 for i in range(len(self.lins))]
        return torch.stack(parts)


@pytest.mark.parametrize("mode", MODES)
def test_dropout_in_graphed_pieces_recomputes_the_forward_masks_and_draws_new_ones_each_step(mode):
    """Random numbers drawn inside captured pieces (forward, and the checkpoint's recompute in the
    backward): the recompute's masks are the forward's, and each replay draws new ones."""
    from torch._dynamo.utils import counters
    from torch._inductor import cudagraph_trees

    torch._dynamo.reset()
    counters.clear()
    model = ParallelDropout().cuda()
    x = torch.randn(2, 16, 32, device="cuda")
    backend = make_backend(CompileConfig(cache_dir=None, splitting_ops=[cm.CUSTOM], training_cudagraphs=mode))
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    seen = []
    for _ in range(4):
        model.zero_grad(set_to_none=True)
        parts = compiled(x)
        parts.sum().backward()
        parts = parts.detach().clone()
        torch.testing.assert_close(model.scales.grad, parts / model.scales.detach(), rtol=1e-4, atol=1e-4)
        seen.append(parts)
    assert all(not torch.equal(a, b) for a, b in zip(seen, seen[1:])), "a replay drew the same masks again"
    assert counters["inductor"]["cudagraph_skips"] == 0
    manager = cudagraph_trees.get_container(torch.cuda.current_device()).tree_manager
    assert manager is not None and len(list(manager.ids_to_funcs)) >= 2, "the pieces were not replayed as graphs"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("attention", [cm.SDPA, cm.CUSTOM])
def test_dropout_with_aten_random_numbers_trains_as_eager(attention, mode):
    """With Inductor's fallback_random (aten's RNG in compiled code, as eager draws it), the graphed
    split model with dropout and checkpointing draws eager's masks: losses and weights equal eager's."""
    from torch._inductor import config as inductor_config

    torch._dynamo.reset()
    model = cm.CheckpointedModel(layers=3, d=32, attention=attention, dropout=0.3).cuda()
    reference = copy.deepcopy(model)
    x = torch.randn(2, 16, 32, device="cuda")
    backend = make_backend(CompileConfig(cache_dir=None, splitting_ops=[attention], training_cudagraphs=mode))
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    with inductor_config.patch(fallback_random=True):
        torch.manual_seed(7)
        actual = _train(model, compiled, x, 4)
    torch.manual_seed(7)
    expected = _train(reference, reference, x, 4)
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-5)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)


_WARM_WORKER = """
import json, sys, torch
sys.path.insert(0, sys.argv[2])
import checkpoint_models as cm
from torch._dynamo.utils import counters
from torch._inductor import cudagraph_trees
from torch_ext.backend import CompileConfig, make_backend
from torch_ext.backend.counters import counters as ext_counters
model = cm.CheckpointedModel(layers=3, d=32, attention=cm.CUSTOM).cuda()
x = torch.randn(2, 16, 32, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
config = CompileConfig(cache_dir=sys.argv[1], splitting_ops=(cm.CUSTOM,), training_cudagraphs=sys.argv[3])
compiled = torch.compile(model, backend=make_backend(config), fullgraph=True)
opt = torch.optim.SGD(model.parameters(), lr=0.05)
losses = []
for _ in range(4):
    opt.zero_grad(set_to_none=True)
    loss = compiled(x)
    loss.backward()
    opt.step()
    losses.append(loss.item())
manager = cudagraph_trees.get_container(torch.cuda.current_device()).tree_manager
print(json.dumps({"losses": losses, "fx_misses": counters["inductor"]["fxgraph_cache_miss"],
                  "fx_hits": counters["inductor"]["fxgraph_cache_hit"],
                  "graphed": len(list(manager.ids_to_funcs)) if manager else 0,
                  "skips": counters["inductor"]["cudagraph_skips"], "whole": ext_counters.graphed_whole}))
"""


@pytest.mark.parametrize("mode", MODES)
def test_a_new_process_loads_the_graphed_training_pieces_and_trains_the_same(tmp_path, mode):
    """Warm start of training_cudagraphs: the second process compiles no piece (Inductor's FX-graph
    cache serves them), still replays them under the CUDA-graph trees ("whole": one graph per
    direction again), and its losses are the first's."""
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}

    def run():
        out = subprocess.run([sys.executable, "-c", _WARM_WORKER, str(tmp_path / "ext"), os.path.dirname(__file__),
                              mode],
                             capture_output=True, text=True, timeout=300, env=env)
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    cold, warm = run(), run()
    print(f"cold {cold}\nwarm {warm}")
    assert cold["fx_misses"] >= 2 and warm["fx_misses"] == 0 and warm["fx_hits"] >= 2
    assert warm["graphed"] == cold["graphed"] and warm["skips"] == cold["skips"] == 0
    if mode == "whole":  # the forward and the backward, the custom op inside both (checkpointed)
        assert cold["graphed"] == 2 and warm["whole"] == cold["whole"] == 2
    else:
        assert cold["graphed"] >= 3 and warm["whole"] == cold["whole"] == 0
    assert warm["losses"] == pytest.approx(cold["losses"], rel=1e-6)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("attention", [cm.SDPA, cm.CUSTOM])
def test_gradient_accumulation_over_micro_batches_equals_eager(attention, set_to_none, mode):
    """Two micro-batches per step, gradients accumulated in .grad between replays of the same backward
    pieces. Under reduce-overhead (and here before gradients were moved out of the pool) the second
    backward raised the trees' "overwritten by a subsequent run" error. Only the .grad tensors still
    in the pool at the next forward are copied: once per step after zero_grad(), once in all with
    zero_grad(set_to_none=False) (then .grad has memory of its own and is added to in place)."""
    from torch_ext.backend.counters import counters

    torch._dynamo.reset()
    counters.reset()
    model = cm.CheckpointedModel(layers=2, d=32, attention=attention).cuda()
    reference = copy.deepcopy(model)
    xs = [torch.randn(2, 16, 32, device="cuda") for _ in range(2)]
    backend = make_backend(CompileConfig(cache_dir=None, splitting_ops=[attention], training_cudagraphs=mode))
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    steps, trained = 3, [p for p in model.parameters() if p.requires_grad]
    for step in range(steps):
        model.zero_grad(set_to_none=set_to_none)
        reference.zero_grad(set_to_none=set_to_none)
        for x in xs:
            compiled(x).backward()
            reference(x).backward()
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=lambda m: f"step {step}: {m}")
    assert counters.pool_gradients_moved == len(trained) * (steps if set_to_none else 1)
