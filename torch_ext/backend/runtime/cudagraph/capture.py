"""The capture itself and the memory every graph of one backend shares: one private pool and one
capture stream per device, and which storages are outputs of a graph of which size (a later piece's
graph reads such an input where it lies, not from a copy). The manager (manager.py) is a GraphCapture;
runners reach these through it (group.GraphServices)."""
from __future__ import annotations

import logging
import time
from typing import Any, Callable

import torch
import tqdm

from torch_ext import compat
from torch_ext.backend.config import CompileConfig
from torch_ext.backend.runtime.cudagraph.errors import CudaGraphCaptureError
from torch_ext.backend.runtime.cudagraph.stats import cudagraph_stats

log = logging.getLogger("torch_ext.backend.cudagraph")  # the name docs/guide/troubleshooting.md documents

_NOT_AN_OUTPUT = object()


class GraphCapture:
    """The shared pool, the capture stream and the output storages of one backend's graphs."""

    def __init__(self):
        self._pools: dict[Any, Any] = {}
        self._streams: dict[Any, Any] = {}
        self._output_storages: dict[int, Any] = {}  # storage address -> capture size of the graph writing it

    def note_outputs(self, outs: list, size) -> None:
        for o in outs:
            if isinstance(o, torch.Tensor):
                self._output_storages[o.untyped_storage().data_ptr()] = size

    def output_view(self, arg: torch.Tensor, size, padded_shape: list[int]) -> torch.Tensor | None:
        """If arg lives in the output of a graph captured for `size`, the same view of it with the
        padded shape (what a graph of this size reads), else None."""
        storage = arg.untyped_storage()
        if self._output_storages.get(storage.data_ptr(), _NOT_AN_OUTPUT) != size:  # size None: static shapes
            return None
        if list(arg.shape) == padded_shape:
            return arg
        end = arg.storage_offset() + sum((s - 1) * st for s, st in zip(padded_shape, arg.stride())) + 1
        if min(padded_shape, default=1) < 1 or end * arg.element_size() > storage.nbytes():
            return None
        return arg.as_strided(padded_shape, arg.stride(), arg.storage_offset())

    def capture(self, fn: Callable, args: list, device: torch.device, name: str, size):
        label = f"{name} at batch size {size}"
        pool = self._pools.get(device)
        if pool is None:
            with torch.cuda.device(device):
                pool = self._pools[device] = torch.cuda.graph_pool_handle()
                self._streams[device] = torch.cuda.Stream(device)
        stream = self._streams[device]
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_reserved(device)
        start = time.perf_counter()
        stream.wait_stream(torch.cuda.current_stream(device))
        index = device.index if device.index is not None else torch.cuda.current_device()
        rng_state = compat.rng_state_before_capture(index)
        try:
            with torch.cuda.device(device), torch.cuda.stream(stream):
                graph.capture_begin(pool=pool, capture_error_mode="thread_local")
                try:
                    out = fn(*args)
                except BaseException:
                    try:  # end the capture, but report what broke it
                        graph.capture_end()
                    except Exception:
                        pass
                    raise
                graph.capture_end()
        except Exception as e:
            compat.recover_from_failed_capture(index, pool, rng_state)
            with torch.cuda.device(device):  # the failed capture's pool id stays taken (see compat)
                self._pools[device] = torch.cuda.graph_pool_handle()
            raise CudaGraphCaptureError(
                f"torch_ext could not capture a CUDA graph of {label}: {type(e).__name__}: {e}\n"
                "Captured code must stay on the GPU: no .item()/.tolist()/print of tensor values, no CPU "
                "tensors, no host synchronization. Make such an op a splitting op (it then runs between "
                "graphs in cudagraph_mode='piecewise'), or use cudagraph_mode='none'.") from e
        torch.cuda.current_stream(device).wait_stream(stream)
        elapsed = time.perf_counter() - start
        grown = torch.cuda.memory_reserved(device) - before
        cudagraph_stats.captures += 1
        cudagraph_stats.capture_seconds += elapsed
        cudagraph_stats.capture_bytes += max(grown, 0)
        cudagraph_stats.sizes.add(size)
        log.debug("torch_ext: captured %s in %.1f ms (+%d bytes reserved)", label, elapsed * 1e3, grown)
        return graph, out


def capture_sizes(step: Callable[[int], Any], config: CompileConfig) -> None:
    """Warm up and capture every size of config.cudagraph_capture_sizes by calling step(size)
    (which runs one forward at that batch size) enough times; largest size first, so the smaller
    sizes' graphs reuse the pool memory of the larger ones. Shows a tqdm bar."""
    sizes = sorted(config.cudagraph_capture_sizes, reverse=True)
    calls = max(1, config.cudagraph_num_warmup) + 1
    disable = {True: False, False: True, None: None}[config.progress_bar]
    for size in tqdm.tqdm(sizes, desc="torch_ext capturing CUDA graphs", unit="size", disable=disable):
        for _ in range(calls):
            step(size)
