"""torch_ext::decode_linear (kernels/decode_linear.py) and the rewrite that puts it in place of linear
calls of a few rows (backend/rewrite/decode_linear.py).

The kernel is checked against a float64 reference under TRITON_INTERPRET=1 (a subprocess: the
variable must be set before Triton loads); its GPU path, programmatic dependent launch included, in
test_decode_linear_gpu.py. The rewrite fires on CUDA inputs only; here it is let onto the CPU (where
the op runs F.linear) to check which calls it takes, what it tells the op, and that compiled models
still equal eager.
"""
from __future__ import annotations

import pytest
import torch

import hf_models as hf
import torch_ext
from torch_ext.backend import CompileConfig, counters
from torch_ext.backend.rewrite import decode_linear as rewrite
from test_hf_decode import decode_matches_eager, fx_pieces  # noqa: F401  (fixture)
from triton_interpreter import run_in_interpreter

KERNEL_CHECK = r'''
import torch
from torch_ext.kernels.decode_linear import config, decode_linear_triton
torch.manual_seed(0)
cases = [(2048, 9, False, torch.float32), (320, 10, True, torch.bfloat16), (4096, 7, True, torch.float32),
         (192, 5, False, torch.float16), (2048, 4, False, torch.bfloat16), (256, 33, True, torch.float16),
         (5632, 3, True, torch.float32), (64, 1, True, torch.float32), (128, 6, False, torch.float32)]
worst = 0.0
for i, (k, n, bias, dtype) in enumerate(cases):
    lead = (1,) if i % 2 else (1, 1)  # leading dims are flattened
    x = torch.randn(*lead, k + 3, dtype=dtype)[..., 3:]  # not contiguous: the op packs it
    w = torch.randn(n, k, dtype=dtype) / k ** 0.5
    b = torch.randn(n, dtype=dtype) if bias else None
    y = decode_linear_triton(x, w, b, False)
    expected = torch.nn.functional.linear(x.double(), w.double(), b.double() if bias else None)
    assert y.shape == expected.shape and y.dtype == dtype and not y.isnan().any(), (k, n)
    err = ((y.double() - expected).norm() / expected.norm()).item()
    assert err < (1e-5 if dtype == torch.float32 else 1e-2), (k, n, config(k), err)
    worst = max(worst, err)
try:
    decode_linear_triton(torch.randn(2, 64), torch.randn(8, 64), None, False)
    raise AssertionError("two rows were taken")
except ValueError as e:
    assert "one row" in str(e)
print("WORST", worst)
'''


@pytest.mark.slow
def test_kernel_equals_a_float64_reference_in_the_interpreter():
    run_in_interpreter(KERNEL_CHECK)


FUSED_CHECK = r'''
import torch
from torch_ext.kernels.decode_linear import decode_linear_reference, decode_linear_triton, prologue_reference
torch.manual_seed(0)
worst = 0.0
# No bfloat16: the interpreter rounds float32 -> bfloat16 toward zero (the GPU test checks bfloat16).
for k, n, dtype in [(2048, 9, torch.float16), (320, 5, torch.float32), (256, 3, torch.float16)]:
    for norm, gated, residual, bias in [(True, False, False, False), (False, True, False, True),
                                        (False, False, True, False), (True, True, True, True)]:
        x = torch.randn(1, 1, k, dtype=dtype) * 3
        w = torch.randn(n, k, dtype=dtype) / k ** 0.5
        args = dict(norm_weight=torch.rand(k, dtype=dtype) + 0.5 if norm else None, eps=1e-5,
                    up=torch.randn(1, 1, k, dtype=dtype) if gated else None,
                    residual=torch.randn(1, 1, n, dtype=dtype) if residual else None)
        b = torch.randn(n, dtype=dtype) if bias else None
        y = decode_linear_triton(x, w, b, False, **args)
        # Eager's prologue (rounding where it rounds), then the projection in float64, rounded, plus the
        # residual: what the op computes, without the CPU's own low-precision matmul.
        xp = prologue_reference(x, args["norm_weight"], args["eps"], args["up"])
        expected = torch.nn.functional.linear(xp.double(), w.double(), b.double() if bias else None).to(dtype)
        if residual:
            expected = expected + args["residual"]
        assert y.shape == expected.shape == (1, 1, n) and y.dtype == dtype, (k, n, dtype)
        assert decode_linear_reference(x, w, b, **args).shape == y.shape
        err = ((y.double() - expected.double()).norm() / expected.double().norm()).item()
        assert err < (1e-5 if dtype == torch.float32 else 1e-2), (k, n, dtype, norm, gated, residual, err)
        worst = max(worst, err)
print("WORST", worst)
'''


