"""FlashInfer's decode kernel as a peer column for the decode-attention benches (issue 47).

HF's static cache, [batch, kv heads, length, head dim] per layer, is FlashInfer's paged "HND" layout
with one page per sequence (page size = the cache's length), so its kernel reads our tensors as they
are: no copy, no repacking. Its kernels are built once per (dtype, head dim) by nvcc; on the GPU
machines they come prebuilt (bench/gpu_check.sh's `.whl/flashinfer_decode_*.tar`, see CONTRIBUTING).
"""
from __future__ import annotations

from typing import Callable

import torch


def flashinfer_status(head_dim: int, tensor_cores: bool = False) -> str | None:
    """None where FlashInfer's decode kernel for `head_dim` (bf16) loads and runs, else why not (shown
    in the bench's header): a missing package, or a prebuilt kernel this machine cannot load."""
    try:
        q = torch.zeros(1, 8, 1, head_dim, device="cuda", dtype=torch.bfloat16)
        cache = [[torch.zeros(1, 8, 16, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(2)]]
        decode_calls(q, cache, 16, tensor_cores)[0]()
    except Exception as e:  # noqa: BLE001  (an optional peer: say why it is missing)
        return f"FlashInfer unavailable: {type(e).__name__}: {str(e)[:160]}"
    return None


def decode_calls(q: torch.Tensor, caches: list[list[torch.Tensor]], lengths: int,
                 tensor_cores: bool = False) -> list[Callable[[], torch.Tensor]]:
    """One call per (k, v) in `caches`: FlashInfer's batch decode over the first `lengths` positions of
    each sequence, q [b, h, 1, d] (our op's layout) -> [b, h, d]; `tensor_cores`: its prefill kernel
    for the decode step (what FlashInfer advises for grouped heads). Planned once here: what a server
    does per step outside its CUDA graph, so the calls themselves are capturable."""
    import flashinfer

    b, h, _, d = q.shape
    hkv, page = caches[0][0].shape[1], caches[0][0].shape[2]
    device = q.device
    workspace = torch.empty(128 * 2**20, dtype=torch.uint8, device=device)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "HND", use_tensor_cores=tensor_cores)
    pages = torch.arange(b + 1, dtype=torch.int32, device=device)  # sequence i is page i
    wrapper.plan(pages, pages[:-1], torch.full((b,), lengths, dtype=torch.int32, device=device), h, hkv, d, page,
                 pos_encoding_mode="NONE", q_data_type=q.dtype, kv_data_type=caches[0][0].dtype)
    q3 = q[:, :, 0].contiguous()
    return [lambda k=k, v=v: wrapper.run(q3, (k, v)) for k, v in caches]
