"""Calls of CPU graphs from many threads: one at a time, each thread on torch's intra-op thread count.

One lock for the process, re-entrant: run at once, every torch op of a call releases the GIL and waits
to take it back from another thread's Python (8 threads calling one model on a 2-core CPU got
0.57-0.60x one thread's throughput; docs/measurements/host-cost.md). The GIL is the process's, so
the lock is too: graphs of two backends contend for it as much as two calls of one, and a compiled
function calling another (a Python splitting op, recursion through torch.compile) takes it again
in its thread instead of waiting on a second lock another thread holds (no lock order to get wrong).

A thread's first call reads torch.get_num_threads(): torch sets a new thread's OpenMP and MKL thread
count lazily, at its first parallel_for big enough to split, and until then small ops ran OpenMP
teams of the machine's default size in that thread, not torch.set_num_threads' (8 threads at 1
intra-op thread on a 2-core CPU: 0.14x one thread's calls/s, 0.98x once set).
"""
from __future__ import annotations

import threading
from typing import Any, Callable

import torch

LOCK = threading.RLock()
_thread = threading.local()


def enter_thread() -> None:
    """This thread's intra-op thread count set to torch's (torch's own lazy per-thread setup)."""
    torch.get_num_threads()
    _thread.ready = True


def serialized(run: Callable) -> Callable:
    """`run`, called one call at a time in the process."""
    def call(*args: Any) -> Any:
        if not getattr(_thread, "ready", False):
            enter_thread()
        with LOCK:
            return run(*args)

    call.serialized_cpu_calls = True
    return call
