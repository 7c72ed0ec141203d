"""CompileConfig(background_compile=True): a call whose program is not ready runs the forward eagerly
while one compile thread loads or compiles it; later calls run the program. Outputs always equal
eager's, the program is traced on the arguments as they were at the call (not as the eager run left
them), and a second process loads what the first saved, tracing nothing."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn

import torch_ext
from torch_ext import compat
from torch_ext.backend import CompileConfig, ConfigError
from torch_ext.backend.counters import counters
from torch_ext.backend.warm_start import background

needs_aot = pytest.mark.skipif(not compat.HAS_AOT_COMPILE, reason="this torch has no AOT compile: no warm start")


@pytest.fixture(autouse=True)
def _compile_thread_idle():
    yield
    assert torch_ext.wait_compiled(600), "a background compile outlived its test"


class Cache:
    """Fills its tensor at the first call it is passed to, as transformers' StaticCache does."""

    def __init__(self):
        self.total = None


class Accumulate(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 16)

    def forward(self, x, cache):
        if cache.total is None:
            cache.total = torch.zeros_like(x)
        cache.total.add_(x)
        return self.proj(x).relu() + cache.total


def frames() -> int:
    return int(torch._dynamo.utils.counters["frames"].get("total", 0))


@needs_aot
@pytest.mark.parametrize("guard_free", [True, False], ids=["guard-free", "warm-start-module"])
def test_first_call_runs_eagerly_then_the_program_serves_new_caches(tmp_path, guard_free):
    torch.manual_seed(0)
    interval = sys.getswitchinterval()
    model = Accumulate().eval()
    compiled = torch_ext.compile(model, CompileConfig(cache_dir=str(tmp_path), background_compile=True,
                                                      guard_free_dispatch=guard_free, progress_bar=False))
    xs = [torch.randn(4, 16) for _ in range(3)]
    with torch.no_grad():
        cache, reference = Cache(), Cache()
        out = compiled(xs[0], cache)  # eager: the program is traced meanwhile
        assert counters.background_eager_calls == 1
        torch.testing.assert_close(out, model(xs[0], reference))
        assert torch_ext.wait_compiled(600)
        assert counters.background_compiles == 1 and counters.warm_start_saves == 1
        assert sys.getswitchinterval() == interval  # lowered while the compile thread worked, then put back
        traced = frames()
        # New caches (total None): the program was traced as the call found its cache, not as the eager
        # run left it, so its guards take these calls: no trace in the foreground.
        for x in xs:
            cache, reference = Cache(), Cache()
            torch.testing.assert_close(compiled(x, cache), model(x, reference))
            assert torch.equal(cache.total, reference.total)
        assert counters.background_eager_calls == 1 and counters.warm_start_fallbacks == 0
        assert frames() == traced
        if not guard_free:  # a cache passed again once filled: the saved guards see it (guard-free
            # dispatch leaves an object's attributes to the caller, docs/guide/backend.md)
            cache, reference = Cache(), Cache()
            for x in xs:
                torch.testing.assert_close(compiled(x, cache), model(x, reference))


@needs_aot
def test_calls_that_record_autograd_compile_in_the_foreground(tmp_path):
    model = Accumulate()
    compiled = torch_ext.compile(model, CompileConfig(cache_dir=str(tmp_path), background_compile=True,
                                                      guard_free_dispatch=True, progress_bar=False))
    x = torch.randn(4, 16, requires_grad=True)
    out = compiled(x, Cache())
    assert counters.background_eager_calls == 0 and counters.warm_start_saves == 1  # traced before it ran
    ref_x = x.detach().clone().requires_grad_()
    expected = model(ref_x, Cache())
    torch.testing.assert_close(out, expected)
    out.sum().backward()
    expected.sum().backward()
    torch.testing.assert_close(x.grad, ref_x.grad)


@needs_aot
def test_a_forward_the_compile_thread_cannot_trace_goes_through_torch_compile(tmp_path):
    class Breaks(nn.Module):
        def forward(self, x):
            y = x.sin()
            torch._dynamo.graph_break()  # AOT compile needs one graph: refused, said, torch.compile instead
            return y.cos()

    model = Breaks()  # (guard-free dispatch compiles with fullgraph=True: a graph break is an error there)
    compiled = torch_ext.compile(model, CompileConfig(cache_dir=str(tmp_path), background_compile=True,
                                                      progress_bar=False))
    x = torch.randn(8)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), x.sin().cos())
        assert counters.background_eager_calls == 1
        assert torch_ext.wait_compiled(600)
        for _ in range(2):
            torch.testing.assert_close(compiled(x), x.sin().cos())
    assert counters.background_eager_calls == 1 and frames() > 0  # the foreground compiled it


