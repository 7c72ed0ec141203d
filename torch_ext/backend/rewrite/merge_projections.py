"""Merge projections that read the same input (q/k/v, gate/up) into one linear, for inference graphs.

A group is >= 2 `linear(x, w_i, b_i)` calls of one graph sharing the node `x`, whose weights (and
biases, all or none) are parameters: plain tensors (no subclass: a quantized weight or a DTensor
computes its linear its own way) in placeholders Dynamo marks static, each used by that one linear
alone, of one dtype and device, contiguous, with the same in_features; x and the output of that dtype
too (autocast would have the merged call compute in another), and no node between the calls that may
mutate a tensor or change autocast / grad mode (the merged call runs where the first one was: a later
one would read x before an in-place update of it, or in another autocast region). The group becomes

    y = linear(x, merged_weight, merged_bias); y_0, y_1, ... = torch.split(y, rows, dim=-1)

where merged_weight / merged_bias are new placeholders appended after the graph's own, marked
static like parameters (CUDA graphs read them in place). The caller passes the buffers that hold
the concatenated parameters (runtime/merged_params.py) after the original arguments; the original
weight placeholders stay (Dynamo still passes them) but nothing reads them.

A group is left alone where a projection's output, or a view of it, is an output of the graph: the
caller (the user, or the code after a graph break) would get a slice, strided unlike eager's result.

Each slice of the merged weight must start 16 bytes into the buffer (Inductor assumes parameters
aligned, and the parameters become views of the buffer): a group whose rows would break that is
left alone.
"""
from __future__ import annotations

import dataclasses
import logging
import operator
from collections import defaultdict

import torch
import torch.fx as fx
from torch._dispatch.python import enable_python_dispatcher
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from torch_ext import compat
from torch_ext.backend.rewrite.writes import is_barrier

log = logging.getLogger("torch_ext.backend")

LINEAR_TARGETS = (torch._C._nn.linear, torch.nn.functional.linear)  # one object on 2.9.1 .. 2.15
ALIGNMENT = 16  # bytes; Inductor's assumed alignment of parameters (GPU_ALIGN_BYTES)
_STATIC = "_dynamo_static_input_type"


@dataclasses.dataclass(frozen=True)
class MergedGroup:
    """One merged group: the graph-input positions of its weights (and biases), in row order."""

    weight_inputs: tuple[int, ...]
    bias_inputs: tuple[int, ...]  # empty: no bias
    rows: tuple[int, ...]
    in_features: int
    names: tuple[str, ...]  # where Dynamo read each weight ("L['self']._modules['q_proj']...")


@dataclasses.dataclass(frozen=True)
class MergePlan:
    """What the rewrite did: the graph now takes, after its `original_inputs` arguments, each group's
    merged weight and then (if the group has biases) its merged bias, in group order."""

    groups: tuple[MergedGroup, ...]
    original_inputs: int

    def describe(self) -> str:
        lines = [f"{len(self.groups)} merged projection group(s); the graph takes their buffers after its "
                 f"{self.original_inputs} inputs"]
        for i, group in enumerate(self.groups):
            bias = "with bias" if group.bias_inputs else "no bias"
            lines.append(f"group {i}: {len(group.rows)} projections, in_features {group.in_features}, "
                         f"rows {list(group.rows)} ({sum(group.rows)} in all), {bias}")
            lines += [f"  {name}: rows {rows}" for name, rows in zip(group.names, group.rows)]
        return "\n".join(lines) + "\n"


def _value(node) -> object:
    return node.meta.get("example_value", node.meta.get("val")) if isinstance(node, fx.Node) else None


def _linear_args(node: fx.Node):
    """(input, weight, bias) of a linear call, or None if it is not one."""
    if node.op != "call_function" or node.target not in LINEAR_TARGETS:
        return None
    names = ("input", "weight", "bias")
    values = list(node.args) + [node.kwargs[n] for n in names[len(node.args):] if n in node.kwargs]
    if len(values) < 2 or len(node.args) + len(node.kwargs) > 3:
        return None
    return values[0], values[1], values[2] if len(values) > 2 else None


def _is_param(node, users_ok) -> bool:
    """A static placeholder holding a contiguous tensor, used by exactly one node that uses it once."""
    if not (isinstance(node, fx.Node) and node.op == "placeholder"
            and _STATIC in node.meta.get("tensor_dict", {})):
        return False
    value = _value(node)
    # A plain tensor: a subclass (a quantized weight, a DTensor) computes its linear its own way.
    if not isinstance(value, torch.Tensor) or is_traceable_wrapper_subclass(value) or not value.is_contiguous():
        return False
    return len(node.users) == 1 and users_ok(next(iter(node.users)))


