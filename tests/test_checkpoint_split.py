"""Activation checkpoints the backend splits keep their recompute: outputs and gradients equal eager's,
and the forward keeps for backward what Inductor keeps.

By default a training graph is differentiated once (backend/joint.py): Inductor's partitioner sees the
checkpoint tags, so the split keeps exactly Inductor's activations. The split-per-piece path
(differentiate_once=False: split/checkpoint.py, runtime/checkpoint.py) keeps what eager checkpointing
keeps; against plain Inductor it keeps the output of the last region of a chain for the layer after it,
and with regions nested in checkpoints Inductor may recompute whole chains from their input."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import checkpoint_models as cm
import hf_models
from torch_ext import compat
from torch_ext.backend import CompileConfig, counters, make_backend
from torch_ext.testing import activation_bytes

TOL = dict(rtol=1e-3, atol=1e-4)


def train_step(model, *inputs, params, loss=lambda out: out):
    """(loss, gradients of the inputs that need them and of `params`, bytes kept for backward)."""
    out, nbytes = activation_bytes(lambda: loss(model(*inputs)))
    wrt = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad] + list(params)
    return out.detach(), torch.autograd.grad(out, wrt), nbytes


def torch_ext_compiled(model, splitting_op, **config):
    torch._dynamo.reset()
    backend = make_backend(CompileConfig(cache_dir=None, splitting_ops=(splitting_op,), **config))
    return torch.compile(model, backend=backend, fullgraph=True)


def steady_step(compiled, *inputs, **kw):
    train_step(compiled, *inputs, **kw)  # compiles
    return train_step(compiled, *inputs, **kw)


def assert_same(actual, expected):
    torch.testing.assert_close(actual[0], expected[0], **TOL)
    for a, e in zip(actual[1], expected[1], strict=True):
        torch.testing.assert_close(a, e, **TOL)


# The versions between the newest and the oldest (Makefile: FULL_VERSIONS) run the three unmarked cases,
# which still cover both attention ops, selective or not, every hop_split and both training paths.
_slow = pytest.mark.slow
CASES = [  # attention op, selective, nesting, hop_split, differentiate_once
    pytest.param(cm.SDPA, False, "none", "inline", True, marks=_slow),
    pytest.param(cm.CUSTOM, False, "none", "in_body", True, marks=_slow),
    (cm.SDPA, True, "none", "inline", True),
    (cm.CUSTOM, False, "region_in_checkpoint", "inline", True),
    pytest.param(cm.SDPA, False, "checkpoint_in_region", "inline", True, marks=_slow),
    pytest.param(cm.CUSTOM, True, "checkpoint_in_region", "in_body", True, marks=_slow),
    pytest.param(cm.SDPA, False, "none", "inline", False, marks=_slow),
    pytest.param(cm.CUSTOM, False, "region_in_checkpoint", "inline", False, marks=_slow),
    (cm.CUSTOM, True, "checkpoint_in_region", "in_body", False),
]


@pytest.mark.parametrize("attention,selective,nesting,hop_split,once", CASES)
def test_split_checkpoint_recomputes_like_eager(attention, selective, nesting, hop_split, once):
    model = cm.CheckpointedModel(layers=2, d=64, attention=attention, selective=selective, nesting=nesting)
    x = torch.randn(8, 64, 64, requires_grad=True)
    params = list(model.parameters())
    eager = train_step(model, x, params=params)

    counters.reset()
    ext = steady_step(torch_ext_compiled(model, attention, hop_split=hop_split, differentiate_once=once),
                      x, params=params)
    if once:  # one graph, split after AOTAutograd: at attention in forward (and its recompute in backward)
        assert counters.joint_graphs == 1 and counters.checkpoint_regions == 0
        assert counters.splitting_op_calls >= 2, counters
    else:
        assert counters.joint_graphs == 0 and counters.checkpoint_regions >= 1
    assert_same(ext, eager)
    torch._dynamo.reset()
    inductor = steady_step(torch.compile(model, fullgraph=True), x, params=params)
    assert_same(inductor, eager)
    if once:  # Inductor's partitioner, Inductor's activations (2.9.1 keeps 1.5x eager's of a selective
        # checkpoint in a region: so does plain Inductor there; differentiate_once=False keeps eager's)
        assert ext[2] <= 1.01 * inductor[2], (ext[2], inductor[2])
        return
    assert ext[2] <= 1.05 * eager[2], (ext[2], eager[2])
    if not selective and nesting != "region_in_checkpoint":
        # At most one hidden state more (the last region's output) and the regions' RNG states.
        assert ext[2] <= inductor[2] + x.nbytes + 2 * 6 * 1024, (ext[2], inductor[2])


def test_without_the_kept_region_the_split_saves_every_piece(monkeypatch):
    """The measurement behind the test above: inlining the region (what the backend did before)
    keeps several times Inductor's activations."""
    import torch_ext.backend.backend as backend_module

    split_graph = backend_module.split_graph
    monkeypatch.setattr(backend_module, "split_graph", lambda *a, **k: split_graph(*a, **{**k, "keep_checkpoints": False}))
    model = cm.CheckpointedModel(layers=2, d=64)
    x = torch.randn(8, 64, 64, requires_grad=True)
    params = list(model.parameters())
    lost = steady_step(torch_ext_compiled(model, cm.SDPA, differentiate_once=False), x, params=params)
    monkeypatch.undo()
    kept = steady_step(torch_ext_compiled(model, cm.SDPA, differentiate_once=False), x, params=params)
    assert lost[2] > 3 * kept[2], (lost[2], kept[2])