GATE_EPILOGUE_CHECK = r'''
import torch
from torch_ext.kernels.decode_linear import decode_linear_reference, decode_linear_triton, prologue_reference
torch.manual_seed(0)
worst = 0.0
# [gate_start, up_start, width] over n outputs: gate then up (Llama's merged gate/up), up first, apart,
# an odd width (masked pairs), with the norm prologue, a bias and a residual.
for k, n, gate, dtype, norm, bias, residual in [
        (256, 16, [0, 8, 8], torch.float16, False, False, False),
        (512, 12, [6, 0, 6], torch.float32, True, True, False),
        (256, 20, [1, 11, 7], torch.float16, True, False, True),
        (2048, 6, [0, 3, 3], torch.float32, False, True, True)]:
    x = torch.randn(1, 1, k, dtype=dtype) * 3
    w = torch.randn(n, k, dtype=dtype) / k ** 0.5
    g = torch.rand(k, dtype=dtype) + 0.5 if norm else None
    b = torch.randn(n, dtype=dtype) if bias else None
    res = torch.randn(1, 1, gate[2], dtype=dtype) if residual else None
    y = decode_linear_triton(x, w, b, False, norm_weight=g, eps=1e-5, residual=res, gate=gate)
    # The projection in float64, rounded, then the gate as eager computes it: what the op computes.
    p = torch.nn.functional.linear(prologue_reference(x, g, 1e-5).double(), w.double(),
                                   b.double() if bias else None).to(dtype)
    s, u, width = gate
    expected = torch.nn.functional.silu(p[..., s:s + width]) * p[..., u:u + width]
    if residual:
        expected = expected + res
    assert y.shape == expected.shape == (1, 1, width) and y.dtype == dtype, (k, n, gate)
    assert decode_linear_reference(x, w, b, g, 1e-5, None, res, gate).shape == y.shape
    err = ((y.double() - expected.double()).norm() / expected.double().norm()).item()
    assert err < (1e-5 if dtype == torch.float32 else 1e-2), (k, n, gate, dtype, err)
    worst = max(worst, err)
try:
    decode_linear_triton(torch.randn(1, 64), torch.randn(8, 64), None, False, gate=[0, 4, 5])
    raise AssertionError("a gate past the outputs was taken")
except ValueError as e:
    assert "gate" in str(e)
print("WORST", worst)
'''


TUNED_CONFIGS_CHECK = r'''
import torch
from torch_ext.kernels.decode_linear import TRITON_CONFIG, decode_linear_reference, decode_linear_triton
from torch_ext.kernels.decode_linear_tuning import triton_configs
torch.manual_seed(0)
worst = 0.0
# Each launch config the tuner may pick at one row, plain, with the norm, and with the gate epilogue
# (which halves the features a program: 2 becomes 1); float32 (the interpreter's bfloat16 rounds wrong).
for k, n in [(320, 21), (2048, 12)]:
    for launch in triton_configs(k):
        overrides = dict(zip(TRITON_CONFIG, launch))
        for extra in [{}, {"norm_weight": torch.rand(k) + 0.5, "eps": 1e-5}, {"gate": [0, n // 2, n // 2]}]:
            x = torch.randn(1, k)
            w = torch.randn(n, k) / k ** 0.5
            b = torch.randn(n)
            y = decode_linear_triton(x, w, b, False, overrides, **extra)
            expected = decode_linear_reference(x.double(), w.double(), b.double(),
                                               **{key: v.double() if torch.is_tensor(v) else v for key, v in extra.items()})
            err = ((y.double() - expected).norm() / expected.norm()).item()
            assert y.shape == expected.shape and err < 1e-5, (k, n, launch, list(extra), err)
            worst = max(worst, err)
print("WORST", worst)
'''


@pytest.mark.slow
def test_every_one_row_launch_config_the_tuner_offers_equals_a_float64_reference_in_the_interpreter():
    """The Triton GEMV under each config decode_linear_tuning may choose (features a program 2, 4, 8),
    plain, with a folded norm and with the gate epilogue."""
    run_in_interpreter(TUNED_CONFIGS_CHECK)


@pytest.mark.slow
def test_one_row_gate_epilogue_equals_the_eager_formulation_in_the_interpreter():
    """The one-row kernel with a gated MLP's silu(gate) * up in its epilogue (each program pairs a gate
    row with its up row) equals projection-then-gate as eager computes it, with the norm, a bias, a
    residual, any slice layout; a gate outside the weight is refused."""
    run_in_interpreter(GATE_EPILOGUE_CHECK)


