"""`torch.ops.torch_ext.decode_attention`: attention of one query token per sequence over a KV cache,
reading the cache at memory bandwidth (split-KV), with SDPA's semantics.

    decode_attention(q, k, v, mask, scale, config=None) -> out
        q: (B, H, 1, D); k, v: (B or 1, Hkv, L, D), H a multiple of Hkv (grouped-query attention);
        mask: None, or bool (True attends) / additive float, broadcastable to (B, H, 1, L);
        out = softmax(q @ k^T * scale + mask) @ v: (B, H, 1, D), q's dtype.
        config: [kernel (0 per head, 1 grouped), cache positions per tile, warps, pipeline stages,
        programs to aim for], as measured for the shape on this GPU (kernels/decode_attention_tuning.py);
        None: the table below.

Why: a decode step's SDPA runs a prefill kernel for one query row, whose B*H programs leave most of
the GPU idle while each walks the whole cache (H100, HF Llama 16x2048, batch 1: 130 us for ~16 us of
KV bytes). Here L is split across programs (grid B*H x splits; with grouped heads B*Hkv x splits, a
program serving the query heads of one kv head, so the cache is read once): each reduces its chunk
with an online softmax into a float32 partial, and a second launch combines the partials (none where B*H alone fills
the GPU: one split, whose program writes the output). The rewrite that puts this
op in place of SDPA is torch_ext/backend/rewrite/decode_attention.py.

CUDA runs the Triton kernels (head dims up to 256); every other device, and shapes the kernels do not
take, run SDPA itself. A fully masked row gives zeros, as SDPA does.
"""
from __future__ import annotations

import dataclasses

import torch

from torch_ext.kernels.fused_add_rms_norm import has_triton
from torch_ext.kernels.launch_policy import runs_reference

__all__ = ["Launch", "checked_config", "decode_attention", "decode_attention_reference", "decode_attention_triton",
           "default_launch"]

_TARGET_PROGRAMS = 264  # about two waves of an H100's 132 SMs
# Per kernel: (cache positions per tile, warps, pipeline stages). The best of a sweep over 32/64/128 x
# 2/4/8 x 1/2/3 on an H200 (`bench/dev/decode_attention_op.py --sweep`, bench/results/decode_attention_sweep*):
# stages 2 or 3 beat Triton's default by up to 10%; the per-head kernel wants small tiles where each row
# is one program walking its whole cache (21 vs 24 us at 32x16x16x256), large ones where rows split it
# (37 vs 47 us at 8x16x16x2048).
# Grouped heads over few rows (batch x kv heads <= 128: each row splits the cache into many long
# programs) want a third stage: 13.0 against 15.0 us at 8x32x4x2048, 130.8 against 138.2 at 32x32x4x8192;
# with more rows the programs compete for shared memory and it loses (149.7 against 125.8 at 32x32x16x2048,
# 79.3 against 66.9 for MHA at 8x32x32x2048; bench/results/decode_attention_grouped_64_4_3_h200_torch2.11.log).
# Only up to head dim 128: three stages of k and v tiles at 256 (Gemma) would take 192 KiB of shared
# memory, more than an A100 has and most of a Hopper's.
_CONFIG = {"grouped": (64, 4, 2), "grouped_few_rows": (64, 4, 3), "per_head": (64, 4, 2),
           "per_head_one_split": (32, 2, 2)}
_FEW_ROWS, _FEW_ROWS_MAX_HEAD_DIM = 128, 128
# Heads with a kv head each (MHA) through the grouped kernel too where their rows fill the GPU: one
# real row of its 16-row tl.dot, the scores and the weighted sum on tensor cores instead of per-slot
# CUDA-core accumulators (H200, 32 heads x 2048 positions: 66.9 against 79.8 us at batch 8, FlashInfer's
# decode kernel 63.7), but not a batch of one, whose 32 rows split the cache (43.4 against 38.7 us at 8192
# positions; bench/results/decode_attention_flashinfer_tc_h200_torch2.11.log). None: that rule;
# True / False: always / never (the benches' comparisons).
MHA_ON_TENSOR_CORES: bool | None = None
_MHA_TENSOR_CORE_ROWS = 128


