"""Bugs of torch itself that torch_ext users meet, pinned with vanilla tensor-only programs.

No torch_ext code is involved: each test shows torch's own result beside eager. They are strict
xfails, so a torch release that fixes one turns its test red and we drop the workaround.
"""
import collections
import functools
import types

import pytest
import torch
import torch._inductor.config

from torch_ext import compat

# Which torch bug is present depends on the version: these run on every CI torch, never sharded.
pytestmark = pytest.mark.every_version


@torch.compiler.nested_compile_region
def sin_cos(x):
    return torch.sin(x), torch.cos(x)


def _grad_error(fn, backend, shape=(4,)):
    x = torch.randn(shape, requires_grad=True)
    torch._dynamo.reset()
    out = torch.compile(fn, backend=backend, fullgraph=True)(x)
    (g_compiled,) = torch.autograd.grad(out.sum(), x)
    (g_eager,) = torch.autograd.grad(fn(x).sum(), x)
    return (g_compiled - g_eager).abs().max().item()


def two_calls_product(x):
    a, b = sin_cos(x)
    a2, b2 = sin_cos(x * 2)
    return (a + b) * (a2 + b2)


def chained_calls(x):
    a, b = sin_cos(x)
    a2, b2 = sin_cos(a)
    return (a + b) * (a2 + b2)


@pytest.mark.xfail(strict=True, raises=AssertionError, reason="torch: Inductor computes wrong gradients when a multi-output "
                   "nested_compile_region is called twice and its outputs are multiplied")
def test_inductor_reused_region_gradients():
    assert _grad_error(two_calls_product, "inductor") < 1e-5


# The workaround (docs/guide/torch-bugs.md): the bug is Inductor reusing, or writing in place into, a buffer that a
# region call still needs.
NO_BUFFER_REUSE = {"allow_buffer_reuse": False, "inplace_buffers": False}


def test_inductor_reused_region_gradients_without_buffer_reuse():
    with torch._inductor.config.patch(NO_BUFFER_REUSE):
        assert _grad_error(two_calls_product, "inductor") < 1e-5


class ResidualBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    @torch.compiler.nested_compile_region
    def forward(self, h, residual):
        r = h + residual
        return self.lin(r).relu(), r


def residual_blocks(x, blocks=[ResidualBlock() for _ in range(4)]):  # noqa: B006 (fixed weights)
    h, residual = x, torch.zeros_like(x)
    for block in blocks:
        h, residual = block(h, residual)
    return h + residual


@pytest.mark.xfail(compat.TORCH_VERSION >= (2, 13), strict=True, raises=AssertionError,
                   reason="torch 2.13, 2.14: Inductor computes a wrong input gradient for 4 chained "
                   "nested_compile_region residual blocks (their backward returns one buffer twice)")
def test_inductor_chained_residual_region_gradients():
    assert _grad_error(residual_blocks, "inductor", shape=(4, 8)) < 1e-5


@pytest.mark.xfail(compat.TORCH_VERSION < (2, 10), strict=True, raises=AssertionError,
                   reason="torch 2.9.1: aot_eager computes wrong gradients for chained region calls")
def test_aot_eager_chained_region_gradients():
    assert _grad_error(chained_calls, "aot_eager") < 1e-5


@pytest.mark.xfail(compat.EAGER_REGION_BACKWARD_NEEDS_FAKE_MODE, strict=True, raises=AssertionError,
                   reason="torch < 2.14: invoke_subgraph's backward outside AOTAutograd (backend='eager') asserts "
                   "'fake_mode should be enabled for HOPs'")
def test_eager_backend_region_backward():
    _grad_error(chained_calls, "eager")


