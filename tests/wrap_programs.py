"""Programs whose HOP bodies return non-proxyable Python structures.

Each entry: a function, a factory for its inputs, and whether to compile with dynamic=True.
The HOPs covered: nested_compile_region (invoke_subgraph), checkpoint (tag_activation_checkpoint),
and wrap.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
from typing import Any, Callable, NamedTuple

import torch
import torch.nn as nn
from torch._higher_order_ops.wrap import wrap
from torch.utils.checkpoint import checkpoint

region = torch.compiler.nested_compile_region


def ckpt(fn, *args, **kwargs):
    return checkpoint(fn, *args, use_reentrant=False, **kwargs)


class Pair:
    def __init__(self, a, b):
        self.a, self.b = a, b

    def total(self):
        return self.a + self.b

    def scaled(self, k):
        return Pair(self.a * k, self.b * k)


@dataclasses.dataclass
class State:
    hidden: torch.Tensor
    gate: torch.Tensor
    step: int = 0


@dataclasses.dataclass(frozen=True)
class Frozen:
    value: torch.Tensor
    name: str
    scale: float = 2.0


class Labeled(NamedTuple):
    label: str
    pair: Pair


class Meta:
    """An object whose attributes are assigned after construction (kept in Dynamo side effects)."""


# --- nested_compile_region ---------------------------------------------------------------

@region
def sin_cos_pair(x):
    return Pair(torch.sin(x), torch.cos(x))


def user_class_with_method(x):
    return sin_cos_pair(x).total() * 2


@region
def labeled_block(x):
    return Labeled("lbl", Pair(x.relu(), x.exp()))


def namedtuple_holding_object(x):
    out = labeled_block(x)
    assert out.label == "lbl"
    return out.pair.a - out.pair.b


@region
def size_block(x):
    return Pair(x * 2, x.size(0)), x.shape


def symint_dynamic(x):
    p, shape = size_block(x)
    return p.a.sum(0) * p.b + shape[0]


def repeated_region(x):
    # The same region three times on same-shaped inputs: one shared subgraph.
    a = sin_cos_pair(x)
    b = sin_cos_pair(x + 1)
    c = sin_cos_pair(x * 3)
    return a.total() + b.total() + c.total()


@region
def one_field(x):
    s = State(torch.tanh(x), torch.sigmoid(x), step=1)
    return s


def chained_regions(x):
    # The output object of one region feeds the next (tanh/sigmoid of each other's fields).
    s = one_field(x)
    t = one_field(s.hidden)
    return t.hidden + t.gate + s.gate * t.step


class Layer(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    @region
    def forward(self, x):
        h = self.lin(x)
        return State(h.relu(), torch.sigmoid(h), step=2)


class Stack(nn.Module):
    def __init__(self, dim=4, depth=2):
        super().__init__()
        self.layers = nn.ModuleList(Layer(dim) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            s = layer(x)
            x = s.hidden * s.gate + s.step
        return x


@region
def attrs_after_construction(x):
    m = Meta()
    m.out = x.sin()
    m.count = 3
    m.cache = {"k": [x.cos(), None]}
    return m


def object_attrs_set_in_body(x):
    m = attrs_after_construction(x)
    return m.out * m.count + m.cache["k"][0]


# --- activation checkpoint ---------------------------------------------------------------

def checkpoint_frozen_dataclass(x, w):
    def body(x):
        return Frozen(torch.sin(x) * w, "f")

    out = ckpt(body, x)
    return out.value * out.scale


def checkpoint_list_of_dataclasses(x):
    def body(x):
        return [State(x.sin(), x.cos()), State(x.tanh(), x.exp(), step=3)]

    a, b = ckpt(body, x)
    return a.hidden * b.gate + a.gate * b.step + b.hidden


def checkpoint_closure_over_outer(x, w):
    bias = w * 2

    def body(x):
        return Pair(x @ w, bias.sin())

    return ckpt(body, x).total()


class CheckpointedBlock(nn.Module):
    def __init__(self, dim=4):
        super().__init__()
        self.inner = nn.Linear(dim, dim)

    def body(self, x):
        h = self.inner(x)
        return State(h.relu(), h.sigmoid())

    def forward(self, x):
        s = ckpt(self.body, x)
        return s.hidden * s.gate


def checkpoint_in_module(x):
    return CHECKPOINTED_BLOCK(x)


def checkpoint_body_kwargs(x, y):
    def body(x, *, y):
        return {"sum": Pair(x + y, x * y), "n": 2}

    out = ckpt(body, x, y=y)
    return out["sum"].total() * out["n"]


def save_matmuls_policy(ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if op is torch.ops.aten.mm.default else CheckpointPolicy.PREFER_RECOMPUTE


def checkpoint_selective_context_fn(x):
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    def body(x):
        h = torch.mm(x, x)
        return Frozen(h.sin(), "s")

    out = checkpoint(body, x, use_reentrant=False,
                     context_fn=functools.partial(create_selective_checkpoint_contexts, save_matmuls_policy))
    return out.value


# --- wrap --------------------------------------------------------------------------------

def wrap_dataclass(x):
    out = wrap(lambda t: State(t.sin(), t.cos(), step=4), x)
    return out.hidden * out.step + out.gate


def wrap_dict_of_objects(x):
    def body(x):
        return {"first": Pair(x + 1, x - 1), "second": [Pair(x * 2, x / 2)]}

    d = wrap(body, x)
    return d["first"].total() * d["second"][0].b


def wrap_constants_beside_tensors(x):
    def body(x):
        return (x.sin(), None, 7, "name", x.shape, torch.float32)

    y, nothing, seven, name, shape, dtype = wrap(body, x)
    assert nothing is None and name == "name" and dtype is torch.float32
    return y * seven + shape[0]


def wrap_nested_in_checkpoint(x):
    def inner(t):
        return Pair(t.exp(), t.neg())

    def outer(t):
        p = wrap(inner, t)
        return Frozen(p.total(), "n")

    return ckpt(outer, x).value


def wrap_symint_in_dataclass_dynamic(x):
    def body(x):
        return State(x.sin(), x.cos(), step=x.size(0))

    s = wrap(body, x)
    return s.hidden * s.step + s.gate


def wrap_returns_closure(x):
    def body(x):
        y = x.sin()

        def apply(z):
            return z * y

        return apply

    fn = wrap(body, x)
    return fn(x + 1)


def wrap_ordered_dict_and_deque(x):
    def body(x):
        return collections.OrderedDict(a=Pair(x.sin(), x.cos()), b=x.sum())

    d = wrap(body, x)
    return d["a"].total() + d["b"]


# (function, input factory, dynamic, hop kind)
Program = tuple[Callable, Callable[[], tuple[Any, ...]], bool, str]


def _x(*shape):
    return lambda: (torch.randn(*shape, requires_grad=True),)


def _xw(n):
    return lambda: (torch.randn(n, n, requires_grad=True), torch.randn(n, n, requires_grad=True))


CHECKPOINTED_BLOCK = CheckpointedBlock()

PROGRAMS: dict[str, Program] = {
    "user_class_with_method": (user_class_with_method, _x(4), False, "invoke_subgraph"),
    "namedtuple_holding_object": (namedtuple_holding_object, _x(4), False, "invoke_subgraph"),
    "symint_dynamic": (symint_dynamic, _x(5, 3), True, "invoke_subgraph"),
    "repeated_region": (repeated_region, _x(4), False, "invoke_subgraph"),
    "chained_regions": (chained_regions, _x(4), False, "invoke_subgraph"),
    "region_on_module_method": (Stack(), _x(3, 4), False, "invoke_subgraph"),
    "object_attrs_set_in_body": (object_attrs_set_in_body, _x(4), False, "invoke_subgraph"),
    "checkpoint_frozen_dataclass": (checkpoint_frozen_dataclass, _xw(3), False, "checkpoint"),
    "checkpoint_list_of_dataclasses": (checkpoint_list_of_dataclasses, _x(4), False, "checkpoint"),
    "checkpoint_closure_over_outer": (checkpoint_closure_over_outer, _xw(3), False, "checkpoint"),
    "checkpoint_in_module": (checkpoint_in_module, _x(2, 4), False, "checkpoint"),
    "checkpoint_body_kwargs": (checkpoint_body_kwargs, lambda: (torch.randn(4, requires_grad=True),
                                                                torch.randn(4, requires_grad=True)), False, "checkpoint"),
    "checkpoint_selective_context_fn": (checkpoint_selective_context_fn, _x(3, 3), False, "checkpoint"),
    "wrap_dataclass": (wrap_dataclass, _x(4), False, "wrap"),
    "wrap_dict_of_objects": (wrap_dict_of_objects, _x(4), False, "wrap"),
    "wrap_constants_beside_tensors": (wrap_constants_beside_tensors, _x(4), False, "wrap"),
    "wrap_nested_in_checkpoint": (wrap_nested_in_checkpoint, _x(4), False, "checkpoint"),
    "wrap_symint_in_dataclass_dynamic": (wrap_symint_in_dataclass_dynamic, _x(6, 2), True, "wrap"),
    "wrap_returns_closure": (wrap_returns_closure, _x(4), False, "wrap"),
    "wrap_ordered_dict": (wrap_ordered_dict_and_deque, _x(4), False, "wrap"),
}
