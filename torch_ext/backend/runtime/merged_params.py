"""The buffers behind merged projections (rewrite/merge_projections.py), kept true to the parameters.

Per merged group, one buffer holds the weights concatenated along dim 0 (and one the biases). Each
parameter's `.data` is rebound to its rows of the buffer, so its old storage is freed (no second
copy) and in-place updates (optimizer steps, `copy_`, `load_state_dict`) write the buffer. Every call
checks that each grouped argument still is its slice (one data_ptr per parameter); one that is not
(`param.data = t`, `load_state_dict(assign=True)`, a new nn.Parameter) is copied into the buffer and
rebound again. The buffers never move, so CUDA graphs read them in place.

Parameters that already are consecutive rows of one storage (another graph of the model merged them,
or they were loaded that way) are used where they are: that storage is the buffer.
"""
from __future__ import annotations

import logging
import threading
from typing import Any, Callable

import torch

from torch_ext import compat
from torch_ext.backend.rewrite.merge_projections import ALIGNMENT, MergePlan

log = logging.getLogger("torch_ext.backend")


class _Slots:
    """One buffer and the graph inputs that are its row slices."""

    def __init__(self, inputs: tuple[int, ...], rows: tuple[int, ...], row_shape: tuple[int, ...]):
        self.inputs = inputs
        self.rows = rows
        self.row_shape = row_shape  # (in_features,) for weights, () for biases
        self.buffer: torch.Tensor | None = None

    def shape(self, rows: int) -> tuple[int, ...]:
        return (rows,) + self.row_shape

    def slices(self) -> list[torch.Tensor]:
        return list(torch.split(self.buffer, list(self.rows)))

    def create(self, params: list[torch.Tensor]) -> None:
        """The buffer: the parameters' own storage where they already lie in it in order, else new."""
        shape = self.shape(sum(self.rows))
        self.buffer = _shared_storage(params, shape)
        if self.buffer is None:  # filled by the rebinding that follows
            self.buffer = torch.empty(shape, dtype=params[0].dtype, device=params[0].device)

    def expected(self) -> list[tuple[int, int]]:
        """(input position, data_ptr) of every slice, for the per-call check."""
        return [(i, s.data_ptr()) for i, s in zip(self.inputs, self.slices())]


def _shared_storage(params: list[torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor | None:
    first = params[0]
    if first.data_ptr() % ALIGNMENT or any(p.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
                                           or p.dtype != first.dtype or not p.is_contiguous() for p in params):
        return None
    offset = first.storage_offset()
    for p in params:
        if p.storage_offset() != offset:
            return None
        offset += p.numel()
    if offset * first.element_size() > first.untyped_storage().nbytes():
        return None
    return torch.empty(0, dtype=first.dtype, device=first.device).set_(
        first.untyped_storage(), first.storage_offset(), shape)


class MergedParams:
    """Calls `compiled` with the merged buffers after the graph's own arguments, having checked that
    every grouped parameter still is its slice of them. Other attributes are the compiled callable's
    (tests and tools read the split graph through it)."""

    def __init__(self, compiled: Callable, plan: MergePlan, name: str):
        self.compiled = compiled
        self.plan = plan
        self.name = name
        self.slots: list[_Slots] = []
        for group in plan.groups:
            self.slots.append(_Slots(group.weight_inputs, group.rows, (group.in_features,)))
            if group.bias_inputs:
                self.slots.append(_Slots(group.bias_inputs, group.rows, ()))
        self.buffers: tuple[torch.Tensor, ...] = ()
        self._expected: tuple[tuple[int, int], ...] = ((plan.groups[0].weight_inputs[0], -1),)  # unbound
        self._at, self._ptrs = compat.address_check(self._expected, plan.original_inputs)  # the per-call check
        self._lock = threading.Lock()
        self._said = False

    def bind(self, args) -> None:
        """Make the buffers from the parameters in `args` (real tensors; not fake ones of a graph
        loaded for a warm start: then the first call does it) and rebind the parameters to them."""
        if all(_is_real(args[i]) for slot in self.slots for i in slot.inputs):
            with self._lock:
                self._rebind(args)

    def __call__(self, *args):
        # One C++ call over every grouped parameter (the hot path: ~100 parameters in a 16-layer model).
        if not compat.data_ptrs_equal(list(args), self._ptrs, self._at):
            with self._lock:
                self._rebind(args)
        return self.compiled(*args, *self.buffers)

    def __getattr__(self, name: str) -> Any:
        if name == "compiled":
            raise AttributeError(name)
        return getattr(self.compiled, name)

    def _rebind(self, args) -> None:
        if all(args[i].data_ptr() == ptr for i, ptr in self._expected):
            return  # another thread did it
        # Outside inference mode: an inference tensor as a parameter's storage would refuse training.
        with torch.inference_mode(False), torch.no_grad():
            if not self.buffers:
                for slot in self.slots:
                    slot.create([args[i] for i in slot.inputs])
                self.buffers = tuple(slot.buffer for slot in self.slots)
            elif not self._said:
                self._said = True
                log.info("torch_ext: %s: parameters of merged projections were replaced or rebound since the "
                         "compile; copying them into their merged buffers (once per change)", self.name)
            for slot in self.slots:
                for i, piece in zip(slot.inputs, slot.slices()):
                    param = args[i]
                    if param.data_ptr() == piece.data_ptr():
                        continue
                    if param.shape != piece.shape or param.dtype != piece.dtype or param.device != piece.device:
                        raise RuntimeError(
                            f"torch_ext: {self.name}: a merged parameter changed from {tuple(piece.shape)} "
                            f"{piece.dtype} on {piece.device} to {tuple(param.shape)} {param.dtype} on "
                            f"{param.device} without a recompile; call torch._dynamo.reset() and compile again")
                    piece.copy_(param.detach())
                    param.data = piece
        self._expected = tuple(pair for slot in self.slots for pair in slot.expected())
        self._at, self._ptrs = compat.address_check(self._expected, self.plan.original_inputs)


def _is_real(value) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return isinstance(value, torch.Tensor) and not is_fake(value) and value.device.type != "meta"
