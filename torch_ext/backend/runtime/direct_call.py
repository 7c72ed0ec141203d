"""Splitting ops defined with `torch.library.custom_op`, called without their Python dispatch layers
where nothing needs them.

Between two piecewise CUDA-graph replays the host runs each splitting op eagerly, on the critical
path. A custom_op call goes C++ dispatcher -> Python autograd kernel -> Python view/version kernel
-> Python backend kernel with an aliasing check -> the user's function: 14-23 us of host time per
call outside inference_mode (bench/splitting_op_cost.py), 16 times per step for a 16-layer model.
When a call needs none of those layers it calls the user's kernel for the device directly and bumps
the version counters of the tensors the schema says it mutates (what the view/version layer does).
It needs none of them when: no gradient can be recorded (grad mode off, or no tensor input requires
grad), no torch-function or dispatch mode is active, autocast is off, every tensor input is a plain
torch.Tensor and all of them are on one device type that has a kernel. Otherwise the op is called
as before. The kernel is looked up at call time: kernels registered later are seen.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.fx as fx

from torch_ext import compat


# Device types whose dispatch key reaches custom_op's all-devices kernel (CompositeExplicitAutograd);
# on others (meta: the fake kernel) the op decides.
_ANY_DEVICE_KERNEL = frozenset({"cpu", "cuda", None})


def direct_caller(op: torch._ops.OpOverload) -> Callable | None:
    """A function with op's signature that skips its Python layers when it may (module docstring),
    or None when op is not a Python custom op."""
    opdef = compat.python_custom_op_def(op)
    if opdef is None:
        return None
    kernels = opdef._backend_fns  # device type (None: every device) -> the user's kernel
    schema = op._schema
    mutated = [(i, arg.name) for i, arg in enumerate(schema.arguments)
               if arg.alias_info is not None and arg.alias_info.is_write]
    lists = any(isinstance(arg.type, torch.ListType) for arg in schema.arguments)
    Tensor, grad_enabled, bump = torch.Tensor, torch.is_grad_enabled, torch.autograd.graph.increment_version
    no_layers_needed = compat.no_modes_or_autocast_active

    def call(*args, **kwargs):
        if no_layers_needed():
            tensors = [a for a in args if isinstance(a, Tensor)]
            if kwargs:
                tensors += [v for v in kwargs.values() if isinstance(v, Tensor)]
            if lists:
                tensors += [t for a in (*args, *kwargs.values()) if isinstance(a, (list, tuple))
                            for t in a if isinstance(t, Tensor)]
            device = tensors[0].device.type if tensors else None
            grad = grad_enabled()
            for t in tensors:
                if type(t) is not Tensor or t.device.type != device or (grad and t.requires_grad):
                    break
            else:
                kernel = kernels.get(device) or (kernels.get(None) if device in _ANY_DEVICE_KERNEL else None)
                if kernel is not None:
                    # custom_op wraps each kernel in torch._disable_dynamo (0.8 us); no Dynamo runs here.
                    out = getattr(kernel, "__wrapped__", kernel)(*args, **kwargs)
                    for i, name in mutated:  # what the ADInplaceOrView layer does
                        _bump(bump, args[i] if i < len(args) else kwargs.get(name))
                    return out
        return op(*args, **kwargs)

    call.__name__ = call.__qualname__ = f"direct_{schema.name.replace('::', '_')}"
    return call


def _bump(bump: Callable, value: Any) -> None:
    if isinstance(value, torch.Tensor):
        bump(value)
    elif isinstance(value, (list, tuple)):
        for t in value:
            if isinstance(t, torch.Tensor):
                bump(t)


def call_directly(gm: fx.GraphModule) -> list[str]:
    """Point gm's calls of Python custom ops at direct callers (in place); returns their names."""
    done = []
    for node in gm.graph.nodes:
        if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
            caller = direct_caller(node.target)
            if caller is not None:
                done.append(node.target._schema.name)
                node.target = caller
    if done:
        gm.recompile()
    return done
