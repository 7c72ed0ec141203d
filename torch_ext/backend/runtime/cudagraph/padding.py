"""Padding a call up to a capture size: the shapes of a region's inputs and outputs as functions of
the batch size (`Spec`), where a call's batch size is read, and the capture size it pads to."""
from __future__ import annotations

import bisect
import dataclasses
from typing import Any

import torch

from torch_ext import compat

TENSOR, SCALAR, CONST = "tensor", "scalar", "const"
STATIC, PINNED, COPIED = "static", "pinned", "copied"


class NotCapturable(Exception):
    pass


class OtherSymbols(NotCapturable):
    """A size or int input depends on a dynamic size other than the batch size: graphs are captured per
    batch size only (the manager says so once, with the fix)."""


def _expr(x: Any, symbol) -> Any:
    """x (int or SymInt) as an int or a sympy expression of the batch symbol only."""
    if isinstance(x, torch.SymInt):
        expr = x.node.expr
        extra = expr.free_symbols - ({symbol} if symbol is not None else set())
        if extra:
            raise OtherSymbols(f"it depends on {sorted(map(str, extra))}, dynamic sizes other than the batch size")
        return int(expr) if not expr.free_symbols else expr
    if isinstance(x, int):
        return x
    raise NotCapturable(f"it holds a symbolic {type(x).__name__}")


def size_at(expr: Any, symbol, n: int) -> int:
    return expr if isinstance(expr, int) else int(expr.xreplace({symbol: n}))


@dataclasses.dataclass
class Spec:
    kind: str  # TENSOR, SCALAR or CONST
    name: str = ""
    shape: tuple = ()  # ints and sympy expressions of the batch symbol
    stride: tuple = ()
    batch_dims: tuple[int, ...] = ()  # dims whose size is the batch size
    dtype: Any = None
    expr: Any = None  # SCALAR: sympy expression or int
    value: Any = None  # CONST
    role: str = COPIED  # tensor inputs: STATIC, PINNED or COPIED
    written: bool = False  # the region writes this input in place
    # Input dims of stride 0 and more than one element (a mask expanded over the batch): its static
    # buffer is expanded too, and a copy fills its one row (runner.py).
    expanded: tuple[int, ...] = ()

    def shape_at(self, symbol, n: int) -> list[int]:
        return [size_at(s, symbol, n) for s in self.shape]

    def stride_at(self, symbol, n: int) -> list[int]:
        return [size_at(s, symbol, n) for s in self.stride]


def spec_of(value: Any, symbol, name: str, output: bool = False) -> Spec:
    """The spec of a region's input, or of its output (`output`). Either may be expanded (stride 0, e.g.
    an attention mask broadcast over the batch): an output tensor is only sliced; an input's static
    buffer keeps the stride 0, and a call's copy fills its single row (`Spec.expanded`)."""
    if isinstance(value, torch.Tensor):
        shape = tuple(_expr(s, symbol) for s in value.shape)
        stride = tuple(_expr(s, symbol) for s in value.stride())
        batch_dims = []
        for d, s in enumerate(shape):
            if isinstance(s, int):
                continue
            if s != symbol:
                raise NotCapturable(f"dim {d} has size {s}: only dims of exactly the batch size can be padded")
            batch_dims.append(d)
        expanded = () if output else tuple(d for d, (sz, st) in enumerate(zip(shape, stride))
                                           if isinstance(st, int) and st == 0 and not (isinstance(sz, int) and sz <= 1))
        return Spec(TENSOR, name, shape, stride, tuple(batch_dims), value.dtype, expanded=expanded)
    if isinstance(value, torch.SymInt):
        return Spec(SCALAR, name, expr=_expr(value, symbol))
    if isinstance(value, (torch.SymFloat, torch.SymBool)):
        raise NotCapturable(f"{name} is a symbolic {type(value).__name__}")
    return Spec(CONST, name, value=value)


def locate_batch_size(inputs: list[Spec], symbol) -> tuple[int, int | None] | None:
    """Where a call's batch size can be read: an int input equal to it (cheapest), else a batch dim."""
    for i, spec in enumerate(inputs):
        if spec.kind == SCALAR and not isinstance(spec.expr, int) and spec.expr == symbol:
            return (i, None)
    for i, spec in enumerate(inputs):
        if spec.kind == TENSOR and spec.batch_dims:
            return (i, spec.batch_dims[0])
    return None


def padded_size(n: int, sizes: tuple[int, ...]) -> int | None:
    """The smallest capture size >= n, or None when n is larger than all of them (sizes sorted)."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


def non_owning(t: torch.Tensor) -> torch.Tensor:
    """A tensor over t's memory that does not keep it allocated (the pool may reuse it)."""
    storage = t.untyped_storage()
    weak = compat.non_owning_storage(storage.data_ptr(), t.device, storage.nbytes())
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(weak, t.storage_offset(), t.shape, t.stride())


def one_row(t: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor | None:
    """t narrowed to one element along `dims`, where t repeats along each of them (stride 0), else None:
    what an expanded static buffer holds."""
    for d in dims:
        if t.stride(d) != 0 and t.shape[d] > 1:
            return None
        t = t.narrow(d, 0, 1)
    return t
