"""Which FX nodes call a configured splitting op, and how calls read in messages.

A splitting op is named in CompileConfig.splitting_ops as an operator ("aten::sdpa", "mylib::attn"),
an overload, or a Python function Dynamo keeps as one call ("module.function"). For an aten op,
Dynamo may record the torch function or Tensor method of the same name instead: those match too.
"""
from __future__ import annotations

import operator
import types
from typing import Any, Callable

import torch
import torch.fx as fx

from torch_ext import compat
from torch_ext.backend.config import resolve_op


# Where Dynamo records a call of an aten op by the torch function that dispatches to it
# (`F.scaled_dot_product_attention` is `torch._C._nn.scaled_dot_product_attention` in the graph).
# Composite aten ops AOTAutograd decomposes before Inductor sees them (training graphs are split
# after AOTAutograd: backend/joint.py): the op each becomes, forward and backward, per backend.
ATEN_FORMS = {
    "aten::scaled_dot_product_attention": (
        "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward",
        "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward",
        "_scaled_dot_product_efficient_attention", "_scaled_dot_product_efficient_attention_backward",
        "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward",
        "_scaled_dot_product_fused_attention_overrideable",
        "_scaled_dot_product_fused_attention_overrideable_backward",
        "_flash_attention_forward", "_flash_attention_backward",
        "_efficient_attention_forward", "_efficient_attention_backward",
    ),
}

_TORCH_FUNCTION_NAMESPACES = ("torch", "torch._C._nn", "torch._C._VariableFunctions", "torch.nn.functional",
                              "torch._C._linalg", "torch._C._special", "torch._C._fft")


def torch_functions_for(op: torch._ops.OpOverloadPacket) -> set[Callable]:
    """The torch functions named like the aten op `op` that Dynamo may record instead of it.
    Only C builtins: a Python function of that name may do more than the op."""
    if op._qualified_op_name.split("::")[0] != "aten":
        return set()
    functions = set()
    for namespace in _TORCH_FUNCTION_NAMESPACES:
        module = operator.attrgetter(namespace.partition(".")[2])(torch) if "." in namespace else torch
        function = getattr(module, op.__name__, None)
        if isinstance(function, types.BuiltinFunctionType):
            functions.add(function)
    return functions


def op_display_name(node: fx.Node) -> str | None:
    """How a call reads in a message: "ns::name" for operators and the torch builtins of aten ops,
    "module.name" for other functions."""
    target = node.target
    if node.op == "call_method":
        return f"Tensor.{target}"
    if node.op != "call_function":
        return None
    if isinstance(target, torch._ops.OpOverload):
        return target.name().split(".")[0]
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name
    name = getattr(target, "__name__", None)
    if isinstance(target, types.BuiltinFunctionType) and hasattr(torch.ops.aten, name or ""):
        return f"aten::{name}"  # what to put in splitting_ops to split at it
    return f"{getattr(target, '__module__', None) or 'torch'}.{name}" if name else None


class SplittingOpMatcher:
    """Tells whether an FX node calls one of the configured splitting ops (any overload, or, for an
    aten op, the torch function or Tensor method of the same name that Dynamo records, or the ATen
    ops AOTAutograd decomposes it into: ATEN_FORMS)."""

    def __init__(self, names: tuple[str, ...]):
        self.names = names
        self._by_target: dict[Any, str] = {}  # op, overload packet or torch function -> configured name
        self._by_method: dict[str, str] = {}  # Tensor method name -> configured name
        for name in names:
            op = resolve_op(name)
            self._by_target[op] = name
            if isinstance(op, torch._ops.OpOverloadPacket):
                for function in torch_functions_for(op):
                    self._by_target.setdefault(function, name)
                if op._qualified_op_name.startswith("aten::") and hasattr(torch.Tensor, op.__name__):
                    self._by_method.setdefault(op.__name__, name)
            # The forms a composite aten op takes after AOTAutograd (training graphs: backend/joint.py).
            packet = op.overloadpacket if isinstance(op, torch._ops.OpOverload) else op
            for form in ATEN_FORMS.get(getattr(packet, "_qualified_op_name", None), ()):
                if hasattr(torch.ops.aten, form):
                    self._by_target.setdefault(getattr(torch.ops.aten, form), name)

    def match(self, node: fx.Node) -> str | None:
        """The configured name `node` calls, or None."""
        if node.op == "call_method":
            return self._by_method.get(node.target)
        if node.op != "call_function":
            return None
        return self.match_target(node.target)

    def match_target(self, target: Any) -> str | None:
        """The configured name a call of `target` calls, or None."""
        try:
            name = self._by_target.get(target)
        except TypeError:  # an unhashable target
            return None
        if name is None and isinstance(target, torch._ops.OpOverload):
            name = self._by_target.get(target.overloadpacket)
        if name is None and isinstance(target, torch._ops.OpOverloadPacket):
            name = next((n for op, n in self._by_target.items()
                         if isinstance(op, torch._ops.OpOverload) and op.overloadpacket is target), None)
        return name

    def overloads(self) -> set[torch._ops.OpOverload]:
        """Every operator overload a node may call to match (for decomposition tables to leave alone)."""
        return {o for target in self._by_target for o in compat.op_overloads(target)}

    def __call__(self, node: fx.Node) -> bool:
        return self.match(node) is not None
