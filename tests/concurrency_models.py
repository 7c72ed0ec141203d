"""A stateless model with SDPA, and a runner of many threads calling one compiled model, for
tests/test_concurrency_gpu.py and bench/dev/concurrency.py."""
from __future__ import annotations

import random
import threading
import time

import torch
import torch.nn.functional as F
from torch import nn

SPLIT_AT = "aten::scaled_dot_product_attention"
SEQ, D, HEADS = 16, 64, 4


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.qkv, self.out = nn.LayerNorm(D), nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.up, self.down = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (y.view(b, t, HEADS, d // HEADS).transpose(1, 2) for y in self.qkv(self.norm(x)).chunk(3, -1))
        x = x + self.out(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(x)))


class Blocks(nn.Module):
    def __init__(self, layers: int = 4):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(Block() for _ in range(layers))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def batch(n: int, device, seed: int) -> torch.Tensor:
    return torch.randn(n, SEQ, D, device=device, generator=torch.Generator(device).manual_seed(seed))


def hammer(compiled, model, *, threads: int, calls: int, max_batch: int, device: str, streams: bool,
           check: bool = True, timeout: float = 300.0) -> dict:
    """`threads` threads start together, each makes `calls` calls at random batch sizes (on its own
    CUDA stream with `streams`); each output is compared with eager on the thread's own input.
    Returns {"calls_per_s", "wrong", "errors"}; a thread still running after `timeout` is an error."""
    barrier = threading.Barrier(threads)
    wrong, errors, lock = [0], [], threading.Lock()

    def work(t):
        rng = random.Random(t)
        stream = torch.cuda.Stream() if streams and device == "cuda" else None
        try:
            barrier.wait(timeout=60)
            with torch.no_grad(), (torch.cuda.stream(stream) if stream is not None else _null()):
                for i in range(calls):
                    x = batch(rng.randint(1, max_batch), device, seed=t * 100003 + i)
                    out = compiled(x)
                    if check:
                        expected = model(x)
                        if not torch.allclose(out, expected, rtol=2e-3, atol=2e-3):
                            with lock:
                                wrong[0] += 1
                if stream is not None:
                    stream.synchronize()
        except BaseException as e:  # noqa: BLE001  (reported)
            with lock:
                errors.append(f"{type(e).__name__}: {e}"[:300])

    pool = [threading.Thread(target=work, args=(t,), daemon=True) for t in range(threads)]
    start = time.perf_counter()
    for p in pool:
        p.start()
    for p in pool:
        p.join(max(0.0, timeout - (time.perf_counter() - start)))
    if device == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    hung = sum(p.is_alive() for p in pool)
    if hung:
        errors.append(f"{hung} thread(s) still running after {timeout:.0f} s")
    return {"calls_per_s": threads * calls / elapsed, "wrong": wrong[0], "errors": errors}


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False