def test_background_compile_needs_a_cache_dir_and_warm_start():
    with pytest.raises(ConfigError, match="background_compile.*needs warm start"):
        CompileConfig(background_compile=True, cache_dir=None)
    with pytest.raises(ConfigError, match="background_compile.*needs warm start"):
        CompileConfig(background_compile=True, cache_dir="/tmp/x", warm_start=False)
    with pytest.raises(ConfigError, match="background_compile"):
        CompileConfig(background_compile="yes", cache_dir="/tmp/x")


@pytest.mark.skipif(compat.HAS_AOT_COMPILE, reason="this torch has AOT compile: the background path applies")
def test_without_aot_compile_it_says_so_and_compiles_in_the_foreground(tmp_path):
    model = Accumulate().eval()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = torch_ext.compile(model, CompileConfig(cache_dir=str(tmp_path), background_compile=True,
                                                          guard_free_dispatch=True, progress_bar=False))
    assert any("background_compile=True, but" in str(w.message) for w in caught)
    x = torch.randn(4, 16)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x, Cache()), model(x, Cache()))
    assert counters.background_eager_calls == 0 and counters.graphs_seen == 1  # compiled before it ran


def test_snapshot_copies_objects_and_containers_and_shares_tensors():
    t = torch.ones(2)
    cache = Cache()
    shared = [t]
    args = ({"cache": cache, "again": cache, "list": shared}, t, nn.Linear(2, 2))
    snap = background._snapshot(args, {})
    cache.total = torch.zeros(1)  # what an eager run does meanwhile
    shared.append(1)
    copied = snap[0]
    assert copied["cache"] is copied["again"] and copied["cache"] is not cache  # aliasing kept
    assert copied["cache"].total is None and copied["list"] == [t]  # as at the call
    assert snap[1] is t and copied["list"][0] is t and snap[2] is args[2]  # tensors and modules shared


WORKER = os.path.join(os.path.dirname(__file__), "hf_generate_worker.py")


@needs_aot
@pytest.mark.slow
@pytest.mark.parametrize("guard_free", [True, False], ids=["guard-free", "warm-start-module"])
def test_generate_runs_eagerly_first_then_later_processes_load_the_programs(tmp_path, guard_free):
    pytest.importorskip("transformers")
    extra = ["--fx-pieces", "--background", "--generates", "3", "--steps", "5"] + (["--guard-free"] if guard_free else [])

    def run():
        out = subprocess.run([sys.executable, WORKER, str(tmp_path), *extra], capture_output=True, text=True,
                             timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    cold = run()
    assert cold["tokens"] == cold["expected"]  # the first generate ran eagerly, the others the programs
    c = cold["counters"]
    assert c["background_eager_calls"] == 5  # prefill and 4 decode steps of the first generate
    assert (c["warm_start_saves"], c["warm_start_fallbacks"]) == (2, 0)
    # The later generates ran the programs: no eager call, no frame through torch.compile (the compile
    # thread's AOT traces do not count as frames)
    assert cold["dynamo_frames"].get("total", 0) == 0
    again = run()
    c = again["counters"]
    assert again["tokens"] == again["expected"] == cold["tokens"]
    assert (c["warm_start_loads"], c["warm_start_saves"], c["warm_start_fallbacks"]) == (2, 0, 0)
    assert again["dynamo_frames"].get("total", 0) == 0


@needs_aot
def test_an_eager_call_that_compiles_a_region_waits_for_the_compile_thread_and_is_right(tmp_path):
    """The eager forward compiles a submodule of its own (torch.compile inside): Dynamo's compile lock,
    which the compile thread holds, makes it wait; nothing deadlocks and every output is eager's."""
    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = torch.compile(nn.Linear(8, 8), backend="eager")
            self.out = nn.Linear(8, 8)

        def forward(self, x):
            return self.out(self.inner(x).relu())

    torch.manual_seed(0)
    model = Outer().eval()
    compiled = torch_ext.compile(model, CompileConfig(cache_dir=str(tmp_path), background_compile=True,
                                                      guard_free_dispatch=True, progress_bar=False))
    x = torch.randn(2, 8)
    with torch.no_grad():
        expected = model.out(model.inner._orig_mod(x).relu())
        for _ in range(3):
            torch.testing.assert_close(compiled(x), expected)
        assert torch_ext.wait_compiled(600)
        torch.testing.assert_close(compiled(x), expected)
    assert counters.background_eager_calls >= 1 and counters.background_compiles == 1


def test_torch_compile_with_the_backend_says_background_compile_does_not_apply(tmp_path, caplog):
    model = Accumulate().eval()
    config = CompileConfig(cache_dir=str(tmp_path), background_compile=True)
    x = torch.randn(4, 16)
    with caplog.at_level("WARNING", logger="torch_ext.backend"), torch.no_grad():
        out = torch.compile(model, backend=torch_ext.backend(config))(x, Cache())
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "background_compile applies to torch_ext.compile" in said
    assert counters.background_eager_calls == 0  # compiled at the call, as it says
    torch.testing.assert_close(out, model(x, Cache()))
