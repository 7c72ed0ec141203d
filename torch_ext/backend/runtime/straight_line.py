"""Run a split graph as generated straight-line Python: one function, no interpreter, no nn.Module calls.

`straight_line(graph, callables)` writes the source of `run(args)` for a split graph whose
`call_module` nodes call compiled pieces or eager splitting ops, and returns it compiled. It takes
its inputs boxed (a list it clears, as Inductor's own code does), and drops each value after its last
use, so a backward graph frees saved activations as it goes instead of holding all of them to its end.
Per piece, a call costs one Python call; the AOTAutograd and nn.Module layers around each piece of
the split-per-piece path (runtime/piecewise.py) are gone (backend/joint.py runs this for both
graphs AOTAutograd makes of a training graph).
"""
from __future__ import annotations

import operator
from typing import Any, Callable

import torch.fx as fx

from torch_ext import compat


def straight_line(graph: fx.Graph, callables: dict[str, Callable], name: str = "split_graph",
                  boxed: bool = True) -> Callable:
    """`run(args)` for `graph`: placeholders from the list `args` (cleared), each `call_module` node
    calling `callables[target]`, getitem on results, other calls by their target, output as written.
    boxed=False: `run(*args)`, for a partition run eagerly (a splitting op) inside such a function."""
    names: dict[fx.Node, str] = {}
    env: dict[str, Any] = {}  # globals of the generated function: callables and constants

    def constant(value: Any) -> str:
        key = f"_c{len(env)}"
        env[key] = value
        return key

    def fmt(arg: Any) -> str:
        if isinstance(arg, fx.Node):
            return names[arg]
        if isinstance(arg, tuple):
            return "(" + "".join(f"{fmt(a)}, " for a in arg) + ")"
        if isinstance(arg, list):
            return "[" + ", ".join(fmt(a) for a in arg) + "]"
        if isinstance(arg, dict):
            return "{" + ", ".join(f"{k!r}: {fmt(v)}" for k, v in arg.items()) + "}"
        if arg is None or isinstance(arg, (bool, int, str)):
            return repr(arg)
        return constant(arg)  # floats (inf, nan), dtypes, devices, ...: by reference

    nodes = list(graph.nodes)
    last_use: dict[fx.Node, fx.Node] = {}
    for node in nodes:
        for used in node.all_input_nodes:
            last_use[used] = node
    dying: dict[fx.Node, list[fx.Node]] = {}  # node -> the values whose last use it is
    for used, last in last_use.items():
        dying.setdefault(last, []).append(used)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    lines = []
    for i, node in enumerate(placeholders):
        names[node] = f"a{i}"
    if placeholders and boxed:
        lines.append("    " + "".join(f"{names[n]}, " for n in placeholders) + "= args")
    if boxed:
        lines.append("    args.clear()")
    for i, node in enumerate(nodes):
        if node.op == "placeholder":
            pass
        elif node.op == "output":
            lines.append(f"    return {fmt(node.args[0])}")
        else:
            value = names[node] = f"v{i}"
            args = ", ".join([fmt(a) for a in node.args] + [f"{k}={fmt(v)}" for k, v in node.kwargs.items()])
            if node.op == "call_module" and getattr(callables[node.target], "_boxed_call", False):
                # A boxed callable (a compiled piece) gets its inputs in a list it clears, and the names
                # whose last use this is are dropped first: it frees each input once it has read it.
                lines.append(f"    {value} = [{args}]")
                if node in dying:
                    lines.append(f"    del {', '.join(names[u] for u in dying.pop(node))}")
                lines.append(f"    {value} = {constant(callables[node.target])}({value})")
            elif node.op == "call_module":
                lines.append(f"    {value} = {constant(callables[node.target])}({args})")
            elif node.op == "call_function" and node.target is operator.getitem:
                lines.append(f"    {value} = {fmt(node.args[0])}[{fmt(node.args[1])}]")
            elif node.op == "call_function":  # RNG-state HOPs without their dispatch (compat/rng_hops.py)
                lines.append(f"    {value} = {constant(compat.direct_hop_call(node.target))}({args})")
            else:
                raise NotImplementedError(f"straight_line: {node.op} node {node.name} in {name}")
            if not node.users:
                lines.append(f"    del {value}")
        # Values whose last use was this node: drop them now (a saved activation freed as early as
        # Inductor's own code frees it).
        if node in dying and node.op != "output":
            lines.append(f"    del {', '.join(names[u] for u in dying[node])}")
    signature = "args" if boxed else ", ".join(names[n] for n in placeholders)
    source = f"def run({signature}):\n" + "\n".join(lines) + "\n"
    code = compile(source, f"<torch_ext {name}>", "exec")
    exec(code, env)
    run = env["run"]
    run._boxed_call = boxed  # AOTAutograd calls a boxed one with a list it may clear
    run.source = source
    return run
