"""Warm start (torch_ext/backend/warm_start/): a new process runs the saved program without Dynamo,
matches eager and the cold compile; calls the program was not traced for go through Dynamo; the
entries are kept like the rest of the cache (atomic, checked, locked); the key changes with what
changes the trace."""
from __future__ import annotations

import contextlib
import glob
import importlib
import json
import logging
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

import backend_models as bm
import torch_ext
from torch_ext import compat
from torch_ext.backend import CompileConfig, ConfigError, counters, make_backend
from torch_ext.backend.compile import cache as cache_mod
from torch_ext.backend.compile import environment
from torch_ext.backend.warm_start import key as warm_key
from torch_ext.backend.warm_start import program as warm_start
from torch_ext.backend.warm_start.module import WarmStartModule

WORKER = os.path.join(os.path.dirname(__file__), "warm_worker.py")
aot_only = pytest.mark.skipif(not compat.HAS_AOT_COMPILE, reason="this torch has no AOT compile: no warm start")


# Models at module level: a class defined inside a function cannot be saved (guards name its type).
class Shift(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x, n: int):
        return self.lin(x) * n


class Breaks(nn.Module):
    """A graph break: AOT compile needs one graph."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        y = self.lin(x)
        torch._dynamo.graph_break()
        return y.relu()


@pytest.fixture
def fx_pieces(monkeypatch):
    """Pieces run as FX graphs: what is tested here is around them (they are then not cached on disk)."""
    from torch_ext.backend.compile.compiler import InductorCompiler

    monkeypatch.setattr(InductorCompiler, "compile", lambda self, gm, example_inputs, variant, name="": gm)
    monkeypatch.setattr(InductorCompiler, "serialize", staticmethod(lambda artifact: None))


def run_worker(cache_dir, *extra, timeout=300):
    out = subprocess.run([sys.executable, WORKER, str(cache_dir), *extra], capture_output=True, text=True,
                         timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def entries(cache_dir):
    return sorted(glob.glob(os.path.join(str(cache_dir), warm_start.STORE, "artifacts", "*.bin")))


def config(cache_dir, **kwargs) -> CompileConfig:
    return CompileConfig(splitting_ops=["torch_ext_test::attention"], cache_dir=str(cache_dir), progress_bar=False,
                         **kwargs)


def new_process(model, cfg):
    """What a new process does, in this one: fresh Dynamo, a fresh backend (its own piece memo)."""
    torch._dynamo.reset()
    return torch_ext.compile(model, cfg)


def calls(compiled, model, sizes=(4, 6, 1), dtype=torch.float32):
    """Run compiled and eager at these batch sizes (the first marked dynamic); return the outputs."""
    eager_caches = [c.to(dtype) for c in model.caches()]
    compiled_caches = [c.clone() for c in eager_caches]
    outs = []
    for i, n in enumerate(sizes):
        x = bm.batch(n, seed=i, dynamic=(i == 0)).to(dtype)
        if i == 0:
            torch._dynamo.mark_dynamic(x, 0)
        with torch.no_grad():
            out = compiled(x, compiled_caches)
            torch.testing.assert_close(out, model(x, eager_caches), atol=1e-5, rtol=1e-5)
        outs.append(out.clone())
    for a, e in zip(compiled_caches, eager_caches):
        torch.testing.assert_close(a, e, atol=1e-5, rtol=1e-5)
    return outs


@pytest.mark.slow
@aot_only
def test_new_process_runs_the_saved_program_without_tracing(tmp_path):
    cold = run_worker(tmp_path, "--sizes", "4,6,9")
    assert cold["max_error"] < 1e-5
    assert cold["counters"]["warm_start_saves"] == 1 and cold["counters"]["inductor_compiles"] == 3
    assert len(entries(tmp_path)) == 1

    warm = run_worker(tmp_path, "--sizes", "4,6,9")
    assert warm["max_error"] < 1e-5
    c = warm["counters"]
    assert c["warm_start_loads"] == 1 and c["warm_start_saves"] == 0 and c["warm_start_fallbacks"] == 0
    assert c["inductor_compiles"] == 0 and c["cache_hits"] == 3
    assert warm["dynamo_frames"].get("total", 0) == 0  # Dynamo never saw a frame
    assert warm["outputs"] == cold["outputs"]  # the same kernels: bit for bit

    # Without warm start the same worker goes through Dynamo (so the frame count above can fail).
    plain = run_worker(tmp_path, "--sizes", "4,6,9", "--no-warm")
    assert plain["dynamo_frames"].get("total", 0) > 0 and plain["counters"]["warm_start_loads"] == 0


@pytest.mark.slow
@aot_only
def test_guard_free_dispatch_arms_the_loaded_program(tmp_path):
    cold = run_worker(tmp_path, "--guard-free", "--fx-pieces", "--sizes", "4,6,1,9")
    warm = run_worker(tmp_path, "--guard-free", "--fx-pieces", "--sizes", "4,6,1,9")
    assert cold["max_error"] < 1e-5 and warm["max_error"] < 1e-5
    assert warm["counters"]["warm_start_loads"] == 1 and warm["dynamo_frames"].get("total", 0) == 0
    assert warm["outputs"] == cold["outputs"]


@aot_only
def test_a_call_the_static_program_refuses_gets_a_dynamic_program_saved_for_the_next_process(tmp_path, fx_pieces,
                                                                                              caplog):
    """As Dynamo's automatic dynamic: the first call of a kind is traced with static sizes, a call with
    other sizes gets the kind's dynamic entry (traced once, saved); the next process loads both."""
    model = bm.Decoder(layers=2)
    cfg = config(tmp_path)
    x = bm.batch(4, seed=0)  # not marked: Dynamo specializes the batch size to 4
    with torch.no_grad():
        cold = new_process(model, cfg)(x, model.caches())
    assert counters.warm_start_saves == 1

    compiled = new_process(model, cfg)
    with caplog.at_level(logging.INFO, logger="torch_ext.backend.warm_start"), torch.no_grad():
        torch.testing.assert_close(compiled(x, model.caches()), cold, rtol=0, atol=0)
        assert counters.warm_start_loads == 1 and counters.graphs_seen == 2  # cold + loaded, no trace
        for n in (6, 7):  # other sizes: the saved guards refuse them; the dynamic program takes both
            y = bm.batch(n, seed=n)
            torch.testing.assert_close(compiled(y, model.caches()), model(y, model.caches()))
    assert counters.warm_start_saves == 2 and counters.warm_start_fallbacks == 0
    assert len(entries(tmp_path)) == 2
    said = [r.getMessage() for r in caplog.records if "was not traced for" in r.getMessage()]
    assert len(said) == 1 and "L['x']" in said[0], said  # one line, saying which argument

    compiled = new_process(model, cfg)
    with torch.no_grad():
        for n in (4, 9, 6):
            y = bm.batch(n, seed=n)
            torch.testing.assert_close(compiled(y, model.caches()), model(y, model.caches()))
    assert counters.warm_start_loads == 3 and counters.warm_start_saves == 2 and counters.warm_start_fallbacks == 0


