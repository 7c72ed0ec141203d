"""Models and helpers shared by the CUDA-graph tests (CPU and GPU).

`decode_attention` is a row-independent decode step: each row writes its k/v at `pos` of its own
cache row and attends over positions 0..pos, so padding rows never change real rows (what
cudagraph_mode="full" needs from its splitting ops). `SimulatedCudaGraphs` lets the CPU run every
code path of the runner: a "graph" replays by re-running the region on the captured static inputs
and writing the results into the captured output tensors, which is what a CUDA graph does with its
fixed addresses.
"""
from __future__ import annotations

import math
import weakref

import torch
from torch import nn

from torch_ext.backend.runtime.cudagraph.manager import CudaGraphManager, cudagraph_stats
from torch_ext.hops.splitting_op import splitting_op

HEADS, HEAD_DIM = 2, 8
D_MODEL = HEADS * HEAD_DIM
MAX_BATCH, MAX_POS = 64, 8


@splitting_op("torch_ext_cg::decode_attention", mutates_args=("k_cache", "v_cache"),
              fake=lambda q, k, v, k_cache, v_cache, pos: torch.empty_like(q))
def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, pos: int) -> torch.Tensor:
    """q, k, v: (n, heads, head_dim); caches: (max_batch, max_pos, heads, head_dim)."""
    n = q.shape[0]
    k_cache[:n, pos] = k
    v_cache[:n, pos] = v
    keys, values = k_cache[:n, : pos + 1], v_cache[:n, : pos + 1]
    scores = torch.einsum("nhd,nthd->nht", q, keys) / math.sqrt(q.shape[-1])
    return torch.einsum("nht,nthd->nhd", scores.softmax(-1), values)


def _decode_attention_into(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                           v_cache: torch.Tensor, pos: int, out: torch.Tensor) -> None:
    """decode_attention writing its result into `out` (vLLM's attention-with-output shape)."""
    out.copy_(decode_attention(q, k, v, k_cache, v_cache, pos))


def _decode_attention_checked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                              v_cache: torch.Tensor, pos: int, out: torch.Tensor) -> None:
    """_decode_attention_into that reads a value on the host: it cannot be captured in a graph."""
    _decode_attention_into(q, k, v, k_cache, v_cache, pos, out)
    if not bool(torch.isfinite(out).all()):
        raise FloatingPointError("attention produced a non-finite value")


ATTENTION_INTO = {  # how Layer's attention writes into a buffer: by op declaration
    "into": splitting_op("torch_ext_cg::decode_attention_into",
                         mutates_args=("k_cache", "v_cache", "out"))(_decode_attention_into),
    "into_inference": splitting_op("torch_ext_cg::decode_attention_into_inference",
                                   mutates_args=("k_cache", "v_cache", "out"), autograd=False)(_decode_attention_into),
    "checked": splitting_op("torch_ext_cg::decode_attention_checked",
                            mutates_args=("k_cache", "v_cache", "out"))(_decode_attention_checked),
}


class Layer(nn.Module):
    def __init__(self, d: int, attention: str = "returns"):
        super().__init__()
        self.attention = attention  # "returns" its result, or writes "into" a buffer (see ATTENTION_INTO)
        self.norm1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.o = nn.Linear(d, d)
        self.norm2 = nn.LayerNorm(d)
        self.up = nn.Linear(d, 2 * d)
        self.down = nn.Linear(2 * d, d)

    def forward(self, h, k_cache, v_cache, pos: int):
        q, k, v = self.qkv(self.norm1(h)).view(h.shape[0], 3, HEADS, HEAD_DIM).unbind(1)
        if self.attention != "returns":  # the result buffer is allocated by the piece before the op
            a = torch.empty_like(q)
            ATTENTION_INTO[self.attention](q, k, v, k_cache, v_cache, pos, a)
        else:
            a = torch.ops.torch_ext_cg.decode_attention(q, k, v, k_cache, v_cache, pos)
        h = h + self.o(a.reshape(h.shape[0], -1))
        return h + self.down(torch.nn.functional.gelu(self.up(self.norm2(h))))


class TinyDecoder(nn.Module):
    def __init__(self, layers: int = 2, d: int = D_MODEL, attention: str = "returns"):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(d, d)
        self.layers = nn.ModuleList(Layer(d, attention) for _ in range(layers))
        self.head = nn.Linear(d, d)

    def forward(self, x, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor], pos: int):
        h = self.embed(x)
        for layer, kc, vc in zip(self.layers, k_caches, v_caches):
            h = layer(h, kc, vc, pos)
        return self.head(h)

    def caches(self, device="cpu", dtype=torch.float32):
        shape = (MAX_BATCH, MAX_POS, HEADS, HEAD_DIM)
        make = lambda: [torch.randn(shape, device=device, dtype=dtype) for _ in self.layers]  # noqa: E731
        return make(), make()


