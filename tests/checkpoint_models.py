"""Activation-checkpointed models split at attention, for tests/test_checkpoint_split.py and
bench/checkpoint_training.py: blocks under torch.utils.checkpoint (plain or selective), attention
through SDPA or a custom splitting op, regions nested either way round."""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import backend_models  # noqa: F401  (declares torch_ext_test::attention_fn, the custom splitting op)

SDPA = "aten::scaled_dot_product_attention"
CUSTOM = "torch_ext_test::attention_fn"
HEADS = 4


def save_matmuls(ctx, op, *args, **kwargs):
    """A selective-checkpoint policy: keep matmul outputs, recompute everything else."""
    if op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def selective_context():
    return create_selective_checkpoint_contexts(save_matmuls)


class Block(nn.Module):
    """Pre-norm attention + MLP; `attention` picks the splitting op the backend cuts at."""

    def __init__(self, d: int, attention: str, dropout: float = 0.0):
        super().__init__()
        self.attention = attention
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.out = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.up, self.down = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
        self.dropout = dropout

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        if self.attention == SDPA:
            q, k, v = (y.view(b, t, HEADS, d // HEADS).transpose(1, 2) for y in (q, k, v))
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        else:
            a = torch.ops.torch_ext_test.attention_fn(q, k, v)
        x = x + F.dropout(self.out(a), self.dropout, self.training)
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class RegionBlock(Block):
    """The block as a nested_compile_region (invoke_subgraph inside the checkpoint)."""

    @torch.compiler.nested_compile_region
    def forward(self, x):
        return super().forward(x)


class CheckpointInRegion(nn.Module):
    """A nested_compile_region whose body checkpoints the block (the checkpoint inside the region)."""

    def __init__(self, block: Block, context_fn):
        super().__init__()
        self.block, self.context_fn = block, context_fn

    @torch.compiler.nested_compile_region
    def forward(self, x):
        return _checkpoint(self.block, x, self.context_fn)


def _checkpoint(fn, x, context_fn):
    if context_fn is None:
        return checkpoint(fn, x, use_reentrant=False)
    return checkpoint(fn, x, use_reentrant=False, context_fn=context_fn)


class CheckpointedModel(nn.Module):
    """`layers` blocks, each checkpointed: nesting "none" (checkpoint(block)), "region_in_checkpoint"
    (checkpoint(region block)) or "checkpoint_in_region" (region(checkpoint(block)))."""

    def __init__(self, layers: int = 3, d: int = 32, attention: str = SDPA, selective: bool = False,
                 nesting: str = "none", dropout: float = 0.0, seed: int = 0, checkpointing: bool = True):
        super().__init__()
        self.checkpointing = checkpointing  # False: the same blocks, nothing recomputed
        torch.manual_seed(seed)
        block_cls = RegionBlock if nesting == "region_in_checkpoint" else Block
        self.blocks = nn.ModuleList(block_cls(d, attention, dropout) for _ in range(layers))
        self.context_fn = functools.partial(create_selective_checkpoint_contexts, save_matmuls) if selective else None
        self.nesting = nesting
        if nesting == "checkpoint_in_region":
            self.wrapped = nn.ModuleList(CheckpointInRegion(b, self.context_fn) for b in self.blocks)
        self.head = nn.Linear(d, d)

    def forward(self, x):
        for i, block in enumerate(self.blocks):
            if not self.checkpointing:
                x = block(x)
            elif self.nesting == "checkpoint_in_region":
                x = self.wrapped[i](x)
            else:
                x = _checkpoint(block, x, self.context_fn)
        return self.head(x).square().mean()