def test_inference_inlines_the_region():
    """Without autograd nothing is saved: the region is inlined into the pieces around it (which
    piecewise CUDA graphs can capture), and runs as before."""
    model = cm.CheckpointedModel(layers=2).eval()
    x = torch.randn(2, 16, 32)
    counters.reset()
    compiled = torch_ext_compiled(model, cm.SDPA)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), **TOL)
    assert counters.checkpoint_regions == 0 and counters.inlined_hops == 2


class DropoutRegion(nn.Module):
    """out = s * sum(dropout(attention(h))): d out / d s == out / s only if backward's recompute
    drew the forward's mask."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(32, 32)
        self.s = nn.Parameter(torch.tensor(1.5))

    def body(self, x):
        h = self.lin(x)
        return F.dropout(torch.ops.torch_ext_test.attention_fn(h, h, h), 0.5, True) * self.s

    def forward(self, x):
        return checkpoint(self.body, x, use_reentrant=False).sum()


@pytest.mark.parametrize("once", [True, False])
def test_recompute_draws_the_forward_random_numbers(once):
    model = DropoutRegion()
    x = torch.randn(4, 8, 32)
    compiled = torch_ext_compiled(model, cm.CUSTOM, differentiate_once=once)
    for _ in range(2):
        model.zero_grad()
        out = compiled(x)
        out.backward()
        torch.testing.assert_close(model.s.grad, out.detach() / model.s.detach(), rtol=1e-4, atol=1e-4)
    with torch.no_grad():  # the mask dropped something
        h = model.lin(x)
        assert not torch.allclose(out, torch.ops.torch_ext_test.attention_fn(h, h, h).sum() * model.s)


class DropoutBranches(nn.Module):
    """One checkpointed region of two branches, each attention -> dropout times its own scale s_i:
    d out_i / d s_i == out_i / s_i only if the recompute drew the forward's masks. Inductor draws all of
    a graph's dropouts from one seeds tensor; in the backward it is recomputed once, ahead of both
    branches' pieces, and each piece looks up its dropout's seed in it."""

    def __init__(self):
        super().__init__()
        self.lins = nn.ModuleList(nn.Linear(32, 32) for _ in range(2))
        self.s = nn.Parameter(torch.tensor([1.5, 0.75]))

    def body(self, x):
        outs = []
        for i, p in enumerate((0.5, 0.25)):
            h = self.lins[i](x)
            outs.append((F.dropout(torch.ops.torch_ext_test.attention_fn(h, h, h), p, True) * self.s[i]).sum())
        return torch.stack(outs)

    def forward(self, x):
        return checkpoint(self.body, x, use_reentrant=False)


def test_recompute_of_random_seeds_shared_across_pieces():
    """Before, the backward's recomputed seeds reached the other pieces without a fake value and
    Inductor failed to compile them (TypeError in inductor_lookup_seed; HF OPT trained this way)."""
    model = DropoutBranches()
    x = torch.randn(4, 8, 32)
    compiled = torch_ext_compiled(model, cm.CUSTOM)
    counters.reset()
    for _ in range(2):
        model.zero_grad()
        outs = compiled(x)
        outs.sum().backward()
        torch.testing.assert_close(model.s.grad, outs.detach() / model.s.detach(), rtol=1e-4, atol=1e-4)
    assert counters.joint_graphs == 1


@pytest.mark.slow
def test_hf_gradient_checkpointing_split_at_sdpa():
    """transformers' gradient checkpointing (non-reentrant) on a Llama, split at its SDPA calls."""
    model = hf_models.build("llama")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    ids = hf_models.token_ids(2, 16)

    params = list(model.parameters())

    def loss(out):
        return out.loss

    def call(m):
        return lambda ids: m(input_ids=ids, labels=ids, use_cache=False)

    eager = train_step(call(model), ids, params=params, loss=loss)
    counters.reset()
    ext = steady_step(call(torch_ext_compiled(model, cm.SDPA)), ids, params=params, loss=loss)
    assert counters.joint_graphs == 1 and counters.splitting_op_calls >= 2 * hf_models.LAYERS
    torch.testing.assert_close(ext[0], eager[0], **TOL)
    for a, e in zip(ext[1], eager[1], strict=True):
        torch.testing.assert_close(a, e, **TOL)
    torch._dynamo.reset()
    assert ext[2] <= 1.05 * eager[2], (ext[2], eager[2])
    inductor = steady_step(call(torch.compile(model, fullgraph=True)), ids, params=params, loss=loss)
    assert ext[2] <= 1.01 * inductor[2], (ext[2], inductor[2])


