"""decode_linear's CUDA path (kernels/decode_linear_mma.py: weights streamed into mma fragments) on a GPU
against a float64 reference, every launch config shape, with and without programmatic dependent launch,
inside CUDA graphs too; skipped without CUDA."""
from __future__ import annotations

import pytest
import torch

import hf_models as hf
from test_decode_linear_gpu import assert_dependent_launch_chain_reads_each_input_complete
from torch_ext.backend import counters
from torch_ext.kernels.decode_linear import prologue_reference
from torch_ext.kernels.decode_linear_mma import decode_linear_mma, mma_takes

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _inputs(rows, k, n, dtype, bias, residual, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(rows, k, device="cuda", dtype=dtype, generator=g)
    w = torch.randn(n, k, device="cuda", dtype=dtype, generator=g) / k ** 0.5
    b = torch.randn(n, device="cuda", dtype=dtype, generator=g) if bias else None
    r = torch.randn(rows, n, device="cuda", dtype=dtype, generator=g) if residual else None
    return x, w, b, r


def _expected(x, w, b, r):
    """The projection in float64, rounded to x's dtype as eager's linear does, plus the residual."""
    y = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double()).to(x.dtype)
    return y if r is None else y + r


def _error(out, expected) -> float:
    return ((out.double() - expected.double()).norm() / expected.double().norm()).item()


@pytest.mark.parametrize("pdl", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 9, 16, 17, 31, 32])
@pytest.mark.parametrize("k,n,bias,residual", [(2048, 6144, False, False), (5632, 2048, True, False),
                                               (2048, 11264, False, True),  # over 4 blocks an SM: 4 warps at 17+ rows
                                               (64, 77, True, True), (320, 33, False, True)])
def test_kernel_equals_a_float64_reference(pdl, dtype, rows, k, n, bias, residual):
    x, w, b, r = _inputs(rows, k, n, dtype, bias, residual, rows * k + n)
    assert mma_takes(x, w, b, residual=r)
    out = decode_linear_mma(x, w, b, pdl, residual=r)
    assert out.shape == (rows, n) and out.dtype == dtype and not out.isnan().any()
    assert _error(out, _expected(x, w, b, r)) < 1e-2


@pytest.mark.parametrize("config", [(1, 8, 2), (2, 8, 2), (1, 4, 4), (2, 4, 1), (1, 16, 1), (4, 2, 2), (1, 8, 1, 1),
                                    (1, 4, 2, 1), (2, 8, 1, 1), (1, 8, 1, 2), (1, 4, 2, 2), (2, 8, 1, 2),
                                    (1, 16, 1, 3), (1, 8, 2, 3), (2, 4, 1, 3), (4, 4, 1, 3)])
@pytest.mark.parametrize("rows", [2, 8, 24])
def test_every_config_shape_gives_the_same_answer(config, rows):
    """Features a block (16 x m-tiles), warps and chunks in flight change who adds what; K = 5632 is 88
    chunks, a multiple of none of the warp counts x chunks in flight, and N = 2056 ends in a part tile."""
    x, w, b, r = _inputs(rows, 5632, 2056, torch.bfloat16, True, True, rows)
    out = decode_linear_mma(x, w, b, True, residual=r, config=config)
    assert _error(out, _expected(x, w, b, r)) < 1e-2


@pytest.mark.parametrize("rows", [2, 9, 32])
@pytest.mark.parametrize("warps,unroll", [(4, 1), (8, 1), (16, 1), (8, 2)])
def test_the_ordered_pipeline_adds_in_the_same_order(rows, warps, unroll):
    """x modes 2 and 3 (loads issued before the mma they overlap, two stages in turn; x in registers or
    through shared memory) multiply the same chunks in the same order as mode 1: the same bits, with the
    norm and gate prologues too."""
    x, w, b, r = _inputs(rows, 5632, 2056, torch.bfloat16, True, True, rows + warps)
    norm_weight = torch.randn(5632, device="cuda", dtype=torch.bfloat16)
    up = torch.randn_like(x)
    for kwargs in ({"residual": r}, {"norm_weight": norm_weight, "eps": 1e-6}, {"up": up}, {"gate": [0, 1028, 1028]}):
        one, *others = (decode_linear_mma(x, w, b, True, config=(1, warps, unroll, mode), **kwargs) for mode in (1, 2, 3))
        for mode, other in enumerate(others, 2):
            assert torch.equal(one, other), (mode, kwargs)


