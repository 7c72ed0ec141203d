"""The buffers behind merged projections (rewrite/merge_projections.py), kept true to the parameters.

Per merged group, one buffer holds the weights concatenated along dim 0 (and one the biases). Each
parameter's `.data` is rebound to its rows of the buffer, so its old storage is freed (no second
copy) and in-place updates (optimizer steps, `copy_`, `load_state_dict`) write the buffer. Every call
checks that each grouped argument still is its slice (one data_ptr per parameter); one that is not
(`param.data = t`, `load_state_dict(assign=True)`, a new nn.Parameter) is copied into the buffer and
rebound again. The buffers never move, so CUDA graphs read them in place. Modules that share one
compiled graph (identical layers compiled one by one) each get buffers of their own.

Parameters that already are consecutive rows of one storage (another graph of the model merged them,
or they were loaded that way) are used where they are: that storage is the buffer.
"""
from __future__ import annotations

import logging
import threading
import weakref
from typing import Any, Callable

import torch

from torch_ext import compat, process_lock
from torch_ext.backend.counters import counters
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


# The set each parameter is bound to now: id -> (the parameter, the set), both weakly. A set whose
# parameter another set takes into storage of its own (the model moved by `.to()` and compiled again:
# the old graph is never called again) drops its buffers, so no second copy of the weights stays
# behind; called again, it makes them anew.
_OWNERS: dict[int, tuple[weakref.ref, weakref.ref]] = {}
_OWNERS_LOCK = threading.Lock()


def _claim(param: torch.Tensor, owner: "_ParamSet") -> None:
    key = id(param)
    with _OWNERS_LOCK:
        entry = _OWNERS.get(key)
        previous = entry[1]() if entry is not None and entry[0]() is param else None

        def forget(ref, key=key):
            with _OWNERS_LOCK:
                if _OWNERS.get(key, (None,))[0] is ref:
                    del _OWNERS[key]

        _OWNERS[key] = (weakref.ref(param, forget), weakref.ref(owner))
    if previous is not None and previous is not owner and not previous.holds(param):
        previous.release()


class _ParamSet:
    """The buffers of one set of parameters (one module's: several modules may share a compiled graph,
    as regional compilation of identical layers does) and the per-call check that the parameters
    still are their slices."""

    def __init__(self, plan: MergePlan):
        self.plan = plan
        self.slots: list[_Slots] = []
        for group in plan.groups:
            self.slots.append(_Slots(group.weight_inputs, group.rows, (group.in_features,)))
            if group.bias_inputs:
                self.slots.append(_Slots(group.bias_inputs, group.rows, ()))
        self.buffers: tuple[torch.Tensor, ...] = ()
        # The parameter object bound to each slice (weak: a set must not keep a dropped module alive).
        self.owners: dict[tuple[int, int], weakref.ref] = {}
        self.expected: tuple[tuple[int, int], ...] = ()
        self.at, self.ptrs = [], []

    def matches(self, args) -> bool:
        return bool(self.buffers) and compat.data_ptrs_equal(args, self.ptrs, self.at)

    def holds(self, param: torch.Tensor) -> bool:
        storage = param.untyped_storage().data_ptr()
        return any(b.untyped_storage().data_ptr() == storage for b in self.buffers)

    def release(self) -> None:
        """Drop the buffers (another set took the parameters elsewhere); the next call makes new ones."""
        self.buffers, self.at, self.ptrs, self.expected = (), [], [], ()
        for slot in self.slots:
            slot.buffer = None
        self.owners.clear()

    def rebind(self, args) -> bool:
        """Make the buffers (first call) or copy into them the parameters of args that are not their
        slices; every parameter is then rebound to its slice. Returns whether anything was copied."""
        copied = False
        created = not self.buffers
        # Outside inference mode: an inference tensor as a parameter's storage would refuse training.
        with torch.inference_mode(False), torch.no_grad():
            if created:
                for slot in self.slots:
                    slot.create([args[i] for i in slot.inputs])
                self.buffers = tuple(slot.buffer for slot in self.slots)
            for n, slot in enumerate(self.slots):
                for i, piece in zip(slot.inputs, slot.slices()):
                    param = args[i]
                    if param.data_ptr() == piece.data_ptr():
                        self.owners[(n, i)] = weakref.ref(param)
                        _claim(param, self)
                        continue
                    if param.shape != piece.shape or param.dtype != piece.dtype or param.device != piece.device:
                        raise RuntimeError(
                            f"torch_ext: a merged parameter changed from {tuple(piece.shape)} {piece.dtype} on "
                            f"{piece.device} to {tuple(param.shape)} {param.dtype} on {param.device} without a "
                            "recompile; call torch._dynamo.reset() and compile again")
                    old = self.owners.get((n, i), lambda: None)()
                    if old is not None and old is not param and old.data_ptr() == piece.data_ptr():
                        old.data = piece.clone()  # another parameter still lives in this slice: give it its own
                    piece.copy_(param.detach())
                    param.data = piece
                    self.owners[(n, i)] = weakref.ref(param)
                    _claim(param, self)
                    copied = True
        self.expected = tuple(pair for slot in self.slots for pair in slot.expected())
        self.at, self.ptrs = compat.address_check(self.expected, self.plan.original_inputs)
        if created:
            self._account(copied)
        return copied

    def _account(self, copied: bool) -> None:
        """Counted and said once per set; where the parameters moved into new buffers, their old storage
        (now free) goes back to the device: the caching allocator would keep it reserved, as much
        memory as the merged weights (a model's projections: most of its weights)."""
        size = sum(b.untyped_storage().nbytes() for b in self.buffers)
        counters.merged_buffer_bytes += size
        device = self.buffers[0].device
        if copied and device.type == "cuda":
            torch.cuda.empty_cache()
        log.info("torch_ext: %d merged projection group(s) hold their parameters in %.1f MiB of buffers on %s "
                 "(the parameters are views of them: no second copy%s)", len(self.plan.groups), size / 2**20,
                 device, "; their old storage was returned to the device" if copied and device.type == "cuda" else "")


