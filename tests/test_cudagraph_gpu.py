"""CUDA graphs on a GPU (run through the device tool: `bash bench/gpu_check.sh`); skipped without CUDA."""
from __future__ import annotations

import random

import pytest
import torch

import cudagraph_models as cm
import torch_ext
from torch_ext.backend import CompileConfig, make_backend
from torch_ext.backend.runtime.cudagraph.manager import capture_sizes, cudagraph_stats

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

CAPTURE = (1, 2, 4, 8, 16, 24, 32, 48)
POS = cm.MAX_POS - 1  # every step writes this position, then reads 0..POS


def config(mode, **kwargs) -> CompileConfig:
    return CompileConfig(splitting_ops=cm.SPLITTING_OPS, cache_dir=None, cudagraph_mode=mode,
                         cudagraph_capture_sizes=CAPTURE, progress_bar=False, **kwargs)


@pytest.fixture(autouse=True)
def fresh():
    torch._dynamo.reset()
    cudagraph_stats.reset()
    yield
    torch._dynamo.reset()


def assert_step_matches(compiled, reference, x, caches, reference_caches, msg, *, rows=None, tol=1e-5):
    """One step of both (each with its own caches): outputs equal, and the caches (their first
    `rows` rows: full graphs pad the splitting op too, rows past the batch may hold padding writes)."""
    with torch.no_grad():
        actual = compiled(x, *caches, POS).clone()  # the next replay overwrites graph outputs
        expected = reference(x, *reference_caches, POS)
    torch.testing.assert_close(actual, expected, atol=tol, rtol=tol, msg=msg)
    for a, e in zip(caches[0] + caches[1], reference_caches[0] + reference_caches[1]):
        torch.testing.assert_close(a[:rows], e[:rows])
    return actual


@pytest.mark.parametrize("mode,options", [("piecewise", {}), ("full", {}),
                                          ("full_and_piecewise", {"full_cudagraph_max_size": 16})])
def test_replays_equal_uncaptured_runs_for_200_random_batch_sizes(mode, options):
    model = cm.TinyDecoder(layers=3).cuda()
    graphs = torch.compile(model, backend=make_backend(config(mode, **options)))
    plain = torch.compile(model, backend=make_backend(config("none")))
    gk, gv = model.caches("cuda")
    pk, pv = [t.clone() for t in gk], [t.clone() for t in gv]
    rng = random.Random(0)
    sizes = [17] + [rng.randint(1, cm.MAX_BATCH) for _ in range(200)]
    for i, n in enumerate(sizes):
        x = torch.randn(n, cm.D_MODEL, device="cuda")
        if i == 0:
            torch._dynamo.mark_dynamic(x, 0)
        actual = assert_step_matches(graphs, plain, x, (gk, gv), (pk, pv), f"call {i}, batch {n}",
                                     rows=None if mode == "piecewise" else n)
        assert actual.shape == (n, cm.D_MODEL)
    assert cudagraph_stats.replays > 100, cudagraph_stats
    assert len(cudagraph_stats.sizes) >= len(CAPTURE) - 1


def test_static_shapes_replays_equal_uncaptured_runs_at_several_batch_sizes():
    """dynamic=False: one graph per batch size, pieces read earlier graphs' outputs in place; sizes
    interleaved so that each graph's memory is reused by the others' between its replays."""
    model = cm.TinyDecoder(layers=3).cuda()
    graphs = torch.compile(model, backend=make_backend(config("piecewise")), dynamic=False)
    plain = torch.compile(model, backend=make_backend(config("none")), dynamic=False)
    gk, gv = model.caches("cuda")
    pk, pv = [t.clone() for t in gk], [t.clone() for t in gv]
    rng = random.Random(1)
    for i, n in enumerate([4, 4, 4, 9, 9, 9] + [rng.choice((4, 9, 2)) for _ in range(60)]):
        x = torch.randn(n, cm.D_MODEL, device="cuda")
        assert_step_matches(graphs, plain, x, (gk, gv), (pk, pv), f"call {i}, batch {n}")
    assert cudagraph_stats.replays > 100, cudagraph_stats


def test_a_splitting_op_that_syncs_leaves_the_full_graph_to_the_pieces():
    """A real failed capture (the op reads a value on the host): warned once, then the piecewise
    graphs serve every call, equal to eager; the device keeps working."""
    model = cm.TinyDecoder(layers=2, attention="checked").cuda()
    graphs = torch.compile(model, backend=make_backend(config("full_and_piecewise")))
    gk, gv = model.caches("cuda")
    ek, ev = [t.clone() for t in gk], [t.clone() for t in gv]
    with pytest.warns(UserWarning, match=r"could not capture a CUDA graph of graph 0 \(full graph\)"):
        for i, n in enumerate([5, 5, 5, 5, 3, 8, 8, 8, 8]):
            x = torch.randn(n, cm.D_MODEL, device="cuda")
            if i == 0:
                torch._dynamo.mark_dynamic(x, 0)
            assert_step_matches(graphs, model, x, (gk, gv), (ek, ev), f"call {i}, batch {n}", rows=n)
    assert cudagraph_stats.replays > 0 and 8 in cudagraph_stats.sizes  # the pieces' graphs


