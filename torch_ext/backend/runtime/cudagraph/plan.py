"""What a CUDA-graph runner (runner.py) holds for one capture size (`Entry`: static buffers, the graph,
addresses at capture) and precomputes for one runtime batch size (`Plan`: the copies, checks and the
bound replay of the hot path)."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from torch_ext import compat
from torch_ext.backend.runtime.cudagraph.group import GraphKey


@dataclasses.dataclass
class Entry:
    """What one runner holds for one capture size."""

    size: Any  # padded batch size (None for a graph without a dynamic dim)
    key: GraphKey  # RunnerGroup.key
    static_args: list  # what the wrapped callable gets: static buffers, in-place tensors, ints
    buffers: dict[int, torch.Tensor]  # own static buffers by input position
    copy_back: set[int]  # buffered inputs the region writes: copied back to the caller after a run
    graph: Any = None
    outputs: list | None = None  # static outputs (non-owning where nothing outside needs them)
    reused: dict[int, tuple[int, tuple]] = dataclasses.field(default_factory=dict)  # pos -> (ptr, stride)
    addresses: dict[int, int] = dataclasses.field(default_factory=dict)  # in-place inputs at capture
    captured_at: int | None = None  # the batch size of the capturing call


@dataclasses.dataclass
class Plan:
    """A replay at one runtime batch size: everything precomputed so the call does little."""

    entry: Entry
    graph: Any
    copies: list  # (pos, destination view of n rows)
    copy_back: list  # (pos, source view of n rows)
    reused: list  # [pos, ptr, stride, last tensor seen there]: read in place from an earlier graph's output
    pinned: list  # (pos, ptr): read in place, verified on every replay (a move captures again)
    checked: list  # (pos, ptr or const): verified when cudagraph_check_addresses is on
    result: Any
    replay: Callable | None = None  # the graph's C++ replay, bound (skips CUDAGraph.replay's Python frame)
    pinned_at: list = dataclasses.field(default_factory=list)  # positions of `pinned`, for one C++ check
    pinned_ptrs: list = dataclasses.field(default_factory=list)  # their addresses by input position
    weights: int = 0  # the entry's weight set (a plan of another set than the group's is not replayed)
    expanded: list = dataclasses.field(default_factory=list)  # (pos, buffer's one row, dims): Spec.expanded


NO_GRAPH = Plan(None, None, [], [], [], [], [], None)  # type: ignore[arg-type]


def moved_input(plan: Plan, args) -> tuple[int, int] | None:
    """The first pinned input not at its captured address, as (pos, ptr), else None."""
    if not plan.pinned or compat.data_ptrs_equal(list(args), plan.pinned_ptrs, plan.pinned_at):
        return None
    return next((i, ptr) for i, ptr in plan.pinned if args[i].data_ptr() != ptr)
