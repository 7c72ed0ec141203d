"""`UnfuseOutputAddmm`: undo Inductor's `mm + x -> addmm` where the split made the sum a piece output.

Inductor folds `add(mm(a, b), x)` into `addmm(x, a, b)` unless every user of the sum is pointwise
(post_grad.py, `is_valid_addmm_fusion`); a graph output does not count as pointwise. In a whole
decoder graph the residual stream `h = h + down(...)` only feeds the next layer's add and RMSNorm,
so the add stays unfused and Inductor fuses it into the norm's kernel. Split at attention, the same
sum is also a piece output (the residual handed to the next piece), so it becomes an addmm; the
residual before it then feeds that addmm and is folded too. On CUDA `addmm(x, a, b, out=buf)`
first copies x into buf (a device-to-device memcpy) and then runs the GEMM with beta=1: measured
on an H200, 30 extra memcpys per 16-layer decode step, 1.04x the time of the same model compiled
whole (bench/dev/decode_profile.py).

This pass, run after Inductor's own patterns, turns such an addmm back into `mm` + `add` when the
sum has at least one pointwise user and no users besides pointwise ones and the output: the add
then fuses into that user's kernel, which also writes the sum out, as in the whole graph. Last
nodes first, so unfolding one sum makes the users of the residual before it pointwise again.
Numerics match eager: the product is rounded to the activation dtype before the add, as
`linear(...) + x` does in eager (addmm rounds once, after the add).
Only a same-shape `x` (no broadcast bias: cuBLAS folds that into its epilogue without a copy),
only on GPU devices by default (on CPU Inductor keeps addmm on purpose).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.fx
from torch._inductor.utils import is_pointwise_use
from torch.fx.experimental.symbolic_shapes import statically_known_true, sym_eq

from torch_ext.backend.passes.base import Pass

__all__ = ["UnfuseOutputAddmm"]

aten = torch.ops.aten


class UnfuseOutputAddmm(Pass):
    def __init__(self, devices: tuple[str, ...] = ("cuda", "xpu")):
        self.devices = tuple(devices)
        self.unfused = 0  # addmms turned back into mm + add (all graphs this pass ran on)

    def config(self) -> Mapping[str, Any]:
        return {"devices": list(self.devices)}

    def __call__(self, graph: torch.fx.Graph) -> None:
        for node in reversed(list(graph.nodes)):
            if self._unfusable(node):
                x, mat1, mat2 = node.args[:3]
                with graph.inserting_before(node):
                    product = graph.call_function(aten.mm.default, (mat1, mat2))
                    total = graph.call_function(aten.add.Tensor, (product, x))
                total.meta = dict(node.meta)  # the sum is what the addmm was
                # The product gets a value of its own: sharing the sum's fake tensor would make later
                # passes (which compare storages) take the two for aliases.
                product.meta = dict(node.meta, val=aten.mm.default(mat1.meta["val"], mat2.meta["val"]))
                node.replace_all_uses_with(total)
                graph.erase_node(node)
                self.unfused += 1

    def _unfusable(self, node: torch.fx.Node) -> bool:
        if node.op != "call_function" or node.target is not aten.addmm.default:
            return False
        if node.kwargs.get("beta", 1) != 1 or node.kwargs.get("alpha", 1) != 1 or len(node.args) != 3:
            return False
        x, out = node.args[0], node.meta.get("val")
        x_val = x.meta.get("val") if isinstance(x, torch.fx.Node) else None
        if not isinstance(x_val, torch.Tensor) or not isinstance(out, torch.Tensor):
            return False
        if x_val.device.type not in self.devices or not statically_known_true(sym_eq(x_val.shape, out.shape)):
            return False
        users = list(node.users)
        pointwise = [u for u in users if u.op != "output" and is_pointwise_use(u)]
        return bool(pointwise) and all(u.op == "output" or u in pointwise for u in users)
