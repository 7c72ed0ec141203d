"""`torch.ops.torch_ext.decode_linear`: F.linear for a few rows (a decode step's projections), at
memory bandwidth.

    decode_linear(x, weight, bias, prefetch) -> F.linear(x, weight, bias)
        x: (..., K) with at most MAX_ROWS rows in all; weight (N, K); bias None or (N,).
        prefetch: the weight is written by no kernel of the graph the call runs in, and a kernel of
        that graph runs before it (the rewrite checks both): the kernel may then load its first
        weight columns before the kernel before it has finished (programmatic dependent launch).

Why: at one row a projection is a GEMV whose kernel is short (2-18 us) and pays a ramp and a tail
each time; cuBLAS's GEMVs ran a chain of Llama-shaped projections at 1.64x the bytes' floor on an
H200, this kernel at 1.38x, and 1.26x when it loads its weights before the previous kernel is done
(bench/pdl_gemv.py, bench/results/pdl_gemv_*). The rewrite that puts the op in place of linear is
torch_ext/backend/rewrite/decode_linear.py.

CUDA runs the Triton kernel where it takes the shapes (a contiguous weight, K a multiple of 64, a
float dtype shared by x, weight and bias); everything else runs F.linear.
"""
from __future__ import annotations

import functools

import torch

from torch_ext.hops.fused_add_rms_norm import has_triton

__all__ = ["MAX_ROWS", "decode_linear", "decode_linear_triton", "kernel_takes"]

# Rows (batch x tokens) the kernel serves; more run F.linear. H100, a chain of Llama projections
# (bench/decode_linear_op.py): one row 0.83x cuBLAS's time, two 1.02x, four 1.30x, eight 1.35x.
MAX_ROWS = 1
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@torch.library.custom_op("torch_ext::decode_linear", mutates_args=())
def decode_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, prefetch: bool) -> torch.Tensor:
    """Every device without the kernel: F.linear."""
    return torch.nn.functional.linear(x, weight, bias)


@decode_linear.register_fake
def _(x, weight, bias, prefetch):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@decode_linear.register_kernel("cuda")
def _(x, weight, bias, prefetch):
    if not (has_triton() and kernel_takes(x, weight, bias)):
        return torch.nn.functional.linear(x, weight, bias)
    from torch_ext.hops.pdl_kernels import has_pdl

    return decode_linear_triton(x, weight, bias, prefetch and has_pdl(x.device))


def kernel_takes(x, weight, bias) -> bool:
    """Shapes and layouts the kernel serves (the op falls back to F.linear on the rest)."""
    k = x.shape[-1]
    rows = x.numel() // k if k else 0
    return (0 < rows <= MAX_ROWS and weight.dim() == 2 and weight.shape[1] == k and k % 64 == 0
            and weight.is_contiguous() and x.dtype in _DTYPES and weight.dtype == x.dtype
            and (bias is None or (bias.dim() == 1 and bias.dtype == x.dtype and bias.is_contiguous()
                                  and bias.shape[0] == weight.shape[0])))


@functools.lru_cache(maxsize=None)
def config(rows: int, k: int, dtype: torch.dtype, path: str | None = None) -> dict:
    """Launch config. One row ("row"): the best of bench/pdl_gemv.py's sweep on an H200 (2 features x
    512 columns a tile, the first 2048 loaded before the wait, 4 warps). A few rows: 16-bit inputs on
    tensor cores ("dot", rows padded to 16; float32 would be tf32), float32 with each row a vector
    against the tile in registers ("rows"). Cached: the caller copies it."""
    import triton

    path = path or ("row" if rows == 1 else ("rows" if dtype == torch.float32 else "dot"))
    if path == "dot" and dtype == torch.float32:
        path = "rows"
    block_k = next(b for b in (512, 256, 128, 64) if k % b == 0)
    if path == "dot":  # the best of --dot-configs on an H100 at 8 rows: 32 x 256, 5 stages (1.00x cuBLAS)
        block_k = min(block_k, 256)
        return dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=block_k, PRE_K=block_k, PATH=path, num_warps=4, num_stages=5)
    block_m = 1 if path == "row" else triton.next_power_of_2(rows)
    pre_k = max(block_k, min(1 << (k.bit_length() - 1), 2048))  # a power of two <= k: a multiple of block_k
    return dict(BLOCK_M=block_m, BLOCK_N=2, BLOCK_K=block_k, PRE_K=pre_k, PATH=path, num_warps=4)


def decode_linear_triton(x, weight, bias, pdl: bool, path: str | None = None,
                         overrides: dict | None = None) -> torch.Tensor:
    """The Triton path (also on CPU tensors under TRITON_INTERPRET=1, with pdl False, for tests); path
    and overrides (launch config entries) replace the kernel's choice (bench/decode_linear_op.py)."""
    import triton

    from torch_ext.hops.decode_linear_kernels import decode_linear_kernel
    from torch_ext.hops.pdl_kernels import launch_options

    n, k = weight.shape
    x2 = x.reshape(-1, k)
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    rows = x2.shape[0]
    y = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    cfg = {**config(rows, k, x.dtype, path), **(overrides or {})}
    decode_linear_kernel[(triton.cdiv(n, cfg["BLOCK_N"]),)](
        x2, weight, bias if bias is not None else weight, y, rows, n, K=k, HAS_BIAS=bias is not None, PDL=pdl, **cfg,
        **launch_options(pdl))
    return y.view(*x.shape[:-1], n)