def test_guard_free_dispatch_with_cuda_graphs_serves_batch_one_from_the_symbolic_graph():
    model = cm.TinyDecoder(layers=2).cuda()
    compiled = torch_ext.compile(model, config("piecewise", guard_free_dispatch=True))
    gk, gv = model.caches("cuda")
    ek, ev = [t.clone() for t in gk], [t.clone() for t in gv]
    for i, n in enumerate([8, 1, 1, 1, 3, 3, 3]):
        x = torch.randn(n, cm.D_MODEL, device="cuda")
        if i == 0:
            torch._dynamo.mark_dynamic(x, 0)
        with torch.no_grad():
            torch.testing.assert_close(compiled(x, gk, gv, POS), model(x, ek, ev, POS), atol=1e-4, rtol=1e-4)
    assert compiled.calls == 1 and {1, 4} <= cudagraph_stats.sizes


@pytest.mark.parametrize("mode", ["piecewise", "full"])
def test_guard_free_dispatch_in_natural_call_order_matches_eager(mode):
    """Batch 1 first compiles the batch dim as 1; the batch-8 call used to replay into it (broadcast
    error). Now it recompiles once, with a GuardFreeDispatchWarning, and every call matches eager."""
    from torch_ext.backend.dispatch.dispatcher import GuardFreeDispatchWarning

    model = cm.TinyDecoder(layers=2).cuda()
    compiled = torch_ext.compile(model, config(mode, guard_free_dispatch=True, compile_sizes=(1, 8)))
    gk, gv = model.caches("cuda")
    ek, ev = [t.clone() for t in gk], [t.clone() for t in gv]
    with pytest.warns(GuardFreeDispatchWarning, match=r"size mismatch at index 0. expected 1, actual 8"):
        for i, n in enumerate([1, 8, 3, 1, 17, 8, 1, 3, 8, 1, 3, 64]):
            x = torch.randn(n, cm.D_MODEL, device="cuda")
            assert_step_matches(compiled, model, x, (gk, gv), (ek, ev), f"call {i}, batch {n}",
                                rows=None if mode == "piecewise" else n, tol=1e-4)
    assert compiled.calls == 2 and cudagraph_stats.replays > 0


@pytest.mark.parametrize("mode", ["piecewise", "full"])
def test_buffer_mutation_is_refused(mode):
    from test_cudagraph import MutatesBuffer

    model = MutatesBuffer().cuda()
    k, v = model.caches("cuda")
    x = torch.randn(3, cm.D_MODEL, device="cuda")
    torch._dynamo.mark_dynamic(x, 0)
    with pytest.raises(Exception, match=r"(?s)mutates the module buffer.*self\.steps\.add_"):
        with torch.no_grad():
            torch.compile(model, backend=make_backend(config(mode)))(x, k, v, POS)