class Linear8(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        return x + self.lin(x).relu()


def per_instance_regions(count: int = 2):
    """Layers made regions per instance, as one does for a model's layers without changing their class."""
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(Linear8() for _ in range(count))
    region = torch.compiler.nested_compile_region(Linear8.forward)
    for layer in layers:
        layer.forward = types.MethodType(region, layer)

    def stack(x):
        for layer in layers:
            x = layer(x)
        return x

    return stack


@pytest.mark.xfail(compat.REGION_REUSE_BINDS_FIRST_INSTANCE, strict=True, raises=AssertionError,
                   reason="torch 2.12 .. 2.15: a region bound per module instance runs every instance with the "
                   "first instance's parameters")
def test_region_bound_per_instance_uses_each_instance_parameters():
    stack = per_instance_regions()
    x = torch.randn(2, 8)
    torch._dynamo.reset()
    with torch.no_grad():
        compiled = torch.compile(stack, backend="eager", fullgraph=True)(x)
        assert (compiled - stack(x)).abs().max().item() < 1e-6


def dropout_body(x, w):
    return torch.nn.functional.dropout(x @ w, 0.5, training=True).relu()


def _always_recompute(ctx, op, *args, **kwargs):
    return torch.utils.checkpoint.CheckpointPolicy.PREFER_RECOMPUTE


def checkpointed_dropout(x, w):
    return torch.utils.checkpoint.checkpoint(dropout_body, x, w, use_reentrant=False).sum(-1)


def selectively_checkpointed_dropout(x, w):
    context_fn = functools.partial(torch.utils.checkpoint.create_selective_checkpoint_contexts, _always_recompute)
    return torch.utils.checkpoint.checkpoint(dropout_body, x, w, use_reentrant=False, context_fn=context_fn).sum(-1)


def seeded_grads(fn, x, w):
    """Output and input gradients of fn, from one seed (dropout draws the same mask)."""
    x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
    torch.manual_seed(0)
    out = fn(x, w)
    return (out, *torch.autograd.grad(out.sum(), (x, w)))


def checkpoint_grad_error(program):
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    torch._dynamo.reset()
    compiled = seeded_grads(torch.compile(program, backend="eager", fullgraph=True), x, w)
    expected = seeded_grads(program, x, w)
    return max((a - b).abs().max().item() for a, b in zip(compiled, expected))


@pytest.mark.xfail(compat.EAGER_CHECKPOINT_LOSES_RNG_STATE, strict=True, raises=AssertionError,
                   reason="torch 2.12 .. 2.15: a checkpoint under backend='eager' recomputes dropout with a new mask")
def test_eager_backend_checkpoint_recomputes_dropout_with_its_mask():
    assert checkpoint_grad_error(checkpointed_dropout) < 1e-5


@pytest.mark.xfail(strict=True, raises=AssertionError, reason="torch: a selective checkpoint under "
                   "backend='eager' recomputes dropout with a new mask")
def test_eager_backend_selective_checkpoint_recomputes_dropout_with_its_mask():
    assert checkpoint_grad_error(selectively_checkpointed_dropout) < 1e-5


def checkpointed_dropout_rows(x, w):
    return torch.utils.checkpoint.checkpoint(dropout_body, x, w, use_reentrant=False)


def dropout_mask_error(compiled, sizes=(4, 5, 6)) -> float:
    """Train `compiled` (checkpointed_dropout_rows) at these batch sizes; the gradients must be those
    of the mask its forward drew (read off its output: dropout_body is relu(dropout(x @ w, 0.5)))."""
    error = 0.0
    for n in sizes:
        x, w = torch.randn(n, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)
        out = compiled(x, w)
        grads = torch.autograd.grad((out * torch.arange(8.0)).sum(), (x, w))
        mask = (out != 0).float().detach()
        expected = torch.autograd.grad((((x @ w) * mask / 0.5).relu() * torch.arange(8.0)).sum(), (x, w))
        error = max(error, *((a - b).abs().max().item() for a, b in zip(grads, expected)))
    return error


@pytest.mark.xfail(compat.PARTITIONER_FAILS_ON_DYNAMIC_CHECKPOINTED_RNG, strict=True,
                   raises=torch._dynamo.exc.BackendCompilerFailed,
                   reason="torch 2.9.1, 2.12.1: Inductor fails to partition a checkpoint that draws random numbers "
                   "under dynamic shapes ('Node mm was invalid, but is output')")
def test_inductor_trains_checkpointed_dropout_with_dynamic_shapes():
    torch._dynamo.reset()
    assert dropout_mask_error(torch.compile(checkpointed_dropout_rows, dynamic=True, fullgraph=True)) < 1e-4


@torch.compiler.nested_compile_region
def inner_region(x):
    return x.sin() * 2


@torch.compiler.nested_compile_region
def outer_region(x):
    return inner_region(x) + 1


def nested_regions(x):
    return outer_region(x) * 3


@pytest.mark.xfail(compat.NESTED_REGION_FAILS_AOT, strict=True, raises=torch._dynamo.exc.BackendCompilerFailed,
                   reason="torch 2.9.1: a region inside a region fails AOTAutograd when gradients are needed "
                   "('fake mode from tracing context doesn't match')")
def test_nested_regions_train():
    assert _grad_error(nested_regions, "aot_eager", shape=(4, 8)) < 1e-5


Pair = collections.namedtuple("Pair", "first second")


@torch.compiler.nested_compile_region
def cos_sin_pair(x):
    return Pair(torch.cos(x), torch.sin(x))


@torch.compiler.nested_compile_region
def cos_sin_list(x):
    return [torch.cos(x), torch.sin(x)]


def branches_on_pair_type(x):
    """Two calls of a region returning a namedtuple; the second's type picks the factor (eager: 2)."""
    a, b = cos_sin_pair(x), cos_sin_pair(x + 1)
    return a.first + b[1] * (2 if isinstance(b, Pair) else 3)


def branches_on_list_type(x):
    """The same with a list (eager: 2)."""
    a, b = cos_sin_list(x), cos_sin_list(x + 1)
    return a[0] + b[1] * (2 if isinstance(b, list) else 3)


def _output_error(fn, backend="eager"):
    x = torch.randn(4, 3)
    torch._dynamo.reset()
    return (torch.compile(fn, backend=backend, fullgraph=True)(x) - fn(x)).abs().max().item()


@pytest.mark.xfail(compat.REGION_REUSE_FLATTENS_OUTPUT_TYPE, strict=True, raises=AssertionError,
                   reason="torch 2.12 .. 2.15: subgraph reuse returns a region's later calls as a plain tuple, "
                   "so a list result is no list there (silently another branch)")
def test_reused_region_keeps_list_type():
    assert _output_error(branches_on_list_type) < 1e-6