@pytest.mark.slow
def test_fused_norm_gate_and_residual_equal_the_eager_formulation_in_the_interpreter():
    """The one-row kernel with an RMSNorm before (HF's rounding), silu(gate) * up before, a residual
    add after, alone and together, equals the op's reference (what eager computes)."""
    run_in_interpreter(FUSED_CHECK)


def test_op_is_linear_off_the_kernel():
    """Off CUDA (and on shapes the kernel does not take) the op is F.linear, bias or not."""
    x, w, b = torch.randn(2, 3, 64), torch.randn(5, 64), torch.randn(5)
    for bias in (b, None):
        out = torch.ops.torch_ext.decode_linear(x, w, bias, True)
        torch.testing.assert_close(out, torch.nn.functional.linear(x, w, bias))
    with torch._subclasses.fake_tensor.FakeTensorMode():  # the fake gives the shape of linear's output
        assert torch.ops.torch_ext.decode_linear(torch.empty(4, 1, 64), torch.empty(7, 64), None, False).shape == (4, 1, 7)


class Block(torch.nn.Module):
    """Linears of every kind the rewrite must tell apart."""

    def __init__(self):
        super().__init__()
        self.first = torch.nn.Linear(64, 64)  # reads the graph input directly: no kernel of the graph before it
        self.after_norm = torch.nn.Linear(64, 128, bias=False)  # reads a norm's output
        self.shared = torch.nn.Linear(128, 64)  # its weight is also read by another op
        self.norm = torch.nn.RMSNorm(64)

    def forward(self, x):
        h = self.first(x)
        h = self.after_norm(self.norm(h))
        return self.shared(torch.nn.functional.silu(h)) + self.shared.weight.sum()


