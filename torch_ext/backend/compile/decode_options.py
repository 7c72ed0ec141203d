"""Inductor options for pieces that run torch_ext's decode kernels: dependent launch and combo kernels.

Programmatic dependent launch (PDL): torch_ext::decode_linear's kernel loads its weights before the
kernel before it has finished, and torch_ext::decode_attention's kernels launch early behind it
(kernels/pdl_kernels.py). That overlap happens only where the kernel before lets its dependents start
early, which Inductor's Triton kernels do under `triton.enable_pdl` (each waits for its predecessor
before touching data the predecessor wrote, and triggers its dependents after its last load). H100, HF
Llama 16x2048 decode (bench/inference_floor.py, bench/results/inference_floor_pdl_attention_*): batch 1
1.029 ms without Inductor's PDL, 0.933 with it; batch 8 (no decode_linear there) 1.248 and 1.224.
Inductor's trigger after the last load comes near a small kernel's end, so our kernel after a norm
still started cold: in pieces compiled with PDL the trigger moves to right after the kernel's first
wait (compat.early_dependent_launch: why that is safe; EARLY_LAUNCH, bench column ext-late-launch).

Combo kernels (`combo_kernels`): between two of our kernels a decode layer has several small
independent pointwise kernels of different sizes (rotary on q, rotary on k with its cache write, the v
cache write, the mask), which Inductor's vertical fusion cannot join; combo kernels run them as one
launch. Same bench (bench/results/inference_floor_combo_*): 214 -> 183 kernels a step, batch 1 0.927 ->
0.904 ms, batch 8 1.226 -> 1.178. Under PDL each sub-kernel still waits before its first load and
triggers after (Inductor's `_filter_pdl`), so the protocol above holds.

Each option is on for a piece that calls either op on a CUDA device (PDL: Hopper or newer) where this
torch has it measured (compat), unless the user's inductor_options set it (CompileConfig wins).
"""
from __future__ import annotations

import contextlib

import torch
import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from torch_ext import compat

PDL_OPTION = "triton.enable_pdl"
COMBO_OPTION = "combo_kernels"
_OPS = ("decode_linear", "decode_attention")
EARLY_LAUNCH = True  # Inductor's kernels in PDL pieces trigger their dependents right after their first wait


def _early_launch(patches: dict) -> bool:
    return EARLY_LAUNCH and bool(patches.get(PDL_OPTION)) and compat.has_inductor_pdl()


def decode_launch_order(patches: dict):
    """The context a piece compiles in: early dependent launch where its options turn PDL on."""
    return compat.early_dependent_launch() if _early_launch(patches) else contextlib.nullcontext()


def keyed_post_pass(patches: dict, post_pass):
    """The post-grad pass to give Inductor: post_pass, wrapped where the launch order moves (the kernels'
    code differs, the graph does not: Inductor's FX-graph cache must not hand back the other order)."""
    return _LaunchOrderKey(post_pass) if _early_launch(patches) else post_pass


class _LaunchOrderKey(CustomGraphPass):
    def __init__(self, inner):
        self.inner = inner

    def __call__(self, graph) -> None:
        if self.inner is not None:
            self.inner(graph)

    def uuid(self):
        """None (Inductor then bypasses its cache) where the inner pass has no key of its own."""
        if self.inner is None:
            return "early-dependent-launch|"
        inner = self.inner.uuid() if hasattr(self.inner, "uuid") else None
        return None if inner is None else f"early-dependent-launch|{inner}"


def decode_piece_patches(gm: fx.GraphModule, user_options: dict) -> dict:
    """The options above that apply to gm (a piece calling one of our decode ops on CUDA), else {}."""
    if not _has_cuda() or not _calls_decode_op(gm):
        return {}
    patches = {}
    if compat.has_inductor_pdl() and _gpu_has_pdl():
        patches[PDL_OPTION] = True
    if compat.combo_kernels_measured():
        patches[COMBO_OPTION] = True
    return {k: v for k, v in patches.items() if k not in user_options}


def _calls_decode_op(gm: fx.GraphModule) -> bool:
    ops = {getattr(torch.ops.torch_ext, name).default for name in _OPS if hasattr(torch.ops.torch_ext, name)}
    return any(n.op == "call_function" and n.target in ops for n in gm.graph.nodes)


def _has_cuda() -> bool:
    return torch.cuda.is_available()


def _gpu_has_pdl() -> bool:
    from torch_ext.kernels.pdl_kernels import has_pdl  # imports Triton: only where a GPU is

    return has_pdl(torch.device("cuda", torch.cuda.current_device()))
