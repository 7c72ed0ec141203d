"""`local_map_hop`: the HOP a `local_map` body is traced as under torch.compile.

    local_map_hop(body, *operands) -> tuple of the body's outputs

torch 2.10+ ships it (`torch._higher_order_ops.local_map`); there this module re-exports torch's. For
torch that lacks it (2.9.1) it defines one with the same name (`torch.ops.higher_order.local_map_hop`)
and calling convention, with every implementation beside it:

- eager (CompositeExplicitAutograd): run the body.
- autograd: the body is transparent to autograd. The Autograd key runs the body op by op, so autograd
  records each op's own backward formula and the gradients are exactly eager's. This is what torch
  2.10+ does too outside Autoparallel's `defer_inlining()`. The alternative, an autograd.Function
  over a traced and partitioned joint (torch's Autoparallel path), keeps a `local_map_hop` node in
  AOTAutograd's forward and backward graphs that no Inductor version can lower, and re-derives what
  autograd already knows; running the body under autograd is sound by construction. Consequently the
  HOP never appears in a joint graph: AOTAutograd and Inductor see the body's ops inline.
- functionalization: unwrap, run the functionalized body one level down, wrap (Dynamo refuses bodies
  that mutate or alias their inputs, so the body is functional at its boundary).
- fake tensors: run the body on the fake operands.
- proxy mode (make_fx below the Autograd key, e.g. under `torch._C._AutoDispatchBelowAutograd()`):
  retrace the body into a subgraph of the tracer's root and record one `local_map_hop` call.

The body's `meta["local_map_kwargs"]` describes the `local_map` call it came from (torch's key; torch
2.10+'s implementations require it). Its operands are the *local* tensors: the DTensor <-> local
conversion (and the gradient placements of `in_grad_placements`) happen outside the HOP.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree

from torch_ext import compat

LOCAL_MAP_KWARGS = "local_map_kwargs"


def _body_meta(body) -> dict:
    """`local_map_kwargs` of a body (a GraphModule, or one wrapped by functionalization)."""
    inner = getattr(body, "subgraph", body)
    return dict(getattr(inner, "meta", {}).get(LOCAL_MAP_KWARGS) or {})


def _run_body(body, *operands) -> tuple:
    out = body(*operands)
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def _define_local_map_hop():
    from torch._C import DispatchKey
    from torch._higher_order_ops.utils import (
        FunctionalizeCtxWrapper,
        redirect_to_mode,
        reenter_make_fx,
        register_fake,
    )
    from torch._ops import HigherOrderOperator
    from torch.fx.experimental.proxy_tensor import ProxyTorchDispatchMode, track_tensor_tree

    class LocalMapHOP(HigherOrderOperator):
        def __init__(self) -> None:
            super().__init__("local_map_hop")

        def __call__(self, body, *operands, **kwargs):
            if kwargs:
                raise TypeError(f"local_map_hop takes no keyword arguments, got {sorted(kwargs)}")
            return super().__call__(body, *operands)

    hop = LocalMapHOP()

    # Selective activation checkpointing policies see the HOP like any op (as torch registers it).
    from torch.utils import checkpoint as _ckpt

    for mode in ("_CachingTorchDispatchMode", "_CachedTorchDispatchMode"):
        if hasattr(_ckpt, mode):
            redirect_to_mode(hop, getattr(_ckpt, mode))

    @hop.py_impl(DispatchKey.CompositeExplicitAutograd)
    def _eager(body, *operands):
        return _run_body(body, *operands)

    @hop.py_impl(DispatchKey.Autograd)
    def _autograd(body, *operands):
        # Transparent to autograd: every op of the body records its own backward (module docstring).
        return _run_body(body, *operands)

    @hop.py_functionalize_impl
    def _functionalize(ctx, body, *operands):
        unwrapped = ctx.unwrap_tensors(operands)
        with ctx.redispatch_to_next():
            out = hop(FunctionalizeCtxWrapper(ctx, body), *unwrapped)
        return ctx.wrap_tensors(out)

    @register_fake(hop)
    def _fake(body, *operands):
        return _run_body(body, *operands)

    @hop.py_impl(ProxyTorchDispatchMode)
    def _proxy(proxy_mode, body, *operands):
        tracer = proxy_mode.tracer
        meta = _body_meta(body)
        graph = reenter_make_fx(lambda *args: _run_body(body, *args))(*operands)
        graph.meta[LOCAL_MAP_KWARGS] = meta
        name = tracer.get_fresh_qualname("local_map_body")
        tracer.root.register_module(name, graph)
        proxy_args = pytree.tree_map(tracer.unwrap_proxy, (graph, *operands))
        out_proxy = tracer.create_proxy("call_function", hop, proxy_args, {})
        out_proxy.node.meta[LOCAL_MAP_KWARGS] = meta
        example_out = hop(graph, *operands)  # the proxy mode is off here: this runs the fake impl
        return track_tensor_tree(example_out, out_proxy, constant=None, tracer=tracer)

    return hop


local_map_hop: Any = compat.torch_local_map_hop() or _define_local_map_hop()

__all__ = ["local_map_hop", "LOCAL_MAP_KWARGS"]
