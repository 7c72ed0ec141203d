"""Our ops' kernels made ready on the compile thread (backend/compile/prime_kernels.py): each distinct call of
a torch_ext op in a graph runs once on zeros of its traced shapes, dtypes and strides. On the CPU the
mechanism is run on CPU tensors (on a GPU it runs CUDA ones only: what Triton compiles at a first launch)."""
from __future__ import annotations

import threading

import pytest
import torch
import torch.fx as fx

import torch_ext
from torch_ext import compat
from torch_ext.backend import CompileConfig
from torch_ext.backend.compile import prime_kernels as prime
from torch_ext.backend.counters import counters

seen: list = []


@torch.library.custom_op("torch_ext::_test_prime_record", mutates_args=())
def _record(x: torch.Tensor, y: torch.Tensor, n: int) -> torch.Tensor:
    if n < 0:
        raise RuntimeError("a kernel that does not take these inputs")
    seen.append((tuple(x.shape), x.stride(), x.dtype, tuple(y.shape), y.stride(), n, bool((x == 0).all())))
    return x.clone()


@_record.register_fake
def _(x, y, n):
    return torch.empty_like(x)


def _graph(*calls) -> fx.GraphModule:
    """A graph calling the recording op once per (x, y, n) in calls, with traced values on its placeholders."""
    graph = fx.Graph()
    for i, (x, y, n) in enumerate(calls):
        px, py = graph.placeholder(f"x{i}"), graph.placeholder(f"y{i}")
        px.meta["example_value"], py.meta["example_value"] = x, y
        graph.call_function(torch.ops.torch_ext._test_prime_record.default, (px, py, n))
    graph.output(None)
    return fx.GraphModule(torch.nn.Module(), graph)


@pytest.fixture(autouse=True)
def _clear():
    seen.clear()


def test_each_distinct_call_runs_once_on_zeros_shaped_as_traced():
    x = torch.randn(4, 8)
    expanded = torch.randn(1, 8).expand(3, 8)  # stride 0: viewed as traced, not made contiguous
    gm = _graph((x, x.t(), 2), (x, x.t(), 2), (x, x.t(), 3), (expanded, x, 2))
    before = counters.kernels_primed
    assert prime.prime_kernels(gm, devices=("cpu",)) == 3
    assert counters.kernels_primed - before == 3
    assert seen == [((4, 8), (8, 1), torch.float32, (8, 4), (1, 8), 2, True),
                    ((4, 8), (8, 1), torch.float32, (8, 4), (1, 8), 3, True),
                    ((3, 8), (0, 1), torch.float32, (4, 8), (8, 1), 2, True)]


def test_calls_it_cannot_shape_are_left_to_the_first_call(monkeypatch):
    x = torch.randn(4, 8)
    gm = _graph((x, x, 1))
    gm.graph.find_nodes(op="placeholder")[1].meta.pop("example_value")  # a value the saved graph dropped
    assert prime.prime_kernels(gm, devices=("cpu",)) == 0
    assert prime.prime_kernels(_graph((x, x, 1)), devices=("cuda",)) == 0  # not on a primed device
    monkeypatch.setattr(prime, "MAX_BYTES", 100)  # 2 x 128 bytes of zeros: too large
    assert prime.prime_kernels(_graph((x, x, 1)), devices=("cpu",)) == 0
    assert seen == []


def test_a_call_that_fails_costs_nothing_but_itself():
    x = torch.randn(4, 8)
    gm = _graph((x, x, -1), (x, x, 1))
    assert prime.prime_kernels(gm, devices=("cpu",)) == 1  # the bad call raised; the other ran
    assert len(seen) == 1


def test_symbolic_sizes_take_their_hints():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic, StatelessSymbolicContext

    mode = FakeTensorMode(shape_env=ShapeEnv())
    context = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC, DimDynamic.STATIC])
    symbolic = mode.from_tensor(torch.randn(5, 8), symbolic_context=context, source=ConstantSource("x"))
    assert isinstance(symbolic.shape[0], torch.SymInt)
    assert prime.prime_kernels(_graph((symbolic, symbolic, 1)), devices=("cpu",)) == 1
    assert seen == [((5, 8), (8, 1), torch.float32, (5, 8), (8, 1), 1, True)]


@pytest.mark.skipif(not compat.HAS_AOT_COMPILE, reason="this torch has no AOT compile: no background compile")
def test_the_compile_thread_primes_and_the_foreground_does_not(tmp_path, monkeypatch):
    from torch_ext.backend import backend

    threads = []

    def recording(gm, devices=("cuda",)):
        threads.append(threading.current_thread().name)
        return 0

    monkeypatch.setattr(backend, "prime_kernels", recording)
    model = torch.nn.Linear(8, 8).eval()
    x = torch.randn(2, 8)
    with torch.no_grad():
        foreground = torch_ext.compile(model, CompileConfig(cache_dir=str(tmp_path / "a"), progress_bar=False))
        torch.testing.assert_close(foreground(x), model(x))
        assert threads == []
        background = torch_ext.compile(model, CompileConfig(cache_dir=str(tmp_path / "b"), background_compile=True,
                                                            progress_bar=False))
        torch.testing.assert_close(background(x), model(x))  # eager; its program compiles on the thread
        assert torch_ext.wait_compiled(600)
        torch.testing.assert_close(background(x), model(x))
    assert threads == ["torch_ext compile"]
