"""A compiled graph with CUDA graphs, called from many threads and CUDA streams at once.

Captured graphs replay over static memory: input buffers, intermediates in the pool every graph of
the backend shares, and the outputs they return. Two calls in flight would copy into, replay over and
read back the same memory (also two different graphs: Dynamo's graph for batch 1 and its symbolic one
share the pool), and in piecewise mode a piece's static outputs are still read by the splitting op and
the pieces after it. `SerializedGraph` wraps what the backend returns when CUDA graphs are on:

* one call at a time among all graphs of the process (`CallOrder`): the process's call lock around the
  whole forward (runtime/serial_calls.py);
* device side, a call on another stream than the previous call's waits for the work on that stream
  (an event recorded there): the GPU never runs two calls over the same buffers. Calls on one stream
  are ordered by the stream itself, so they pay only one C++ query of the current stream (a query
  through torch.cuda.current_stream and an event per call cost ~20 us, a third of a layer's call in
  regional compilation);
* once calls have come from more than one thread, outputs made by the graph are copied into tensors
  of the caller's own before the next call may start: a call cannot overwrite what another thread
  still reads. With one thread, an output lives until the next call at its batch size (as with
  reduce-overhead), and is not copied.

One lock means N threads get at most one thread's throughput of the graphs (bench/dev/concurrency.py
measures it); the work between calls (the caller's own) still runs in parallel.
"""
from __future__ import annotations

import logging
import threading
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree

from torch_ext import compat
from torch_ext.backend.runtime import serial_calls

log = logging.getLogger("torch_ext.backend.cudagraph")


class CallOrder:
    """One call at a time over the graphs of one backend, which share one memory pool: a lock, the
    stream of the last call's device work, and which threads have called."""

    def __init__(self):
        # The process's call lock (re-entrant: full_and_piecewise falls back into its own pieces; one
        # lock for every backend: no lock order between graphs calling graphs; runtime/serial_calls.py).
        self.lock = serial_calls.LOCK
        self.stream: torch.cuda.Stream | None = None  # where the last call's work ran
        self.raw_stream: int | None = None  # its cudaStream_t (a cheap comparison)
        self.thread: int | None = None  # the only thread seen so far
        self.copies_outputs = False  # calls have come from more than one thread

    def note_thread(self, name: str) -> None:
        me = threading.get_ident()
        if self.thread is None:
            self.thread = me
        elif me != self.thread and not self.copies_outputs:
            self.copies_outputs = True
            log.info("torch_ext: %s is called from more than one thread: its graphs run one call at a time, "
                     "and each call returns outputs of its own (copied out of the graphs' static memory)", name)


class SerializedGraph:
    """Calls `fn` (a split graph with CUDA-graph runners, or a full-graph runner) in `order`: one call
    at a time among all graphs sharing it (a backend's graphs share their memory pool)."""

    def __init__(self, fn: Callable, name: str, order: CallOrder):
        self.fn = fn
        self.name = name
        self.order = order
        self._device: torch.device | None = None

    def __repr__(self) -> str:
        return f"SerializedGraph({self.name})"

    def __getattr__(self, name: str) -> Any:  # the wrapped split graph's attributes (tests, dumps)
        if name == "fn":
            raise AttributeError(name)
        return getattr(self.fn, name)

    @property
    def copies_outputs(self) -> bool:
        return self.order.copies_outputs

    def __call__(self, *args):
        order = self.order
        with order.lock:
            order.note_thread(self.name)
            device = self._device or self._find_device(args)
            if device is not None:
                raw = compat.current_raw_stream(device.index)
                if raw != order.raw_stream:  # another stream: wait for the last call's work
                    stream = torch.cuda.current_stream(device)
                    if order.stream is not None:
                        stream.wait_stream(order.stream)
                    order.stream, order.raw_stream = stream, raw
            out = self.fn(*args)
            if order.copies_outputs:
                out = _own_outputs(out, args)
            return out

    def _find_device(self, args) -> torch.device | None:
        for a in args:
            if isinstance(a, torch.Tensor) and a.is_cuda:
                self._device = a.device
                return a.device
        return None


def _own_outputs(out, args):
    """`out` with every tensor the graph made (not an input, not one that records autograd, which a
    replay never returns) copied, so no later call can overwrite it."""
    inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor) and a.device.type != "meta"}

    def own(t: torch.Tensor) -> torch.Tensor:
        if t.requires_grad or t.untyped_storage().data_ptr() in inputs:
            return t
        return t.clone()

    return pytree.tree_map_only(torch.Tensor, own, out)