@aot_only
def test_with_dynamic_false_a_call_the_program_was_not_traced_for_goes_through_dynamo(tmp_path, fx_pieces, caplog):
    model = bm.Decoder(layers=2)
    cfg = config(tmp_path)
    x = bm.batch(4, seed=0)
    with torch.no_grad():
        torch._dynamo.reset()
        torch_ext.compile(model, cfg, dynamic=False)(x, model.caches())
        torch._dynamo.reset()
        compiled = torch_ext.compile(model, cfg, dynamic=False)
        compiled(x, model.caches())
        with caplog.at_level(logging.INFO, logger="torch_ext.backend.warm_start"):
            for n in (6, 7):
                y = bm.batch(n, seed=n)
                torch.testing.assert_close(compiled(y, model.caches()), model(y, model.caches()))
    assert counters.warm_start_loads == 1 and counters.warm_start_saves == 1
    assert counters.warm_start_fallbacks == 2 and counters.graphs_seen == 4  # Dynamo traced 6 and 7
    said = [r.getMessage() for r in caplog.records if "goes through torch.compile" in r.getMessage()]
    assert len(said) == 1, said


@aot_only
def test_a_call_that_found_no_program_does_not_compute_the_key_again(tmp_path, fx_pieces, monkeypatch):
    """Serving keeps calling at a shape no saved program takes (Dynamo's batch-1 graph): the entry key
    (the model's digest: milliseconds on a large model) is computed at the first such call only."""
    model = bm.Decoder(layers=2)
    compiled = torch_ext.compile(model, config(tmp_path), dynamic=False)
    keys = []
    entry_key = warm_start.WarmStart.entry_key
    monkeypatch.setattr(warm_start.WarmStart, "entry_key", lambda *a: keys.append(1) or entry_key(*a))
    with torch.no_grad():
        compiled(bm.batch(4, seed=0), model.caches())
        first = len(keys)
        for _ in range(5):
            y = bm.batch(6, seed=6)
            torch.testing.assert_close(compiled(y, model.caches()), model(y, model.caches()))
    assert counters.warm_start_fallbacks == 5
    assert len(keys) == first + 1, keys  # the batch-6 call's key, once


