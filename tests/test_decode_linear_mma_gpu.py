"""decode_linear's CUDA path (hops/decode_linear_mma.py: weights streamed into mma fragments) on a GPU
against a float64 reference, every launch config shape, with and without programmatic dependent launch,
inside CUDA graphs too; skipped without CUDA."""
from __future__ import annotations

import pytest
import torch

from torch_ext.hops.decode_linear_mma import decode_linear_mma, mma_takes

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
                                               (64, 77, True, True), (320, 33, False, True)])
def test_kernel_equals_a_float64_reference(pdl, dtype, rows, k, n, bias, residual):
    x, w, b, r = _inputs(rows, k, n, dtype, bias, residual, rows * k + n)
    assert mma_takes(x, w, b, r)
    out = decode_linear_mma(x, w, b, pdl, residual=r)
    assert out.shape == (rows, n) and out.dtype == dtype and not out.isnan().any()
    assert _error(out, _expected(x, w, b, r)) < 1e-2


@pytest.mark.parametrize("config", [(1, 8, 2), (2, 8, 2), (1, 4, 4), (2, 4, 1), (1, 16, 1), (4, 2, 2)])
@pytest.mark.parametrize("rows", [2, 8, 24])
def test_every_config_shape_gives_the_same_answer(config, rows):
    """Features a block (16 x m-tiles), warps and chunks in flight change who adds what; K = 5632 is 88
    chunks, a multiple of none of the warp counts x chunks in flight, and N = 2056 ends in a part tile."""
    x, w, b, r = _inputs(rows, 5632, 2056, torch.bfloat16, True, True, rows)
    out = decode_linear_mma(x, w, b, True, residual=r, config=config)
    assert _error(out, _expected(x, w, b, r)) < 1e-2


def test_leading_dims_and_a_noncontiguous_input():
    x, w, b, _ = _inputs(12, 1024, 512, torch.bfloat16, True, False, 3)
    x3 = x.view(3, 4, 1024).transpose(0, 1)  # (4, 3, 1024), not contiguous
    out = decode_linear_mma(x3, w, b, False)
    assert out.shape == (4, 3, 512)
    assert _error(out, _expected(x3.reshape(-1, 1024), w, b, None).view(4, 3, 512)) < 1e-2


def test_what_the_path_declines():
    x, w, _, _ = _inputs(8, 2048, 256, torch.bfloat16, False, False, 4)
    assert not mma_takes(x.float(), w.float(), None, None)  # float32: the Triton paths
    assert not mma_takes(torch.cat([x] * 5), w, None, None)  # 40 rows: cuBLAS
    assert not mma_takes(x[:, :2000], w[:, :2000], None, None)  # K not a multiple of 64
    odd = torch.empty(8 * 2048 + 1, device="cuda", dtype=torch.bfloat16)[1:].view(8, 2048)
    assert not mma_takes(odd, w, None, None)  # x not 16-byte aligned


def test_a_chain_with_dependent_launch_in_a_cuda_graph_reads_each_input_complete():
    """Linears that load their weights before the kernel before them finishes, reading the previous
    one's output directly or through a pointwise kernel, captured and replayed on fresh inputs: a read
    of an input before it is written would show as a moving error."""
    g = torch.Generator(device="cuda").manual_seed(0)
    weights = [torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16, generator=g) / 2048 ** 0.5
               for _ in range(6)]
    x = torch.empty(8, 2048, device="cuda", dtype=torch.bfloat16)

    def chain(linear=lambda h, w: decode_linear_mma(h, w, None, True), h=x):
        for i, w in enumerate(weights):  # every other linear reads the one before it directly
            h = linear(torch.tanh(h) * 2 if i % 2 == 0 else h, w)
        return h

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        chain()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain()
    for _ in range(20):
        x.copy_(torch.randn(8, 2048, device="cuda", dtype=torch.bfloat16, generator=g))
        graph.replay()
        ref = chain(lambda h, w: torch.nn.functional.linear(h, w.double()), x.double())
        assert ((out.double() - ref).norm() / ref.norm()).item() < 2e-2
