"""Programmatic dependent launch (PDL) for pieces that run torch_ext::decode_linear.

The op's kernel loads its weights before the kernel before it has finished; that overlap happens
only where the kernel before it lets its dependents start early, which Inductor's Triton kernels do
under `triton.enable_pdl` (each waits for its predecessor before touching data the predecessor
wrote, and triggers its dependents after that wait). Measured on an H100, HF Llama 16x2048 decode at
batch 1 (bench/inference_floor.py): 1.045 ms with decode_linear alone, 0.962 with Inductor's PDL as
well; without decode_linear, Inductor's PDL alone gave ~1% (cuBLAS does not take part).

On for a piece that calls the op, on Hopper or newer, where this torch has the option and the user
did not set it (CompileConfig.inductor_options wins).
"""
from __future__ import annotations

import functools

import torch
import torch.fx as fx

from torch_ext import compat

OPTION = "triton.enable_pdl"


def dependent_launch_patches(gm: fx.GraphModule, user_options: dict) -> dict:
    """{OPTION: True} for a piece that calls torch_ext::decode_linear on a GPU that has PDL, else {}."""
    if OPTION in user_options or not compat.has_inductor_pdl() or not _gpu_has_pdl():
        return {}
    op = getattr(torch.ops.torch_ext, "decode_linear", None)
    if op is None or not any(n.op == "call_function" and n.target is op.default for n in gm.graph.nodes):
        return {}
    return {OPTION: True}


@functools.lru_cache(maxsize=None)
def _gpu_has_pdl() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9
