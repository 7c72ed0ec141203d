"""Recompute a value of a HOP body in the caller's graph instead of returning it from the subgraph.

Two kinds of values are cheap and sound to recompute outside, because they depend on no tensor
data:
- symbolic values (SymInt, SymFloat, SymBool): `x.size(0) / 2.0` in the body becomes
  `sym_size(x, 0) / 2.0` in the caller. HOP outputs must be tensors or SymInts (torch 2.9.1's
  invoke_subgraph: tensors only), so this is how a SymFloat can leave a body at all.
- views: `x.t()` of an input, or `y.view(-1)` of another output. invoke_subgraph outputs may not
  alias its inputs or each other (autograd does not inline it); taking the same view in the caller,
  on the input or on the HOP's output, is exactly what eager computes.
A value that depends on tensor data (`.item()`, arithmetic on tensors) is never recomputed.
"""
from __future__ import annotations

import torch
import torch.fx
from torch.multiprocessing.reductions import StorageWeakRef

_SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool)


def _is_symbolic(value) -> bool:
    if isinstance(value, (torch.Size, tuple)):  # x.size() on the way to x.size()[0]
        return all(isinstance(v, _SYMBOLIC) for v in value)
    return isinstance(value, _SYMBOLIC)


def storage_of(node: torch.fx.Node):
    value = node.meta.get("example_value")
    if isinstance(value, torch.Tensor) and not value.is_sparse:
        return StorageWeakRef(value.untyped_storage())
    return None


def is_view(node: torch.fx.Node) -> bool:
    """A call whose tensor result shares storage with its only tensor input (and changes nothing)."""
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    if name.endswith("_") and not name.endswith("__"):
        return False  # in-place (t_, transpose_): not a pure view
    tensor_inputs = [n for n in node.all_input_nodes if storage_of(n) is not None]
    result = storage_of(node)
    return result is not None and len(tensor_inputs) == 1 and storage_of(tensor_inputs[0]) == result


def replay_plan(node: torch.fx.Node, roots: set[torch.fx.Node]) -> list[torch.fx.Node] | None:
    """The body nodes to replay (in graph order) to compute `node` from `roots`, or None if it
    depends on anything but roots, symbolic ops and views."""
    needed: dict[torch.fx.Node, None] = {}
    stack = [node]
    while stack:
        n = stack.pop()
        if n in needed or n in roots:
            continue
        if n.op not in ("call_function", "call_method"):
            return None  # a placeholder that is not a root, an attribute, ...
        if not (_is_symbolic(n.meta.get("example_value")) or is_view(n)):
            return None  # depends on tensor data
        needed[n] = None
        stack.extend(n.all_input_nodes)
    order = {n: i for i, n in enumerate(node.graph.nodes)}
    return sorted(needed, key=order.__getitem__)


def replay(tx, plan: list[torch.fx.Node], env: dict[torch.fx.Node, torch.fx.Proxy], tracer) -> torch.fx.Proxy:
    """Create `plan`'s nodes in `tracer`'s graph, reading roots from `env`; the last node's proxy.
    Example values are computed afresh, so a view's fake tensor aliases the caller's tensor."""
    from torch._dynamo.utils import get_fake_value

    env = dict(env)
    for n in plan:
        args, kwargs = torch.fx.node.map_arg((n.args, n.kwargs), lambda a: env[a])
        proxy = tracer.create_proxy(n.op, n.target, args, kwargs)
        proxy.node.meta["example_value"] = get_fake_value(proxy.node, tx)
        env[n] = proxy
    return env[plan[-1]]


def inputs_of_caller(lifted_freevars: dict) -> dict[torch.fx.Node, torch.fx.Proxy]:
    """Body placeholder node -> the caller's proxy it was lifted from."""
    return {inner.node: outer for outer, inner in lifted_freevars.items()}
