"""`torch.ops.torch_ext.skinny_linear`: `F.linear` for inputs of a few rows (a decode step), reading the
weight once at memory bandwidth.

    skinny_linear(x, weight, bias) -> out
        x: (..., K) with at most MAX_ROWS rows in all; weight: (N, K); bias: None or (N,)
        out = x @ weight.T + bias: (..., N), x's dtype

Why: a decode step is a chain of matrix-vector products whose weights are most of the bytes it
reads. cuBLAS picks GEMM tiles made for many rows, so at one to a few dozen rows it reads the weight
well under the copy bandwidth (H100, HF Llama 16x2048, batch 1: ~880 us of projections for weights
worth 590 us). Here every program owns BLOCK_N output columns and walks K with all rows at once, so
each weight byte is read once, in wide coalesced loads along K.

CUDA runs the Triton kernel for bf16/fp16 with rows <= MAX_ROWS; every other case runs F.linear.
"""
from __future__ import annotations

import dataclasses
import functools

import torch

from torch_ext.hops.fused_add_rms_norm import has_triton

__all__ = ["MAX_ROWS", "SkinnyConfig", "skinny_linear", "skinny_linear_triton", "default_config"]

MAX_ROWS = 64  # one program holds every row: more rows would re-read the weight per row block


@dataclasses.dataclass(frozen=True)
class SkinnyConfig:
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def default_config(rows: int, n: int, k: int) -> SkinnyConfig:
    """Tiles by the row count (bench/skinny_linear.py measures the alternatives)."""
    if rows == 1:
        return SkinnyConfig(block_n=16, block_k=256, num_warps=4, num_stages=3)
    return SkinnyConfig(block_n=32, block_k=128, num_warps=4, num_stages=3)


@torch.library.custom_op("torch_ext::skinny_linear", mutates_args=())
def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Every device without a dedicated kernel: F.linear."""
    return torch.nn.functional.linear(x, weight, bias)


@skinny_linear.register_fake
def _(x, weight, bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@skinny_linear.register_kernel("cuda")
def _(x, weight, bias):
    if not _triton_takes(x, weight, bias):
        return torch.nn.functional.linear(x, weight, bias)
    return skinny_linear_triton(x, weight, bias)


def _triton_takes(x, weight, bias) -> bool:
    rows = x.numel() // max(x.shape[-1], 1)
    return (has_triton() and 0 < rows <= MAX_ROWS and x.dtype in (torch.float16, torch.bfloat16)
            and weight.dtype == x.dtype and weight.dim() == 2 and weight.shape[1] == x.shape[-1]
            and (bias is None or (bias.dtype == x.dtype and bias.shape == (weight.shape[0],))))


def skinny_linear_triton(x, weight, bias, config: SkinnyConfig | None = None) -> torch.Tensor:
    """The Triton path (also on CPU tensors under TRITON_INTERPRET=1, for tests)."""
    import triton

    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    rows, n = x2.shape[0], weight.shape[0]
    config = config or default_config(rows, n, k)
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    block_m = 1 if rows == 1 else max(16, triton.next_power_of_2(rows))
    _kernel()[(triton.cdiv(n, config.block_n),)](
        x2, weight, bias if bias is not None else weight, out, rows, n, k,
        x2.stride(0), x2.stride(1), weight.stride(0), weight.stride(1), out.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        num_warps=config.num_warps, num_stages=config.num_stages)
    return out.reshape(*x.shape[:-1], n)


@functools.cache
def _kernel():
    # Defined lazily: importing this module must not need Triton.
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(x, w, bias, out, M, N, K, sx_m, sx_k, sw_n, sw_k, so_m,
               HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        cols_ok = cols < N
        ks = tl.arange(0, BLOCK_K)
        w_rows = w + cols[:, None].to(tl.int64) * sw_n
        if BLOCK_M == 1:
            # One row: products summed along K at the end, no matrix unit (it would idle 15/16).
            acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
            for k0 in range(0, K, BLOCK_K):
                kk = k0 + ks
                k_ok = kk < K
                wt = tl.load(w_rows + kk[None, :] * sw_k, mask=cols_ok[:, None] & k_ok[None, :], other=0.0)
                xv = tl.load(x + kk * sx_k, mask=k_ok, other=0.0)
                acc += wt.to(tl.float32) * xv.to(tl.float32)[None, :]
            result = tl.sum(acc, axis=1)[None, :]
            rows = tl.arange(0, 1)
        else:
            rows = tl.arange(0, BLOCK_M)
            rows_ok = rows < M
            result = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for k0 in range(0, K, BLOCK_K):
                kk = k0 + ks
                k_ok = kk < K
                wt = tl.load(w_rows + kk[None, :] * sw_k, mask=cols_ok[:, None] & k_ok[None, :], other=0.0)
                xt = tl.load(x + rows[:, None] * sx_m + kk[None, :] * sx_k, mask=rows_ok[:, None] & k_ok[None, :],
                             other=0.0)
                result += tl.dot(xt, tl.trans(wt))
        if HAS_BIAS:
            result += tl.load(bias + cols, mask=cols_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(out + rows[:, None] * so_m + cols[None, :], result.to(out.dtype.element_ty),
                 mask=(rows[:, None] < M) & cols_ok[None, :])

    return kernel