def grouped(b: int, h: int, hkv: int) -> bool:
    """Whether a launch takes the grouped (tensor-core) kernel: grouped heads, or MHA rows enough."""
    if h > hkv:
        return True
    return b * h >= _MHA_TENSOR_CORE_ROWS if MHA_ON_TENSOR_CORES is None else MHA_ON_TENSOR_CORES


def config_kind(b: int, h: int, hkv: int, d: int = 128) -> str:
    """Which _CONFIG entry a launch takes: the grouped kernel (over few rows or not), or the per-head
    one with rows that split the cache or rows that are one program each (as many as the target: one
    split)."""
    if grouped(b, h, hkv):
        few = h > hkv and b * hkv <= _FEW_ROWS and d <= _FEW_ROWS_MAX_HEAD_DIM
        return "grouped_few_rows" if few else "grouped"
    return "per_head" if b * h < _TARGET_PROGRAMS else "per_head_one_split"


@dataclasses.dataclass(frozen=True)
class Launch:
    """How the Triton path runs one shape: the op's `config` argument, decoded."""
    grouped: bool  # the grouped (tensor-core) kernel; else the per-head one (any grouping: reads per head)
    block_n: int  # cache positions per tile
    warps: int
    stages: int
    programs: int  # the split-KV grid aims for about this many programs

    def encode(self) -> list[int]:
        return [int(self.grouped), self.block_n, self.warps, self.stages, self.programs]


def default_launch(b: int, h: int, hkv: int, d: int = 128) -> Launch:
    """The table's launch for a shape (config None)."""
    kind = config_kind(b, h, hkv, d)
    return Launch(kind.startswith("grouped"), *_CONFIG[kind], _TARGET_PROGRAMS)


def _power_of_2(n) -> bool:
    return isinstance(n, int) and n > 0 and n & (n - 1) == 0


def checked_config(config: list[int] | None) -> Launch | None:
    """The op's `config` argument as a Launch; a value no kernel can launch is an error naming it."""
    if config is None:
        return None
    ok = (isinstance(config, (list, tuple)) and len(config) == 5 and config[0] in (0, 1)
          and _power_of_2(config[1]) and 16 <= config[1] <= 256 and _power_of_2(config[2]) and config[2] <= 16
          and isinstance(config[3], int) and 1 <= config[3] <= 5 and isinstance(config[4], int) and config[4] >= 1)
    if not ok:
        raise ValueError(f"torch_ext::decode_attention: config {config!r} is not [kernel 0 or 1, positions per "
                         "tile (a power of 2, 16-256), warps (a power of 2, at most 16), stages (1-5), programs "
                         "(at least 1)]; pass None for the built-in table")
    return Launch(bool(config[0]), *config[1:])


