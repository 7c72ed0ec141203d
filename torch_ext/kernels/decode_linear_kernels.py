"""Triton kernel of torch_ext::decode_linear (kernels/decode_linear.py); imported only where it runs.

A program owns BLOCK_N output features of the one row: it streams those rows of the weight once,
BLOCK_K columns at a time, reducing in float32. Its first PRE_K columns are loaded before
`wait_then_release` (kernels/pdl_kernels.py): the weights depend on no earlier kernel of the graph, so
under programmatic dependent launch they are in flight while the previous kernel drains; x, the
bias and the output are touched only after the wait.

The kernel also fuses what a decode layer runs around its projections (the op's docstring):
NORM, an RMSNorm of x first (each program sums x's squares itself: one row is a few KB from L2);
GATED, silu(x) * up; GATE, a gated MLP's silu(gate) * up over two slices of this projection's outputs
(output j pairs weight rows gate_start + j and up_start + j in one program, so nothing is computed twice);
RESIDUAL, an add after. Each rounds to x's dtype where eager does.
"""
from __future__ import annotations

import triton
import triton.language as tl

from torch_ext.kernels.pdl_kernels import wait_then_release


@triton.jit
def _row_prologue(x_ptr, up_ptr, g_ptr, cols, inv_rms, NORM: tl.constexpr, GATED: tl.constexpr):
    """x[cols] after the fused prologue, in float32 holding x's dtype's values."""
    x = tl.load(x_ptr + cols)
    dtype = x.dtype
    x = x.to(tl.float32)
    if NORM:  # HF's order: normalize in float32, round, then the weight in x's dtype
        x = (x * inv_rms).to(dtype).to(tl.float32)
        x = (tl.load(g_ptr + cols).to(tl.float32) * x).to(dtype).to(tl.float32)
    if GATED:
        x = (x * tl.sigmoid(x)).to(dtype).to(tl.float32)
        x = (x * tl.load(up_ptr + cols).to(tl.float32)).to(dtype).to(tl.float32)
    return x


@triton.jit
def decode_linear_kernel(x_ptr, w_ptr, b_ptr, y_ptr, g_ptr, up_ptr, res_ptr, eps, N, gate_start, up_start,
                         K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         PRE_K: tl.constexpr, PDL: tl.constexpr, NORM: tl.constexpr, GATED: tl.constexpr,
                         RESIDUAL: tl.constexpr, GATE: tl.constexpr):
    outs = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # this program's outputs (N of them in all)
    live = outs < N
    features = outs + gate_start  # weight rows (without GATE gate_start is 0)
    ups = outs + up_start  # GATE: the up rows paired with them
    pre_cols = tl.arange(0, PRE_K)
    w_pre = tl.load(w_ptr + features[:, None] * K + pre_cols[None, :], mask=live[:, None], other=0.0)
    if GATE:
        w_pre_up = tl.load(w_ptr + ups[:, None] * K + pre_cols[None, :], mask=live[:, None], other=0.0)
    wait_then_release(PDL)  # x is complete, y is ours to write
    inv_rms = 1.0
    if NORM:  # the row's mean square
        squares = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k0 in tl.static_range(0, K, BLOCK_K):  # unrolled: the row's loads go out together
            xk = tl.load(x_ptr + k0 + tl.arange(0, BLOCK_K)).to(tl.float32)
            squares += xk * xk
        inv_rms = tl.rsqrt(tl.sum(squares, axis=0) / K + eps)
    # Each tile's names are its own: a variable carried through the loop must keep its shape (PRE_K
    # and BLOCK_K columns differ; the interpreter does not check that, the compiler does).
    x_pre = _row_prologue(x_ptr, up_ptr, g_ptr, pre_cols, inv_rms, NORM, GATED)
    acc = tl.sum(w_pre.to(tl.float32) * x_pre[None, :], axis=1)
    acc_up = acc  # GATE only; the names must exist on every path
    if GATE:
        acc_up = tl.sum(w_pre_up.to(tl.float32) * x_pre[None, :], axis=1)
    for k0 in range(PRE_K, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + features[:, None] * K + cols[None, :], mask=live[:, None], other=0.0)
        x_tile = _row_prologue(x_ptr, up_ptr, g_ptr, cols, inv_rms, NORM, GATED)
        acc += tl.sum(w.to(tl.float32) * x_tile[None, :], axis=1)
        if GATE:
            w_up = tl.load(w_ptr + ups[:, None] * K + cols[None, :], mask=live[:, None], other=0.0)
            acc_up += tl.sum(w_up.to(tl.float32) * x_tile[None, :], axis=1)
    if HAS_BIAS:
        acc += tl.load(b_ptr + features, mask=live, other=0.0).to(tl.float32)
        if GATE:
            acc_up += tl.load(b_ptr + ups, mask=live, other=0.0).to(tl.float32)
    out = acc.to(y_ptr.dtype.element_ty)
    if GATE:  # eager: the projection rounded, silu of the gate half rounded, times the up half, rounded
        g = out.to(tl.float32)
        g = (g * tl.sigmoid(g)).to(y_ptr.dtype.element_ty).to(tl.float32)
        out = (g * acc_up.to(y_ptr.dtype.element_ty).to(tl.float32)).to(y_ptr.dtype.element_ty)
    if RESIDUAL:  # eager adds the rounded projection to the residual, in y's dtype
        res = tl.load(res_ptr + outs, mask=live, other=0.0)
        out = (out.to(tl.float32) + res.to(tl.float32)).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + outs, out, mask=live)
