"""torch_ext::skinny_linear (hops/skinny_linear.py): F.linear for a few rows, one pass over the weight.

The Triton kernel is checked against a float64 reference under TRITON_INTERPRET=1 (a subprocess: the
variable must be set before Triton loads; the interpreter's bf16 matrix product is wrong, so rows > 1
are checked in fp16 there) and on a GPU in tests/test_skinny_linear_gpu.py."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import torch_ext.hops.skinny_linear  # noqa: F401  (registers the op)

KERNEL_CHECK = r'''
import torch
from torch_ext.hops.skinny_linear import skinny_linear_triton, SkinnyConfig
torch.manual_seed(0)
small = SkinnyConfig(block_n=16, block_k=64, num_warps=4, num_stages=1)
cases = [((1, 200), 70, torch.bfloat16, False), ((1, 1, 130), 33, torch.float16, True),
         ((3, 200), 70, torch.float16, False), ((2, 3, 96), 40, torch.float16, True),
         ((17, 64), 16, torch.float16, True), ((64, 80), 20, torch.float16, False)]
worst = 0.0
for shape, n, dtype, bias in cases:
    x = torch.randn(*shape[:-1], shape[-1] + 6, dtype=dtype)[..., 3:-3]  # rows with a stride of their own
    w = torch.randn(n, shape[-1], dtype=dtype)
    b = torch.randn(n, dtype=dtype) if bias else None
    out = skinny_linear_triton(x, w, b, small)
    expected = torch.nn.functional.linear(x.double(), w.double(), b.double() if bias else None)
    assert out.shape == expected.shape and out.dtype == dtype, (shape, out.shape)
    assert not out.isnan().any()
    err = ((out.double() - expected).norm() / expected.norm()).item()
    assert err < 5e-3, (shape, n, dtype, bias, err)
    worst = max(worst, err)
print("WORST", worst)
'''


def test_triton_kernel_equals_a_float64_reference_in_the_interpreter():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-c", KERNEL_CHECK], capture_output=True, text=True, env=env, timeout=600)
    if done.returncode and "only 0-dimensional arrays can be converted to Python scalars" in done.stderr:
        pytest.skip("this Triton's CPU interpreter cannot run a loop over an int argument with this NumPy")
    assert done.returncode == 0 and "WORST" in done.stdout, done.stdout[-2000:] + done.stderr[-4000:]


def test_op_is_linear_off_cuda_and_traces_with_its_fake():
    x, w, b = torch.randn(2, 3, 8), torch.randn(5, 8), torch.randn(5)
    assert torch.equal(torch.ops.torch_ext.skinny_linear(x, w, b), torch.nn.functional.linear(x, w, b))
    compiled = torch.compile(lambda x, w: torch.ops.torch_ext.skinny_linear(x, w, None).relu(), backend="aot_eager",
                             fullgraph=True)
    assert torch.equal(compiled(x, w), torch.nn.functional.linear(x, w).relu())