@pytest.mark.parametrize("pdl", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [2, 8, 32])
@pytest.mark.parametrize("parts", [("norm",), ("norm", "residual"), ("up",), ("norm", "up", "residual")])
@pytest.mark.parametrize("config", [None, (1, 8, 1, 1), (1, 16, 1, 3)])  # x a round ahead / through shared memory
def test_fused_parts_equal_the_eager_formulation(pdl, dtype, rows, parts, config):
    """The norm / gate / residual add inside the kernel: eager's prologue (its roundings), the projection
    in float64, rounded, plus the residual. up is a row-strided view, as a merged gate/up output's half is."""
    k, n = 2048, 5632
    g = torch.Generator(device="cuda").manual_seed(rows + len(parts))
    x = torch.randn(rows, 1, k, device="cuda", dtype=dtype, generator=g) * 3
    w = torch.randn(n, k, device="cuda", dtype=dtype, generator=g) / k ** 0.5
    gate_up = torch.randn(rows, 1, 2 * k, device="cuda", dtype=dtype, generator=g)
    args = dict(norm_weight=torch.rand(k, device="cuda", dtype=dtype, generator=g) + 0.5 if "norm" in parts else None,
                eps=1e-6, up=gate_up[..., k:] if "up" in parts else None,
                residual=torch.randn(rows, 1, n, device="cuda", dtype=dtype, generator=g) if "residual" in parts else None)
    assert mma_takes(x, w, None, args["norm_weight"], args["up"], args["residual"])
    out = decode_linear_mma(x, w, None, pdl, **args, config=config)
    xp = prologue_reference(x, args["norm_weight"], args["eps"], args["up"])
    assert _error(out, _expected(xp, w, None, args["residual"])) < 1e-2


@pytest.mark.parametrize("pdl", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 8, 9, 32])
@pytest.mark.parametrize("k,n,gate,bias,residual,config", [
    (2048, 11264, [0, 5632, 5632], False, False, None),  # Llama's gate/up at the default config
    (5632, 4096, [2048, 0, 2048], True, True, (1, 16, 2)),  # up first, 16 warps x 2 chunks (o and down)
    (320, 50, [5, 27, 20], True, False, (2, 4, 1)),  # slices at odd offsets, a part tile, 2 m-tiles
    (64, 16, [0, 8, 8], False, True, (1, 2, 2))])
def test_gate_epilogue_equals_the_eager_formulation(pdl, rows, k, n, gate, bias, residual, config):
    """gate=[gate_start, up_start, width]: silu(y[gate slice]) * y[up slice] (+ residual) written by the
    kernel's epilogue, rounded where eager rounds (the projection, silu, the product)."""
    x, w, b, _ = _inputs(rows, k, n, torch.bfloat16, bias, False, rows + n)
    width = gate[2]
    r = torch.randn(rows, width, device="cuda", dtype=torch.bfloat16) if residual else None
    assert mma_takes(x, w, b, residual=r, gate=gate)
    out = decode_linear_mma(x, w, b, pdl, residual=r, gate=gate, config=config)
    y = _expected(x, w, b, None)
    expected = torch.nn.functional.silu(y[:, gate[0]:gate[0] + width]) * y[:, gate[1]:gate[1] + width]
    assert out.shape == (rows, width) and not out.isnan().any()
    assert _error(out, expected if r is None else expected + r) < 1e-2
    assert not mma_takes(x, w, b, gate=[n - width + 1, 0, width])  # a slice past the weight's rows
    assert not mma_takes(x, w, b, residual=torch.randn(rows, n, device="cuda", dtype=torch.bfloat16)[:, :width + 1],
                         gate=gate)  # a residual of another shape


def test_leading_dims_and_a_noncontiguous_input():
    x, w, b, _ = _inputs(12, 1024, 512, torch.bfloat16, True, False, 3)
    x3 = x.view(3, 4, 1024).transpose(0, 1)  # (4, 3, 1024), not contiguous
    out = decode_linear_mma(x3, w, b, False)
    assert out.shape == (4, 3, 512)
    assert _error(out, _expected(x3.reshape(-1, 1024), w, b, None).view(4, 3, 512)) < 1e-2


def test_what_the_path_declines():
    x, w, _, _ = _inputs(8, 2048, 256, torch.bfloat16, False, False, 4)
    assert mma_takes(x, w)
    assert not mma_takes(x.float(), w.float())  # float32: cuBLAS
    assert not mma_takes(torch.cat([x] * 5), w)  # 40 rows: cuBLAS
    assert not mma_takes(x[:, :2000].contiguous(), w[:, :2000].contiguous())  # K not a multiple of 64
    assert not mma_takes(x, w.t().contiguous().t())  # a weight it would have to copy every call
    odd = torch.empty(256 * 2048 + 1, device="cuda", dtype=torch.bfloat16)[1:].view(256, 2048)
    assert not mma_takes(x, odd)  # a weight not 16-byte aligned
    unaligned_x = torch.empty(8 * 2048 + 1, device="cuda", dtype=torch.bfloat16)[1:].view(8, 2048).copy_(x)
    assert mma_takes(unaligned_x, w)  # x is copied to an aligned buffer instead
    assert _error(decode_linear_mma(unaligned_x, w, None, False), _expected(x, w, None, None)) < 1e-2


def test_a_chain_with_dependent_launch_in_a_cuda_graph_reads_each_input_complete():
    """8 rows through the CUDA path directly (the Triton kernel's test runs the same chain at one row)."""
    assert_dependent_launch_chain_reads_each_input_complete(
        lambda h, w: decode_linear_mma(h, w, None, True), rows=8)


