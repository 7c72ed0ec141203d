"""Where torch_ext goes further than torch (2.9.1 and 2.13): passthrough outputs, symbolic float
outputs, checkpoint side effects, and precise diagnostics. Each test shows torch's own behaviour
beside torch_ext's."""
import dataclasses

import pytest
import torch
import torch._dynamo
from torch._higher_order_ops.wrap import wrap
from torch.utils.checkpoint import checkpoint

import torch_ext
from torch_ext.testing import assert_graph_snapshot, check_matches_eager

# HOP tracing is where torch versions differ most: these run on every CI torch, never sharded.
pytestmark = pytest.mark.every_version

region = torch.compiler.nested_compile_region


class Foo:
    def __init__(self, a, b):
        self.a, self.b = a, b


@region
def passthrough_tuple(x, y):
    return x, torch.mul(x, y)


@region
def passthrough_object(x):
    return Foo(x, x.sin())


W = torch.randn(4)


@region
def passthrough_outer(x):
    return W, x.cos()


def uses_passthrough_tuple(x, y):
    same, prod = passthrough_tuple(x, y)
    return same * prod


def uses_passthrough_object(x):
    out = passthrough_object(x)
    return out.a + out.b


def uses_passthrough_outer(x):
    w, c = passthrough_outer(x)
    return w * c


def _xy():
    return torch.randn(4, requires_grad=True), torch.randn(4, requires_grad=True)


def _vanilla_error(fn, *inputs, dynamic=False):
    torch._dynamo.reset()
    with pytest.raises(Exception) as info:
        torch.compile(fn, backend="eager", fullgraph=True, dynamic=dynamic)(*inputs)
    return str(info.value)


# eager backend gradients of invoke_subgraph are a torch bug (test_torch_bugs.py); train backends:
TRAIN_BACKENDS = ("aot_eager", "inductor")


@pytest.mark.parametrize("fn,make_inputs", [
    (uses_passthrough_tuple, _xy),
    (uses_passthrough_object, lambda: (torch.randn(4, requires_grad=True),)),
    (uses_passthrough_outer, lambda: (torch.randn(4, requires_grad=True),)),
], ids=["tuple_with_input", "object_holding_input", "outer_tensor"])
def test_region_returning_an_input_unchanged(fn, make_inputs):
    inputs = make_inputs()
    assert "aliasing" in _vanilla_error(fn, *inputs) or fn is uses_passthrough_object
    with torch_ext.installed():
        check_matches_eager(fn, *inputs, backends=("eager",), check_grads=False)
        results = check_matches_eager(fn, *inputs, backends=TRAIN_BACKENDS)
    assert results["aot_eager"].frame_count == 1


def test_passthrough_needs_no_subgraph_output(installed):
    def twice(x, y):  # two calls so torch 2.13 keeps the region (it inlines single-use ones)
        return uses_passthrough_tuple(x, y) + uses_passthrough_tuple(y, x)

    gm = check_matches_eager(twice, *_xy(), backends=("eager",), check_grads=False)["eager"].graphs[0]
    assert_graph_snapshot("beyond_torch.passthrough_tuple", gm)
    body = gm.subgraph_0
    (out,) = [n for n in body.graph.nodes if n.op == "output"]
    assert [a.name for a in out.args[0]] == ["mul"]


@region
def view_of_input(x):
    return x.t(), x.sin()


@region
def outputs_alias_each_other(x):
    y = x.sin()
    return y.view(-1), y, y[0].unsqueeze(0)


def uses_view_of_input(x):
    t, s = view_of_input(x)
    return t.sum(0) * s.sum(1)


def uses_outputs_alias_each_other(x):
    flat, y, row = outputs_alias_each_other(x)
    return flat.sum() * y + row


@pytest.mark.parametrize("fn", [uses_view_of_input, uses_outputs_alias_each_other])
def test_region_view_outputs_are_taken_in_the_caller(fn):
    x = torch.randn(2, 3, requires_grad=True)
    assert "alias" in _vanilla_error(fn, x)
    with torch_ext.installed():
        results = check_matches_eager(fn, x, backends=TRAIN_BACKENDS)
        gm = check_matches_eager(lambda x: fn(x) + fn(x + 1), x, backends=("eager",),
                                 check_grads=False)["eager"].graphs[0]
    assert results["aot_eager"].frame_count == 1
    assert_graph_snapshot(f"beyond_torch.{fn.__name__}", gm)


