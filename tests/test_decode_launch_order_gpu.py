"""compat.early_dependent_launch on a GPU: the Triton kernels Inductor generates under triton.enable_pdl
trigger their dependents right after their first wait inside the context, after their last load
outside it (Inductor's own placement), and compute the same. Skipped without a Hopper+ GPU."""
from __future__ import annotations

import pytest
import torch

from torch_ext import compat

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0) or not compat.has_inductor_pdl(),
    reason="needs a Hopper+ GPU and Inductor's triton.enable_pdl")]

WAIT, LAUNCH = "gdc_wait()", "gdc_launch_dependents()"


def _kernels(code: str) -> list[list[str]]:
    """The generated module's Triton kernels, each as its lines (from its @triton.jit on)."""
    parts = code.split("@triton.jit")[1:]
    return [[line.strip() for line in part.splitlines()] for part in parts]


def _trigger_follows_first_wait(lines: list[str]) -> bool:
    waits = [i for i, line in enumerate(lines) if WAIT in line]
    launches = [i for i, line in enumerate(lines) if LAUNCH in line]
    return bool(waits) and launches == [waits[0] + 1]


def _norm_and_add(x, w, r):
    """A reduction (RMS) and pointwise kernels, as a decode layer has between its projections."""
    h = x.float()
    return (w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)) + r.sin()


def _compiled_code(early: bool, *args):
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    with torch._inductor.config.patch({"triton.enable_pdl": True, "fx_graph_cache": False}):
        if early:
            with compat.early_dependent_launch():
                return run_and_get_code(torch.compile(_norm_and_add), *args)
        return run_and_get_code(torch.compile(_norm_and_add), *args)


def test_inductor_kernels_trigger_right_after_their_first_wait_inside_the_context_only():
    x, r = (torch.randn(8, 2048, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    w = torch.rand(2048, device="cuda", dtype=torch.bfloat16) + 0.5
    late_out, late_code = _compiled_code(False, x, w, r)
    early_out, early_code = _compiled_code(True, x, w, r)
    late = [k for code in late_code for k in _kernels(code) if any(LAUNCH in line for line in k)]
    early = [k for code in early_code for k in _kernels(code) if any(LAUNCH in line for line in k)]
    assert early and len(early) == len(late)
    assert all(_trigger_follows_first_wait(k) for k in early)
    assert not all(_trigger_follows_first_wait(k) for k in late)  # Inductor's own: after the last load
    torch.testing.assert_close(early_out, late_out, rtol=0, atol=0)
    torch.testing.assert_close(early_out, _norm_and_add(x, w, r), rtol=2e-2, atol=2e-2)