class MergedParams:
    """Calls `compiled` with the merged buffers after the graph's own arguments, having checked that
    every grouped parameter still is its slice of them. Other attributes are the compiled callable's
    (tests and tools read the split graph through it).

    One graph may serve several modules' parameters (identical layers compiled one by one: Dynamo
    reuses the graph), so each set of parameters, known by its first grouped parameter object, has
    buffers of its own: copying a second module's weights into the first's buffers would change the
    first module's weights too (they are views of those buffers)."""

    def __init__(self, compiled: Callable, plan: MergePlan, name: str):
        self.compiled = compiled
        self.plan = plan
        self.name = name
        self._key_input = plan.groups[0].weight_inputs[0]
        self._sets: dict[int, tuple[weakref.ref, _ParamSet]] = {}  # id(first parameter) -> its set
        self._current: _ParamSet | None = None  # the set of the last call: the fast path
        self._lock = threading.Lock()
        self._said = False

    @property
    def buffers(self) -> tuple[torch.Tensor, ...]:
        """The buffers of the last call's parameters."""
        return self._current.buffers if self._current is not None else ()

    def bind(self, args) -> None:
        """Make the buffers from the parameters in `args` (real tensors; not fake ones of a graph
        loaded for a warm start: then the first call does it) and rebind the parameters to them. Not on the
        background compiler's thread: the caller's thread may be running the model eagerly meanwhile."""
        if process_lock.in_background():
            return
        if all(_is_real(args[i]) for group in self.plan.groups for i in group.weight_inputs + group.bias_inputs):
            self._resolve(list(args))

    def __call__(self, *args):
        current = self._current  # one read: another thread may switch it
        buffers = current.buffers if current is not None else ()  # before the check: a release may follow it
        if not (buffers and current.matches(list(args))):
            buffers = self._resolve(list(args)).buffers
        return self.compiled(*args, *buffers)

    def __getattr__(self, name: str) -> Any:
        if name in ("compiled", "_current", "_sets"):
            raise AttributeError(name)
        return getattr(self.compiled, name)

    def _resolve(self, args) -> _ParamSet:
        with self._lock:
            key = args[self._key_input]
            entry = self._sets.get(id(key))
            if entry is None or entry[0]() is not key:
                entry = (weakref.ref(key, self._forget(id(key))), _ParamSet(self.plan))
                self._sets[id(key)] = entry
            param_set = entry[1]
            if not param_set.matches(args):
                first = not param_set.buffers
                if param_set.rebind(args) and not first and not self._said:
                    self._said = True
                    log.info("torch_ext: %s: parameters of merged projections were replaced or rebound since "
                             "the compile; copying them into their merged buffers (once per change)", self.name)
            self._current = param_set
            return param_set

    def _forget(self, key: int) -> Callable:
        """Drops a set when its first parameter is collected (the module was dropped)."""
        def forget(ref, sets=self._sets):
            entry = sets.get(key)
            if entry is not None and entry[0] is ref:
                del sets[key]
        return forget


def _is_real(value) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return isinstance(value, torch.Tensor) and not is_fake(value) and value.device.type != "meta"