@aot_only
def test_first_call_other_dtype_or_mode_never_runs_the_saved_program(tmp_path, fx_pieces):
    model = bm.Decoder(layers=2)
    cfg = config(tmp_path)
    calls(new_process(model, cfg), model, sizes=(4,))
    # Another dtype (a key of its own), then grad mode on: traced and saved anew, never loaded.
    calls(new_process(model.double(), cfg), model, sizes=(4,), dtype=torch.float64)
    assert counters.warm_start_loads == 0 and counters.warm_start_saves == 2
    model.float()
    x = bm.batch(4, seed=0)
    torch.testing.assert_close(new_process(model, cfg)(x, model.caches()), model(x, model.caches()))
    assert counters.warm_start_loads == 0 and counters.warm_start_saves == 3
    assert len(entries(tmp_path)) == 3


@aot_only
@pytest.mark.parametrize("grad", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["inference", "training"])
def test_int_argument_specialized_by_dynamo_is_guarded(tmp_path, fx_pieces, grad):
    """Training: the dynamic program's backward saves x, which AOTAutograd marks dynamic; the program
    puts its marks back (else the third process, which calls with this x, found no entry for it)."""
    with torch.set_grad_enabled(grad):
        _int_argument_calls(tmp_path)


def _int_argument_calls(tmp_path):
    model, x = Shift(), torch.randn(4, 8)
    cfg = CompileConfig(cache_dir=str(tmp_path), progress_bar=False)
    new_process(model, cfg)(x, 2)
    compiled = new_process(model, cfg)
    torch.testing.assert_close(compiled(x, 2), model(x, 2))
    torch.testing.assert_close(compiled(x, 3), model(x, 3))  # not the program traced for n=2: n symbolic
    assert counters.warm_start_loads == 1 and counters.warm_start_saves == 2 and counters.warm_start_fallbacks == 0
    torch.testing.assert_close(new_process(model, cfg)(x, 5), model(x, 5))  # the dynamic program, loaded
    assert counters.warm_start_loads == 3 and counters.warm_start_saves == 2 and counters.warm_start_fallbacks == 0


