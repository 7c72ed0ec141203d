"""`FuseAddRMSNormPass`: residual add + RMSNorm -> `torch.ops.torch_ext.fused_add_rms_norm`.

Matched in the post-grad graph (the model's code, as Dynamo and AOT autograd decompose it):

    r = x + residual                   # or addmm(residual, a, b): Inductor folds mm + add so
    h = r.float()                      #   when r has a non-pointwise user (always on CPU)
    var = h.pow(2).mean(-1, keepdim=True)
    y = (h * torch.rsqrt(var + eps)).to(x.dtype) * weight      # outputs: r and y
                                                               # (or weight * (...), as HF writes)

for x, residual and weight of one dtype among `dtypes`, any eps, any leading shape. Inductor's
pattern matcher finds it (patterns traced like Inductor's own replacements); `MultiOutputMatch`
replaces it (two outputs) with `auto_functionalized(fused_add_rms_norm)` and two getitems, after
an `mm` for the addmm form. Inductor then re-inplaces: x and residual are updated in place when
nothing reads them later, else cloned first; a graph input is always cloned (`skip_graph_inputs`
leaves such matches alone).

Bytes per layer in the decode benchmark (16-layer Llama-style decoder, hidden H = 2048, bf16,
B tokens per step). T = 2*B*H bytes = 4 KiB * B, one bf16 activation (an fp32 one is 2T). A layer
has two add+RMSNorms, A (after attention) and B (after the MLP, the next layer's input norm).

- Least traffic for one add+RMSNorm: read x, residual; write r, y: 4T (+ 4 KiB of weight). The
  Triton kernel does exactly that (one program per row, the row stays in registers).
- Against eager op by op: add 3T, .float() 3T, pow 4T, mean 2T, h*rsqrt 4T, .to 3T, *weight 2T
  = 21T, so 17T saved per norm, 34T = 136 KiB * B per layer.
- Against Inductor (the benchmark's piecewise column), which already emits one kernel per norm:
  2048 > 1024 (its persistent-reduction limit) makes it a looped reduction that re-reads r in its
  second loop, from L2 at decode sizes. The fusion saves that re-read, T per norm, and costs:
  - +2T and one clone kernel when `residual` is an input of the piece: norm A, since attention
    is the splitting op;
  - +T when Inductor had folded the add into the projection before it (addmm epilogue, done on GPU
    when the sum has a non-pointwise user: norm B's r is a piece output, and once B is folded A's
    r feeds an addmm): the fusion splits it back into mm + op, writing and re-reading the product.
    Only with 2-D activations; 3-D ones put views between mm and add, and nothing is folded.
  Per layer, 2-D: 2T of L2 reads saved, 4T of DRAM traffic added (+16 KiB * B); 3-D: 2T saved,
  2T added (+8 KiB * B); each with one more kernel. With `skip_graph_inputs=True` norm A stays with
  Inductor: 2-D +T - T, 3-D -T (L2 only): about 0.

Prediction: against piecewise Inductor the fusion saves no DRAM bytes per layer; it adds 4T
(2-D) or 2T (3-D) per layer, 16 * 16 KiB = 256 KiB per step at B=1 (about 0.06 us at 4.3 TB/s),
and 16 clone kernels per step: expect equal or slightly slower steps, dominated by the extra
kernels. Its saving is against unfused eager: 34T = 136 KiB * B per layer.
"""
from __future__ import annotations

import functools
import itertools
import sys
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
import torch.fx

import torch_ext.kernels.fused_add_rms_norm as _op_module
from torch_ext.backend.passes import multi_output_match as _mom_module
from torch_ext.backend.passes.base import Pass
from torch_ext.backend.passes.multi_output_match import MultiOutputMatch

if TYPE_CHECKING:
    from torch._inductor.pattern_matcher import Match, PatternMatcherPass

__all__ = ["FuseAddRMSNormPass", "COUNTER"]

#: torch._dynamo.utils.counters["torch_ext"][COUNTER] counts the replacements made.
COUNTER = "fuse_add_rms_norm"

