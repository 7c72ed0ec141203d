"""`invoke_subgraph`, which `torch.compiler.nested_compile_region` functions are traced as.

Repeated calls of one region share one subgraph: torch's `install_subgraph_in_output_graph`
(inherited) finds an identical previously installed body and reuses its name.
invoke_subgraph is not inlined before autograd, so its outputs may not alias its inputs.
On torch < 2.11 a region called inside another HOP's body is traced inline (compat.NESTED_REGION_FAILS_AOT).
"""
from __future__ import annotations

import torch

from torch_ext import compat

from .base import WrapSemanticsMixin
from .reproxify import call_and_reproxify


def _bound_per_instance(fn_vt) -> bool:
    """The region function was read off a bound method stored on an object (`layer.forward =
    MethodType(region, layer)`): its source passes through `__func__`. torch's subgraph reuse then
    runs every instance with the first one's parameters (compat.REGION_REUSE_BINDS_FIRST_INSTANCE)."""
    source = getattr(fn_vt, "source", None)
    while source is not None:
        if getattr(source, "member", None) == "__func__":
            return True
        source = getattr(source, "base", None)
    return False


def _inside_a_region(tx) -> bool:
    """Traced inside another invoke_subgraph body (at any depth)."""
    tracer = tx.output.current_tracer
    while tracer.parent is not None:
        if getattr(tracer, "source_target", None) is torch._higher_order_ops.invoke_subgraph:
            return True
        tracer = tracer.parent
    return False


class InvokeSubgraphVariable(WrapSemanticsMixin, compat.InvokeSubgraphHigherOrderVariable):
    body_supports_input_mutation = True
    body_supports_aliasing = False

    def torch_gets_wrong(self, tx, args, kwargs) -> bool:
        if super().torch_gets_wrong(tx, args, kwargs):
            return True
        if compat.NESTED_REGION_FAILS_AOT and _inside_a_region(tx):
            return True
        return compat.REGION_REUSE_BINDS_FIRST_INSTANCE and _bound_per_instance(args[0])

    def body_options(self, tx):
        opts = super().body_options(tx)
        # A region's body runs once per call, so what it stores into the caller's lists, dicts, objects,
        # cells and globals is replayed by Dynamo after the graph, as torch 2.15 does for regions;
        # the tensors stored become outputs of the call.
        return type(opts)(**{**opts.__dict__, "symint_outputs": compat.INVOKE_SUBGRAPH_RETURNS_SYMINTS,
                             "allow_side_effects": True})

    @compat.hard_error_on_graph_break(
        reason="torch.compile requires the `nested_compile_region` decorated function to be "
        "capturable into a single graph",
    )
    def call_with_wrap_semantics(self, tx, args, kwargs):
        fn_vt = args[0]
        if compat.NESTED_REGION_FAILS_AOT and tx.output.current_tracer.parent is not None:
            # Inside another HOP's body: as its own subgraph it would fail AOTAutograd on this torch;
            # inlined it computes the same (a region just runs its body), without subgraph reuse.
            return fn_vt.call_function(tx, list(args[1:]), kwargs)
        spec, body_gmod, body_name, proxy_args = self.trace_body(
            tx, fn_vt, args[1:], kwargs, subgraph_name="subgraph"
        )
        # nested_compile_region(options=...) hands its options to the backend through node meta.
        fn = fn_vt.get_function() if hasattr(fn_vt, "get_function") else None
        config = getattr(fn, "__marked_compile_region_config__", None)
        node_meta = None
        if config is not None:
            body_gmod.meta["nested_region_config"] = config
            node_meta = {"custom": {"nested_region_config": config}}
        body_node, *lifted = proxy_args
        return call_and_reproxify(
            tx, torch._higher_order_ops.invoke_subgraph, (body_node, body_name, *lifted), {}, spec, node_meta
        )