def _damage_truncate(path):
    data = open(path, "rb").read()
    open(path, "wb").write(data[: len(data) // 2])


def _damage_flip(path):
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0x10
    open(path, "wb").write(bytes(data))


def _damage_unloadable(path):
    import pickle

    entry = pickle.loads(cache_mod.unpack(open(path, "rb").read()))
    entry["aot"] = entry["aot"][:100]  # checksum valid, torch cannot load it
    open(path, "wb").write(cache_mod.pack(pickle.dumps(entry)))


@aot_only
@pytest.mark.parametrize("damage", [_damage_truncate, _damage_flip, _damage_unloadable],
                         ids=["truncated", "bit_flipped", "unloadable"])
def test_damaged_entry_is_reported_set_aside_and_traced_again(tmp_path, fx_pieces, caplog, damage):
    model = bm.Decoder(layers=2)
    cfg = config(tmp_path)
    calls(new_process(model, cfg), model, sizes=(4, 6))
    (path,) = entries(tmp_path)
    damage(path)
    counters.reset()
    with caplog.at_level(logging.WARNING, logger="torch_ext.backend.compile.cache"):
        calls(new_process(model, cfg), model, sizes=(4, 6))
    assert counters.cache_damaged == 1 and counters.warm_start_loads == 0 and counters.warm_start_saves == 1
    assert any("damaged" in r.getMessage() and os.path.basename(path) in r.getMessage() for r in caplog.records)
    assert os.path.exists(path + ".damaged")
    cache_mod.unpack(open(path, "rb").read())  # rewritten whole
    counters.reset()
    calls(new_process(model, cfg), model, sizes=(4, 6))
    assert counters.warm_start_loads == 1


@aot_only
def test_traced_source_change_invalidates(tmp_path, fx_pieces, caplog, monkeypatch):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "warm_helper.py").write_text("def act(x):\n    return x * 2\n")
    (package / "warm_model.py").write_text(
        "import torch\nimport warm_helper\n\n"
        "class M(torch.nn.Module):\n"
        "    def __init__(self):\n        super().__init__()\n        self.lin = torch.nn.Linear(8, 8)\n\n"
        "    def forward(self, x):\n        return warm_helper.act(self.lin(x))\n")
    monkeypatch.syspath_prepend(str(package))
    import warm_helper
    import warm_model

    model, x = warm_model.M(), torch.randn(4, 8)
    cfg = CompileConfig(cache_dir=str(tmp_path / "cache"), progress_bar=False)
    new_process(model, cfg)(x)
    (package / "warm_helper.py").write_text("def act(x):\n    return x * 3\n")  # a file Dynamo traced
    importlib.reload(warm_helper)
    with caplog.at_level(logging.INFO, logger="torch_ext.backend.warm_start"):
        torch.testing.assert_close(new_process(model, cfg)(x), model.lin(x) * 3)
    assert counters.warm_start_loads == 0 and counters.warm_start_saves == 2
    assert any("warm_helper.py changed" in r.getMessage() for r in caplog.records)
    torch.testing.assert_close(new_process(model, cfg)(x), model.lin(x) * 3)
    assert counters.warm_start_loads == 1


@aot_only
@pytest.mark.parametrize("change", ["torch version", "triton", "backend config", "dynamo config", "model structure",
                                    "model attribute", "training", "dtype", "dim marking", "grad mode", "torch_ext source"])
def test_entry_key_changes_with_what_changes_the_trace(tmp_path, monkeypatch, change):
    model = bm.Decoder(layers=2)
    cfg = config(tmp_path)
    compiled = torch_ext.compile(model, cfg)
    x = bm.batch(4)
    key = lambda: compiled.warm.entry_key((x, model.caches()), {}, None)[0]  # noqa: E731
    with torch.no_grad(), contextlib.ExitStack() as stack:
        before = key()
        assert key() == before
        if change == "torch version":
            monkeypatch.setattr(torch, "__version__", "2.99.0")
        elif change == "triton":
            monkeypatch.setattr(environment, "_version", lambda package: "9.9.9")
        elif change == "backend config":
            compiled.warm.backend.config = config(tmp_path, inductor_options={"max_autotune_pointwise": False})
        elif change == "dynamo config":
            stack.enter_context(torch._dynamo.config.patch(assume_static_by_default=False))
        elif change == "model structure":
            model.layers.append(bm.Layer())
        elif change == "model attribute":
            model.layers[0].kind = "fn"
        elif change == "training":
            model.eval()
        elif change == "dtype":
            x = x.double()
        elif change == "dim marking":
            torch._dynamo.mark_dynamic(x, 0)
        elif change == "torch_ext source":
            monkeypatch.setattr(warm_key, "package_digest", lambda: "edited")
        if change == "grad mode":
            with torch.enable_grad():
                assert key() != before
        else:
            assert key() != before


@aot_only
@pytest.mark.parametrize("why", ["asked for", "internal error"])
def test_a_warm_start_that_cannot_apply_is_a_warning_when_asked_for_or_not_dynamos_refusal(tmp_path, fx_pieces,
                                                                                           caplog, monkeypatch, why):
    model, x = (Breaks(), torch.randn(4, 8)) if why == "asked for" else (nn.Linear(8, 8), torch.randn(4, 8))
    cfg = CompileConfig(cache_dir=str(tmp_path), progress_bar=False, warm_start=True if why == "asked for" else None)
    if why == "internal error":  # what a torch release that moved an internal looks like
        monkeypatch.setattr(compat, "aot_compile", lambda *a, **k: __import__("torch._dynamo.no_such_module"))
    with caplog.at_level(logging.INFO, logger="torch_ext.backend.warm_start"):
        torch.testing.assert_close(new_process(model, cfg)(x), model(x))
    said = [r for r in caplog.records if "cannot trace it for a warm start" in r.getMessage()]
    assert [r.levelname for r in said] == ["WARNING"], [r.getMessage() for r in said]


@aot_only
def test_a_forward_that_cannot_be_saved_goes_through_torch_compile_and_is_not_retraced(tmp_path, fx_pieces,
                                                                                      caplog, monkeypatch):
    model, x = Breaks(), torch.randn(4, 8)
    cfg = CompileConfig(cache_dir=str(tmp_path), progress_bar=False)
    with caplog.at_level(logging.INFO, logger="torch_ext.backend.warm_start"):
        torch.testing.assert_close(new_process(model, cfg)(x), model(x))
    said = [r for r in caplog.records if "cannot trace it for a warm start" in r.getMessage()]
    assert [r.levelname for r in said] == ["INFO"]  # on by default (warm_start=None): a graph break is no fault
    traced = []
    monkeypatch.setattr(compat, "aot_compile", lambda *a, **k: traced.append(1))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="torch_ext.backend.warm_start"):
        torch.testing.assert_close(new_process(model, cfg)(x), model(x))
    assert traced == []  # the refusal is remembered: no second attempt
    assert sum("could not be saved" in r.getMessage() for r in caplog.records) == 1