_TRAIN_WORKER = """
import json, sys, torch
sys.path.insert(0, sys.argv[2])
import checkpoint_models as cm
from torch_ext.backend import CompileConfig, counters, make_backend
from torch._dynamo.utils import counters as dynamo_counters
model = cm.CheckpointedModel(layers=2, attention=cm.CUSTOM)
x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(0), requires_grad=True)
config = CompileConfig(cache_dir=sys.argv[1], splitting_ops=(cm.CUSTOM,), differentiate_once=sys.argv[3] == "1")
torch.compile(model, backend=make_backend(config), fullgraph=True)(x).backward()
print(json.dumps({"counters": counters.snapshot(), "grad": x.grad.double().sum().item(),
                  "fx_misses": dynamo_counters["inductor"]["fxgraph_cache_miss"]}))
"""


def _train_in_new_process(cache_dir, once: bool):
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": os.path.join(cache_dir, "inductor")}
    out = subprocess.run([sys.executable, "-c", _TRAIN_WORKER, str(cache_dir), os.path.dirname(__file__), str(int(once))],
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr


@pytest.mark.slow
def test_training_pieces_differentiated_once_load_from_inductors_cache(tmp_path):
    """The pieces of a training graph differentiated once are Inductor compiles of ATen graphs: a second
    process generates no code for them (Inductor's FX-graph cache serves every one)."""
    first, _ = _train_in_new_process(tmp_path, True)
    second, _ = _train_in_new_process(tmp_path, True)
    assert first["counters"]["joint_graphs"] == 1 and first["fx_misses"] >= 2
    assert second["fx_misses"] == 0 and second["grad"] == pytest.approx(first["grad"], rel=1e-6)


@pytest.mark.slow
def test_training_pieces_load_from_the_disk_cache_in_a_new_process(tmp_path):
    """Split per piece: pieces compiled with gradients (a checkpoint region's, and those around it) are
    saved and a second process loads them all (2.10-2.12 compile their backward up front for it); torch
    2.9.1 cannot save those AOTAutograd compiled afresh, and says so once."""
    first, said = _train_in_new_process(tmp_path, False)
    second, _ = _train_in_new_process(tmp_path, False)
    compiled = first["counters"]["inductor_compiles"]
    assert compiled >= 2 and second["grad"] == pytest.approx(first["grad"], rel=1e-6)
    if compat.TRAINING_ARTIFACTS_SAVEABLE:
        assert second["counters"]["inductor_compiles"] == 0
        assert second["counters"]["cache_hits"] == compiled
    elif "cannot be saved to the cache" in said:  # 2.9.1 saves them only where AOTAutograd's own cache hit
        assert said.count("cannot be saved to the cache") == 1
        assert second["counters"]["inductor_compiles"] > 0
    else:
        assert second["counters"]["inductor_compiles"] == 0


@torch.library.custom_op("torch_ext_test::random_mask", mutates_args=(),
                         tags=(torch.Tag.nondeterministic_seeded,))
def random_mask(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x times a random 0/2 mask (dropout 0.5), and the mask: a random splitting op."""
    mask = (torch.rand_like(x) > 0.5).to(x.dtype) * 2
    return x * mask, mask


@random_mask.register_fake
def _(x):
    return torch.empty_like(x), torch.empty_like(x)


def _random_mask_setup(ctx, inputs, output):
    ctx.save_for_backward(output[1])


def _random_mask_backward(ctx, grad, _grad_mask):
    return grad * ctx.saved_tensors[0]


random_mask.register_autograd(_random_mask_backward, setup_context=_random_mask_setup)


class RandomSplitRegion(nn.Module):
    """out = s * sum(random_mask(lin(x))), the random op a splitting op inside a checkpoint region:
    the joint graph saves its RNG state (run_and_save_rng_state) and replays it in the recompute
    (run_with_rng_state), both run eagerly between the pieces."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(32, 32)
        self.s = nn.Parameter(torch.tensor(1.5))

    def body(self, x):
        return torch.ops.torch_ext_test.random_mask(self.lin(x))[0] * self.s

    def forward(self, x):
        return checkpoint(self.body, x, use_reentrant=False).sum()


def test_rng_state_hops_between_pieces_run_directly(monkeypatch):
    """The RNG-state HOPs around a random splitting op skip their dispatch (compat/rng_hops.py) and
    still hand the recompute the forward's random numbers: d out / d s == out / s."""
    from torch_ext.compat import rng_hops

    direct = []
    device_of_plain = rng_hops._device_of_plain
    monkeypatch.setattr(rng_hops, "_device_of_plain",
                        lambda args, kwargs: direct.append(device_of_plain(args, kwargs)) or direct[-1])
    model = RandomSplitRegion()
    x = torch.randn(4, 8, 32)
    compiled = torch_ext_compiled(model, "torch_ext_test::random_mask")
    for _ in range(2):
        direct.clear()  # the first call may run under a mode (then through the HOP, as before)
        model.zero_grad()
        out = compiled(x)
        out.backward()
        torch.testing.assert_close(model.s.grad, out.detach() / model.s.detach(), rtol=1e-4, atol=1e-4)
    assert direct == ["cpu", "cpu"], direct  # a steady step: saved in the forward, replayed in the backward
    torch.manual_seed(0)  # outside the graphs the HOP's direct form draws as the HOP does
    a = torch.ops.torch_ext_test.random_mask(x)[1]
    from torch._prims.rng_prims import run_and_save_rng_state, run_with_rng_state
    state, b = rng_hops.direct_hop_call(run_and_save_rng_state)(torch.ops.torch_ext_test.random_mask.default, x)
    again = rng_hops.direct_hop_call(run_with_rng_state)(state, torch.ops.torch_ext_test.random_mask.default, x)
    torch.testing.assert_close(again[1], b[1])
    assert not torch.equal(a, b[1])


class _SumLossBlock(nn.Module):
    def __init__(self, dim: int = 16, heads: int = 2):
        super().__init__()
        self.heads, self.qkv = heads, nn.Linear(dim, 3 * dim)
        self.up, self.down = nn.Linear(dim, dim), nn.Linear(dim, dim)

    def body(self, x):
        q, k, v = self.qkv(x).unflatten(-1, (3, self.heads, -1)).permute(2, 0, 3, 1, 4)
        h = x + F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(2)
        return h + self.down(torch.relu(self.up(h))), h.shape[-1]

    def forward(self, x):
        out, width = checkpoint(self.body, x, use_reentrant=False)
        return out * (width / 16)


class _WithLoss(nn.Module):
    """The loss inside the compiled graph, as a training script computes it in its model's forward."""

    def __init__(self, body: nn.Module, loss: str):
        super().__init__()
        self.body, self.loss = body, loss
        self.register_buffer("labels", torch.randint(0, 16, (2 * 6,)))

    def forward(self, x):
        out = self.body(x)
        return out.sum() if self.loss == "sum" else F.cross_entropy(out.flatten(0, 1), self.labels)


@pytest.mark.parametrize("loss", ["sum", "cross_entropy"])
def test_loss_summed_from_a_split_checkpoint_trains_like_eager(loss):
    """`out.sum()` as the loss: its backward starts with an expand of the scalar tangent (stride 0), which
    AOTAutograd's backward graph gives contiguous fake strides on 2.14.1 and 2.15; the first backward piece returns a
    view of it to the next one, which was compiled for the fake's layout and failed Inductor's stride
    assert. Such an input is now copied into that layout, and only such: a loss that makes its gradient
    densely (cross entropy) adds no check."""
    torch.manual_seed(0)
    model = _WithLoss(nn.Sequential(*[_SumLossBlock() for _ in range(3)]), loss)
    x = torch.randn(2, 6, 16)
    expected = train_step(model, x, params=model.parameters())
    counters.reset()
    compiled = torch_ext_compiled(model, "aten::scaled_dot_product_attention")
    for _ in range(2):
        assert_same(train_step(compiled, x, params=model.parameters()), expected)
    assert counters.joint_graphs == 1
    if loss == "cross_entropy":  # which torch versions give the tangent's expand wrong fakes varies (2.14.1, 2.15)
        assert counters.relaid_inputs == 0
