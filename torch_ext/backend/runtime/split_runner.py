"""Call an inference split graph through generated straight-line code instead of fx's module calls.

A split graph module calls each piece as `self.submod_N(...)`: a splitting op's partition is a
GraphModule, so each of its calls went through nn.Module.__call__ and GraphModule's wrapper (about
5 us each on a CPU thread, twice per layer with the graph module itself). `run_straight_line(split_gm)`
writes the split graph as one function (runtime/straight_line.py) that calls the compiled pieces
directly and inlines the splitting ops' partitions (plain calls of the ops), and makes calling
`split_gm` run it. The module stays what the backend returns (tests, dumps and the config
reporter's hook read it); while it has forward hooks, a call takes nn.Module's path to run them.

`serial`: calls of CPU graphs from many threads run one at a time (runtime/serial_calls.py).
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.fx as fx

from torch_ext.backend.runtime.serial_calls import serialized
from torch_ext.backend.runtime.straight_line import straight_line


def _plain(gm: fx.GraphModule) -> bool:
    """A partition of plain calls (a splitting op, tuple unpacking), which straight_line can inline."""
    return all(node.op in ("placeholder", "call_function", "output") for node in gm.graph.nodes)


def run_straight_line(split_gm: fx.GraphModule, name: str, serial: bool = False) -> Callable | None:
    """Make calls of `split_gm` run straight-line code, one call at a time in the process if `serial`;
    returns that code, or None where the graph holds something it cannot write (an attribute read),
    left as it is."""
    graph = split_gm.graph
    if any(node.op not in ("placeholder", "call_module", "call_function", "output") or
           (node.op == "placeholder" and node.args) for node in graph.nodes):  # args: a default value
        return None
    callables: dict[str, Callable] = {}
    for node in graph.find_nodes(op="call_module"):
        if node.target in callables:
            continue
        runner: Any = split_gm.__dict__.get(node.target)  # a compiled piece (backend._install_runners)
        if runner is None:
            module = getattr(split_gm, node.target)
            runner = straight_line(module.graph, {}, f"{name} {node.target}", boxed=False) \
                if isinstance(module, fx.GraphModule) and _plain(module) else module
        callables[node.target] = runner
    run = straight_line(graph, callables, name, boxed=False)
    cls = type(split_gm)  # GraphModule makes a class per instance: this changes only split_gm

    forward = serialized(run) if serial else run

    def call(self, *args):
        if self._forward_pre_hooks or self._forward_hooks:
            return torch.nn.Module.__call__(self, *args)
        return forward(*args)

    cls.__call__ = call
    split_gm.forward = forward  # nn.Module's path (with hooks) runs the same code
    split_gm.straight_line_source = run.source
    return run
