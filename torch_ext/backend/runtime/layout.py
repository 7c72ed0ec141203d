"""Give a compiled piece's inputs the memory layout Inductor compiled it for.

Inductor compiles each piece from the fake values of its inputs and asserts their strides on
every call. Inputs made inside the graph can arrive laid out otherwise, and the piece then fails
("expected size 4==4, stride 16==128") or, without Inductor's size asserts, reads the wrong
elements. Both happen with torch alone, e.g. in Hugging Face's Phi-3 on CPU: Inductor returns
`torch.cat([q, q[..., 16:]], -1)` (an empty second part) as q itself, whose layout is not the
fake's, and the eager splitting op (`F.scaled_dot_product_attention`) after it then lays its
output out the same way. A splitting op whose fake kernel disagrees with its real one does it too.
So each tensor input a piece gets from inside the graph (not a graph input: Dynamo guards those)
whose fake is dense is checked against the fake's dimension order (strides of size-1 dims are
free, as in Inductor's assert) and, where it differs, copied into that order; said once per splitting op (or piece input).
A fake that is not dense (expanded, sliced) is left as it is: Inductor's assert still guards it.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any

import sympy
import torch

log = logging.getLogger("torch_ext.backend")

_said: set[str] = set()


def _expr(x: Any):
    return x.node.expr if isinstance(x, torch.SymInt) else sympy.Integer(int(x))


def dense_order(fake: torch.Tensor) -> tuple[int, ...] | None:
    """The dims of a dense fake tensor from innermost (stride 1) outwards, leaving out dims of
    static size 1; None where its strides are not those of a dense tensor (or cannot be proven so)."""
    sizes = [_expr(s) for s in fake.shape]
    strides = [_expr(s) for s in fake.stride()]
    if any(s == 0 for s in sizes):
        return None
    left = [d for d in range(fake.dim()) if sizes[d] != 1]
    order: list[int] = []
    expected = sympy.Integer(1)
    while left:
        matches = [d for d in left if sympy.expand(strides[d] - expected) == 0]
        if len(matches) != 1:
            return None
        d = matches[0]
        order.append(d)
        left.remove(d)
        expected = expected * sizes[d]
    return tuple(order)


@dataclasses.dataclass(frozen=True)
class LayoutCheck:
    index: int  # of the piece's argument
    order: tuple[int, ...]  # dense_order of its fake
    contiguous: bool  # order is the contiguous one (a faster test)


def checks_for(fakes: list[Any], indices) -> tuple[LayoutCheck, ...]:
    """Checks of the arguments at `indices` whose fakes are dense tensors."""
    checks = []
    for i in sorted(indices):
        fake = fakes[i]
        if not isinstance(fake, torch.Tensor) or fake.dim() == 0:
            continue
        order = dense_order(fake)
        if order is not None:
            checks.append(LayoutCheck(i, order, list(order) == sorted(order, reverse=True)))
    return tuple(checks)


def has_layout(x: torch.Tensor, check: LayoutCheck) -> bool:
    if check.contiguous:
        return x.is_contiguous()
    shape, stride, expected = x.shape, x.stride(), 1
    for d in check.order:
        n = shape[d]
        if n != 1 and stride[d] != expected:
            return False
        expected *= n
    return True


def relay(args: list, checks: tuple[LayoutCheck, ...], piece: str, sources: dict[int, str]) -> bool:
    """Replace in the list `args` each checked tensor laid out otherwise by a copy in its layout;
    whether any was."""
    changed = False
    for check in checks:
        x = args[check.index]
        if has_layout(x, check) or x.numel() == 0:
            continue
        args[check.index] = _copy_in_order(x, check.order)
        _say(piece, check.index, x, sources.get(check.index, "the graph"))
        changed = True
    return changed


def with_layouts(args: tuple, checks: tuple[LayoutCheck, ...], piece: str, sources: dict[int, str]) -> tuple:
    """args, with each checked tensor that is laid out otherwise replaced by a copy in its layout."""
    if all(has_layout(args[check.index], check) or args[check.index].numel() == 0 for check in checks):
        return args  # the usual call: no list made
    fixed = list(args)
    relay(fixed, checks, piece, sources)
    return tuple(fixed)


def _copy_in_order(x: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
    outer = [d for d in range(x.dim()) if d not in order]
    physical = outer + list(reversed(order))  # outermost first, as empty_permuted takes it
    return torch.empty_permuted(x.shape, physical, dtype=x.dtype, device=x.device).copy_(x)


def _say(piece: str, index: int, x: torch.Tensor, source: str) -> None:
    key = source if "::" in source else f"{piece}/{index}"  # an op's layout: said once for all its uses
    if key in _said:
        return
    _said.add(key)
    user_op = "::" in source and not source.startswith("aten::")
    log.log(logging.WARNING if user_op else logging.INFO,
            "torch_ext: input %d of %s (made by %s) has strides %s at shape %s, not the layout the piece was "
            "compiled for; it is copied into that layout on every such call%s", index, piece, source, x.stride(),
            tuple(x.shape), ". Make the op's fake kernel return its real layout to avoid the copy."
            if user_op else "")


def _stride_expr(x: Any):
    return x if isinstance(x, sympy.Basic) else _expr(x)


def strides_agree(fake: torch.Tensor, strides) -> bool:
    """Whether a piece's output, laid out with `strides` (what Inductor reported for it), has the layout
    of `fake` (what the next piece was compiled for): equal strides on every dim not of size 1."""
    if strides is None or len(strides) != fake.dim():
        return strides is None  # nothing reported: the fake is all there is to go by
    for size, want, got in zip(fake.shape, fake.stride(), strides):
        if _expr(size) != 1 and sympy.expand(_expr(want) - _stride_expr(got)) != 0:
            return False
    return True


class LaidOutPiece:
    """A boxed compiled piece of a graph differentiated once (backend/joint.py) whose inputs at `checks`
    come from an earlier piece that returns them laid out otherwise than this piece was compiled for: a
    view of its own input, whose real strides its fake did not have (AOTAutograd's backward graph holds
    `expand` of a loss's scalar tangent with contiguous strides on 2.14.1 and 2.15, stride 0 in fact).
    Each such input is copied into the compiled layout where it differs; said once."""

    _boxed_call = True

    def __init__(self, compiled: Any, checks: tuple[LayoutCheck, ...], label: str, sources: dict[int, str]):
        self.compiled, self.checks, self.label, self.sources = compiled, checks, label, sources
        self.output_strides = compiled.output_strides

    def __call__(self, args: list):
        relay(args, self.checks, self.label, self.sources)
        return self.compiled(args)
