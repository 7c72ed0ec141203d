"""Gradients that a CUDA-graphed backward left in the trees' pool, moved out only where they must be.

Under `training_cudagraphs` a backward graph's pieces replay under Inductor's CUDA-graph trees, so its
gradients live in the trees' pool, and AccumulateGrad keeps such a tensor as `.grad` where the
parameter had none. At the next forward the trees start a new generation and mark every output of
the last one still alive as overwritten: a `.grad` that is still there then (gradient accumulation
over micro-batches, `zero_grad(set_to_none=False)`) would raise at its `+=`, as it does under
`mode="reduce-overhead"`.

Copying every gradient out after each backward fixes that but holds the gradients twice (the pool
keeps its memory) and costs a copy per gradient per step. Instead, before the first forward after a
graphed backward, only the `.grad` tensors still pointing into that backward's outputs are replaced by
copies: none in the usual loop (`zero_grad()` sets them to None first), one copy per gradient per
step where they accumulate.
"""
from __future__ import annotations

import dataclasses
import weakref
from typing import Any, Callable, Sequence

import torch

from torch_ext.backend.counters import counters


@dataclasses.dataclass
class LeafScan:
    """What one graph's last scan of its inputs saw, so that a call with the same leaves skips the scan
    (one Python test per parameter: 1.3-1.9 us each on a CPU thread, 0.4-0.6 ms a forward at 291)."""

    length: int = -1
    leaf_positions: tuple[int, ...] = ()
    leaf_ids: tuple[int, ...] = ()
    non_leaf_positions: tuple[int, ...] = ()  # inputs that required grad without being leaves
    forgotten: int = -1  # PoolGradients.forgotten then


class PoolGradients:
    """Process-wide: the trees' generations are. Leaves are the training graphs' inputs that
    AccumulateGrad may hand a gradient to (leaf tensors that require grad), noted as they come."""

    def __init__(self):
        self._leaves: dict[int, weakref.ref] = {}  # id -> weakref, so a lookup costs no weakref
        self._pool_storages: set[int] = set()  # storage addresses of the last graphed backward's outputs
        self.forgotten = 0  # noted leaves that died: an id seen before may now be another tensor's
        self.scans = 0

    def note_leaves(self, args: Sequence[Any], last: LeafScan | None = None) -> None:
        """Note a training graph's inputs that AccumulateGrad may hand a gradient to. `last`: that
        graph's last scan, skipped where its leaves are the same objects: the same ids while no noted
        leaf has died (a live object's id is its own). A position that held a non-leaf may hold a new
        leaf: those are tested. One whose tensor did not require grad cannot: Dynamo guards
        requires_grad, so such a call runs another graph."""
        if last is not None and last.length == len(args) and last.forgotten == self.forgotten \
                and tuple(map(id, map(args.__getitem__, last.leaf_positions))) == last.leaf_ids \
                and not any(isinstance(args[i], torch.Tensor) and args[i].is_leaf for i in last.non_leaf_positions):
            return
        self.scans += 1
        leaf_positions, non_leaf_positions = [], []
        for i, leaf in enumerate(args):
            if not (isinstance(leaf, torch.Tensor) and leaf.requires_grad):
                continue
            if not leaf.is_leaf:
                non_leaf_positions.append(i)
                continue
            leaf_positions.append(i)
            key = id(leaf)
            ref = self._leaves.get(key)
            if ref is None or ref() is not leaf:  # new, or an id reused by a later object
                self._leaves[key] = weakref.ref(leaf, lambda _, key=key: self._forget(key))
        if last is not None:
            last.length, last.forgotten = len(args), self.forgotten
            last.leaf_positions, last.non_leaf_positions = tuple(leaf_positions), tuple(non_leaf_positions)
            last.leaf_ids = tuple(id(args[i]) for i in leaf_positions)

    def _forget(self, key: int) -> None:
        self.forgotten += 1
        ref = self._leaves.get(key)
        if ref is not None and ref() is None:
            del self._leaves[key]

    def after_backward(self, outputs: Sequence[Any]) -> None:
        """A graphed backward returned `outputs`: its tensors are the pool's until the next forward
        (one step may run several graphs' backwards)."""
        self._pool_storages.update(t.untyped_storage().data_ptr() for t in outputs if isinstance(t, torch.Tensor))

    def before_forward(self) -> None:
        """Move every `.grad` still in the last graphed backward's outputs into memory of its own."""
        if not self._pool_storages:
            return
        pool, self._pool_storages = self._pool_storages, set()
        with torch.no_grad():
            for ref in list(self._leaves.values()):
                leaf = ref()
                grad = None if leaf is None else leaf.grad
                if grad is not None and grad.untyped_storage().data_ptr() in pool:
                    leaf.grad = grad.clone()
                    counters.pool_gradients_moved += 1


POOL_GRADIENTS = PoolGradients()


class GraphedBackward:
    """A backward graph replayed under the trees: its outputs noted as the pool's (`POOL_GRADIENTS`).
    Passed through as they are where Inductor has turned the graphs off (`box`)."""

    def __init__(self, run: Callable, box: Any):
        self.run = run
        self.box = box
        # AOTAutograd hands a list it may clear. In the instance's dict: the disable wrapper AOTAutograd
        # puts around a backward copies the wrapped object's __dict__, not its class attributes.
        self._boxed_call = True

    def __call__(self, args: list) -> Any:
        outs = self.run(args)
        if self.box:
            POOL_GRADIENTS.after_backward(outs)
        return outs
