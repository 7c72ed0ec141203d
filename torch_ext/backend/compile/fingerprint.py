"""Canonical fingerprints of FX graphs: equal fingerprints mean one compiled artifact serves both.

Node names, placeholder names and stack traces are ignored (layer 3's piece names its weights
differently from layer 7's); what the compiled code depends on is kept: the ops and their
constant arguments in order, every input's dtype/device/shape/stride/requires_grad (symbolic
sizes by their expression, with the value ranges of their symbols), which inputs share storage,
and the contents of attributes the graph reads (HOP bodies by their own fingerprint, tensors by
their bytes). Fingerprints are stable across processes, so they also name cache entries.
"""
from __future__ import annotations

import enum
import hashlib
import io
import logging
import operator
import types
from typing import Any

import torch
import torch.fx as fx

from torch_ext.backend.split.checkpoint import CONTEXT_FN

log = logging.getLogger(__name__)


def graph_fingerprint(gm: fx.GraphModule) -> str:
    return hashlib.sha256(canonical_text(gm).encode()).hexdigest()


def body_fingerprint(gm: fx.GraphModule) -> tuple[str, list[int]] | None:
    """The fingerprint of gm but for what it returns, and the positions (in node order) of the nodes
    it returns; None unless it returns a flat tuple of nodes."""
    returned = gm.graph.output_node().args[0]
    if not isinstance(returned, (tuple, list)) or not all(isinstance(n, fx.Node) for n in returned):
        return None
    position = {node: i for i, node in enumerate(gm.graph.nodes)}
    text = canonical_text(gm, with_output=False)
    return hashlib.sha256(text.encode()).hexdigest(), [position[n] for n in returned]


def canonical_text(gm: fx.GraphModule, with_output: bool = True) -> str:
    names: dict[fx.Node, str] = {}
    lines: list[str] = []
    storages: list[Any] = []
    symbols = _Symbols()
    for i, node in enumerate(gm.graph.nodes):
        name = names[node] = f"%{i}"
        fmt = lambda a: _format_arg(a, names)  # noqa: E731
        if node.op == "placeholder":
            value = _example_value(node)
            line = f"{name} = input {describe_value(value, symbols)}"
            if isinstance(value, torch.Tensor):
                line += _alias_note(value, storages)
            lines.append(line)
        elif node.op == "output":
            if with_output:
                lines.append(f"return {fmt(node.args[0])}")
        elif node.op == "get_attr":
            lines.append(f"{name} = attr {_describe_attr(_get_attr(gm, node.target))}")
        elif node.op == "call_module":
            module = _get_attr(gm, node.target)
            lines.append(f"{name} = module {_describe_attr(module)}({fmt(node.args)}, {fmt(node.kwargs)})")
        else:
            lines.append(f"{name} = {node.op} {target_name(node.target)}({fmt(node.args)}, {fmt(node.kwargs)})")
    lines.extend(symbols.ranges())
    return "\n".join(lines)


def _example_value(node: fx.Node) -> Any:
    return node.meta.get("example_value", node.meta.get("val"))


class _Symbols:
    """Renames shape symbols S0, S1, ... in order of appearance (Dynamo names them after their
    source, so the same piece traced from differently named inputs gets other names)."""

    def __init__(self):
        self.canonical: dict[Any, Any] = {}
        self.shape_envs: dict[Any, Any] = {}

    def text(self, expr, shape_env) -> str:
        import sympy

        for sym in sorted(getattr(expr, "free_symbols", ()), key=str):
            if sym not in self.canonical:
                self.canonical[sym] = sympy.Symbol(f"S{len(self.canonical)}")
                self.shape_envs[sym] = shape_env
        return str(expr.xreplace(self.canonical)) if self.canonical else str(expr)

    def ranges(self) -> list[str]:
        out = []
        for sym, name in self.canonical.items():
            shape_env = self.shape_envs[sym]
            rng = shape_env.var_to_range.get(sym) if shape_env is not None else None
            out.append(f"range {name} " + (f"[{rng.lower}, {rng.upper}]" if rng is not None else "?"))
        return out


