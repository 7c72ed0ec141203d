"""Host cost of one eager attention call at a decode shape: what a piecewise step pays per layer.

    python bench/dev/attention_host_cost.py [--batches 1,8] [--heads 16] [--kv-heads 16] [--cache 384]

In a piecewise CUDA-graph step the splitting op (attention) runs eagerly between graph replays, so
its host time is paid once per layer. Rows: SDPA with HF's boolean mask (what the HF decode graph
calls), with the mask already additive, under each backend, the backends' own ops called directly,
torch_ext's decode-attention op, and a CUDA-graph replay for scale. Host us: the GPU kept busy by a
queued sleep; GPU us: CUDA events over back-to-back calls; max |diff| against the default call.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode_profile import gpu_us, host_us  # noqa: E402


def rows(b: int, h: int, hkv: int, cache: int, d: int = 128):
    dev, dt = "cuda", torch.bfloat16
    q = torch.randn(b, h, 1, d, device=dev, dtype=dt)
    k = torch.randn(b, hkv, cache, d, device=dev, dtype=dt)
    v = torch.randn(b, hkv, cache, d, device=dev, dtype=dt)
    # HF's StaticCache decode mask: the first `filled` slots visible, one row, expanded over the batch.
    filled = cache * 2 // 3
    bool_mask = (torch.arange(cache, device=dev) < filled).view(1, 1, 1, cache).expand(b, 1, 1, cache)
    add_mask = torch.where(bool_mask, 0.0, float("-inf")).to(dt)
    gqa = h != hkv
    choice = torch._fused_sdp_choice(q, k, v, bool_mask, 0.0, False, enable_gqa=gqa)

    def sdpa(mask):
        return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)

    def under(backend, fn):
        def run():
            with sdpa_kernel(backend):
                return fn()
        return run

    out = {
        "sdpa, bool mask (default backend)": sdpa(bool_mask),
        "sdpa, additive mask": sdpa(add_mask),
        "sdpa, bool mask, EFFICIENT only": under(SDPBackend.EFFICIENT_ATTENTION, sdpa(bool_mask)),
        "sdpa, additive mask, EFFICIENT only": under(SDPBackend.EFFICIENT_ATTENTION, sdpa(add_mask)),
        "sdpa, bool mask, CUDNN only": under(SDPBackend.CUDNN_ATTENTION, sdpa(bool_mask)),
        "sdpa, additive mask, CUDNN only": under(SDPBackend.CUDNN_ATTENTION, sdpa(add_mask)),
        "sdpa, bool mask, MATH only": under(SDPBackend.MATH, sdpa(bool_mask)),
        "sdpa, no mask (FLASH)": lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa),
        "sdpa_kernel() context alone": under(SDPBackend.EFFICIENT_ATTENTION, lambda: None),
        "_fused_sdp_choice alone": lambda: torch._fused_sdp_choice(q, k, v, bool_mask, 0.0, False, enable_gqa=gqa),
        "where(bool, 0, -inf) alone": lambda: torch.where(bool_mask, 0.0, float("-inf")),
    }
    if not gqa:
        out["_efficient_attention op, additive mask"] = (
            lambda: torch._scaled_dot_product_efficient_attention(q, k, v, add_mask, False)[0])
        out["_cudnn_attention op, additive mask"] = (
            lambda: torch._scaled_dot_product_cudnn_attention(q, k, v, add_mask, False, 0.0, False, False)[0])
    try:
        from torch_ext.kernels.decode_attention import decode_attention
        scale = d ** -0.5
        out["torch_ext::decode_attention (op)"] = lambda: decode_attention(q, k, v, bool_mask, scale)
        out["torch.ops.torch_ext.decode_attention"] = (
            lambda: torch.ops.torch_ext.decode_attention(q, k, v, bool_mask, scale))
    except Exception as e:  # noqa: BLE001 - a row missing is reported, not fatal
        print(f"  (torch_ext decode attention not run: {type(e).__name__}: {e})")

    # A CUDA graph of the default call, and of 20 small kernels: what a replay costs on the host.
    static_out = {}
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            sdpa(bool_mask)()
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        static_out["a"] = sdpa(bool_mask)()
    out["CUDA graph replay (the default call)"] = g.replay
    g20 = torch.cuda.CUDAGraph()
    x = torch.zeros(b, 2048, device=dev, dtype=dt)
    with torch.cuda.graph(g20):
        y = x
        for _ in range(20):
            y = y * 1.0001
    out["CUDA graph replay (20 kernels)"] = g20.replay
    return out, sdpa(bool_mask), choice


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="1,8")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=16)
    p.add_argument("--cache", type=int, default=384)
    p.add_argument("--rounds", type=int, default=2)
    a = p.parse_args()
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, heads {a.heads}/{a.kv_heads}, cache {a.cache}")
    for b in map(int, a.batches.split(",")):
        fns, ref_fn, choice = rows(b, a.heads, a.kv_heads, a.cache)
        ref = ref_fn()
        print(f"\nbatch {b} (SDPA's backend choice for the bool mask: {choice})")
        print(f"| call | host us | GPU us | max abs diff vs default |")
        print(f"|---|---|---|---|")
        results = {name: [] for name in fns}
        for _ in range(a.rounds):  # interleaved rounds
            for name, fn in fns.items():
                if isinstance(results[name], str):  # failed in an earlier round
                    continue
                try:
                    results[name].append((host_us(fn, inner=20, reps=9), gpu_us(fn, inner=20, reps=9)))
                except Exception as e:  # noqa: BLE001
                    results[name] = f"error: {type(e).__name__}: {str(e)[:80]}"
        for name, fn in fns.items():
            r = results[name]
            if isinstance(r, str):
                print(f"| {name} | {r} | | |")
                continue
            o = fn()
            diff = (o.float() - ref.float()).abs().max().item() if isinstance(o, torch.Tensor) and o.shape == ref.shape else "-"
            diff = f"{diff:.2e}" if isinstance(diff, float) else diff
            host = " / ".join(f"{h:.1f}" for h, _ in r)
            gpu = " / ".join(f"{g:.1f}" for _, g in r)
            print(f"| {name} | {host} | {gpu} | {diff} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
