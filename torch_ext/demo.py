"""`python -m torch_ext demo`: a small model whose nested_compile_region and checkpoint bodies return
dataclasses, compiled without and with `torch_ext.install()`.

For each: the graph count and graph breaks Dynamo reports, the captured graph, and whether the
compiled outputs and gradients equal eager's.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import torch_ext
from torch_ext.testing import graph_text


@dataclasses.dataclass
class BlockOutput:
    hidden: torch.Tensor
    residual: torch.Tensor
    layer: int


class Block(nn.Module):
    def __init__(self, dim: int, index: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.index = index

    @torch.compiler.nested_compile_region
    def forward(self, x):
        h = self.mlp(self.norm(x))
        return BlockOutput(hidden=h, residual=x + h, layer=self.index)


class Head(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.proj = nn.Linear(dim, dim)

    def body(self, x):
        y = self.proj(x)
        return BlockOutput(hidden=torch.tanh(y), residual=x, layer=-1)

    def forward(self, x):
        out = checkpoint(self.body, x, use_reentrant=False)
        return out.hidden + out.residual


class DemoModel(nn.Module):
    def __init__(self, dim: int = 32, depth: int = 3):
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim, i) for i in range(depth))
        self.head = Head(dim)

    def forward(self, x):
        for block in self.blocks:
            x = block(x).residual
        return self.head(x)


def _compile_and_check(model: nn.Module, x: torch.Tensor, backend: str) -> str:
    torch._dynamo.reset()
    graphs: list[torch.fx.GraphModule] = []

    from torch._dynamo.backends.registry import lookup_backend

    def capture(gm, example_inputs):
        graphs.append(gm)
        return lookup_backend(backend)(gm, example_inputs)

    try:
        explanation = torch._dynamo.explain(model)(x)
        torch._dynamo.reset()
        compiled = torch.compile(model, backend=capture)
        out = compiled(x)
    except Exception as e:  # torch's own failure is part of what the demo shows
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return f"  compile FAILED: {type(e).__name__}: {first_line[:160]}\n"
    ref = model(x)
    (grad,) = torch.autograd.grad(out.sum(), x)
    (ref_grad,) = torch.autograd.grad(ref.sum(), x)
    same = torch.allclose(out, ref, atol=1e-5) and torch.allclose(grad, ref_grad, atol=1e-5)
    lines = [
        f"  graphs: {explanation.graph_count}, graph breaks: {explanation.graph_break_count}",
        *(f"    break: {str(r.reason).splitlines()[0][:140]}" for r in explanation.break_reasons),
        f"  outputs and gradients equal eager ({backend} backend): {same}",
    ]
    if len(graphs) == 1:
        lines.append("  captured graph:")
        lines += ["    " + line for line in graph_text(graphs[0]).splitlines()]
    return "\n".join(lines) + "\n"


def main() -> int:
    torch.manual_seed(0)
    model = DemoModel()
    x = torch.randn(4, 32, requires_grad=True)
    print(f"torch {torch.__version__}: 3 nested_compile_region blocks and a checkpointed head, "
          "all returning a dataclass\n")
    print("torch.compile without torch_ext:")
    print(_compile_and_check(model, x, "aot_eager"))
    with torch_ext.installed():
        print("torch.compile with torch_ext.install():")
        print(_compile_and_check(model, x, "aot_eager"))
    return 0
