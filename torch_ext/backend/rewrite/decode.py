"""The decode rewrites in their order, each where CompileConfig.uses() says, counted: decode SDPA ->
decode_attention, linears of a few rows -> decode_linear (after the merge: merged projections are linears of
their own), then their norms, gates and residual adds folded in. Run on Dynamo's graph (backend.py)
and again on a size variant's piece (per_size.py)."""
from __future__ import annotations

from typing import Callable

import torch.fx as fx

from torch_ext.backend.config import CompileConfig
from torch_ext.backend.counters import counters
from torch_ext.backend.rewrite.decode_attention import use_decode_attention
from torch_ext.backend.rewrite.decode_linear import use_decode_linear
from torch_ext.backend.rewrite.decode_linear_fusion import fuse_into_decode_linear
from torch_ext.kernels.decode_attention_tuning import Tuner as AttentionTuner
from torch_ext.kernels.decode_linear_tuning import Tuner


def decode_rewrites(gm: fx.GraphModule, config: CompileConfig, is_splitting: Callable[[fx.Node], bool]) -> int:
    """Apply them to gm in place (no placeholder changes); returns how many calls they changed."""
    changed = 0
    if config.uses("decode_attention"):
        measured = AttentionTuner.measured
        found = use_decode_attention(gm, is_splitting, AttentionTuner(config.cache_dir) if config.kernel_tuning else None)
        counters.decode_attention_calls += found
        counters.tuned_shapes += AttentionTuner.measured - measured
        changed += found
    if config.uses("decode_linear"):
        measured, tuner = Tuner.measured, Tuner(config.cache_dir) if config.kernel_tuning else None
        found = use_decode_linear(gm, tuner)
        counters.decode_linear_calls += found
        changed += found
        if config.decode_linear_fusion:
            fused = fuse_into_decode_linear(gm, tuner)
            counters.decode_linear_fusions += fused
            changed += fused
        counters.tuned_shapes += Tuner.measured - measured
    return changed
