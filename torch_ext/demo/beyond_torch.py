"""Demo part `beyond`: programs plain torch.compile refuses on this torch and torch_ext compiles.

Both are nested_compile_region bodies torch 2.13 and 2.14 still refuse (tests/test_beyond_torch.py
has the rest): one returns one of its inputs unchanged ("Encountered aliasing during higher order
op tracing"), one returns a float computed from a symbolic size under dynamic=True. Whether torch
alone refuses is found out at run time, not assumed.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch
from torch._dynamo.backends.registry import lookup_backend

import torch_ext
from torch_ext.demo import show
from torch_ext.graph_summary import summarize

region = torch.compiler.nested_compile_region


@region
def keep_and_scale(x, y):
    return x, x * y  # x leaves the region unchanged: an output aliasing an input


def uses_keep_and_scale(x, y):
    a, b = keep_and_scale(x, y)
    c, d = keep_and_scale(b, y)  # a second call: the region stays one shared subgraph
    return a * d + c


@region
def sin_and_half_rows(x):
    return x.sin(), x.size(0) / 2.0  # a float computed from a symbolic size


def uses_sin_and_half_rows(x):
    s, half = sin_and_half_rows(x)
    return s * half


@dataclasses.dataclass
class Program:
    title: str
    source: str  # the line that makes the difference, as printed
    fn: Callable
    batches: tuple[int, ...]  # dim-0 sizes it is run at (several: the float follows the batch)
    dynamic: bool
    make_inputs: Callable[[int], tuple[torch.Tensor, ...]]


PROGRAMS = (
    Program("a region returns one of its inputs unchanged", "return x, x * y", uses_keep_and_scale,
            (4,), False, lambda n: (torch.randn(n, 3, requires_grad=True), torch.randn(n, 3))),
    Program("a region returns a float made from a size", "return x.sin(), x.size(0) / 2.0",
            uses_sin_and_half_rows, (3, 6, 10), True, lambda n: (torch.randn(n, 2, requires_grad=True),)),
)

BACKEND = "aot_eager"  # AOTAutograd (forward and backward graphs) without Inductor's C++ compile time


def compile_and_compare(program: Program) -> dict:
    """Compile with fullgraph=True, run at each batch size; raise what torch raises. Returns the
    graph count, the first captured graph and whether outputs and input gradients equal eager's."""
    torch._dynamo.reset()
    graphs: list[torch.fx.GraphModule] = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return lookup_backend(BACKEND)(gm, example_inputs)

    compiled = torch.compile(program.fn, backend=capture, fullgraph=True, dynamic=program.dynamic)
    equal = True
    for batch in program.batches:
        inputs = program.make_inputs(batch)
        twins = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
        out, ref = compiled(*inputs), program.fn(*twins)
        out.sum().backward()
        ref.sum().backward()
        equal &= torch.allclose(out, ref, atol=1e-5) and all(
            torch.allclose(a.grad, b.grad, atol=1e-5) for a, b in zip(inputs, twins) if a.requires_grad)
    return {"graphs": len(graphs), "graph": graphs[0], "equal_eager": equal}


def run() -> dict:
    version = torch.__version__.split("+")[0]
    show.header("beyond", f"torch {version} alone, then with torch_ext.install()")
    facts = {}
    for number, program in enumerate(PROGRAMS, 1):
        torch.manual_seed(0)
        print(f"  {number}. {program.title}:  {program.source}"
              + ("  (dynamic=True)" if program.dynamic else ""))
        show.flush()
        vanilla_ok, vanilla = show.attempt(lambda: compile_and_compare(program), show.OUTCOME_WIDTH)
        with torch_ext.installed():
            ext_ok, ext = show.attempt(lambda: compile_and_compare(program), show.OUTCOME_WIDTH)
        torch._dynamo.reset()
        rows = [("torch alone", _outcome(vanilla_ok, vanilla, program)),
                ("torch_ext.install()", _outcome(ext_ok, ext, program))]
        show.table(rows, indent="     ")
        if ext_ok:
            print(f"     captured graph ({BACKEND} backend):")
            for line in summarize(ext["graph"], indent="       ", width=show.WIDTH):
                print(line)
        facts[program.fn.__name__] = {"vanilla_compiled": vanilla_ok, "torch_ext_compiled": ext_ok,
                                      "equal_eager": ext_ok and ext["equal_eager"]}
    return facts


def _outcome(ok: bool, result, program: Program) -> str:
    if not ok:
        return f"refused: {result}"
    sizes = ", ".join(map(str, program.batches))
    return (f"compiled, {result['graphs']} graph{'s' if result['graphs'] != 1 else ''}; "
            f"outputs, grads equal eager (batch {sizes}): {result['equal_eager']}")
