"""Calls of compiled graphs from many threads: one at a time in the process, each thread on torch's
intra-op thread count.

One lock for the process, re-entrant. Run at once, every torch op of a call releases the GIL and
waits to take it back from another thread's Python: the thread in a call loses the GIL to threads
running Dynamo's guards or their own code, at every op (8 threads calling one model on a 2-core CPU
got 0.57-0.60x one thread's throughput; on an H100, 0.37-0.57x with or without CUDA graphs;
docs/measurements/host-cost.md). Waiting on the lock releases the GIL, so the thread in a call runs
its Python uncontended. The GIL is the process's, so the lock is too: graphs of two backends contend
for it as much as two calls of one, and a compiled function calling another (a Python splitting op,
recursion through torch.compile) takes it again in its thread instead of waiting on a second lock
another thread holds (no lock order to get wrong). Who takes it: CPU graphs (`serialized`), the
CUDA-graph runners' call order (runtime/cudagraph/concurrency.py: their static memory allows one
call at a time), and `torch_ext.compile`'s guard-free dispatcher around its whole call (guards and
graphs), so a call's Python runs uncontended from its first line. GPU work stays asynchronous: a
call holds the lock while it queues kernels, not while they run.

A thread's first call reads torch.get_num_threads(): torch sets a new thread's OpenMP and MKL thread
count lazily, at its first parallel_for big enough to split, and until then small ops ran OpenMP
teams of the machine's default size in that thread, not torch.set_num_threads' (8 threads at 1
intra-op thread on a 2-core CPU: 0.14x one thread's calls/s, 0.98x once set).
"""
from __future__ import annotations

import threading
from typing import Any, Callable

import torch

from torch_ext.process_lock import LOCK  # noqa: F401 (the lock this module's calls take)

_thread = threading.local()


def enter_thread() -> None:
    """This thread's intra-op thread count set to torch's (torch's own lazy per-thread setup)."""
    torch.get_num_threads()
    _thread.ready = True


def ready_thread() -> None:
    """enter_thread once per thread."""
    if not getattr(_thread, "ready", False):
        enter_thread()


def serialized(run: Callable) -> Callable:
    """`run`, called one call at a time in the process."""
    def call(*args: Any) -> Any:
        if not getattr(_thread, "ready", False):
            enter_thread()
        with LOCK:
            return run(*args)

    call.serialized_calls = True
    return call