_SUPPORTED = (torch.float32, torch.bfloat16, torch.float16)
# Stands in for eps while tracing: the pattern takes whatever constant the graph holds there.
_EPS_PLACEHOLDER = 1.2345e-6

aten = torch.ops.aten


def _rms_norm(r: torch.Tensor, weight: torch.Tensor, eps: float, weight_first: bool):
    h = r.float()
    var = h.pow(2).mean(-1, keepdim=True)
    normed = (h * torch.rsqrt(var + eps)).to(r.dtype)
    # Both orders occur (HF Llama writes `weight * normed`); the matcher knows no commutativity.
    return weight * normed if weight_first else normed * weight


def _make_search(addmm: bool, weight_first: bool):
    if addmm:
        # Inductor's own post-grad pattern folds `mm(a, b) + residual` into addmm when the sum has
        # a non-pointwise user (always on CPU; on GPU e.g. when it leaves the piece as an output).
        # The replacement splits it again, mm then add in the op: the model's eager rounding.
        def search(mat1, mat2, residual, weight, eps):
            r = torch.addmm(residual, mat1, mat2)
            return r, _rms_norm(r, weight, eps, weight_first)

    else:

        def search(x, residual, weight, eps):
            r = x + residual
            return r, _rms_norm(r, weight, eps, weight_first)

    return search


def _unused_replacement(*args):
    raise AssertionError("FuseAddRMSNormPass replaces matches itself, through MultiOutputMatch")


def _eps_of(match: Match) -> float | None:
    """The constant added to the variance, read off the graph.

    (2.13 also reports it in match.kwargs; 2.9.1 does not once the match is re-checked with real
    shapes, since the re-traced pattern holds it as a literal.)"""
    for n in match.nodes:
        if n.target is aten.rsqrt.default and isinstance(n.args[0], torch.fx.Node):
            args = n.args[0].args
            if len(args) == 2 and isinstance(args[1], (int, float)) and not isinstance(args[1], bool):
                return float(args[1])
    return None


def _only_default_kwargs(node: torch.fx.Node) -> bool:
    """The matcher ignores kwargs a pattern node lacks (add's alpha, mean's dtype, addmm's beta):
    accept them only at their defaults."""
    if not node.kwargs:
        return True
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return False
    defaults = {a.name: a.default_value for a in schema.arguments if a.has_default_value()}
    return all(k in defaults and defaults[k] == v for k, v in node.kwargs.items())