@region
def returns_mutated_input(x):
    return x.add_(1), x.sin()


def test_region_returning_an_in_place_result_gets_a_clear_error(installed):
    def fn(x):
        a, b = returns_mutated_input(x)
        return a * b

    message = _vanilla_error(fn, torch.randn(3))
    assert "invoke_subgraph" in message and ".clone()" in message and "alias" in message


def test_views_are_fine_where_the_body_is_inlined(installed):
    # checkpoint and wrap are inlined before autograd: a view of an input is a plain output.
    def fn(x):
        t, s = checkpoint(lambda x: (x.t(), x.sin()), x, use_reentrant=False)
        u, v = wrap(lambda x: (x.view(-1), x.cos()), x)
        return t.sum(0) * s.sum(1) + u.sum() * v.sum()

    check_matches_eager(fn, torch.randn(2, 3, requires_grad=True))


# --- symbolic float outputs --------------------------------------------------------------

@region
def half_size(x):
    return x.sin(), x.size(0) / 2.0


def uses_half_size(x):
    s, half = half_size(x)
    return s * half


def test_symbolic_float_output_is_recomputed_in_the_caller():
    x = torch.randn(6, 2, requires_grad=True)
    vanilla = _vanilla_error(uses_half_size, x, dynamic=True)
    assert "float" in vanilla.lower() or "SymFloat" in vanilla or "Unsupported" in vanilla
    with torch_ext.installed():
        check_matches_eager(uses_half_size, x, backends=("eager",), dynamic=True, check_grads=False)
        check_matches_eager(uses_half_size, x, backends=TRAIN_BACKENDS, dynamic=True)
        compiled = torch.compile(uses_half_size, backend="aot_eager", fullgraph=True, dynamic=True)
        for batch in (3, 10):  # the float follows the batch size
            y = torch.randn(batch, 2)
            torch.testing.assert_close(compiled(y), uses_half_size(y))


def test_float_from_tensor_data_gets_a_clear_error(installed):
    @dataclasses.dataclass
    class Entry:
        meta: float

    def fn(x):
        def body(x):
            return Foo(x.sin(), [Entry(1.0), Entry(2.0), Entry(x.sum().item())])

        out = wrap(body, x)
        return out.a * out.b[2].meta

    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        message = _vanilla_error(fn, torch.randn(3))
    assert "wrap" in message and "`out.b[2].meta`" in message and "float" in message
    assert ".item()" in message  # what to do instead


# --- checkpoint side effects -------------------------------------------------------------

def checkpoint_appending(x):
    z = []

    def body(x, z):
        h = torch.matmul(x, x)
        out = h.sin()
        z.append(out)
        return torch.cos(out) + h

    y = checkpoint(body, x, z, use_reentrant=False)
    return y, z[0]


def test_checkpoint_side_effects_are_opt_in():
    x = torch.randn(3, 3, requires_grad=True)
    with torch_ext.installed():
        message = _vanilla_error(checkpoint_appending, x)
        assert "utat" in message  # refused by default, as in torch ("Mutating a variable ...")
        with torch_ext.config.patch(checkpoint_side_effects=True):
            results = check_matches_eager(checkpoint_appending, x)
    assert all(r.frame_count == 1 for r in results.values())


def test_checkpoint_side_effect_tensor_is_an_extra_output():
    with torch_ext.installed(), torch_ext.config.patch(checkpoint_side_effects=True):
        gm = check_matches_eager(checkpoint_appending, torch.randn(3, 3), backends=("eager",),
                                 check_grads=False)["eager"].graphs[0]
    (out,) = [n for n in gm.wrap_body_0.graph.nodes if n.op == "output"]
    assert len(out.args[0]) == 2  # the returned value and the appended intermediate


def test_config_patch_rejects_unknown_options():
    with pytest.raises(AttributeError, match="no option"):
        with torch_ext.config.patch(checkpoint_side_effect=True):
            pass
