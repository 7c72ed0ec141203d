"""`torch.ops.torch_ext.fused_add_rms_norm`: residual add + RMSNorm in one pass over memory, in place.

    fused_add_rms_norm(x, residual, weight, eps) -> None
        residual <- x + residual                      (the new residual stream)
        x        <- rms_norm(x + residual) * weight   (the normalized activation)

It mutates both inputs (as vLLM's op does) so that, after Inductor re-inplaces the
`auto_functionalized` call the fusion pass inserts, no output buffer is allocated. Numerics follow
the eager formulation the fusion pass matches, rounding where eager rounds:

    r = x + residual                 # in x.dtype
    h = r.float()
    y = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight

CUDA runs a Triton kernel (one program per row); every other device runs the PyTorch reference.
"""
from __future__ import annotations

import functools

import torch

__all__ = ["fused_add_rms_norm", "fused_add_rms_norm_reference"]

# One program holds a whole row in registers; longer rows (which would spill) take the reference.
_MAX_TRITON_COLS = 16384


def fused_add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Out-of-place reference: returns (normalized, new_residual); the formulation the pass matches."""
    r = x + residual
    h = r.float()
    var = h.pow(2).mean(-1, keepdim=True)
    y = (h * torch.rsqrt(var + eps)).to(x.dtype) * weight
    return y, r


def _check_args(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> None:
    # Dtype checks only: shape comparisons on symbolic sizes would add guards when this runs as
    # the fake impl inside a compile; the fusion pass checks shapes before inserting the op.
    if not (x.dtype == residual.dtype == weight.dtype):
        raise ValueError(
            "torch_ext::fused_add_rms_norm needs x, residual and weight of one dtype, got "
            f"{x.dtype}, {residual.dtype}, {weight.dtype}"
        )
    if weight.dim() != 1:
        raise ValueError(f"torch_ext::fused_add_rms_norm needs a 1-D weight, got {weight.dim()}-D")


def _reference_inplace(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> None:
    _check_args(x, residual, weight)
    if x.shape != residual.shape or weight.shape[0] != x.shape[-1]:
        raise ValueError(
            "torch_ext::fused_add_rms_norm: x and residual must have one shape and weight the "
            f"size of their last dim; got {tuple(x.shape)}, {tuple(residual.shape)}, "
            f"{tuple(weight.shape)}"
        )
    y, r = fused_add_rms_norm_reference(x, residual, weight, eps)
    residual.copy_(r)
    x.copy_(y)


@torch.library.custom_op("torch_ext::fused_add_rms_norm", mutates_args=("x", "residual"))
def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> None:
    """Reference implementation (CPU and any device without a dedicated kernel)."""
    _reference_inplace(x, residual, weight, eps)


@fused_add_rms_norm.register_fake
def _(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    _check_args(x, residual, weight)


@fused_add_rms_norm.register_kernel("cuda")
def _(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    _check_args(x, residual, weight)
    n_cols = x.shape[-1]
    x2d = _rows_view(x)
    r2d = _rows_view(residual)
    if (
        x2d is None
        or r2d is None
        or x.shape != residual.shape
        or weight.shape != (n_cols,)
        or not weight.is_contiguous()
        or n_cols > _MAX_TRITON_COLS
        or not has_triton()
    ):
        # Odd layouts: correctness over speed; still writes in place through copy_.
        return _reference_inplace(x, residual, weight, eps)
    if x2d.shape[0] == 0:
        return None
    import triton

    block = triton.next_power_of_2(n_cols)
    # 2048 columns -> 8 warps: 8 bf16 per thread per load, enough bytes in flight per SM.
    num_warps = min(max(block // 256, 1), 16)
    with torch.cuda.device(x.device):
        _triton_kernel()[(x2d.shape[0],)](
            x2d,
            r2d,
            weight,
            x2d.stride(0),
            r2d.stride(0),
            n_cols,
            eps,
            BLOCK=block,
            num_warps=num_warps,
        )
    return None


def _rows_view(t: torch.Tensor) -> torch.Tensor | None:
    """A (rows, cols) view with unit column stride, or None when the layout has none."""
    if t.dim() == 0 or t.stride(-1) != 1:
        return None
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError:
        return None


@functools.cache
def has_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def _triton_kernel():
    # Defined lazily: importing this module must not need Triton (CPU CI has none).
    import triton
    import triton.language as tl

    @triton.jit
    def fused_add_rms_norm_kernel(
        x_ptr, res_ptr, w_ptr, x_row_stride, res_row_stride, n_cols, eps, BLOCK: tl.constexpr
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        x_row = x_ptr + row * x_row_stride
        res_row = res_ptr + row * res_row_stride
        x = tl.load(x_row + cols, mask=mask, other=0.0)
        res = tl.load(res_row + cols, mask=mask, other=0.0)
        # Round the sum to the storage dtype before normalizing, as eager does.
        s = (x.to(tl.float32) + res.to(tl.float32)).to(x.dtype)
        tl.store(res_row + cols, s, mask=mask)
        h = s.to(tl.float32)
        var = tl.sum(h * h, axis=0) / n_cols
        normed = (h * tl.rsqrt(var + eps)).to(x.dtype)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0)
        y = (normed.to(tl.float32) * w.to(tl.float32)).to(x.dtype)
        tl.store(x_row + cols, y, mask=mask)

    return fused_add_rms_norm_kernel
