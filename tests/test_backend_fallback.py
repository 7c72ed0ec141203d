"""A graph Inductor cannot compile for a reason Dynamo treats as a fallback: a data-dependent value inside
an op's backward (as transformers' MoE layers do: `offsets.tolist()` in the grouped-mm backward). Under
torch's own backends Dynamo then runs the frame eagerly; the torch_ext backend must do the same, and say
so, rather than fail the user's training step with BackendCompilerFailed."""
from __future__ import annotations

import logging

import pytest
import torch

import torch_ext.backend.compile.compiler as compiler
from torch_ext.backend import CompileConfig, make_backend


@torch.library.custom_op("torch_ext_fallback::scaled", mutates_args=())
def scaled(x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    return x * 2


@scaled.register_fake
def _(x, counts):
    return torch.empty_like(x)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[1])


def _backward(ctx, grad):
    (counts,) = ctx.saved_tensors
    total = sum(counts.tolist())  # a value read back from a tensor: fake tensors cannot answer it
    return grad * 2 * (total / total), None


scaled.register_autograd(_backward, setup_context=_setup)


def step(x, counts):
    return scaled(x.sin(), counts).cos().sum()


def _grad(fn, x, counts):
    x = x.detach().clone().requires_grad_(True)
    loss = fn(x, counts)
    loss.backward()
    return loss.detach(), x.grad


@pytest.mark.parametrize("backend", ["inductor", "torch_ext"])
def test_a_data_dependent_backward_falls_back_to_eager_like_inductor(backend, caplog):
    torch._dynamo.reset()
    compiler._said_fallback.clear()
    x, counts = torch.randn(4, 8), torch.tensor([1, 2, 3])
    expected = _grad(step, x, counts)
    chosen = make_backend(CompileConfig(cache_dir=None)) if backend == "torch_ext" else backend
    with caplog.at_level(logging.WARNING, logger="torch_ext"):
        for _ in range(2):
            actual = _grad(torch.compile(step, backend=chosen), x, counts)
            torch.testing.assert_close(actual, expected)
    said = [r.getMessage() for r in caplog.records if "runs this graph's frame eagerly" in r.getMessage()]
    if backend == "torch_ext":
        assert len(said) == 1 and "DataDependentOutputException" in said[0]
    else:
        assert not said


def test_outside_dynamo_the_failure_stays_a_piece_compile_error(monkeypatch):
    """A size variant compiles on a call, after Dynamo's: nobody would fall back, so the error names the piece."""
    torch._dynamo.reset()
    gm = torch.fx.symbolic_trace(lambda x: x + 1)

    def data_dependent(*args):
        raise torch._subclasses.fake_tensor.DataDependentOutputException(torch.ops.aten._local_scalar_dense.default)

    # monkeypatch restores the class's own staticmethod object (a plain function put back would bind self).
    monkeypatch.setattr(compiler.InductorCompiler, "_standalone_compile", staticmethod(data_dependent))
    c = compiler.InductorCompiler(CompileConfig(cache_dir=None))
    with pytest.raises(compiler.PieceCompileError, match="piece p .size=4.*DataDependentOutputException"):
        c.compile(gm, [torch.randn(4)], compiler.Variant("size", size=4), name="p")
    with pytest.raises(torch._subclasses.fake_tensor.DataDependentOutputException):
        c.compile(gm, [torch.randn(4)], compiler.GENERAL, name="p")