class FuseAddRMSNormPass(Pass):
    source_dependencies = (sys.modules[__name__], _mom_module, _op_module)

    def __init__(
        self, dtypes: Iterable[torch.dtype] = _SUPPORTED, *, skip_graph_inputs: bool = False
    ) -> None:
        dtypes = tuple(dict.fromkeys(dtypes))
        bad = [d for d in dtypes if d not in _SUPPORTED]
        if bad or not dtypes:
            raise ValueError(f"FuseAddRMSNormPass supports dtypes {_SUPPORTED}, got {dtypes}")
        self.dtypes = dtypes
        self.skip_graph_inputs = skip_graph_inputs
        self._patterns: PatternMatcherPass | None = None  # built on first use: tracing costs ~1 s
        self._found: list[tuple[Match, float]] = []

    def config(self) -> dict[str, Any]:
        return {
            "dtypes": [str(d) for d in self.dtypes],
            "skip_graph_inputs": self.skip_graph_inputs,
        }

    def __getstate__(self) -> dict[str, Any]:
        # The pattern registry holds closures; rebuild it after unpickling.
        return {**self.__dict__, "_patterns": None, "_found": []}

    def __call__(self, graph: torch.fx.Graph) -> None:
        from torch._dynamo.utils import counters

        patterns = self._pattern_pass()
        if graph.owning_module is None:
            # The pattern matcher needs a GraphModule; Inductor's graphs have one, bare ones don't.
            torch.fx.GraphModule(torch.nn.Module(), graph)
        self._found = []
        try:
            # The extra check records each match and declines it, so the matcher replaces nothing.
            patterns.apply(graph)
            done: set[torch.fx.Node] = set()
            for match, eps in self._found:
                if done.isdisjoint(match.nodes):  # never touch a match another one rewrote
                    self._replace(match, eps)
                    done.update(match.nodes)
                    counters["torch_ext"][COUNTER] += 1
        finally:
            self._found = []

    def _replace(self, match: Match, eps: float) -> None:
        kw = match.kwargs
        r_old, y_old = match.output_nodes()
        m = MultiOutputMatch.from_match(match)
        x = kw.get("x")
        if x is None:  # addmm form: the op needs the product on its own
            x = m.insert(aten.mm.default, (kw["mat1"], kw["mat2"]))
        af = m.insert_auto_functionalized(
            torch.ops.torch_ext.fused_add_rms_norm.default,
            x=x,
            residual=kw["residual"],
            weight=kw["weight"],
            eps=eps,
        )
        # Item 0 is the op's (None) result, then the mutated args in schema order: x, residual.
        y_new, r_new = m.insert_getitems(af, (1, 2))
        m.replace({y_old: y_new, r_old: r_new})

    def _accept(self, dtype: torch.dtype, match: Match) -> bool:
        from torch.fx.experimental.symbolic_shapes import statically_known_true

        def same_shape(a: torch.Tensor, b: torch.Tensor) -> bool:
            return a.dim() == b.dim() and all(
                statically_known_true(i == j) for i, j in zip(a.shape, b.shape)
            )

        kw = match.kwargs
        r_old, y_old = match.output_nodes()
        x, residual, weight = kw.get("x"), kw.get("residual"), kw.get("weight")
        mutated = [n for n in (x, residual) if n is not None]  # x is None in the addmm form
        inputs = [*mutated, weight, *(kw[k] for k in ("mat1", "mat2") if k in kw)]
        if not all(isinstance(n, torch.fx.Node) and "val" in n.meta for n in [*inputs, r_old, y_old]):
            return False
        if len(set(mutated)) != len(mutated) or weight in mutated:
            return False  # the op writes x and residual: they must be distinct buffers
        if not all(_only_default_kwargs(n) for n in match.nodes):
            return False
        eps = _eps_of(match)
        if eps is None:
            return False
        if self.skip_graph_inputs and any(n.op in ("placeholder", "get_attr") for n in mutated):
            return False
        vals = [n.meta["val"] for n in inputs]
        r, y, w = r_old.meta["val"], y_old.meta["val"], weight.meta["val"]
        if not all(isinstance(v, torch.Tensor) for v in [*vals, r, y]):
            return False
        # Mixed dtypes (e.g. an fp32 residual stream or weight) promote in eager; the op does not.
        if any(v.dtype != dtype for v in [*vals, r, y]):
            return False
        if any(v.device != r.device for v in vals) or r.dim() < 1 or w.dim() != 1:
            return False
        if not all(same_shape(n.meta["val"], r) for n in mutated):
            return False  # a broadcasting add (or a bias): the op needs equal shapes
        if not statically_known_true(w.shape[0] == r.shape[-1]):
            return False
        self._found.append((match, eps))
        return False

    def _pattern_pass(self) -> PatternMatcherPass:
        if self._patterns is not None:
            return self._patterns
        from torch._inductor.pattern_matcher import (
            PatternMatcherPass,
            fwd_only,
            register_replacement,
        )

        patterns = PatternMatcherPass(pass_name="torch_ext_fuse_add_rms_norm")
        for dtype in self.dtypes:
            # Traced on CPU whatever the target device: the decomposed ops are the same.
            a = torch.empty(4, 16, dtype=dtype)
            w = torch.empty(16, dtype=dtype)
            check = functools.partial(self._accept, dtype)
            for addmm, weight_first in itertools.product((False, True), (False, True)):
                inputs = [a, torch.empty(16, 16, dtype=dtype)] if addmm else [a]
                register_replacement(
                    _make_search(addmm, weight_first),
                    _unused_replacement,
                    [*inputs, a.clone(), w],
                    fwd_only,
                    patterns,
                    extra_check=check,
                    scalar_workaround={"eps": _EPS_PLACEHOLDER},
                )
        self._patterns = patterns
        return patterns
