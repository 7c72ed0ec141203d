"""Counters of torch_ext's CUDA graphs (captures, replays, memory), one instance per process."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class CudaGraphStats:
    captures: int = 0  # graphs captured
    replays: int = 0
    recaptures: int = 0  # graphs dropped to be captured again (an in-place input moved)
    uncaptured_runs: int = 0  # calls that ran without a graph (warm-up, too large, not capturable)
    capture_seconds: float = 0.0  # wall time inside capture (warm-up runs not included)
    capture_bytes: int = 0  # growth of reserved device memory during captures: the pools
    static_input_bytes: int = 0  # static input buffers (outside the pools)
    sizes: set = dataclasses.field(default_factory=set)  # capture sizes with at least one graph

    def reset(self) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default)


cudagraph_stats = CudaGraphStats()
