"""Which nodes of a Dynamo graph may write a tensor or change global state, for the rewrites that
move a read or a call (merged projections run where the first one was; a fused decode_linear reads
its norm's inputs later; decode attention reads the cache a repeat had copied): no such node may lie
between the old place and the new one."""
from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_leaves

__all__ = ["is_barrier", "writes_between"]

_STATE_MODULES = ("torch.amp", "torch.autograd.grad_mode", "torch.autocast", "torch._C._autograd")
_IN_PLACE_OPERATORS = (operator.setitem, operator.iadd, operator.isub, operator.imul, operator.itruediv,
                       operator.ifloordiv, operator.imod, operator.ipow, operator.imatmul, operator.iand,
                       operator.ior, operator.ixor, operator.ilshift, operator.irshift)

_IN_PLACE_DUNDERS = {f"__{op.__name__.strip('_')}__" for op in _IN_PLACE_OPERATORS}  # __setitem__, __iadd__, ...


def is_barrier(node: fx.Node) -> bool:
    """A node that may mutate a tensor or change global state (autocast, grad mode)."""
    if node.op == "call_module":
        return True
    if node.op == "call_method":
        return _mutates_by_name(node.target)
    if node.op != "call_function":
        return False
    target = node.target
    if isinstance(target, torch._ops.HigherOrderOperator):  # a body may do anything
        return True
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.is_mutable
    if isinstance(target, torch._ops.OpOverloadPacket):
        return any(getattr(target, o)._schema.is_mutable for o in target.overloads())
    if node.kwargs.get("inplace") is True or "out" in node.kwargs or any(target is t for t in _IN_PLACE_OPERATORS):
        return True
    name = getattr(target, "__name__", "")
    module = getattr(target, "__module__", None) or ""
    return _mutates_by_name(name) or name.startswith(("_set_", "_enter_", "_exit_")) or module.startswith(_STATE_MODULES)


def _mutates_by_name(name: str) -> bool:
    """Tensor.add_, torch.relu_, Tensor.__iadd__, Tensor.__setitem__: torch's in-place naming."""
    return name.endswith("_") and not name.endswith("__") or name in _IN_PLACE_DUNDERS


def writes_between(first: fx.Node, last: fx.Node, value: torch.Tensor | None = None) -> bool:
    """A node after first and before last (graph order; first precedes last) may write a tensor; with
    `value` (an example value), may write that one: a barrier handed a tensor sharing its storage (or a
    node of unknown value), or one that may do anything (a module call, a HOP body). What writes a
    tensor of a Dynamo graph is handed it: state comes in as inputs."""
    storage = StorageWeakRef(value.untyped_storage()) if value is not None else None
    node = first.next
    while node is not last:
        if node.op == "root" or (is_barrier(node) and (storage is None or _may_write(node, storage))):
            return True
        node = node.next
    return False


def _may_write(barrier: fx.Node, storage: StorageWeakRef) -> bool:
    if barrier.op == "call_module" or isinstance(barrier.target, torch._ops.HigherOrderOperator):
        return True
    for arg in tree_leaves((barrier.args, barrier.kwargs)):
        if not isinstance(arg, fx.Node):
            continue
        seen = arg.meta.get("example_value", arg.meta.get("val"))
        if seen is None or any(isinstance(t, torch.Tensor) and StorageWeakRef(t.untyped_storage()) == storage
                               for t in tree_leaves(seen)):
            return True
    return False
