"""One rank of the multi-process tests (tests/test_distributed.py): real process groups (gloo, CPU).

    python tests/distributed_worker.py {local_map|tp_decoder} RANK WORLD STORE_FILE [CACHE_DIR]

Prints one JSON line (what the rank checked) as its last line; exits non-zero on any failure.
A collective that hangs fails after the process group's timeout instead of blocking the test.
"""
from __future__ import annotations

import dataclasses
import datetime
import gc
import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

import torch_ext

TIMEOUT = datetime.timedelta(seconds=60)


# --- local_map over DTensors on a real 2-rank mesh --------------------------------------------

@dataclasses.dataclass
class Stats:
    y: torch.Tensor
    norm: torch.Tensor
    scale: float


def _stats_body(x, w):
    y = torch.tanh(x @ w)
    return Stats(y, y.pow(2).sum(-1, keepdim=True), 0.5)


def run_local_map(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.experimental import local_map

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)  # the same global tensors on every rank; distribute_tensor shards them
    x_full, w_full = torch.randn(8, 4), torch.randn(4, 4)
    lm = local_map(_stats_body, out_placements=None, in_placements=([Shard(0)], [Replicate()]), device_mesh=mesh)

    def fn(x, w):
        s = lm(x, w)
        return s.y * s.norm * s.scale

    def run(compiled: bool):
        x = distribute_tensor(x_full, mesh, [Shard(0)]).requires_grad_()
        w = distribute_tensor(w_full, mesh, [Replicate()]).requires_grad_()
        out = (torch.compile(fn, backend=backend, fullgraph=True) if compiled else fn)(x, w)
        out.sum().backward()
        return out, x.grad.to_local(), w.grad.to_local()

    torch_ext.install()
    errors = {}
    for backend in ("eager", "aot_eager", "inductor"):
        torch._dynamo.reset()
        expected, actual = run(False), run(True)
        torch.testing.assert_close(actual, expected, msg=lambda m: f"[rank {rank}, {backend}] {m}")
        errors[backend] = max((a - e).abs().max().item() for a, e in zip(actual, expected))
    # The body ran on this rank's shard: rows rank*4 .. rank*4+3 of the global input.
    local_rows = x_full[rank * 4:(rank + 1) * 4]
    torch.testing.assert_close(expected[0], _stats_body(local_rows, w_full).y * 0.5
                               * _stats_body(local_rows, w_full).norm)
    return {"rank": rank, "max_error": errors}


# --- a tensor-parallel decoder through the torch_ext backend ---------------------------------

D, HEADS, HEAD_DIM, LAYERS = 16, 4, 4, 3


def _declare_attention():
    """Multi-head attention over the rows of q/k/v that writes k into its KV cache: heads are
    independent, so a rank holding some heads computes exactly those heads of the full layer."""
    from torch_ext.hops.splitting_op import splitting_op

    @splitting_op("torch_ext_dist::attention", mutates_args=("kv_cache",),
                  fake=lambda q, k, v, kv_cache: torch.empty_like(q))
    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        kv_cache[: k.shape[0]].copy_(k)
        n, heads = q.shape[0], q.shape[1] // HEAD_DIM
        q, k, v = (t.view(n, heads, HEAD_DIM).transpose(0, 1) for t in (q, k, v))
        scores = (q @ k.transpose(-1, -2)) / HEAD_DIM ** 0.5
        return (scores.softmax(-1) @ v).transpose(0, 1).reshape(n, heads * HEAD_DIM)

    return attention