def _graph(model, *args, dynamic=False):
    """The Dynamo graph of model(*args) and its example inputs (parameters among them)."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append((gm, example_inputs))
        return gm

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend=backend, dynamic=dynamic)(*args)
    (graph,) = graphs
    return graph


def _calls(gm):
    return [n for n in gm.graph.nodes if n.target is torch.ops.torch_ext.decode_linear.default]


def test_rewrite_takes_few_row_linears_and_prefetches_only_where_safe(monkeypatch):
    monkeypatch.setattr(rewrite, "DEVICES", ("cpu",))
    gm, inputs = _graph(Block().eval(), torch.randn(1, 1, 64))
    with torch.no_grad():
        expected = gm(*inputs)
    assert rewrite.use_decode_linear(gm) == 3
    first, after_norm, shared = _calls(gm)
    # Only the linear after the norm: the first reads the input (the caller's kernel, maybe a write of
    # its weight, runs right before it); the shared weight is read by another op of the graph.
    assert [c.args[3] for c in (first, after_norm, shared)] == [False, True, False]
    assert first.args[2] is not None and after_norm.args[2] is None
    with torch.no_grad():
        torch.testing.assert_close(gm(*inputs), expected)


class TiedHead(torch.nn.Module):
    """Two linears reading the embedding's weight (tied): read-only, unless the embedding renormalizes
    its rows in place (max_norm)."""

    def __init__(self, max_norm):
        super().__init__()
        self.embed = torch.nn.Embedding(10, 64, max_norm=max_norm)
        self.norm = torch.nn.RMSNorm(64)

    def forward(self, ids):
        h = self.norm(self.embed(ids))
        return torch.nn.functional.linear(h, self.embed.weight), torch.nn.functional.linear(h.tanh(), self.embed.weight)


@pytest.mark.parametrize("max_norm,prefetch", [(None, True), (1.0, False)])
def test_a_weight_an_embedding_may_write_is_not_loaded_early(monkeypatch, max_norm, prefetch):
    monkeypatch.setattr(rewrite, "DEVICES", ("cpu",))
    gm, inputs = _graph(TiedHead(max_norm).eval(), torch.tensor([[3]]))
    with torch.no_grad():
        expected = gm(*inputs)
    assert rewrite.use_decode_linear(gm) == 2
    assert [c.args[3] for c in _calls(gm)] == [prefetch, prefetch]  # the second sees the first already ours
    with torch.no_grad():
        torch.testing.assert_close(gm(*inputs), expected)


@pytest.mark.parametrize("shape,dynamic", [((2, 64), False), ((3, 5, 64), False), ((2, 64), True)])
def test_rewrite_leaves_many_rows_and_symbolic_rows_alone(monkeypatch, shape, dynamic):
    """Several float32 rows (cuBLAS beats our kernels there), or a row count the graph does not fix."""
    monkeypatch.setattr(rewrite, "DEVICES", ("cpu",))
    gm, _ = _graph(torch.nn.Sequential(torch.nn.Linear(64, 32)).eval(), torch.randn(*shape), dynamic=dynamic)
    assert rewrite.use_decode_linear(gm) == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rewrite_takes_up_to_max_rows_of_a_16_bit_input(monkeypatch, dtype):
    """The op's CUDA path serves 2..MAX_ROWS rows of a 16-bit float; one more row is F.linear's."""
    from torch_ext.kernels import decode_linear as op

    monkeypatch.setattr(rewrite, "DEVICES", ("cpu",))
    model = torch.nn.Sequential(torch.nn.Linear(64, 32)).to(dtype).eval()
    for rows, calls in ((2, 1), (op.MAX_ROWS, 1), (op.MAX_ROWS + 1, 0)):
        gm, inputs = _graph(model, torch.randn(rows, 64, dtype=dtype))
        with torch.no_grad():
            expected = gm(*inputs)
        assert rewrite.use_decode_linear(gm) == calls
        with torch.no_grad():
            torch.testing.assert_close(gm(*inputs), expected, rtol=0, atol=0)


def test_rewrite_leaves_cpu_graphs_alone():
    gm, _ = _graph(torch.nn.Sequential(torch.nn.Linear(64, 32)).eval(), torch.randn(1, 64))
    assert rewrite.use_decode_linear(gm) == 0


@pytest.mark.parametrize("enabled,fusion", [(True, True), (True, False), (False, True)])
def test_hf_llama_decode_runs_the_op_and_matches_eager(monkeypatch, fx_pieces, enabled, fusion):  # noqa: F811
    """An HF Llama decode step at batch 1 through torch_ext.compile: every projection of the decode graph (merged
    q/k/v and gate/up, o, down, lm_head) runs the op, with both RMSNorms, the gate and both residual
    adds of each layer inside it; logits and caches equal eager's over several steps.
    decode_linear=False turns it off, decode_linear_fusion=False the fused parts."""
    monkeypatch.setattr(rewrite, "DEVICES", ("cpu",))
    model = hf.build("llama").eval()
    config = CompileConfig(cache_dir=None, guard_free_dispatch=True, decode_linear=enabled, decode_linear_fusion=fusion)
    decode_matches_eager(model, torch_ext.compile(model, config, dynamic=False), batch=1)
    layers = model.config.num_hidden_layers
    assert counters.decode_linear_calls == (4 * layers + 1 if enabled else 0)
    # The final norm feeds lm_head through HF's logits_to_keep slice: not an RMSNorm's output.
    assert counters.decode_linear_fusions == (5 * layers if enabled and fusion else 0)


def test_pieces_that_run_the_op_get_dependent_launch_and_combo_kernels(monkeypatch):
    """Inductor's PDL (its kernels let the op start early) and combo kernels (a layer's small kernels as
    one launch) go to pieces that call the op (or decode attention) on CUDA, PDL where the GPU has it,
    each where this torch has it measured; the user's own setting wins."""
    from torch_ext import compat
    from torch_ext.backend.compile import decode_options as do

    monkeypatch.setattr(rewrite, "DEVICES", ("cpu",))
    monkeypatch.setattr(do, "_has_cuda", lambda: True)
    monkeypatch.setattr(do, "_gpu_has_pdl", lambda: True)
    with_op, _ = _graph(Block().eval(), torch.randn(1, 1, 64))
    rewrite.use_decode_linear(with_op)
    without_op, _ = _graph(Block().eval(), torch.randn(4, 64))
    pdl = {"triton.enable_pdl": True} if compat.has_inductor_pdl() else {}
    combo = {"combo_kernels": True} if compat.combo_kernels_measured() else {}
    assert compat.combo_kernels_measured() == (compat.versions.TORCH_VERSION >= (2, 11))
    assert do.decode_piece_patches(with_op, {}) == {**pdl, **combo}
    assert do.decode_piece_patches(without_op, {}) == {}
    assert do.decode_piece_patches(with_op, {"triton.enable_pdl": False, "combo_kernels": False}) == {}
    assert do.decode_piece_patches(with_op, {"combo_kernels": False}) == pdl
    from torch_ext.backend.rewrite.decode_attention import use_decode_attention

    sdpa = torch.nn.functional.scaled_dot_product_attention
    attention, _ = _graph(lambda q, k, v: sdpa(q, k, v) * 2, *(torch.randn(1, 4, n, 16) for n in (1, 10, 10)))
    assert use_decode_attention(attention, lambda node: False) == 1
    assert do.decode_piece_patches(attention, {}) == {**pdl, **combo}
    monkeypatch.setattr(do, "_gpu_has_pdl", lambda: False)
    assert do.decode_piece_patches(with_op, {}) == combo
    monkeypatch.setattr(do, "_has_cuda", lambda: False)
    assert do.decode_piece_patches(with_op, {}) == {}
