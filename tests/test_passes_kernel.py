"""The Triton kernel of torch_ext::fused_add_rms_norm: on CUDA, and in Triton's CPU interpreter."""
import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from torch_ext.kernels.fused_add_rms_norm import fused_add_rms_norm_reference

OP = torch.ops.torch_ext.fused_add_rms_norm.default
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

INTERPRETER_CHECK = textwrap.dedent(
    """
    import torch, triton
    from torch_ext.kernels import fused_add_rms_norm as m

    def trunc_bf16(t):  # the interpreter casts fp32 -> bf16 by truncation; GPUs round to nearest
        return (t.float().view(torch.int32) & ~0xFFFF).view(torch.float32).to(torch.bfloat16)

    kernel = m._triton_kernel()
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for rows, cols in ((3, 2048), (5, 100)):
            x, r = torch.randn(rows, cols, dtype=dtype), torch.randn(rows, cols, dtype=dtype)
            w = torch.rand(cols, dtype=dtype) + 0.5
            if dtype is torch.bfloat16:
                s = trunc_bf16(x.float() + r.float())
                h = s.float()
                n = trunc_bf16(h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6))
                y = trunc_bf16(n.float() * w.float())
            else:
                y, s = m.fused_add_rms_norm_reference(x, r, w, 1e-6)
            x2, r2 = x.clone(), r.clone()
            block = triton.next_power_of_2(cols)
            kernel[(rows,)](x2, r2, w, x2.stride(0), r2.stride(0), cols, 1e-6, BLOCK=block)
            assert torch.equal(r2, s), (dtype, rows, cols)
            # numpy and torch sum the row in different orders: the fp32 norm may differ in its last
            # bits, which can move a 16-bit result by one unit in the last place, never more.
            ulp = 1e-6 if dtype is torch.float32 else torch.finfo(dtype).eps
            torch.testing.assert_close(x2, y, rtol=ulp, atol=1e-6)
    print("ok")
    """
)


def test_triton_kernel_in_interpreter():
    for module in ("triton", "numpy"):  # the interpreter runs on numpy
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"needs {module}")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run(
        [sys.executable, "-c", INTERPRETER_CHECK], env=env, capture_output=True, text=True
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(7, 2048), (2, 3, 100), (1, 4096)])
def test_cuda_kernel_matches_reference(dtype, shape):
    x = torch.randn(shape, dtype=dtype, device="cuda")
    res = torch.randn(shape, dtype=dtype, device="cuda")
    w = torch.rand(shape[-1], dtype=dtype, device="cuda") + 0.5
    y_ref, r_ref = fused_add_rms_norm_reference(x, res, w, 1e-6)
    OP(x, res, w, 1e-6)
    torch.testing.assert_close(res, r_ref, rtol=0, atol=0)
    # Same rounding points as eager; only the order of the fp32 reduction differs.
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(x, y_ref, rtol=tol, atol=tol)


@pytest.mark.gpu
@needs_cuda
def test_cuda_odd_layout_takes_the_reference_path():
    base = torch.randn(8, 64, device="cuda")
    x = base.t()  # column stride != 1: no row view, the kernel cannot run
    res = torch.randn(64, 8, device="cuda")
    w = torch.rand(8, device="cuda")
    y_ref, r_ref = fused_add_rms_norm_reference(x, res, w, 1e-6)
    OP(x, res, w, 1e-6)
    torch.testing.assert_close(base.t(), y_ref)
    torch.testing.assert_close(res, r_ref)
