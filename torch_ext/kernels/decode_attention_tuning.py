"""Which launch serves a decode_attention shape, chosen by timing the candidates on this GPU.

A shape is (batch, heads, kv heads, cache length, head dim, dtype, mask). Its candidates: the table's
launch (kernels/decode_attention.py), SDPA itself (what the rewrite replaces, with HF's repeated kv
heads), and the Triton kernels under other tiles, warps, stages and split counts. One table cannot
serve every shape: on an H200 the best of a sweep differed by shape by up to 15%, and a config that won
one sweep lost over the whole grid (bench/results/decode_attention_*). Each candidate that computes
the right result is timed in a CUDA graph over enough copies of the cache that they do not fit in L2
(each layer of a decode step reads its own cache from HBM); the fastest wins. Where SDPA wins the
rewrite leaves the call alone; otherwise the winner goes into the op's `config`, so a saved graph
brings its choice back. Kept like decode_linear's choices (kernels/tuning_store.py).
"""
from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Callable

import torch

from torch_ext.kernels import decode_attention as op, tuning_store as store
from torch_ext.kernels.fused_add_rms_norm import has_triton

log = logging.getLogger("torch_ext.backend")

# Launches timed beside the table's: (kernel, positions per tile, warps, stages); the grouped kernel
# serves MHA too (one real row of its tl.dot), the per-head one only MHA (with grouped heads it reads
# the cache once per query head). Each also with twice the programs, for long caches over few rows,
# and two with one split per row.
GROUPED_ALTERNATIVES = ((1, 64, 4, 2), (1, 64, 4, 3), (1, 128, 4, 2), (1, 32, 4, 2), (1, 128, 8, 2))
PER_HEAD_ALTERNATIVES = ((0, 32, 2, 2), (0, 64, 4, 2), (0, 128, 4, 2))
_MAX_THREE_STAGE_HEAD_DIM = 128  # three 256-wide stages of k and v need 192 KiB of shared memory
_CACHE_COPIES = 64  # at most: a short cache is a few hundred KiB, and L2 holds 50 MiB