def test_warm_start_off_or_unavailable(tmp_path, caplog):
    model = nn.Linear(4, 4)
    off = torch_ext.compile(model, CompileConfig(cache_dir=str(tmp_path), warm_start=False))
    assert isinstance(off, torch._dynamo.eval_frame.OptimizedModule)
    off(torch.randn(2, 4))
    assert not os.path.exists(tmp_path / warm_start.STORE)
    with pytest.raises(ConfigError, match="warm_start"):
        CompileConfig(cache_dir=None, warm_start=True)
    on = CompileConfig(cache_dir=str(tmp_path), warm_start=True)
    with caplog.at_level(logging.WARNING):
        torch.compile(model, backend=make_backend(on))(torch.randn(2, 4))  # torch.compile: said once
        compiled = torch_ext.compile(model, on)
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "warm_start applies to torch_ext.compile" in said
    if compat.HAS_AOT_COMPILE:
        assert isinstance(compiled, WarmStartModule)
    else:  # torch 2.9.1: the normal path, and a line saying so
        assert isinstance(compiled, torch._dynamo.eval_frame.OptimizedModule)
        assert "has no AOT compile" in said


@aot_only
def test_an_entry_that_does_not_load_is_traced_once_more_then_refused(tmp_path, fx_pieces, monkeypatch):
    model = bm.Decoder(layers=2)
    cfg = config(tmp_path)
    calls(new_process(model, cfg), model, sizes=(4, 6))

    def cannot_load(*args, **kwargs):
        raise RuntimeError("torch cannot load it")

    monkeypatch.setattr(compat, "aot_deserialize", cannot_load)
    calls(new_process(model, cfg), model, sizes=(4, 6))  # set aside, traced and saved once more
    assert counters.warm_start_saves == 2 and counters.cache_damaged == 1
    calls(new_process(model, cfg), model, sizes=(4, 6))  # the second failure: refused, through torch.compile
    traced = []
    monkeypatch.setattr(compat, "aot_compile", lambda *a, **k: traced.append(1))
    calls(new_process(model, cfg), model, sizes=(4, 6))
    assert traced == [] and counters.warm_start_saves == 2 and counters.warm_start_loads == 0


@aot_only
def test_transformers_model_warm_starts(tmp_path, fx_pieces):
    """A decorated forward (its closure holds the undecorated one) returning a ModelOutput."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2)).eval()
    cfg = CompileConfig(splitting_ops=["aten::scaled_dot_product_attention"], cache_dir=str(tmp_path),
                        progress_bar=False)
    ids = torch.randint(0, 128, (2, 16))
    with torch.no_grad():
        expected = model(input_ids=ids, use_cache=False).logits
        cold = new_process(model, cfg)(input_ids=ids, use_cache=False).logits
        warm = new_process(model, cfg)(input_ids=ids, use_cache=False).logits
    assert counters.warm_start_saves == 1 and counters.warm_start_loads == 1
    assert counters.warm_start_fallbacks == 0
    torch.testing.assert_close(cold, expected)
    torch.testing.assert_close(warm, cold, rtol=0, atol=0)


@pytest.mark.slow
@aot_only
def test_a_forward_whose_floats_dynamo_specializes_on_a_restart_warm_starts(tmp_path):
    """A tanh-GELU head reads the global float math.pi, which Dynamo leaves unspecialized under
    dynamic=True: the backend asks Dynamo to trace again with it specialized, and the value guard on
    math.pi names an import alias. Both used to send every call through torch.compile (HF GPT-2)."""
    cold = run_worker(tmp_path, "--gelu", "--dynamic", "--fx-pieces")
    assert cold["max_error"] < 1e-5 and cold["counters"]["warm_start_saves"] == 1
    warm = run_worker(tmp_path, "--gelu", "--dynamic", "--fx-pieces")
    assert warm["max_error"] < 1e-5
    assert warm["counters"]["warm_start_loads"] == 1 and warm["counters"]["warm_start_fallbacks"] == 0
    assert warm["outputs"] == cold["outputs"]


@aot_only
def test_a_ranged_dynamic_dim_loads_the_saved_program(tmp_path, fx_pieces):
    """mark_dynamic(x, 0, min=, max=): torch 2.15 keeps the range on the tensor and guards it by value;
    the saved program's guards get the range back (compat.DIM_MARKING_ATTRS), so it takes the call."""
    model = bm.Decoder(layers=2)
    cfg = config(tmp_path)
    for process in range(2):
        compiled = new_process(model, cfg)
        for n in (4, 6):
            x = bm.batch(n, seed=n)
            torch._dynamo.mark_dynamic(x, 0, min=2, max=64)
            with torch.no_grad():
                torch.testing.assert_close(compiled(x, model.caches()), model(x, model.caches()))
    assert counters.warm_start_saves == 1 and counters.warm_start_loads == 1
    assert counters.warm_start_fallbacks == 0


