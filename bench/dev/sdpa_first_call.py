"""What a process's first scaled_dot_product_attention calls cost, by backend (issue 49's switch: the cold
process's first prefill program spent 1.33 s in 16 aten::_cudnn_attention_forward calls).

    python bench/dev/sdpa_first_call.py [--heads 32 --seq 128 --kv 192 --dim 64]

Prints which backend SDPA picks for an HF-style prefill (StaticCache: keys padded to the cache length, an
additive mask), then per backend: the first call in the process, the next three, and the first call
on a new thread (cuDNN keeps its plans per thread); host ms, synchronized."""
from __future__ import annotations

import argparse
import threading
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def timed(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--kv", type=int, default=192)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--compiled-layers", type=int, default=0,
                        help="then time the first calls of an eager and an Inductor-compiled stack of this many layers")
    args = parser.parse_args()
    torch.ones(1, device="cuda")  # the context, outside the figures
    shape_q = (1, args.heads, args.seq, args.dim)
    shape_kv = (1, args.heads, args.kv, args.dim)

    def make():
        q = torch.randn(shape_q, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(shape_kv, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(shape_kv, device="cuda", dtype=torch.bfloat16)
        mask = torch.zeros(1, 1, args.seq, args.kv, device="cuda", dtype=torch.bfloat16)
        mask[..., args.seq:] = float("-inf")
        return q, k, v, mask

    q, k, v, mask = make()
    choice = torch._fused_sdp_choice(q, k, v, mask, 0.0, False)
    names = {int(getattr(SDPBackend, n)): n for n in ("ERROR", "MATH", "FLASH_ATTENTION", "EFFICIENT_ATTENTION",
                                                          "CUDNN_ATTENTION") if hasattr(SDPBackend, n)}
    print(f"torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, {torch.cuda.get_device_name()}")
    print(f"SDPA picks {names.get(int(choice), choice)} for q {shape_q}, kv {shape_kv}, additive mask")
    print(f"{'backend':<20} {'first ms':>9} {'next 3 ms':>20} {'new thread ms':>14} {'new shape ms':>13}")
    for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION,
                    SDPBackend.MATH):
        def call(tensors=(q, k, v, mask)):
            with sdpa_kernel(backend):
                F.scaled_dot_product_attention(*tensors[:3], attn_mask=tensors[3])
        try:
            first = timed(call)
        except RuntimeError as e:
            print(f"{backend.name:<20} not usable here: {str(e).splitlines()[0][:70]}")
            continue
        following = [timed(lambda: call(make())) for _ in range(3)]
        on_thread = []
        worker = threading.Thread(target=lambda: on_thread.append(timed(call)))
        worker.start()
        worker.join()
        q2 = torch.randn(1, args.heads, args.seq + 1, args.dim, device="cuda", dtype=torch.bfloat16)
        mask2 = torch.zeros(1, 1, args.seq + 1, args.kv, device="cuda", dtype=torch.bfloat16)
        new_shape = timed(lambda: call((q2, k, v, mask2)))
        print(f"{backend.name:<20} {first:9.1f} {' / '.join(f'{t:.2f}' for t in following):>20} "
              f"{on_thread[0]:14.2f} {new_shape:13.2f}")
    if args.compiled_layers:
        compiled_layers(args.compiled_layers, args.heads, args.seq, args.kv, args.dim)


def compiled_layers(layers: int, heads: int, seq: int, kv: int, dim: int) -> None:
    """The first call of an Inductor-compiled stack of attention layers (a projection, then SDPA over a
    per-layer cache with an additive mask, as a compiled prefill runs it): each cuDNN call's host ms."""
    hidden = heads * dim

    class Stack(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.ModuleList(torch.nn.Linear(hidden, hidden) for _ in range(layers))
            self.keys = [torch.randn(1, heads, kv, dim, device="cuda", dtype=torch.bfloat16) for _ in range(layers)]

        def forward(self, x, mask):
            for proj, k in zip(self.proj, self.keys):
                q = proj(x).view(1, seq, heads, dim).transpose(1, 2)
                x = x + F.scaled_dot_product_attention(q, k, k, attn_mask=mask).transpose(1, 2).reshape(1, seq, hidden)
            return x

    model = Stack().to("cuda", torch.bfloat16)
    x = torch.randn(1, seq, hidden, device="cuda", dtype=torch.bfloat16)
    mask = torch.zeros(1, 1, seq, kv, device="cuda", dtype=torch.bfloat16)
    # The compiled stack's first call includes its compile; each cuDNN event is timed on its own.
    for name, fn in (("eager", model), ("inductor", torch.compile(model))):
        with torch.no_grad():
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                total = timed(lambda: fn(x, mask))
        calls = [e.cpu_time_total / 1e3 for e in prof.events() if e.name == "aten::_cudnn_attention_forward"]
        print(f"{name}: call {total:.1f} ms; cuDNN forward calls (ms): {' '.join(f'{c:.1f}' for c in calls)}")


if __name__ == "__main__":
    main()