class AssignsBuffer(TinyDecoder):
    """Assigns a module buffer in forward: refused under CUDA graphs (graphs read buffers in place)."""

    def __init__(self):
        super().__init__(layers=1)
        self.register_buffer("last", torch.zeros(D_MODEL))

    def forward(self, x, k_caches, v_caches, pos):
        out = super().forward(x, k_caches, v_caches, pos)
        self.last = out[0].detach()  # a new tensor each call: graphs would keep reading the old one
        return out


@splitting_op("torch_ext_cg::cache_attention", fake=lambda q, k_cache, v_cache, pos: torch.empty_like(q))
def cache_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pos: int) -> torch.Tensor:
    """Attention of q (n, heads, head_dim) over positions 0..pos of caches (n, max_pos, heads, head_dim)."""
    keys, values = k_cache[:, : pos + 1], v_cache[:, : pos + 1]
    scores = torch.einsum("nhd,nthd->nht", q, keys) / math.sqrt(q.shape[-1])
    return torch.einsum("nht,nthd->nhd", scores.softmax(-1), values)


class BatchCacheDecoder(TinyDecoder):
    """A KV cache per batch size, as HF's StaticCache: (batch, max_pos, heads, head_dim), written in
    place by the compiled code (the graph before attention) and read by the splitting op."""

    def forward(self, x, k_caches, v_caches, pos: int):
        h = self.embed(x)
        for layer, kc, vc in zip(self.layers, k_caches, v_caches):
            q, k, v = layer.qkv(layer.norm1(h)).view(h.shape[0], 3, HEADS, HEAD_DIM).unbind(1)
            kc[:, pos] = k
            vc[:, pos] = v
            a = torch.ops.torch_ext_cg.cache_attention(q, kc, vc, pos)
            h = h + layer.o(a.reshape(h.shape[0], -1))
            h = h + layer.down(torch.nn.functional.gelu(layer.up(layer.norm2(h))))
        return self.head(h)

    def caches_for(self, n: int, device="cpu", dtype=torch.float32, max_pos: int = MAX_POS):
        shape = (n, max_pos, HEADS, HEAD_DIM)
        make = lambda: [torch.randn(shape, device=device, dtype=dtype) for _ in self.layers]  # noqa: E731
        return make(), make()


class PositionStep(nn.Module):
    """A step taking its position as a Python int (Meta's Llama reference does), its tensors static: once
    the int changes, Dynamo makes it a symbolic int input that sizes no tensor."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(D_MODEL, D_MODEL)

    def forward(self, x, pos: int):
        return self.proj(x) * pos + pos


SPLITTING_OPS = ("torch_ext_cg::cache_attention", "torch_ext_cg::decode_attention", "torch_ext_cg::decode_attention_into",
                 "torch_ext_cg::decode_attention_into_inference", "torch_ext_cg::decode_attention_checked")


class SimulatedGraph:
    """Holds its tensor inputs weakly, as a CUDA graph holds only their addresses: the runner must
    keep alive what its graphs read (a replay over a freed input fails here)."""

    def __init__(self, fn, args, outs, single):
        self.fn, self.outs, self.single = fn, outs, single
        self.args = [weakref.ref(a) if isinstance(a, torch.Tensor) else a for a in args]

    def replay(self):
        args = [a() if isinstance(a, weakref.ref) else a for a in self.args]
        assert all(a is not None for a in args), "a simulated graph replayed over a freed input"
        with torch.no_grad():
            new = self.fn(*args)
        new = [new] if self.single else list(new)
        for old, value in zip(self.outs, new):
            if isinstance(old, torch.Tensor) and old is not value:
                copy_once(old, value)


def copy_once(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst.copy_(src) where dst may be expanded (stride 0): its memory is written once."""
    for d in range(dst.dim()):
        if dst.stride(d) == 0 and dst.shape[d] > 1:
            dst, src = dst.narrow(d, 0, 1), src.narrow(d, 0, 1)
    dst.copy_(src)


class SimulatedCudaGraphs(CudaGraphManager):
    """A CudaGraphManager whose graphs are simulated on the CPU (see the module docstring).
    Capturing runs the region once to learn its outputs, then restores every tensor input, since
    a real capture records without running."""

    def graphs_available(self) -> bool:
        return True

    def can_capture_on(self, device) -> bool:
        return True

    def capture(self, fn, args, device, name, size):
        saved = {i: a.clone() for i, a in enumerate(args) if isinstance(a, torch.Tensor)}
        out = fn(*args)
        for i, value in saved.items():
            copy_once(args[i], value)
        single = not isinstance(out, (tuple, list))
        outs = [out] if single else list(out)
        self.captured.append((name, size))
        cudagraph_stats.captures += 1
        cudagraph_stats.sizes.add(size)
        return SimulatedGraph(fn, list(args), outs, single), out

    def __init__(self, config):
        super().__init__(config)
        self.captured: list = []
