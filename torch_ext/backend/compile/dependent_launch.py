"""Programmatic dependent launch (PDL) for pieces that run torch_ext's own decode kernels.

torch_ext::decode_linear's kernel loads its weights before the kernel before it has finished, and
torch_ext::decode_attention's kernels launch early behind it (hops/pdl_kernels.py). That overlap
happens only where the kernel before lets its dependents start early, which Inductor's Triton
kernels do under `triton.enable_pdl` (each waits for its predecessor before touching data the
predecessor wrote, and triggers its dependents after that wait). Measured on an H100, HF Llama
16x2048 decode (bench/inference_floor.py, bench/results/inference_floor_pdl_attention_*): batch 1
1.029 ms without Inductor's PDL, 0.933 with it; batch 8 (no decode_linear there) 1.248 and 1.224.

On for a piece that calls either op, on Hopper or newer, where this torch has the option and the
user did not set it (CompileConfig.inductor_options wins).
"""
from __future__ import annotations

import torch
import torch.fx as fx

from torch_ext import compat

OPTION = "triton.enable_pdl"
_OPS = ("decode_linear", "decode_attention")


def dependent_launch_patches(gm: fx.GraphModule, user_options: dict) -> dict:
    """{OPTION: True} for a piece that calls one of torch_ext's decode ops on a GPU that has PDL, else {}."""
    if OPTION in user_options or not compat.has_inductor_pdl() or not _gpu_has_pdl():
        return {}
    ops = {getattr(torch.ops.torch_ext, name).default for name in _OPS if hasattr(torch.ops.torch_ext, name)}
    if not any(n.op == "call_function" and n.target in ops for n in gm.graph.nodes):
        return {}
    return {OPTION: True}


def _gpu_has_pdl() -> bool:
    if not torch.cuda.is_available():
        return False
    from torch_ext.hops.pdl_kernels import has_pdl  # imports Triton: only where a GPU is

    return has_pdl(torch.device("cuda", torch.cuda.current_device()))
