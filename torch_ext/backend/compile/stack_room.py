"""Run a compile on a Python frame stack with room, so that CPython does not map and unmap stack
memory at every call that crosses a chunk boundary.

CPython (3.11 on) keeps frames in 16 KiB chunks of a per-thread stack; a call that does not fit
maps a new chunk, and the return that empties it unmaps it. Code that calls and returns many
times right at a boundary, such as Inductor's pattern matcher or the partitioner recursing over a
7,000-node joint graph, then pays four page faults per call. Where the boundary falls depends only
on how deep the caller is: measured (torch 2.15, 32-layer Llama training graph, 2-core CPU), the
same joint-graph passes took 18 s and 1.3 M page faults at one depth, 4.7 s and 1.6 k faults at
another. `with_stack_room` calls through a frame that declares a huge value stack it never uses:
CPython gives that frame a fresh 1 MiB chunk, and everything the compile calls fits in the rest.
"""
from __future__ import annotations

from typing import Any, Callable

# Value-stack slots the trampoline declares: 70,000 words (560 KB) do not fit any 16 KiB chunk,
# so the frame gets a chunk of its own; rounding up to 1 MiB leaves ~480 KB, thousands of frames,
# for what it calls. Only the pages those frames use are touched.
_DECLARED_STACK = 70_000


def _call(fn: Callable, args: tuple, kwargs: dict) -> Any:
    return fn(*args, **kwargs)


_call.__code__ = _call.__code__.replace(co_stacksize=_DECLARED_STACK)


def with_stack_room(fn: Callable, *args, **kwargs) -> Any:
    """fn(*args, **kwargs), its callees' frames in a stack chunk with ~480 KB free."""
    return _call(fn, args, kwargs)