def test_pool_is_shared_and_only_escaping_outputs_stay_allocated():
    model = cm.TinyDecoder(layers=4).cuda()
    cfg = config("piecewise")
    compiled = torch.compile(model, backend=make_backend(cfg))
    k, v = model.caches("cuda")
    step = lambda n: compiled(torch.randn(n, cm.D_MODEL, device="cuda"), k, v, POS)  # noqa: E731
    first = torch.randn(17, cm.D_MODEL, device="cuda")
    torch._dynamo.mark_dynamic(first, 0)
    with torch.no_grad():
        compiled(first, k, v, POS)
        for _ in range(2):  # capture the largest size: the pool now also holds cuBLAS's workspace
            step(CAPTURE[-1])
        torch.cuda.synchronize()
        before, static_before = torch.cuda.memory_allocated(), cudagraph_stats.static_input_bytes
        capture_sizes(step, CompileConfig(cudagraph_capture_sizes=CAPTURE[1:-1], cache_dir=None, progress_bar=False))
        torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - before
    # Held by the graphs of the other sizes: their static input buffers and final outputs. Every
    # other piece output is non-owning: its memory went back to the pool, shared by all sizes.
    kept = sum(-(-(n * cm.D_MODEL * 4) // 512) * 512 for n in CAPTURE[1:-1])
    static = cudagraph_stats.static_input_bytes - static_before
    print(f"\ncapture: {cudagraph_stats.captures} graphs in {cudagraph_stats.capture_seconds * 1e3:.1f} ms, pool "
          f"+{cudagraph_stats.capture_bytes / 2**20:.1f} MiB reserved; sizes {CAPTURE[1:-1]} hold {held / 2**10:.1f} KiB "
          f"(static inputs {static / 2**10:.1f} KiB, final outputs {kept / 2**10:.1f} KiB)")
    assert cudagraph_stats.captures == 5 * (len(CAPTURE) - 1)  # 5 pieces around 4 attentions
    assert held <= static + kept + 16 * 1024


def test_full_graph_is_captured_again_for_new_caches_written_in_place():
    """generate makes a new cache per call: the full graph (dynamic=False: caches read in place) is
    captured again at the new addresses, into the same pool, with outputs and caches equal to the
    uncaptured runs'; the first caches' graph is gone once the new one is captured."""
    model = cm.TinyDecoder(layers=3).cuda()
    graphs = torch.compile(model, backend=make_backend(config("full")), dynamic=False)
    plain = torch.compile(model, backend=make_backend(config("none")), dynamic=False)
    n = cm.MAX_BATCH
    for round_ in range(3):  # three caches, one after the other
        gk, gv = model.caches("cuda")
        pk, pv = [t.clone() for t in gk], [t.clone() for t in gv]
        for i in range(4):
            x = torch.randn(n, cm.D_MODEL, device="cuda")
            assert_step_matches(graphs, plain, x, (gk, gv), (pk, pv), f"cache {round_}, call {i}")
    assert cudagraph_stats.recaptures == 2 and cudagraph_stats.captures == 3, cudagraph_stats


@pytest.mark.parametrize("mode", ["piecewise", "full"])
def test_caches_with_the_batch_dim_are_read_in_place_and_recaptured_when_new(mode):
    """One cache per batch size (HF StaticCache): calls at capture sizes read it where it is (static
    input bytes stay near zero across sizes), padded calls copy it, a new cache captures again;
    outputs and caches equal the uncaptured runs' throughout."""
    model = cm.BatchCacheDecoder(layers=3).cuda()
    graphs = torch.compile(model, backend=make_backend(config(mode)))
    plain = torch.compile(model, backend=make_backend(config("none")))
    cache_bytes = 0
    for round_ in range(2):  # a second round: new caches for every size
        for n in (8, 4, 2, 1, 3):
            gk, gv = model.caches_for(n, "cuda")
            cache_bytes += sum(t.untyped_storage().nbytes() for t in gk + gv)
            pk, pv = [t.clone() for t in gk], [t.clone() for t in gv]
            for i in range(4):
                x = torch.randn(n, cm.D_MODEL, device="cuda")
                if round_ == 0 and n == 8 and i == 0:
                    for t in [x, *gk, *gv, *pk, *pv]:
                        torch._dynamo.mark_dynamic(t, 0)
                assert_step_matches(graphs, plain, x, (gk, gv), (pk, pv), f"{mode}: round {round_}, batch {n}, call {i}")
    static = cudagraph_stats.static_input_bytes
    print(f"\n{mode}: static input buffers {static / 2**10:.1f} KiB for caches of {cache_bytes / 2**10:.1f} KiB "
          f"({cudagraph_stats.captures} captures, {cudagraph_stats.recaptures} re-captures)")
    padded_copies = sum(t.untyped_storage().nbytes() for t in model.caches_for(4, "cuda")[0]) * 2
    assert static <= padded_copies * 2 + 64 * 1024  # batch 3's padded graphs (two rounds); no other cache copy
    assert cudagraph_stats.recaptures >= 4 and cudagraph_stats.replays > 0


@pytest.mark.parametrize("mode", ["full", "piecewise"])
def test_an_int_that_is_not_a_batch_size_is_never_padded(mode):
    """Only a dynamic dim of a tensor is a batch size: an int input that sizes no tensor (a position)
    must not be read as one, padded up to a capture size and replaced by it."""
    torch._dynamo.reset()
    model = cm.PositionStep().cuda()
    compiled = torch_ext.compile(model, CompileConfig(cache_dir=None, cudagraph_mode=mode, progress_bar=False,
                                                      cudagraph_capture_sizes=(1, 2, 4, 8, 16)))
    x = torch.randn(3, cm.D_MODEL, device="cuda")
    with torch.no_grad():
        for pos in [1, 2, 3, 5, 6, 7, 9, 3, 5]:
            torch.testing.assert_close(compiled(x, pos), model(x, pos), msg=lambda m: f"pos {pos}: {m}")
        # A dynamic batch beside it (padded: 3 -> 4, 5 -> 8), the position equal to the batch at times.
        for rows, pos in [(2, 4), (3, 5), (5, 5), (3, 3), (6, 2), (7, 7), (3, 11)]:
            x = torch.randn(rows, cm.D_MODEL, device="cuda")
            torch.testing.assert_close(compiled(x, pos), model(x, pos), msg=lambda m: f"{rows} rows, pos {pos}: {m}")