@aot_only
def test_the_dynamic_entry_makes_dynamic_only_the_dims_that_changed(tmp_path, fx_pieces):
    """A call its static entry refuses (another batch) gets a dynamic entry traced with the dims that
    differ from the static entry's call dynamic, as Dynamo's automatic dynamic: with every dim dynamic
    (head counts, cache length) CUDA graphs could not pad its graph, and each step ran without one."""
    import cudagraph_models as cm
    from torch_ext.backend.runtime.cudagraph.stats import cudagraph_stats

    cudagraph_stats.reset()
    model = cm.BatchCacheDecoder(layers=2)
    cfg = CompileConfig(splitting_ops=cm.SPLITTING_OPS, cache_dir=str(tmp_path), cudagraph_mode="full",
                        cudagraph_capture_sizes=(2, 4, 8), progress_bar=False)
    compiled = torch_ext.compile(model, cfg)
    compiled.warm.backend.cudagraphs = cm.SimulatedCudaGraphs(cfg)
    with torch.no_grad():
        for n in (4, 2, 8):
            ek, ev = model.caches_for(n, max_pos=12)  # a length no other dim has: it would stay symbolic
            ck, cv = [t.clone() for t in ek], [t.clone() for t in ev]
            for _ in range(3):
                x = torch.randn(n, cm.D_MODEL)
                torch.testing.assert_close(compiled(x, ck, cv, 3), model(x, ek, ev, 3), atol=1e-5, rtol=1e-5)
    assert counters.warm_start_saves == 2 and counters.warm_start_fallbacks == 0
    runners = compiled.warm.backend.cudagraphs.runners()
    assert len(runners) == 2 and all(r.capturable for r in runners), [r.reason for r in runners]
    assert {2, 8} <= cudagraph_stats.sizes  # the dynamic program's graphs
    assert all(not hasattr(t, "_dynamo_weak_dynamic_indices") for t in ck + cv)  # the user's tensors as they were


SCALE = 2.0  # read by Scaled.forward: Dynamo guards on its value


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x) * SCALE


@aot_only
def test_a_global_changed_since_the_trace_does_not_run_the_saved_program(tmp_path, fx_pieces, monkeypatch):
    """Dynamo's guards on globals are not saved with the program; the values they checked are, so a
    global set otherwise (another process's environment, a flag flipped between calls) goes through
    torch.compile, which traces with its value, instead of running code traced with the old one."""
    model = Scaled().eval()
    x = torch.randn(3, 8)
    with torch.no_grad():
        compiled = new_process(model, config(tmp_path))
        torch.testing.assert_close(compiled(x), model(x))
        monkeypatch.setattr(sys.modules[__name__], "SCALE", 3.0)
        torch.testing.assert_close(compiled(x), model(x))  # this process, after the change
        loads = counters.warm_start_loads
        torch.testing.assert_close(new_process(model, config(tmp_path))(x), model(x))  # the next process
        assert counters.warm_start_loads > loads  # found, refused by the value: torch.compile ran it
        monkeypatch.setattr(sys.modules[__name__], "SCALE", 2.0)
        torch.testing.assert_close(new_process(model, config(tmp_path))(x), model(x))  # the saved one again
