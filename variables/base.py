"""The part every wrap-semantics HOP VariableTracker shares: trace the body, install it, call it."""
from __future__ import annotations

import torch

from torch_ext import compat

from .speculate import BodyOptions, Speculation, speculate


class WrapSemanticsMixin:
    """Mixed into subclasses of torch's own HOP VTs, whose subgraph installation (naming, and
    deduplication for invoke_subgraph) we keep; only speculation and the call are ours."""

    supports_input_mutation = True
    supports_aliasing = True

    def body_options(self, tx) -> BodyOptions:
        return BodyOptions(
            hop_name=self.value.__name__,
            supports_input_mutation=self.supports_input_mutation,
            supports_aliasing=self.supports_aliasing,
        )

    def trace_body(self, tx, fn_vt, args, kwargs, *, subgraph_name: str):
        """Speculate the body and install it as a submodule; returns (spec, body_gmod, body_name,
        proxy args of the call: the body's get_attr node, then the lifted inputs)."""
        spec: Speculation = speculate(tx, self.value, fn_vt, list(args), dict(kwargs), self.body_options(tx))
        body_gmod = torch.fx.GraphModule(tx.output.nn_modules, spec.graph)
        body_name = self.install_subgraph_in_output_graph(
            tx, fn_vt, list(args), kwargs, body_gmod, attr_name=subgraph_name
        )
        body_node = compat.make_attr(tx, body_name)
        return spec, body_gmod, body_name, (body_node, *spec.lifted_freevars.keys())