def _candidate(node: fx.Node):
    """The group key and (weight, bias) of a linear that may be merged, else None."""
    parts = _linear_args(node)
    if parts is None:
        return None
    x, weight, bias = parts
    x_value, out = _value(x), _value(node)
    uses_once = lambda param: lambda user: user is node and [x, weight, bias].count(param) == 1  # noqa: E731
    if not isinstance(x, fx.Node) or not _is_param(weight, uses_once(weight)):
        return None
    w = _value(weight)
    if w.dim() != 2 or any(isinstance(s, torch.SymInt) for s in w.shape):
        return None
    if not (isinstance(x_value, torch.Tensor) and isinstance(out, torch.Tensor) and x_value.dtype == out.dtype == w.dtype):
        return None  # autocast (or a mixed-dtype call): the merged call would be cast otherwise
    if bias is not None:
        b = _value(bias) if _is_param(bias, uses_once(bias)) else None
        if b is None or b.dim() != 1 or b.shape[0] != w.shape[0] or b.dtype != w.dtype or b.device != w.device:
            return None
    return (x, bias is not None, w.dtype, w.device, w.shape[1]), (weight, bias)


def _aligned(rows: list[int], row_bytes: int) -> bool:
    start = 0
    for r in rows:
        if (start * row_bytes) % ALIGNMENT:
            return False
        start += r
    return True


def find_groups(gm: fx.GraphModule) -> list[list[fx.Node]]:
    """The linear nodes of each mergeable group, in graph order."""
    by_key: dict[tuple, list[fx.Node]] = defaultdict(list)
    segment = 0  # barriers seen so far: linears of one group lie between the same two barriers
    for node in gm.graph.nodes:
        if is_barrier(node):
            segment += 1
            continue
        found = _candidate(node)
        if found is not None:
            by_key[(segment, *found[0])].append(node)
    groups = []
    for (_, _, has_bias, dtype, _, in_features), nodes in by_key.items():
        if len(nodes) < 2:
            continue
        rows = [_value(_linear_args(n)[1]).shape[0] for n in nodes]
        itemsize = dtype.itemsize
        if not (_aligned(rows, in_features * itemsize) and (not has_bias or _aligned(rows, itemsize))):
            log.debug("torch_ext: projections %s not merged: a slice would not start %d-byte aligned",
                      [n.name for n in nodes], ALIGNMENT)
            continue
        groups.append(nodes)
    return groups


def merge_projections(gm: fx.GraphModule) -> tuple[fx.GraphModule, MergePlan] | None:
    """A copy of gm with its projections merged and the plan for the runtime, or None where nothing
    was merged. gm itself is left alone: Dynamo reads its placeholders after the backend returns."""
    if not find_groups(gm):
        return None
    gm = _copy(gm)
    groups = find_groups(gm)
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    position = {node: i for i, node in enumerate(placeholders)}
    # The mode of the graph's own example values (the tracing context's may be another: 2.15 hands the
    # backend a copy of Dynamo's).
    fake_mode = next((v.fake_mode for v in map(_value, placeholders) if isinstance(v, FakeTensor)), None)
    if fake_mode is None:  # no fake values to set on the new nodes: leave the graph alone
        return None
    last_input = placeholders[-1]
    planned = []
    for nodes in groups:
        weights = [_linear_args(n)[1] for n in nodes]
        biases = [_linear_args(n)[2] for n in nodes if _linear_args(n)[2] is not None]
        w0 = _value(weights[0])
        rows = tuple(int(_value(w).shape[0]) for w in weights)
        x = _value(_linear_args(nodes[0])[0])
        with fake_mode, enable_python_dispatcher():  # as Dynamo runs ops (symbolic sizes in composite ops)
            merged_w = torch.empty((sum(rows), w0.shape[1]), dtype=w0.dtype, device=w0.device)
            merged_b = torch.empty((sum(rows),), dtype=w0.dtype, device=w0.device) if biases else None
            merged_y = torch._C._nn.linear(x, merged_w, merged_b)
            parts = torch.split(merged_y, list(rows), dim=-1)
        views = _replay_views(nodes, parts, fake_mode)
        if views is None:
            continue
        for node, value in views.items():  # later stages read the strides of the slices' views
            node.meta["example_value"] = value
        last_input = w_node = _static_placeholder(gm, last_input, "merged_weight", merged_w)
        b_node = None
        if biases:
            last_input = b_node = _static_placeholder(gm, last_input, "merged_bias", merged_b)
        _replace_group(gm, nodes, w_node, b_node, rows, merged_y, parts)
        planned.append(MergedGroup(tuple(position[w] for w in weights), tuple(position[b] for b in biases), rows,
                                   int(w0.shape[1]), tuple(compat.placeholder_source(w) or w.name for w in weights)))
    if not planned:
        return None
    gm.graph.lint()
    gm.recompile()
    return gm, MergePlan(tuple(planned), len(placeholders))


