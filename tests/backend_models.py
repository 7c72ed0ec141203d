"""Small models and splitting ops shared by the backend tests, the bench and the subprocess worker.

The ops are declared once per process (importing this module twice reuses them).
"""
from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn

from torch_ext.hops.splitting_op import splitting_op

D_MODEL = 32
CACHE_ROWS = 64


def _attention_math(q, k, v):
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    return scores.softmax(-1) @ v


@splitting_op("torch_ext_test::attention", mutates_args=("kv_cache",),
              fake=lambda q, k, v, kv_cache: torch.empty_like(q))
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
    """Attention over the rows of q/k/v that also writes k into the KV cache, in place."""
    kv_cache[: k.shape[0]].copy_(k)
    return _attention_math(q, k, v)


@splitting_op("torch_ext_test::attention_fn", fake=lambda q, k, v: torch.empty_like(q))
def attention_fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Functional attention with an autograd formula (for training)."""
    return _attention_math(q, k, v)


def _attention_fn_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _attention_fn_backward(ctx, grad):
    q, k, v = ctx.saved_tensors
    with torch.enable_grad():
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        out = _attention_math(q, k, v)
        return torch.autograd.grad(out, (q, k, v), grad)


attention_fn.register_autograd(_attention_fn_backward, setup_context=_attention_fn_setup)


def _attention_out(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                   out: torch.Tensor) -> None:
    """vLLM-style: returns nothing, writes the result into `out` and k into the cache."""
    if isinstance(q, torch._subclasses.FakeTensor):  # what compilers trace is the fake implementation
        raise RuntimeError("the real kernel of a splitting op ran on fake tensors")
    kv_cache[: k.shape[0]].copy_(k)
    out.copy_(_attention_math(q, k, v))


attention_out = splitting_op("torch_ext_test::attention_out", mutates_args=("out", "kv_cache"))(_attention_out)
# The same function as an inference-only op (registered straight with the dispatcher).
attention_out_inference = splitting_op("torch_ext_test::attention_out_inference", mutates_args=("out", "kv_cache"),
                                       autograd=False)(_attention_out)


class Layer(nn.Module):
    """Pre-norm attention layer (kept small: tests compile it cold on a 2-core CPU); the attention
    kind picks the splitting op."""

    def __init__(self, d: int = D_MODEL, kind: str = "cache", mlp: bool = False):
        super().__init__()
        self.kind = kind
        self.norm1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)) if mlp else None

    def forward(self, x: torch.Tensor, kv_cache: torch.Tensor | None) -> torch.Tensor:
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        if self.kind == "cache":
            a = torch.ops.torch_ext_test.attention(q, k, v, kv_cache)
        elif self.kind in ("out", "out_inference"):
            a = torch.empty_like(q)
            op = torch.ops.torch_ext_test.attention_out if self.kind == "out" else attention_out_inference
            op(q, k, v, kv_cache, a)
        else:
            a = torch.ops.torch_ext_test.attention_fn(q, k, v)
        x = x + torch.nn.functional.gelu(self.proj(a))
        return x if self.mlp is None else x + self.mlp(x)


class NestedLayer(Layer):
    """The same layer as a nested_compile_region (Dynamo traces it once, as invoke_subgraph)."""

    @torch.compiler.nested_compile_region
    def forward(self, x, kv_cache):
        return super().forward(x, kv_cache)


class Decoder(nn.Module):
    def __init__(self, layers: int = 2, d: int = D_MODEL, kind: str = "cache", nested: bool = False,
                 mlp: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(d, d)
        layer_cls = NestedLayer if nested else Layer
        self.layers = nn.ModuleList(layer_cls(d, kind, mlp) for _ in range(layers))
        self.head = nn.Linear(d, d)

    def forward(self, x: torch.Tensor, caches: list[torch.Tensor]) -> torch.Tensor:
        h = self.embed(x)
        for i, layer in enumerate(self.layers):
            h = layer(h, caches[i] if caches else None)
        return self.head(h)

    def caches(self, rows: int = CACHE_ROWS) -> list[torch.Tensor]:
        return [torch.zeros(rows, self.head.in_features) for _ in self.layers]


def batch(n: int, d: int = D_MODEL, *, dynamic: bool = False, seed: int | None = None) -> torch.Tensor:
    if seed is not None:
        torch.manual_seed(seed)
    x = torch.randn(n, d)
    if dynamic:
        torch._dynamo.mark_dynamic(x, 0)
    return x


@dataclasses.dataclass
class LayerOutput:
    hidden: torch.Tensor
    residual: torch.Tensor


class ObjectOutputLayer(Layer):
    """A nested_compile_region returning a dataclass: not proxyable, needs torch_ext.install()."""

    @torch.compiler.nested_compile_region
    def forward(self, x, kv_cache):
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        a = torch.ops.torch_ext_test.attention(q, k, v, kv_cache)
        return LayerOutput(hidden=self.proj(a), residual=x)


class OutputsObjectDecoder(Decoder):
    def __init__(self, layers: int = 2, d: int = D_MODEL):
        super().__init__(layers=0, d=d)
        torch.manual_seed(1)
        self.layers = nn.ModuleList(ObjectOutputLayer(d) for _ in range(layers))

    def forward(self, x, caches):
        h = self.embed(x)
        for layer, cache in zip(self.layers, caches):
            out = layer(h, cache)
            h = out.hidden + out.residual
        return self.head(h)
