"""What an FX graph writes in place: which of its inputs a node mutates, followed through views
and into the bodies of wrap-like HOPs. CUDA graphs read such inputs in place instead of copying."""
from __future__ import annotations

import operator
from typing import Any, Callable

import torch
import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef

from torch_ext.backend.split.splitter import INLINABLE_HOPS, hop_bodies, hop_name

_NOT_DATA_WRITES = {"requires_grad_", "share_memory_", "record_stream_", "retain_grad_"}
_INPLACE_OPERATORS = {operator.setitem, operator.iadd, operator.isub, operator.imul, operator.itruediv,
                      operator.ifloordiv, operator.imod, operator.ipow, operator.iand, operator.ior,
                      operator.ixor, operator.ilshift, operator.irshift, operator.imatmul}


def written_args(node: fx.Node) -> list[Any]:
    """The arguments `node` writes in place (a conservative reading of a Dynamo-level node)."""
    written: list[Any] = []
    out = node.kwargs.get("out")
    if out is not None:
        written.extend(out if isinstance(out, (tuple, list)) else [out])
    if node.op == "call_method":
        name = node.target
        if name.endswith("_") and not name.endswith("__") and name not in _NOT_DATA_WRITES:
            written.append(node.args[0])
    elif node.op == "call_function":
        target = node.target
        if target in _INPLACE_OPERATORS:
            written.append(node.args[0])
        elif isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
            overloads = [target] if isinstance(target, torch._ops.OpOverload) else \
                [getattr(target, name) for name in target.overloads()]
            for op in overloads:
                for i, arg in enumerate(op._schema.arguments):
                    if arg.alias_info is not None and arg.alias_info.is_write:
                        if i < len(node.args):
                            written.append(node.args[i])
                        elif arg.name in node.kwargs:
                            written.append(node.kwargs[arg.name])
        else:
            name = getattr(target, "__name__", "")
            if (name.endswith("_") and not name.endswith("__") and name not in _NOT_DATA_WRITES
                    and node.args) or node.kwargs.get("inplace") is True:
                written.append(node.args[0])
    return [w for w in written if isinstance(w, fx.Node)]


def fake_value(node: fx.Node) -> Any:
    return node.meta.get("example_value", node.meta.get("val"))


def _storage(value: Any):
    if isinstance(value, torch.Tensor):
        try:
            return StorageWeakRef(value.untyped_storage())  # views of one fake tensor share it
        except Exception:  # a tensor subclass without a storage
            return None
    return None


def written_placeholders(gm: fx.GraphModule, skip: Callable[[fx.Node], bool] | None = None) -> dict[int, fx.Node]:
    """Placeholders (by position) whose memory some node of gm writes in place, with that node.
    Views count (storage identity of the fake values); bodies of wrap-like HOPs are followed.
    `skip(node)` leaves chosen nodes out (the splitting ops)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    by_storage: dict[Any, list[int]] = {}
    for i, p in enumerate(placeholders):
        key = _storage(fake_value(p))
        if key is not None:
            by_storage.setdefault(key, []).append(i)
    found: dict[int, fx.Node] = {}

    def mark(target: fx.Node, writer: fx.Node) -> None:
        if target.op == "placeholder":
            found.setdefault(placeholders.index(target), writer)
            return
        for i in by_storage.get(_storage(fake_value(target)), ()):
            found.setdefault(i, writer)

    for node in gm.graph.nodes:
        if skip is not None and skip(node):
            continue
        for arg in written_args(node):
            mark(arg, node)
        name = hop_name(node)
        if name in INLINABLE_HOPS:
            bodies = hop_bodies(gm, node)
            _, first = INLINABLE_HOPS[name]
            operands = node.args[first:]
            for body in bodies[:1]:
                for i in written_placeholders(body, skip):
                    if i < len(operands) and isinstance(operands[i], fx.Node):
                        mark(operands[i], node)
    return found