@dataclasses.dataclass(frozen=True)
class Shape:
    b: int
    h: int
    hkv: int
    length: int
    d: int
    dtype: torch.dtype
    mask: str  # "none", "bool" or "float"
    mask_per_head: bool  # (B, H, 1, L); else broadcast over heads, (B, 1, 1, L)

    @classmethod
    def of(cls, q, k, mask) -> "Shape | None":
        """The shape of decode_attention(q, k, ..., mask); None where a size is symbolic (no one shape
        to time)."""
        sizes = (*q.shape, *k.shape, *(mask.shape if mask is not None else ()))
        if not all(isinstance(s, int) for s in sizes):
            return None
        kind = "none" if mask is None else "bool" if mask.dtype == torch.bool else "float"
        per_head = mask is not None and mask.shape[1] != 1
        return cls(q.shape[0], q.shape[1], k.shape[1], k.shape[2], q.shape[3], q.dtype, kind, per_head)

    def key(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        return (f"{self.b},{self.h},{self.hkv},{self.length},{self.d},{dtype},{self.mask}"
                f"{'-heads' if self.mask_per_head else ''}")


class Choice(store.Choice):
    """path "triton" (config: op.Launch.encode()) or "sdpa"."""

    def encode(self) -> list[int] | None:
        """The op's `config` argument (None for SDPA: the rewrite leaves that call alone)."""
        return None if self.path == "sdpa" else list(self.config)


def candidates(shape: Shape, device: torch.device) -> list[Choice]:
    """The table's launch first (what runs where nothing could be timed), SDPA, then the alternatives."""
    if not has_triton() or shape.d > 256:
        return [Choice("sdpa")]
    table = op.default_launch(shape.b, shape.h, shape.hkv, shape.d).encode()
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    programs = 2 * sms
    launches = [tuple(table), *((*c, programs) for c in GROUPED_ALTERNATIVES)]
    if shape.h == shape.hkv:
        launches += [(*c, programs) for c in PER_HEAD_ALTERNATIVES]
    launches.append((*table[:4], 2 * programs))
    # One split per row where the rows fit in one wave: no float32 partials and no combine launch
    # (8 x 32 x 16 x 256 on an H200: 8.1 against 9.3 us). Over more rows the tuner's timing picked it
    # where it ran 1.2x slower in the bench (32 x 32 x 8 x 1024: 46.0 against 38.2 us).
    if shape.b * shape.hkv <= sms:  # rows of either kernel (the per-head one serves MHA only)
        launches += [(*table[:4], 1), (1, 128, 4, 2, 1)]
    if shape.d > _MAX_THREE_STAGE_HEAD_DIM:
        launches = [c for c in launches if c[3] < 3]
    out = [Choice("triton", c) for c in dict.fromkeys(launches)]
    return [out[0], Choice("sdpa"), *out[1:]]


def _sdpa(q, k, v, mask, scale):
    """The call as the model made it: HF's repeat_kv of grouped heads (expand + reshape: capturable), SDPA."""
    b, hkv, length, d = k.shape
    n = q.shape[1] // hkv
    if n > 1:
        k = k[:, :, None].expand(b, hkv, n, length, d).reshape(b, hkv * n, length, d)
        v = v[:, :, None].expand(b, hkv, n, length, d).reshape(b, hkv * n, length, d)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def _run(choice: Choice, q, k, v, mask, scale):
    if choice.path == "sdpa":
        return _sdpa(q, k, v, mask, scale)
    return op.decode_attention_triton(q, k, v, mask, scale, op.checked_config(list(choice.config)))


def measure_cuda(shape: Shape, choices: list[Choice], device: torch.device) -> dict[Choice, float]:
    """Microseconds per call of each choice that computes attention right (others are left out); none
    where the copies of the cache would not fit beside what the process holds."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    esize = torch.finfo(shape.dtype).bits // 8
    cache_bytes = 2 * shape.b * shape.hkv * shape.length * shape.d * esize
    copies = store.copies_beyond_l2(cache_bytes, device, most=_CACHE_COPIES)
    room = torch.cuda.mem_get_info(device)[0] // 2
    if copies * cache_bytes > room:
        copies = 1
        if cache_bytes > room:
            log.info("torch_ext: decode_attention %s not tuned: a copy of its cache (%.0f MiB) does not fit "
                     "beside what this process holds; the built-in launch runs", shape.key(), cache_bytes / 2**20)
            return store.Times(transient="no room beside what the process holds")
    times = store.Times()
    with unset_fake_temporarily(), torch.no_grad(), torch.cuda.device(device):
        g = torch.Generator(device=device).manual_seed(0)
        q = torch.randn(shape.b, shape.h, 1, shape.d, device=device, generator=g).to(shape.dtype)
        caches = [tuple(torch.randn(shape.b, shape.hkv, shape.length, shape.d, device=device, generator=g)
                        .to(shape.dtype) for _ in range(2)) for _ in range(copies)]
        mask = _mask(shape, device, g)
        scale = shape.d ** -0.5
        k0, v0 = caches[0]
        ref = op.decode_attention_reference(q.double(), k0.double(), v0.double(),
                                            mask if mask is None or mask.dtype == torch.bool else mask.double(), scale)
        for choice in choices:
            try:
                out = _run(choice, q, k0, v0, mask, scale)
                err = ((out.double() - ref).norm() / ref.norm()).item()
                if not err < 2e-2:  # NaN too: a candidate that is wrong here is never chosen
                    log.warning("torch_ext: decode_attention candidate %s is wrong on %s (relative error "
                                "%.2e); left out", choice.label(), shape.key(), err)
                    continue
                times[choice] = store.time_in_graph(
                    [lambda k=k, v=v, c=choice: _run(c, q, k, v, mask, scale) for k, v in caches], device)
            except Exception as e:  # noqa: BLE001 - a launch that cannot run here (shared memory) is not chosen
                torch.cuda.synchronize()
                log.info("torch_ext: decode_attention candidate %s failed on %s (%s: %s); left out",
                         choice.label(), shape.key(), type(e).__name__, str(e)[:200])
                if store.is_transient(e):
                    times.transient = f"{choice.label()} ran out of memory"
        del caches, ref
    torch.cuda.empty_cache()  # the copies of the cache: not held as reserved memory afterwards
    return times


def _mask(shape: Shape, device: torch.device, g: torch.Generator) -> torch.Tensor | None:
    """A mask of the shape's kind attending to nine positions in ten (the kernels read it whole)."""
    if shape.mask == "none":
        return None
    heads = shape.h if shape.mask_per_head else 1
    keep = torch.rand(shape.b, heads, 1, shape.length, device=device, generator=g) < 0.9
    keep[..., 0] = True
    if shape.mask == "bool":
        return keep
    return torch.zeros(keep.shape, device=device, dtype=shape.dtype).masked_fill(~keep, float("-inf"))


class Tuner(store.MeasuredChoices):
    """decode_attention launches per shape (MeasuredChoices)."""

    kind = "decode_attention"
    choice_type, paths, gpu_measure = Choice, ("sdpa", "triton"), staticmethod(measure_cuda)
    # H200, the grid beside FlashInfer (bench/results/decode_attention_tuned_h200_torch2.11.log): with no
    # margin the tuner's pick ran 1.07-1.09x the table's time on three of 48 shapes when timed again
    # (launches within a few per cent of each other); the table's launch holds those.
    margin = 0.05
    _memo: dict[tuple, object] = {}
    _warned: set[str] = set()
    measured = 0  # shapes timed in this process (counters.tuned_shapes)

    def __init__(self, directory: str | None,
                 measure: Callable[[Shape, list[Choice], torch.device], dict[Choice, float]] = measure_cuda,
                 candidates: Callable[[Shape, torch.device], list[Choice]] = candidates,
                 file_name: Callable[[torch.device], str] = functools.partial(store.file_name, "decode_attention")):
        super().__init__(directory, measure, candidates, file_name)
