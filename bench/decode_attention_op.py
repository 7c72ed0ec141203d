"""torch_ext::decode_attention's kernels on grouped-query shapes: one program per kv head (the cache
read once) against one per query head over the repeated cache (what the kernel did before: the same
math, each cache byte read `groups` times), and SDPA over HF's repeat_kv.

    python bench/decode_attention_op.py [--shapes 8x16x4x2048,1x16x4x2048,32x32x8x1024]

Shapes are batch x heads x kv heads x cache length, head dim 128, bf16, a bool mask over the cache.
Microseconds per call (CUDA events over replays of a CUDA graph of 50 calls), and x floor: the cache bytes
(k and v, read once) / device-to-device copy bandwidth.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def per_call_us(fn, calls: int = 50, replays: int = 20) -> float:
    """GPU time per call: `calls` calls captured in one CUDA graph (as the op runs inside a model's
    graph), replayed; eager timing would measure Python and Triton's launch path (~70-120 us)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (calls * replays)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="8x16x4x2048,1x16x4x2048,32x32x8x1024")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench/decode_attention_op.py needs a CUDA GPU.")
        return 0
    from decode import copy_bandwidth
    from table import print_table
    from torch_ext.hops.decode_attention import decode_attention_triton

    bandwidth = copy_bandwidth()
    rows = []
    for shape in args.shapes.split(","):
        b, h, hkv, length = (int(x) for x in shape.split("x"))
        d, n = 128, h // hkv
        q = torch.randn(b, h, 1, d, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(b, hkv, length, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        mask = torch.rand(b, 1, 1, length, device="cuda") > 0.1
        kr, vr = k.repeat_interleave(n, dim=1), v.repeat_interleave(n, dim=1)
        grouped = per_call_us(lambda: decode_attention_triton(q, k, v, mask, d ** -0.5))
        per_head = per_call_us(lambda: decode_attention_triton(q, kr, vr, mask, d ** -0.5))
        sdpa = per_call_us(lambda: torch.nn.functional.scaled_dot_product_attention(
            q, k[:, :, None].expand(b, hkv, n, length, d).reshape(b, h, length, d),
            v[:, :, None].expand(b, hkv, n, length, d).reshape(b, h, length, d), attn_mask=mask, scale=d ** -0.5))
        err = (decode_attention_triton(q, k, v, mask, d ** -0.5).float()
               - decode_attention_triton(q, kr, vr, mask, d ** -0.5).float()).abs().max().item()
        floor = 2 * k.numel() * k.element_size() / bandwidth * 1e6
        rows.append([shape, f"{floor:.1f}", f"{grouped:.1f} ({grouped / floor:.2f})",
                     f"{per_head:.1f} ({per_head / floor:.2f})", f"{sdpa:.1f} ({sdpa / floor:.2f})", f"{err:.1e}"])
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, head dim 128; copy bandwidth "
          f"{bandwidth / 1e12:.2f} TB/s; us per call (x floor)")
    print_table(["b x h x hkv x L", "floor us", "grouped (now)", "per query head (before)", "SDPA + repeat_kv",
                 "max |grouped - per head|"], rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
