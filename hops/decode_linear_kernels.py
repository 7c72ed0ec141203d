"""Triton kernel of torch_ext::decode_linear (hops/decode_linear.py); imported only where it runs.

A program owns BLOCK_N output features of all M (<= 8) rows: it streams those rows of the weight once,
BLOCK_K columns at a time, reducing in float32. Its first PRE_K columns are loaded before
`wait_then_release` (hops/pdl_kernels.py): the weights depend on no earlier kernel of the graph, so
under programmatic dependent launch they are in flight while the previous kernel drains; x, the
bias and the output are touched only after the wait.

PATH: "row" (one row: a weight tile times a vector), "rows" (a few rows, each a weight tile times a
vector, the tile loaded once), "dot" (16-bit inputs, rows padded to 16: tensor cores).
"""
from __future__ import annotations

import triton
import triton.language as tl

from torch_ext.hops.pdl_kernels import wait_then_release


@triton.jit
def _tile_times_rows(acc, w, x_ptr, cols, M, K: tl.constexpr, BLOCK_M: tl.constexpr, PATH: tl.constexpr):
    """acc (BLOCK_M, BLOCK_N) += x[:, cols] @ w.T for the weight tile w (BLOCK_N, len(cols))."""
    if PATH == "row":
        x = tl.load(x_ptr + cols).to(tl.float32)
        acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)[None, :]
    elif PATH == "dot":
        rows = tl.arange(0, BLOCK_M)
        x = tl.load(x_ptr + rows[:, None] * K + cols[None, :], mask=(rows < M)[:, None], other=0.0)
        acc += tl.dot(x, tl.trans(w))
    else:
        rows = tl.arange(0, BLOCK_M)
        wf = w.to(tl.float32)
        for m in tl.static_range(BLOCK_M):
            if m < M:
                x = tl.load(x_ptr + m * K + cols).to(tl.float32)
                acc += tl.where(rows[:, None] == m, tl.sum(wf * x[None, :], axis=1)[None, :], 0.0)
    return acc


@triton.jit
def decode_linear_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K: tl.constexpr, HAS_BIAS: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         PRE_K: tl.constexpr, PDL: tl.constexpr, PATH: tl.constexpr):
    features = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    live = features < N
    pre_cols = tl.arange(0, PRE_K)
    w_pre = tl.load(w_ptr + features[:, None] * K + pre_cols[None, :], mask=live[:, None], other=0.0)
    wait_then_release(PDL)  # x is complete, y is ours to write
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc = _tile_times_rows(acc, w_pre, x_ptr, pre_cols, M, K, BLOCK_M, PATH)
    for k0 in range(PRE_K, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + features[:, None] * K + cols[None, :], mask=live[:, None], other=0.0)
        acc = _tile_times_rows(acc, w, x_ptr, cols, M, K, BLOCK_M, PATH)
    if HAS_BIAS:
        acc += tl.load(b_ptr + features, mask=live, other=0.0).to(tl.float32)[None, :]
    out_rows = tl.arange(0, BLOCK_M)
    tl.store(y_ptr + out_rows[:, None] * N + features[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(out_rows < M)[:, None] & live[None, :])