def _all_reduce(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed import _functional_collectives as fc

    return fc.all_reduce(t, "sum", dist.group.WORLD)


class TPLayer(nn.Module):
    """Attention heads and MLP columns split over the ranks (Megatron style): column-parallel qkv and
    up projections, row-parallel output and down projections, one all-reduce after each."""

    def __init__(self, full: "FullLayer", rank: int, world: int):
        super().__init__()
        heads, cols = HEADS // world, 2 * D // world
        q, k, v = full.qkv.weight.view(3, HEADS, HEAD_DIM, D).unbind(0)
        take = slice(rank * heads, (rank + 1) * heads)
        self.qkv_weight = nn.Parameter(torch.cat([q[take], k[take], v[take]]).reshape(-1, D).clone())
        self.o_weight = nn.Parameter(full.o.weight.view(D, HEADS, HEAD_DIM)[:, take].reshape(D, -1).clone())
        self.up_weight = nn.Parameter(full.up.weight[rank * cols:(rank + 1) * cols].clone())
        self.down_weight = nn.Parameter(full.down.weight[:, rank * cols:(rank + 1) * cols].clone())
        self.heads = heads

    def forward(self, x, kv_cache):
        q, k, v = (x @ self.qkv_weight.T).chunk(3, dim=-1)
        a = torch.ops.torch_ext_dist.attention(q, k, v, kv_cache)
        x = x + _all_reduce(a @ self.o_weight.T)
        return x + _all_reduce(torch.relu(x @ self.up_weight.T) @ self.down_weight.T)


class FullLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D, bias=False)
        self.o, self.up = nn.Linear(D, D, bias=False), nn.Linear(D, 2 * D, bias=False)
        self.down = nn.Linear(2 * D, D, bias=False)

    def forward(self, x, kv_cache):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        a = torch.ops.torch_ext_dist.attention(q, k, v, kv_cache)
        x = x + self.o(a)
        return x + self.down(torch.relu(self.up(x)))


class Decoder(nn.Module):
    def __init__(self, layers):
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, x, caches):
        for layer, cache in zip(self.layers, caches):
            x = layer(x, cache)
        return x


def run_tp_decoder(rank: int, world: int, cache_dir: str) -> dict:
    from torch_ext.backend import counters

    _declare_attention()
    torch.manual_seed(0)
    full = Decoder([FullLayer() for _ in range(LAYERS)])  # the single-process model, same on every rank
    tp = Decoder([TPLayer(layer, rank, world) for layer in full.layers])
    config = torch_ext.CompileConfig(splitting_ops=["torch_ext_dist::attention"], compile_sizes=[4],
                                     cache_dir=cache_dir)
    compiled = torch.compile(tp, backend=torch_ext.backend(config), dynamic=True)
    worst = 0.0
    with torch.no_grad():
        for n in (4, 6, 4):
            x = torch.randn(n, D)
            full_caches = [torch.zeros(8, D) for _ in range(LAYERS)]
            tp_caches = [torch.zeros(8, D // world) for _ in range(LAYERS)]
            expected, actual = full(x, full_caches), compiled(x, tp_caches)
            torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5,
                                       msg=lambda m: f"[rank {rank}] TP decoder vs the 1-process model: {m}")
            # This rank's KV cache holds its heads' keys: columns of the full cache.
            torch.testing.assert_close(torch.cat([c[:n] for c in tp_caches]),
                                       torch.cat([c[:n, rank * D // world:(rank + 1) * D // world]
                                                  for c in full_caches]), atol=1e-5, rtol=1e-5)
            worst = max(worst, (actual - expected).abs().max().item())
    return {"rank": rank, "max_error": worst, "counters": counters.snapshot()}


def end_process_group() -> None:
    """destroy_process_group, then a collection. On torch 2.15 a compiled graph's node meta holds the
    ProcessGroup itself (the `real_obj` of a FakeScriptObject: the group is an opaque object there), and
    such graphs are reference cycles: without the collection the group, and gloo's threads, outlived
    destroy_process_group until the interpreter's teardown, where a rank aborted now and then after
    printing its results ("terminate called without an active exception", SIGABRT)."""
    dist.destroy_process_group()
    gc.collect()


def native_threads(prefix: str) -> list[str]:
    """Names of this process's OS threads that start with `prefix` (Linux; none elsewhere)."""
    if not os.path.isdir("/proc/self/task"):
        return []
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # the thread ended meanwhile
            pass
    return sorted(n for n in names if n.startswith(prefix))


def main() -> None:
    mode, rank, world, store_file = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    dist.init_process_group("gloo", store=dist.FileStore(store_file, world), rank=rank, world_size=world,
                            timeout=TIMEOUT)
    try:
        result = run_local_map(rank, world) if mode == "local_map" else run_tp_decoder(rank, world, sys.argv[5])
        dist.barrier()
    finally:
        end_process_group()
    result["threads_at_exit"] = native_threads("gloo") + native_threads("pt_gloo")  # none may outlive the group
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