def describe_value(value: Any, symbols: _Symbols | None = None) -> str:
    if symbols is None:
        symbols = _Symbols()
    if isinstance(value, torch.Tensor):
        shape = ",".join(_sym_str(s, symbols) for s in value.shape)
        stride = ",".join(_sym_str(s, symbols) for s in value.stride())
        offset = _sym_str(value.storage_offset(), symbols)
        return (f"Tensor[{value.dtype}|{value.device}|{value.layout}|({shape})|({stride})|+{offset}"
                f"|grad={value.requires_grad}]")
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return f"{type(value).__name__}[{_sym_str(value, symbols)}]"
    if value is None or isinstance(value, (bool, int, float, str)):
        return repr(value)
    return f"opaque[{type(value).__module__}.{type(value).__qualname__}]"


def _sym_str(value: Any, symbols: _Symbols) -> str:
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return symbols.text(value.node.expr, value.node.shape_env)
    return str(value)


def _alias_note(tensor: torch.Tensor, storages: list[Any]) -> str:
    try:
        ref = torch.multiprocessing.reductions.StorageWeakRef(tensor.untyped_storage())
    except (NotImplementedError, RuntimeError):  # tensors without storage (sparse, nested)
        return ""
    for i, other in enumerate(storages):
        if other == ref:
            return f" alias_of_storage={i}"
    storages.append(ref)
    return ""


def target_name(target: Any) -> str:
    if isinstance(target, str):
        return target
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return f"op:{target}"
    if isinstance(target, torch._ops.HigherOrderOperator):
        return f"hop:{target.name()}"
    module = getattr(target, "__module__", None) or ""
    qualname = getattr(target, "__qualname__", None) or getattr(target, "__name__", None) or repr(target)
    code = getattr(target, "__code__", None)
    if isinstance(code, types.CodeType):  # plain Python function: two lambdas may share a qualname
        qualname += "#" + hashlib.sha256(code.co_code + repr(code.co_consts).encode()).hexdigest()[:12]
    return f"{module}.{qualname}"


def _format_arg(arg: Any, names: dict[fx.Node, str]) -> str:
    if isinstance(arg, fx.Node):
        return names[arg]
    if isinstance(arg, tuple):
        return "(" + ",".join(_format_arg(a, names) for a in arg) + ",)"
    if isinstance(arg, list):
        return "[" + ",".join(_format_arg(a, names) for a in arg) + "]"
    if isinstance(arg, dict):
        return "{" + ",".join(f"{k!r}:{_format_arg(v, names)}" for k, v in sorted(arg.items(), key=str)) + "}"
    if isinstance(arg, slice):
        return f"slice({_format_arg(arg.start, names)},{_format_arg(arg.stop, names)},{_format_arg(arg.step, names)})"
    if arg is None or arg is Ellipsis or isinstance(arg, (bool, int, float, str, complex)):
        return repr(arg)
    if isinstance(arg, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
        return f"{type(arg).__name__}:{arg}"
    if isinstance(arg, enum.Enum):
        return f"{type(arg).__qualname__}.{arg.name}"
    if isinstance(arg, torch.Tensor):
        return _describe_attr(arg)
    if callable(arg):
        return "fn:" + target_name(arg)
    text = repr(arg)
    if " at 0x" in text:
        # No stable description: keep the fingerprint process-local rather than wrong.
        log.debug("fingerprint: %s has no stable repr; pieces using it are not shared across processes", text)
        text += f"#id{id(arg)}"
    return f"{type(arg).__qualname__}:{text}"


def _get_attr(gm: fx.GraphModule, target: str) -> Any:
    return operator.attrgetter(target)(gm)


def _describe_attr(obj: Any) -> str:
    if isinstance(obj, fx.GraphModule):
        policy = obj.meta.get(CONTEXT_FN)  # a selective checkpoint's policy: Python code, told by identity
        return f"graph:{graph_fingerprint(obj)}" + (f"|policy#id{id(policy)}" if policy is not None else "")
    if isinstance(obj, torch.Tensor):
        meta = describe_value(obj)
        if obj.device.type == "meta" or isinstance(obj, torch._subclasses.FakeTensor):
            return f"tensor:{meta}"
        buffer = io.BytesIO()
        torch.save(obj.detach().cpu().contiguous(), buffer)  # bytes without numpy
        return f"tensor:{meta}:{hashlib.sha256(buffer.getvalue()).hexdigest()}"
    if isinstance(obj, torch.nn.Module):
        return f"module:{type(obj).__qualname__}#id{id(obj)}"  # an opaque module: never shared
    return _format_arg(obj, {})
