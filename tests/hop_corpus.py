"""HOP programs for the differential harness (tests/differential.py): each compiled by vanilla torch and
under torch_ext.install(), compared with eager and with each other.

Every HOP kind torch_ext traces (nested_compile_region, checkpoint, wrap, dynamo_bypassing_wrapper),
bodies with side effects on the caller's state, every kind of aliasing, SymInt, buffer, closure and
nonlocal inputs, dataclass and nested outputs. A program returns everything it can observe (values a
body stored into lists, dicts, objects, cells and globals), so a side effect dropped or replayed twice
shows up as a wrong value.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple

import torch
from torch._higher_order_ops.wrap import dynamo_bypassing_wrapper, wrap
from torch.utils.checkpoint import checkpoint

region = torch.compiler.nested_compile_region


class Program(NamedTuple):
    fn: Callable
    make_inputs: Callable[[], tuple]
    dynamic: bool = False


def ckpt(fn, *args):
    return checkpoint(fn, *args, use_reentrant=False)


@dataclasses.dataclass
class Stats:
    mean: torch.Tensor
    scale: torch.Tensor
    n: int = 0


class Box:
    pass


SEEN: list = []  # a global the bodies append to
G = torch.randn(8)  # a global tensor the bodies close over


def _x(*shape):
    return lambda: (torch.randn(*shape, requires_grad=True),)


# --- nested_compile_region (invoke_subgraph) -----------------------------------------------------

@region
def r_tensors(x, y):
    return torch.cos(x @ y), torch.sin(x)


def region_tensors(x):
    a, b = r_tensors(x, x.t().contiguous())
    return a + b.sum()


@region
def r_append(x, z):
    out = x.sin()
    z.append(out)
    return torch.cos(x @ x), torch.sin(x)


def region_list_append(x):  # the program of issue 50
    z = []
    outs = r_append(x, z)
    return outs[0] + outs[-1], z[0]


@region
def r_extend(x, z):
    z.extend([x.sin(), x.cos()])
    return x * 2


def region_list_extend(x):
    z = [x]
    out = r_extend(x, z)
    return out, z[1] + z[2], len(z)


@region
def r_setitem(x, z):
    z[0] = x.exp()
    return x.relu()


def region_list_setitem(x):
    z = [None]
    out = r_setitem(x, z)
    return out + z[0]


@region
def r_dict(x, d):
    d["sin"] = x.sin()
    d.update(cos=x.cos())
    return x + 1


def region_dict_update(x):
    d = {}
    out = r_dict(x, d)
    return out * d["sin"] + d["cos"]


@region
def r_attr(x, box):
    box.value = x.tanh()
    return x.sigmoid()


def region_attr_on_passed_object(x):
    box = Box()
    out = r_attr(x, box)
    return out + box.value


def _nonlocal_region():
    total = None

    def reset(t):
        nonlocal total
        total = t

    @region
    def body(t):
        nonlocal total  # a cell of the enclosing function, not of the body
        total = total + t.sin()
        return t.cos()

    return reset, body, lambda: total


_nl_reset, _nl_body, _nl_read = _nonlocal_region()


def region_nonlocal(x):
    _nl_reset(x * 2)
    out = _nl_body(x)
    return out, _nl_read()


@region
def r_global(x):
    SEEN.append(x.sin())
    return x.cos()


def region_global_list(x):
    before = len(SEEN)
    out = r_global(x)
    return out + SEEN[-1], len(SEEN) - before


@region
def r_two(x, y):
    return x.sin() + y.cos()


def region_inputs_alias(x):
    return r_two(x, x.view(-1).view(x.shape))


@region
def r_passthrough(x):
    return x, x.sin()


def region_output_is_input(x):
    same, s = r_passthrough(x)
    return same * s


@region
def r_view_of_input(x):
    return x.t(), x.sin()


def region_output_view_of_input(x):
    t, s = r_view_of_input(x)
    return t.sum(0) * s.sum(1)


@region
def r_outputs_alias(x):
    y = x.sin()
    return y.view(-1), y


def region_outputs_alias_each_other(x):
    flat, y = r_outputs_alias(x)
    return flat.sum() * y


@region
def r_inplace(x):
    x.mul_(2)
    return x.sin()


def region_mutates_input(x):
    y = x.clone()
    out = r_inplace(y)
    return out + y


@region
def r_symint(x):
    return x * 2, x.shape[0]


def region_symint_output(x):
    y, n = r_symint(x)
    return y.sum(0) * n


@region
def r_closure(x):
    return x * G


def region_closure(x):
    return r_closure(x) + r_closure(x + 1)


@region
def r_dataclass(x):
    return Stats(x.mean(0), x.std(0), n=x.shape[0])


def region_dataclass_output(x):
    s = r_dataclass(x)
    return (x - s.mean) / s.scale * s.n


@region
def r_nested(x):
    return {"a": [x.sin(), (x.cos(), 3)], "b": x.exp()}


def region_nested_output(x):
    out = r_nested(x)
    return out["a"][0] + out["a"][1][0] * out["a"][1][1] + out["b"]


class Norm(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("shift", torch.randn(8))
        self.lin = torch.nn.Linear(8, 8)

    @region
    def forward(self, x):
        return self.lin(x - self.shift).relu()


_norm = Norm()


def region_buffer_operand(x):
    return _norm(x) + _norm(x * 2)


def region_repeated(x):
    y = x.detach() * 2
    return r_tensors(x, y)[0] + r_tensors(x + 1, y)[0]


# --- checkpoint (tag_activation_checkpoint) -------------------------------------------------------

def checkpoint_tensors(x):
    return ckpt(lambda t: (t.sin() @ t.cos()).relu(), x)


def checkpoint_dataclass_output(x):
    s = ckpt(lambda t: Stats(t.mean(0), t.std(0)), x)
    return (x - s.mean) / s.scale


def checkpoint_list_append(x):
    z = []

    def body(t):
        z.append(t.sin())
        return t.cos()

    out = ckpt(body, x)
    return out, z[0]


def checkpoint_closure(x):
    w = x.detach() + 1
    return ckpt(lambda t: t * w + G, x)


def checkpoint_symint(x):
    return ckpt(lambda t: t.sum(0) * t.shape[0], x)


def checkpoint_region_inside(x):
    return ckpt(lambda t: r_tensors(t, t)[0], x)


# --- wrap, dynamo_bypassing_wrapper --------------------------------------------------------------

def wrap_tensors(x):
    return wrap(lambda t: t.sin() * 2, x)


def wrap_dataclass_output(x):
    s = wrap(lambda t: Stats(t.sin(), t.cos(), n=2), x)
    return s.mean + s.scale * s.n


def wrap_list_append(x):
    z = []

    def body(t):
        z.append(t.exp())
        return t.relu()

    return wrap(body, x), z[0]


def wrap_nonlocal(x):
    total = x

    def body(t):
        nonlocal total
        total = total * t.sin()
        return t

    wrap(body, x)
    return total


def wrap_output_is_input(x):
    same, s = wrap(lambda t: (t, t.sin()), x)
    return same * s


def _passthrough_wrapper(fn):
    return fn


def bypassing_wrapper_tensors(x):
    return dynamo_bypassing_wrapper(_passthrough_wrapper, lambda t: t.sin() + 1, x)


PROGRAMS: dict[str, Program] = {
    "region_tensors": Program(region_tensors, _x(4, 4)),
    "region_list_append": Program(region_list_append, _x(8, 8)),
    "region_list_extend": Program(region_list_extend, _x(4)),
    "region_list_setitem": Program(region_list_setitem, _x(4)),
    "region_dict_update": Program(region_dict_update, _x(4)),
    "region_attr_on_passed_object": Program(region_attr_on_passed_object, _x(4)),
    "region_nonlocal": Program(region_nonlocal, _x(4)),
    "region_global_list": Program(region_global_list, _x(4)),
    "region_inputs_alias": Program(region_inputs_alias, _x(2, 4)),
    "region_output_is_input": Program(region_output_is_input, _x(4)),
    "region_output_view_of_input": Program(region_output_view_of_input, _x(2, 3)),
    "region_outputs_alias_each_other": Program(region_outputs_alias_each_other, _x(2, 3)),
    "region_mutates_input": Program(region_mutates_input, lambda: (torch.randn(4),)),
    "region_symint_output": Program(region_symint_output, _x(5, 3), dynamic=True),
    "region_closure": Program(region_closure, _x(8)),
    "region_dataclass_output": Program(region_dataclass_output, _x(5, 3)),
    "region_nested_output": Program(region_nested_output, _x(4)),
    "region_buffer_operand": Program(region_buffer_operand, _x(2, 8)),
    "region_buffer_operand_dynamic": Program(region_buffer_operand, _x(3, 8), dynamic=True),
    "region_repeated": Program(region_repeated, _x(4, 4)),
    "checkpoint_tensors": Program(checkpoint_tensors, _x(4, 4)),
    "checkpoint_dataclass_output": Program(checkpoint_dataclass_output, _x(5, 3)),
    "checkpoint_list_append": Program(checkpoint_list_append, _x(4)),
    "checkpoint_closure": Program(checkpoint_closure, _x(8)),
    "checkpoint_symint": Program(checkpoint_symint, _x(5, 3), dynamic=True),
    "checkpoint_region_inside": Program(checkpoint_region_inside, _x(4, 4)),
    "wrap_tensors": Program(wrap_tensors, _x(4)),
    "wrap_dataclass_output": Program(wrap_dataclass_output, _x(4)),
    "wrap_list_append": Program(wrap_list_append, _x(4)),
    "wrap_nonlocal": Program(wrap_nonlocal, _x(4)),
    "wrap_output_is_input": Program(wrap_output_is_input, _x(4)),
    "bypassing_wrapper_tensors": Program(bypassing_wrapper_tensors, _x(4)),
}

__all__ = ["PROGRAMS", "Program"]
