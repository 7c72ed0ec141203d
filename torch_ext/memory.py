"""How much memory a training forward keeps for backward, on any device, without a profiler.

    out, nbytes = activation_bytes(lambda: model(x))    # then out.backward()

Counts every tensor storage that the forward made and that is still alive when it returns: what
autograd saved for backward (seen through saved_tensors_hooks, custom autograd Functions and
compiled graphs included), what Python still holds (the inputs a non-reentrant checkpoint keeps
for its recompute), and the outputs. Storages that existed before (parameters, inputs) are not
counted; each storage counts once, whatever views of it were saved. A byte count, so comparing
two ways of running one model is deterministic (unlike a timing).
"""
from __future__ import annotations

import gc
import warnings
from typing import Any, Callable, Iterable

import torch

__all__ = ["activation_bytes"]


def activation_bytes(forward: Callable[[], Any]) -> tuple[Any, int]:
    """Run `forward()`; return its result and the bytes of storages it made that are still alive."""
    before = _live_storages()
    saved: list[torch.Tensor] = []

    def pack(tensor):
        saved.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = forward()
    held = {**_live_storages(), **_storages(saved)}
    return out, sum(nbytes for ptr, nbytes in held.items() if ptr not in before)


def _live_storages() -> dict[int, int]:
    gc.collect()
    with warnings.catch_warnings():  # isinstance() on every object touches deprecated module attributes
        warnings.simplefilter("ignore")
        return _storages(o for o in gc.get_objects() if isinstance(o, torch.Tensor))


def _storages(tensors: Iterable[torch.Tensor]) -> dict[int, int]:
    """data pointer -> bytes of the storages behind real (not fake or meta) tensors."""
    out = {}
    for tensor in tensors:
        if isinstance(tensor, torch._subclasses.FakeTensor):
            continue
        try:
            if tensor.device.type == "meta":
                continue
            storage = tensor.untyped_storage()
            ptr = storage.data_ptr()
        except Exception:  # sparse, nested: no single storage; half-built subclasses gc still sees; a
            continue       # CUDA-graph output a later replay overwrote (its memory is the pool's)
        if ptr:
            out[ptr] = storage.nbytes()
    return out