def _copy(gm: fx.GraphModule) -> fx.GraphModule:
    """gm with a graph of its own (nodes' meta copied shallowly; submodules shared)."""
    graph = fx.Graph()
    nodes: dict[fx.Node, fx.Node] = {}
    out = graph.graph_copy(gm.graph, nodes)
    graph.output(out)
    for old, new in nodes.items():
        if hasattr(old, "_dynamo_source"):  # the placeholder's source (2.13+), read by placeholder_source
            new._dynamo_source = old._dynamo_source
    copy = fx.GraphModule(gm, graph, gm.__class__.__name__)
    copy.meta = dict(getattr(gm, "meta", {}))
    return copy


# Ops whose output may alias their input: a projection's output, once a slice of the merged one,
# has other strides, and a `view` downstream of it may no longer be possible.
_VIEW_METHODS = {"view", "transpose", "permute", "unsqueeze", "squeeze", "reshape", "unflatten", "flatten",
                 "expand", "t", "split", "chunk", "narrow", "movedim", "unbind", "select", "view_as", "__getitem__"}
_VIEW_FUNCTIONS = {operator.getitem, torch.transpose, torch.permute, torch.reshape, torch.unsqueeze, torch.squeeze,
                   torch.flatten, torch.split, torch.chunk, torch.narrow, torch.movedim, torch.unbind, torch.select}


def _replay_views(nodes: list[fx.Node], parts, fake_mode) -> dict[fx.Node, object] | None:
    """Replay the view-like ops that use each projection's output (and their view-like users) on
    the slice that replaces it: their new example values, or None where one fails (a `view` that
    merges the sliced dim with another) or where one of them is a graph output."""
    values: dict[fx.Node, object] = dict(zip(nodes, parts))
    pending = [u for n in nodes for u in n.users]
    seen = set()
    lookup = lambda a: values.get(a, _value(a)) if isinstance(a, fx.Node) else a  # noqa: E731
    while pending:
        node = pending.pop()
        if node in seen:
            continue
        seen.add(node)
        if node.op == "output":  # the caller would get a slice, with other strides than eager's
            log.debug("torch_ext: projections %s not merged: an output (or a view of it) leaves the graph",
                      [n.name for n in nodes])
            return None
        if node.op == "call_method" and node.target in _VIEW_METHODS:
            run = lambda *a, **k: getattr(a[0], node.target)(*a[1:], **k)  # noqa: E731
        elif node.op == "call_function" and node.target in _VIEW_FUNCTIONS:
            run = node.target
        else:
            continue  # computes a new tensor: any strides will do
        try:
            with fake_mode, enable_python_dispatcher():
                args, kwargs = fx.node.map_aggregate((node.args, node.kwargs), lookup)
                values[node] = run(*args, **kwargs)
        except Exception as e:  # e.g. "view size is not compatible with input tensor's size and stride"
            log.debug("torch_ext: projections %s not merged: %s fails on a slice (%s)",
                      [n.name for n in nodes], node.format_node(), e)
            return None
        pending.extend(node.users)
    return {node: value for node, value in values.items() if node not in nodes}


def _static_placeholder(gm: fx.GraphModule, after: fx.Node, name: str, value: torch.Tensor) -> fx.Node:
    with gm.graph.inserting_after(after):
        node = gm.graph.placeholder(name)
    node.target = node.name  # the argument's name in the generated code: unique like the node's
    node.meta["example_value"] = value
    node.meta["tensor_dict"] = {_STATIC: "unguarded"}  # a parameter: CUDA graphs read it in place
    return node


def _replace_group(gm, nodes, w_node, b_node, rows, merged_y, parts) -> None:
    x = _linear_args(nodes[0])[0]
    graph = gm.graph
    with graph.inserting_before(nodes[0]):
        merged = graph.call_function(torch._C._nn.linear, (x, w_node) if b_node is None else (x, w_node, b_node))
        merged.meta["example_value"] = merged_y
        split = graph.call_function(torch.split, (merged, list(rows)), {"dim": -1})
        split.meta["example_value"] = parts
        for i, node in enumerate(nodes):
            item = graph.call_function(operator.getitem, (split, i))
            item.meta["example_value"] = parts[i]
            for key in ("stack_trace", "nn_module_stack", "source_fn_stack"):
                if key in node.meta:
                    item.meta.setdefault(key, node.meta[key])
            node.replace_all_uses_with(item)
    for node in nodes:
        graph.erase_node(node)
