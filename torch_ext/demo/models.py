"""The model of the demo's `backend` part: nested_compile_region layers whose attention writes a KV
cache in place, as serving code does. The attention is a splitting op: the torch_ext backend runs
it eagerly between compiled pieces; plain torch.compile must functionalize it inside the region,
and cannot (a mutating custom op whose output carries an alias annotation)."""
from __future__ import annotations

import math

import torch
from torch import nn

from torch_ext.hops.splitting_op import splitting_op

D_MODEL = 32  # small: the demo compiles cold on a 2-core CPU
LAYERS = 3
CACHE_ROWS = 64
ATTENTION = "torch_ext_demo::attention"


@splitting_op(ATTENTION, mutates_args=("kv_cache",), fake=lambda q, k, v, kv_cache: torch.empty_like(q))
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
    """Attention over the batch rows; writes k into the KV cache in place."""
    kv_cache[: k.shape[0]].copy_(k)
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    return scores.softmax(-1) @ v


class Layer(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    @torch.compiler.nested_compile_region
    def forward(self, x: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm(x)).chunk(3, dim=-1)
        return x + torch.nn.functional.gelu(self.proj(attention(q, k, v, kv_cache)))


class Decoder(nn.Module):
    def __init__(self, layers: int = LAYERS, d: int = D_MODEL):
        super().__init__()
        torch.manual_seed(0)  # the same weights in every process (the warm run compares too)
        self.embed = nn.Linear(d, d)
        self.layers = nn.ModuleList(Layer(d) for _ in range(layers))
        self.head = nn.Linear(d, d)

    def forward(self, x: torch.Tensor, caches: list[torch.Tensor]) -> torch.Tensor:
        h = self.embed(x)
        for layer, cache in zip(self.layers, caches):
            h = layer(h, cache)
        return self.head(h)

    def caches(self) -> list[torch.Tensor]:
        return [torch.zeros(CACHE_ROWS, self.head.in_features) for _ in self.layers]
