"""Insert the HOP call into the outer graph and point the body's output VTs at its results.

The VTs the body returned still hold proxies of subgraph nodes. After the call node exists, each of
them is re-pointed at the matching output of the call, so code after the HOP reads the HOP's
outputs while the Python structure around them (objects, dataclasses, dicts) stays as traced.
"""
from __future__ import annotations

from typing import Any

from torch_ext import compat

from .speculate import Speculation
from .symbolic import replay


def call_and_reproxify(tx, target, proxy_args: tuple, proxy_kwargs: dict, spec: Speculation,
                       node_meta: dict[str, Any] | None = None):
    """Create `target(*proxy_args, **proxy_kwargs)` in the outer graph; return the body's output VT."""
    proxy = tx.output.create_proxy("call_function", target, args=proxy_args, kwargs=proxy_kwargs)
    if node_meta:
        proxy.node.meta.update(node_meta)
    results = compat.wrap_fx_proxy(tx=tx, proxy=proxy, example_value=spec.example_value)
    for group, result in zip(spec.output_vts, results.items, strict=True):
        for vt in group:
            vt.proxy = result.proxy
    for vt, outer_proxy in spec.recomputed:
        vt.proxy = outer_proxy
    if spec.views_of_outputs:
        # Body output node -> the HOP's result for it; views of outputs are taken on those.
        (body_output,) = spec.graph.find_nodes(op="output")
        results_of = {node: result.proxy for node, result in zip(body_output.args[0], results.items)}
        for vts, plan in spec.views_of_outputs:
            outer_proxy = replay(tx, plan, results_of, tx.output.current_tracer)
            for vt in vts:
                vt.proxy = outer_proxy
    return spec.output
