"""Many threads calling one compiled model (runtime/cudagraph/concurrency.py, compile/builder.py's
lock, the dispatcher's): each gets its own right answer, first calls compile each variant once, and
nothing hangs (every thread is joined with a timeout). Guard-free dispatch follows train()/eval() and
changed module attributes. Bad configuration gets a clear error."""
from __future__ import annotations

import threading
import time
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torch_ext
from torch_ext.backend import CompileConfig, ConfigError, counters
from torch_ext.backend.dispatch import GuardFreeDispatchWarning
from torch_ext.backend.runtime.cudagraph.concurrency import CallOrder, SerializedGraph

THREADS = 6
JOIN_TIMEOUT = 240


def run_threads(work, count=THREADS):
    """Start `count` threads together on work(i); return their results (re-raising any error)."""
    barrier = threading.Barrier(count)
    results, errors = [None] * count, []

    def body(i):
        try:
            barrier.wait(timeout=60)
            results[i] = work(i)
        except BaseException as e:  # noqa: BLE001  (re-raised in the test's thread)
            errors.append(e)

    threads = [threading.Thread(target=body, args=(i,), daemon=True) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN_TIMEOUT)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    if errors:
        raise errors[0]
    return results


class Attention(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        torch.manual_seed(0)
        self.qkv, self.out = nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return self.out(F.scaled_dot_product_attention(q, k, v)).relu() + x


def test_first_calls_from_many_threads_compile_each_size_once(tmp_path):
    """Lazy size compiles and disk-cache writes, then, in a new backend, disk-cache loads: all from
    threads starting together, each with its own batch size."""
    model = Attention().eval()
    sizes = [2, 4, 8, 2, 4, 8][:THREADS]  # (batch 1 would be its own graph: Dynamo specializes 1)
    inputs = [torch.randn(n, 5, 32, generator=torch.Generator().manual_seed(n)) for n in sizes]
    with torch.no_grad():
        expected = [model(x) for x in inputs]
    for round_ in ("compile", "load"):
        torch._dynamo.reset()
        counters.reset()
        config = CompileConfig(cache_dir=str(tmp_path), splitting_ops=("aten::scaled_dot_product_attention",),
                               compile_sizes=(1, 2, 4, 8))
        compiled = torch.compile(model, backend=torch_ext.backend(config))
        with torch.no_grad():
            first = torch.randn(3, 5, 32)
            torch._dynamo.mark_dynamic(first, 0)  # the batch dim: compile_sizes pick its variants
            compiled(first)  # the general compile, on this thread: Dynamo traces once
            pieces = counters.unique_pieces

            def call(i):
                with torch.no_grad():  # grad mode is per thread
                    return compiled(inputs[i])

            outs = run_threads(call)
        for out, exp in zip(outs, expected):
            torch.testing.assert_close(out, exp, rtol=1e-4, atol=1e-5)
        assert counters.graphs_seen == 1
        by_size = {v: n for v, n in counters.compiles_by_variant.items() if v.startswith("size")}
        if round_ == "compile":
            assert by_size == {f"size={n}": pieces for n in (2, 4, 8)}, by_size  # each once, not per thread
        else:
            assert by_size == {} and counters.cache_hits == 4 * pieces, (by_size, counters.cache_hits)


_active, _peak, _count_lock = [0], [0], threading.Lock()


@torch.library.custom_op("torch_ext_concurrency_test::slow_identity", mutates_args=())
def _slow_identity(x: torch.Tensor) -> torch.Tensor:
    """A splitting op that notes how many calls of the graph around it run at once."""
    with _count_lock:
        _active[0] += 1
        _peak[0] = max(_peak[0], _active[0])
    time.sleep(0.002)  # releases the GIL: another thread would enter here if nothing kept it out
    with _count_lock:
        _active[0] -= 1
    return x.clone()


_slow_identity.register_fake(lambda x: torch.empty_like(x))


def test_cpu_graph_calls_from_many_threads_run_one_at_a_time():
    """CPU graphs of a backend run one call at a time (runtime/split_runner.py): at once, every op
    of a call waits for the GIL behind the other threads' Python. Each thread still gets its answer."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16)).eval()

    def forward(x):
        return model(torch.ops.torch_ext_concurrency_test.slow_identity(model(x).relu()))

    config = CompileConfig(cache_dir=None, splitting_ops=("torch_ext_concurrency_test::slow_identity",))
    compiled = torch.compile(forward, backend=torch_ext.backend(config))
    inputs = [torch.randn(4, 16, generator=torch.Generator().manual_seed(i)) for i in range(THREADS)]
    with torch.no_grad():
        expected = [forward(x) for x in inputs]
        compiled(inputs[0])
    _peak[0] = 0

    def call(i):
        with torch.no_grad():
            return [compiled(inputs[i]) for _ in range(5)]

    for outs, exp in zip(run_threads(call), expected):
        for out in outs:
            torch.testing.assert_close(out, exp)
    assert _peak[0] == 1


def test_serial_calls_set_each_thread_to_torch_intra_op_threads_once(monkeypatch):
    """A thread's first CPU graph call runs torch's per-thread thread-count setup (runtime/serial_calls.py)."""
    from torch_ext.backend.runtime import serial_calls

    entered = []
    real = serial_calls.enter_thread
    monkeypatch.setattr(serial_calls, "enter_thread", lambda: (entered.append(threading.get_ident()), real()))
    model = Attention().eval()
    compiled = torch.compile(model, backend=torch_ext.backend(CompileConfig(
        cache_dir=None, splitting_ops=("aten::scaled_dot_product_attention",))))
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        expected = model(x)
        compiled(x)
    entered.clear()  # the main thread may have entered before (another test's graph)

    def call(i):
        with torch.no_grad():
            return [compiled(x) for _ in range(3)]

    for outs in run_threads(call):
        for out in outs:
            torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
    assert sorted(set(entered)) == sorted(entered) and len(entered) == THREADS


_inner, _outer, _depth = [None], [None], threading.local()


@torch.library.custom_op("torch_ext_concurrency_test::calls_compiled", mutates_args=())
def _calls_compiled(x: torch.Tensor) -> torch.Tensor:
    """A splitting op that calls compiled CPU graphs: another backend's, and once its own caller's."""
    depth = getattr(_depth, "n", 0)
    _depth.n = depth + 1
    try:
        return _outer[0](x) if depth == 0 else _inner[0](x)
    finally:
        _depth.n = depth


_calls_compiled.register_fake(lambda x: torch.empty_like(x))


def test_compiled_cpu_graphs_calling_each_other_from_many_threads_do_not_deadlock():
    """CPU calls run one at a time under one re-entrant lock (runtime/serial_calls.py): a graph whose
    splitting op calls another backend's graph, and itself again through torch.compile, while other
    threads call each directly, finishes with each thread's answer."""
    torch.manual_seed(0)
    lin = nn.Linear(16, 16).eval()

    def inner(x):
        return lin(torch.ops.torch_ext_concurrency_test.slow_identity(lin(x).relu()))

    def outer(x):
        return lin(torch.ops.torch_ext_concurrency_test.calls_compiled(lin(x).tanh()))

    def backend(op):
        return torch_ext.backend(CompileConfig(cache_dir=None, splitting_ops=(f"torch_ext_concurrency_test::{op}",)))

    _inner[0], _outer[0] = inner, outer  # eager first: the expected values
    inputs = [torch.randn(4, 16, generator=torch.Generator().manual_seed(i)) for i in range(THREADS)]
    with torch.no_grad():
        expected = [(outer(x), inner(x)) for x in inputs]
        _inner[0] = torch.compile(inner, backend=backend("slow_identity"))
        _outer[0] = torch.compile(outer, backend=backend("calls_compiled"))
        _outer[0](inputs[0]), _inner[0](inputs[0])

    def call(i):
        with torch.no_grad():
            fn = _outer[0] if i % 2 else _inner[0]
            return [fn(inputs[i]) for _ in range(3)]

    try:
        for i, outs in enumerate(run_threads(call)):
            for out in outs:
                torch.testing.assert_close(out, expected[i][0 if i % 2 else 1], rtol=1e-4, atol=1e-5)
    finally:
        _inner[0] = _outer[0] = None


def test_guard_free_dispatch_first_calls_from_many_threads():
    model = Attention().eval()
    x = torch.randn(4, 5, 32)
    with torch.no_grad():
        expected = model(x)
        compiled = torch_ext.compile(model, CompileConfig(cache_dir=None, guard_free_dispatch=True))
        def call(i):
            with torch.no_grad():  # grad mode is per thread
                return compiled(x.clone())

        outs = run_threads(call)
        for out in outs:
            torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
        assert compiled.calls == THREADS  # through torch.compile's guards, one at a time, one compile
        assert len(compiled.signatures) == 1
        torch.testing.assert_close(compiled(x), expected, rtol=1e-4, atol=1e-5)  # armed: no guards now
        assert compiled.calls == THREADS


def test_serialized_graph_gives_each_thread_its_own_outputs():
    """What a captured graph does (a static output buffer written on every replay), from many threads:
    each caller's result stays what its own call computed, however the threads interleave."""
    static = torch.zeros(64)

    def graph(x):  # like a replay: fills the static buffer, returns it
        static.copy_(x.expand(64))
        return static

    serialized = SerializedGraph(graph, "test graph", CallOrder())
    first = serialized(torch.tensor(-1.0))
    assert first is static  # one thread: the static output itself (valid until the next call)

    def call(i):
        mine = serialized(torch.tensor(float(i)))
        for _ in range(200):  # other threads replay meanwhile
            assert torch.equal(mine, torch.full((64,), float(i)))
        return mine

    outs = run_threads(call, count=8)
    assert serialized.copies_outputs
    for i, out in enumerate(outs):
        assert out is not static and torch.equal(out, torch.full((64,), float(i)))


class DropoutScale(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.drop = nn.Dropout(p=1.0)  # all zeros in training, identity in eval: no randomness to compare
        self.scale = 2.0

    def forward(self, x):
        return self.drop(self.lin(x)) * self.scale


def test_guard_free_dispatch_follows_train_eval_and_module_attributes():
    model = DropoutScale().eval()
    x = torch.randn(3, 16)
    compiled = torch_ext.compile(model, CompileConfig(cache_dir=None, guard_free_dispatch=True))
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x))
        torch.testing.assert_close(compiled(x), model(x))  # the armed variant
        model.train()
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            assert torch.count_nonzero(compiled(x)) == 0  # dropout(p=1) in training, as eager
            assert torch.count_nonzero(compiled(x)) == 0
        assert sum("training flag is True" in str(w.message) for w in said if w.category is GuardFreeDispatchWarning) == 1
        model.eval()
        torch.testing.assert_close(compiled(x), model(x))
        model.scale = 3.0
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            torch.testing.assert_close(compiled(x), model(x))  # 3.0, not the 2.0 compiled in
            torch.testing.assert_close(compiled(x), model(x))
        assert sum("scale" in str(w.message) for w in said if w.category is GuardFreeDispatchWarning) == 1


def test_bad_configuration_is_named_with_its_fix(tmp_path):
    a_file = tmp_path / "not_a_dir"
    a_file.write_text("")
    for path in (a_file, a_file / "sub"):
        with pytest.raises(ConfigError, match=r"cache_dir.*is a file.*cache_dir=None"):
            CompileConfig(cache_dir=str(path))
    with pytest.raises(TypeError, match=r"CompileConfig\(\*\*\{'cudagraph_mode': 'none'\}\)"):
        torch_ext.backend({"cudagraph_mode": "none"})
    with pytest.raises(TypeError, match="must be a torch_ext.CompileConfig"):
        torch_ext.compile(nn.Linear(2, 2), {"guard_free_dispatch": True})
