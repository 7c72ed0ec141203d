"""backend/runtime/direct_call.py: a torch.library.custom_op called without its Python layers only where
none of them is needed; everywhere else the op itself runs (autograd, modes, autocast, subclasses)."""
from __future__ import annotations

import sys

import pytest
import torch
from torch._library.custom_ops import OPDEFS
from torch.utils._python_dispatch import TorchDispatchMode

from torch_ext.backend.runtime.direct_call import call_directly, direct_caller


@torch.library.custom_op("torch_ext_direct::scale_into", mutates_args=("out",))
def scale_into(x: torch.Tensor, factors: list[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    out.copy_(x * sum(f.sum() for f in factors))
    return x * 2


scale_into.register_fake(lambda x, factors, out: torch.empty_like(x))


@torch.library.custom_op("torch_ext_direct::double", mutates_args=())
def double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


double.register_fake(lambda x: torch.empty_like(x))
double.register_autograd(lambda ctx, grad: grad * 2, setup_context=lambda ctx, inputs, output: None)

OP = torch.ops.torch_ext_direct.scale_into.default


@pytest.fixture
def route(monkeypatch):
    """How each call reached a kernel: 'direct' or 'op' (through the dispatcher's layers)."""
    routes = []
    for name in ("torch_ext_direct::scale_into", "torch_ext_direct::double"):
        kernel = OPDEFS[name]._backend_fns[None]

        def spy(*args, kernel=kernel, **kwargs):
            routes.append("op" if sys._getframe(1).f_code.co_name == "backend_impl" else "direct")
            return kernel(*args, **kwargs)

        monkeypatch.setitem(OPDEFS[name]._backend_fns, None, spy)
    return routes


def operands():
    return torch.randn(4, 3), [torch.ones(2), torch.ones(1)], torch.zeros(4, 3)


def test_plain_call_is_direct_and_equals_the_op(route):
    call = direct_caller(OP)
    x, factors, out = operands()
    out_op = out.clone()
    version = out._version
    with torch.no_grad():
        result = call(x, factors, out)
    torch.testing.assert_close(result, OP(x, factors, out_op))
    torch.testing.assert_close(out, out_op)
    assert torch.equal(out, x * 3)
    assert out._version > version  # bumped, as the op's view/version layer does
    assert route == ["direct", "op"]
    assert direct_caller(torch.ops.aten.add.Tensor) is None  # not a Python custom op


def test_a_call_that_records_autograd_goes_through_the_op(route):
    call = direct_caller(torch.ops.torch_ext_direct.double.default)
    x = torch.randn(4, 3, requires_grad=True)
    call(x).sum().backward()
    torch.testing.assert_close(x.grad, torch.full_like(x, 2.0))
    assert route == ["op"]
    with torch.no_grad():  # the same input without grad mode: nothing to record
        call(x)
    call(x.detach())  # grad mode on, but nothing requires grad
    assert route == ["op", "direct", "direct"]


def test_modes_autocast_subclasses_and_kwargs(route):
    call = direct_caller(OP)
    x, factors, out = operands()

    class Seen(TorchDispatchMode):
        ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Seen.ops.append(func)
            return func(*args, **(kwargs or {}))

    with torch.no_grad():
        with Seen():
            call(x, factors, out)
        assert OP in Seen.ops  # the mode saw the op: it was not bypassed
        with torch.autocast("cpu"):
            call(x, factors, out)
        call(torch.nn.Parameter(x.clone(), requires_grad=False), factors, out)  # a subclass
        call(x, factors, out=out)  # mutated argument passed by name
    assert route == ["op", "op", "op", "direct"]


def test_meta_tensors_reach_the_fake_kernel_not_the_users(route):
    call = direct_caller(OP)
    x = torch.empty(4, 3, device="meta")
    result = call(x, [torch.empty(2, device="meta")], torch.empty(4, 3, device="meta"))
    assert result.device.type == "meta" and route == []


def test_call_directly_rewrites_a_graph_and_keeps_its_results(route):
    def f(x, factors, out):
        return OP(x, factors, out) + 1

    gm = torch.fx.symbolic_trace(f)
    assert call_directly(gm) == ["torch_ext_direct::scale_into"]
    x, factors, out = operands()
    with torch.no_grad():
        torch.testing.assert_close(gm(x, factors, out), x * 2 + 1)
    assert route == ["direct"] and "direct_torch_ext_direct_scale_into" in gm.code
