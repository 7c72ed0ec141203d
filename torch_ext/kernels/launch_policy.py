"""Whether a decode op launches its Triton kernel on this call: a per-thread switch the CUDA-graph
runner sets.

torch_ext's decode ops (decode_attention, decode_linear) pay off where a CUDA graph replays their
launches: launched from Python, each Triton kernel costs ~0.1 ms of CPU, more than the GPU time it
saves (docs/guide/decode-kernels.md, "Where the decode ops run"). Their default (None) puts them into graphs compiled for
CUDA graphs, but such a graph also runs without one: a batch above the largest capture size, a
region that cannot be captured, an input that moved. Around those calls the runner names the ops
left to their default, and they run their reference formulation instead (cuBLAS, SDPA: one launch
each from C++). An op the user turned on (True) keeps its kernel everywhere.
"""
from __future__ import annotations

import contextlib
import threading

__all__ = ["launched_from_host", "runs_reference"]

_local = threading.local()


@contextlib.contextmanager
def launched_from_host(ops: frozenset[str]):
    """While inside, the named ops run their reference formulation on this thread."""
    before = getattr(_local, "ops", frozenset())
    _local.ops = before | ops
    try:
        yield
    finally:
        _local.ops = before


def runs_reference(op: str) -> bool:
    """Whether the op named `op` runs its reference here (launched_from_host named it)."""
    return op in getattr(_local, "ops", ())
