"""A compiled graph with CUDA graphs, called from many threads and CUDA streams at once.

Captured graphs replay over static memory: input buffers, intermediates in the shared pool, and the
outputs they return. Two calls in flight would copy into, replay over and read back the same memory,
and in piecewise mode a piece's static outputs are still read by the splitting op and the pieces after
it. `SerializedGraph` wraps what the backend returns when CUDA graphs are on:

* one call at a time: a lock around the whole forward (host side);
* device side, each call's work on its own stream waits for an event recorded after the previous
  call's work, on whatever stream that ran: the GPU never runs two calls over the same buffers;
* once calls have come from more than one thread, outputs made by the graph are copied into tensors
  of the caller's own before the next call may start: a call cannot overwrite what another thread
  still reads. With one thread, an output lives until the next call at its batch size (as with
  reduce-overhead), and is not copied.

One lock means N threads get at most one thread's throughput of the graphs (bench/concurrency.py
measures it); the work between calls (the caller's own) still runs in parallel.
"""
from __future__ import annotations

import logging
import threading
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree

log = logging.getLogger("torch_ext.backend.cudagraph")


class SerializedGraph:
    """Calls `fn` (a split graph with CUDA-graph runners, or a full-graph runner) one call at a time."""

    def __init__(self, fn: Callable, name: str):
        self.fn = fn
        self.name = name
        self._lock = threading.RLock()  # re-entrant: full_and_piecewise falls back into its own pieces
        self._event: torch.cuda.Event | None = None  # after the last call's device work
        self._device: torch.device | None = None
        self._thread: int | None = None  # the only thread seen so far
        self.copies_outputs = False  # calls have come from more than one thread

    def __repr__(self) -> str:
        return f"SerializedGraph({self.name})"

    def __getattr__(self, name: str) -> Any:  # the wrapped split graph's attributes (tests, dumps)
        if name == "fn":
            raise AttributeError(name)
        return getattr(self.fn, name)

    def __call__(self, *args):
        with self._lock:
            self._note_thread()
            device = self._device or self._find_device(args)
            if device is not None and self._event is not None:
                torch.cuda.current_stream(device).wait_event(self._event)
            out = self.fn(*args)
            if self.copies_outputs:
                out = _own_outputs(out, args)
            if device is not None:
                if self._event is None:
                    self._event = torch.cuda.Event()
                self._event.record(torch.cuda.current_stream(device))
            return out

    def _note_thread(self) -> None:
        me = threading.get_ident()
        if self._thread is None:
            self._thread = me
        elif me != self._thread and not self.copies_outputs:
            self.copies_outputs = True
            log.info("torch_ext: %s is called from more than one thread: its calls run one at a time, and "
                     "each returns outputs of its own (copied out of the graphs' static memory)", self.name)

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