def decode_attention_reference(q, k, v, mask, scale: float) -> torch.Tensor:
    """SDPA with the op's arguments (grouped heads repeated): what the op computes."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


@torch.library.custom_op("torch_ext::decode_attention", mutates_args=())
def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                     scale: float, config: list[int] | None = None) -> torch.Tensor:
    """Every device without a dedicated kernel: SDPA."""
    return decode_attention_reference(q, k, v, mask, scale)


@decode_attention.register_fake
def _(q, k, v, mask, scale, config=None):
    checked_config(config)  # a config no kernel launches fails at compile time
    return torch.empty_like(q, memory_format=torch.contiguous_format)


@decode_attention.register_kernel("cuda")
def _(q, k, v, mask, scale, config=None):
    if runs_reference("decode_attention") or not _triton_takes(q, k, v, mask):
        return decode_attention_reference(q, k, v, mask, scale)
    return decode_attention_triton(q, k, v, mask, scale, checked_config(config))


def _triton_takes(q, k, v, mask) -> bool:
    d = q.shape[-1]
    return (has_triton() and q.shape[2] == 1 and d <= 256 and d == k.shape[-1] == v.shape[-1]
            and q.dtype in (torch.float16, torch.bfloat16, torch.float32) and k.dtype == v.dtype == q.dtype
            and q.shape[1] % k.shape[1] == 0 and (mask is None or mask.dim() == 4))


def decode_attention_triton(q, k, v, mask, scale: float, launch: Launch | None = None) -> torch.Tensor:
    """The Triton path (also on CPU tensors under TRITON_INTERPRET=1, for tests); launch: the table's
    where None."""
    import triton

    b, h, _, d = q.shape
    hkv, length = k.shape[1], k.shape[2]
    if length == 0:  # nothing to attend to: zeros, as SDPA gives
        return q.new_zeros((b, h, 1, d))
    # SDPA broadcasts a batch of one; the kernels index k and v by q's batch (stride 0 reads it again).
    k, v = k.expand(b, hkv, length, d), v.expand(b, hkv, length, d)
    out = torch.empty((b, h, 1, d), dtype=q.dtype, device=q.device)
    groups = h // hkv
    # Grouped heads: one program serves the query heads of one kv head, so each cache byte is read once
    # (a program per query head read it `groups` times: 4.3x the cache's bytes, H100, 4 of 16 heads).
    launch = launch or default_launch(b, h, hkv, d)
    rows = b * hkv if launch.grouped else b * h  # programs of the grid's first axis
    block_n, warps, stages = launch.block_n, launch.warps, launch.stages
    tiles = triton.cdiv(length, block_n)
    splits = max(1, min(tiles, triton.cdiv(launch.programs, rows)))
    per_split = triton.cdiv(tiles, splits) * block_n
    splits = triton.cdiv(length, per_split)
    # One split: no partials (the kernel writes `out`; the argument is unused).
    partial = torch.empty((b * h, splits, d + 2), dtype=torch.float32, device=q.device) if splits > 1 else out
    if mask is not None:
        mask = mask.expand(b, h, 1, length)  # stride 0 where it broadcasts: read once per row
        ms, is_bool = mask.stride(), mask.dtype == torch.bool
    else:
        ms, is_bool = (0, 0, 0, 0), False
    partial_kernel, grouped_kernel, combine_kernel = _kernels()
    from torch_ext.kernels.pdl_kernels import has_pdl, launch_options

    # Launched early behind the kernel before (PDL, Hopper+); each waits for it before reading anything.
    pdl = q.is_cuda and has_pdl(q.device)
    options = launch_options(pdl)
    block_d = triton.next_power_of_2(d)
    direct = splits == 1  # one split per row (the rows fill the GPU): the partial kernel writes the output
    args = (q, k, v, mask if mask is not None else q, partial, out, scale * 1.4426950408889634,  # exp2 of log2(e)-scaled scores
            q.stride(0), q.stride(1), q.stride(3), k.stride(0), k.stride(1), k.stride(2), k.stride(3),
            v.stride(0), v.stride(1), v.stride(2), v.stride(3), ms[0], ms[1], ms[3], out.stride(0), out.stride(1),
            h, groups, length, per_split, d, splits)
    flags = dict(HAS_MASK=mask is not None, BOOL_MASK=is_bool, DIRECT=direct, BLOCK_N=block_n, BLOCK_D=block_d,
                 num_warps=warps, num_stages=stages, PDL=pdl, **options)
    if launch.grouped:  # tl.dot needs 16 rows: the group's heads, padded
        flags["BLOCK_D"] = max(16, block_d)  # tl.dot's smallest K
        grouped_kernel[(rows, splits)](*args, BLOCK_G=max(16, triton.next_power_of_2(groups)),
                                       IEEE=q.dtype == torch.float32, **flags)
    else:
        partial_kernel[(rows, splits)](*args, **flags)
    if not direct:
        combine_kernel[(b * h,)](partial, out, out.stride(0), out.stride(1), h, d, splits,
                                 BLOCK_S=triton.next_power_of_2(splits), BLOCK_D=block_d, num_warps=4, PDL=pdl,
                                 **options)
    return out


def _kernels():
    # Imported here: the kernels' module imports Triton, this one must import without it.
    from torch_ext.kernels import decode_attention_kernels as kernels

    return kernels.partial_kernel, kernels.grouped_kernel, kernels.combine_kernel