@pytest.mark.parametrize("mode,prologue_rows,gate,batch", [("full", 1, False, 4), ("none", 1, False, 4),
                                                           ("full", 8, False, 4), ("full", 1, True, 4),
                                                           ("full", 1, False, 24)])
def test_hf_llama_in_bfloat16_at_small_batches_runs_the_path_fused_and_matches_eager(monkeypatch, mode, prologue_rows,
                                                                               gate, batch):
    """A decode step of 4 (and 24: three n-tiles) sequences: every projection runs the CUDA path, with the layer's residual adds
    inside (and its norms and gate where NORM_ / GATE_PROLOGUE_MAX_ROWS let them in; the gate in gate/up's epilogue
    where it measures faster, on with `gate`), logits equal eager's
    (bfloat16 tolerance), weights scaled in place at step 3 are read."""
    import torch_ext.kernels.decode_linear as op
    import torch_ext.kernels.decode_linear_mma as module

    monkeypatch.setattr(op, "NORM_PROLOGUE_MAX_ROWS", prologue_rows)
    monkeypatch.setattr(op, "GATE_PROLOGUE_MAX_ROWS", prologue_rows)
    monkeypatch.setattr(op, "GATE_EPILOGUE_ROWS", range(1, op.MAX_ROWS + 1))  # untuned; tuned, the tuner decides
    monkeypatch.setattr(op, "GATE_EPILOGUE", gate)
    launches = []
    run = module.decode_linear_mma
    monkeypatch.setattr(module, "decode_linear_mma", lambda *a, **kw: launches.append(1) or run(*a, **kw))
    counters.reset()
    model = hf.cuda_decode_matches_eager(mode, batch=batch, update_weights_at=3, dtype=torch.bfloat16, tol=3e-2,
                                         decode_linear=True)
    layers = model.config.num_hidden_layers
    assert counters.decode_linear_calls == (4 * layers + 1) * counters.graphs_seen
    per_layer = 5 if prologue_rows >= batch else 2 + gate  # two norms and the gate, two residual adds
    assert counters.decode_linear_fusions == per_layer * layers * counters.graphs_seen
    assert launches


def test_a_kernel_that_does_not_compile_leaves_the_calls_to_f_linear(monkeypatch, tmp_path):
    """No NVRTC, or a compile error: said once, and the op runs F.linear (no crash inside a model)."""
    import torch_ext.kernels.decode_linear_mma as module
    from torch_ext import compat

    def broken(source, name):
        raise RuntimeError("nvrtc: error: simulated")

    module._kernel.cache_clear()
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # no compiled module on disk either
    monkeypatch.setattr(compat, "nvrtc_compile", broken)
    try:
        x, w, b, _ = _inputs(4, 256, 128, torch.bfloat16, True, False, 5)
        with pytest.warns(UserWarning, match="did not compile"):
            assert not mma_takes(x, w, b)
        out = torch.ops.torch_ext.decode_linear(x, w, b, False)
        torch.testing.assert_close(out, torch.nn.functional.linear(x, w, b), rtol=0, atol=0)
    finally:
        module._kernel.cache_clear()


_MODULE_CACHE_WORKER = r"""
import sys, time, torch
from torch_ext import compat
from torch_ext.kernels.decode_linear_mma import decode_linear_mma
if sys.argv[1] == "warm":
    def refuse(source, name):
        raise AssertionError("NVRTC called in the warm process")
    compat.nvrtc_compile = refuse
g = torch.Generator(device="cuda").manual_seed(0)
x = torch.randn(8, 2048, device="cuda", dtype=torch.bfloat16, generator=g)
w = torch.randn(4096, 2048, device="cuda", dtype=torch.bfloat16, generator=g) / 2048 ** 0.5
torch.cuda.synchronize()
start = time.perf_counter()
out = decode_linear_mma(x, w, None, True)
torch.cuda.synchronize()
print(time.perf_counter() - start)
torch.save(out.cpu(), sys.argv[2])
"""


def test_a_new_process_loads_the_compiled_kernel_from_disk(tmp_path):
    """The first process compiles the kernel with NVRTC and keeps its cubin under Inductor's cache dir; a
    second one loads it (NVRTC refused there) and computes the same bits."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
    seconds = {}
    for phase in ("cold", "warm"):
        done = subprocess.run([sys.executable, "-W", "error::UserWarning", "-c", _MODULE_CACHE_WORKER, phase,
                               str(tmp_path / f"{phase}.pt")], env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        seconds[phase] = float(done.stdout.strip().splitlines()[-1])
    print(f"first call of a decode_linear CUDA variant: compiled {seconds['cold'] * 1e3:.1f} ms, "
          f"loaded {seconds['warm'] * 1e3:.1f} ms")
    assert torch.equal(torch.load(tmp_path / "cold.pt"), torch.load(tmp_path / "warm.pt"))
    assert len(list((tmp_path / "inductor" / "torch_ext_cuda_modules").iterdir())) == 1
