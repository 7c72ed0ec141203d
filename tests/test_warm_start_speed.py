"""What makes a warm start fast, and stays correct: the Dynamo graph saved with example values only
where pieces meet (warm_graph.dump_graph; restored before Inductor compiles a piece of it), and
Inductor's key of torch's sources saved for the next process (inductor_keys.py)."""
from __future__ import annotations

import glob
import os

import pytest
import torch
import torch.fx as fx

import backend_models as bm
from torch_ext import compat
from torch_ext.backend.compile import example_values, inductor_keys
from torch_ext.backend.warm_start import saved_graph as warm_graph
from torch_ext.backend.split.matcher import SplittingOpMatcher
from test_warm_start import aot_only, run_worker


def _values(gm: fx.GraphModule) -> dict[str, object]:
    return {n.name: n.meta.get("example_value", n.meta.get("val")) for n in gm.graph.nodes}


def _dynamo_graph(model, *args) -> fx.GraphModule:
    graphs = []

    def grab(gm, example_inputs):
        graphs.append(gm)
        return gm

    torch._dynamo.reset()
    torch.compile(model, backend=grab, fullgraph=True)(*args)
    return graphs[0]


@aot_only  # the graph is saved only with AOT compile (2.9.1's GraphPickler cannot load it back)
def test_saved_graph_keeps_values_where_pieces_meet_and_restores_the_rest():
    model = bm.Decoder(layers=3)
    x = bm.batch(4, dynamic=True)
    with torch.no_grad():
        gm = _dynamo_graph(model, x, model.caches())
    matcher = SplittingOpMatcher(("torch_ext_test::attention",))
    before = _values(gm)
    loaded = warm_graph.load_graph(warm_graph.dump_graph(gm, lambda n: matcher.match(n) is not None))
    assert _values(gm).keys() == before.keys() and all(_values(gm)[k] is v for k, v in before.items())  # untouched

    after = _values(loaded)
    dropped = [n for n in loaded.graph.nodes if after[n.name] is None and before[n.name] is not None]
    computed = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method")
                and isinstance(before[n.name], torch.Tensor)]
    assert len(dropped) >= len(computed) // 3, (len(dropped), len(computed))  # values inside pieces go
    for node in loaded.graph.nodes:
        crosses = any(matcher.match(u) or u.op == "output" for u in node.users) or matcher.match(node)
        if node.op == "placeholder" or crosses:
            assert after[node.name] is not None, node.format_node()

    assert all(n.meta.get(example_values.VALUE_DROPPED) for n in dropped)
    example_values.restore_example_values(loaded)
    assert not any(example_values.VALUE_DROPPED in n.meta for n in loaded.graph.nodes)
    restored = _values(loaded)
    for node in dropped:
        value, original = restored[node.name], before[node.name]
        assert isinstance(value, torch.Tensor), node.format_node()
        assert (value.dtype, value.dim(), str(value.shape)) == (original.dtype, original.dim(), str(original.shape))


def test_restore_leaves_graphs_that_were_not_loaded_alone():
    model = bm.Decoder(layers=1)
    with torch.no_grad():
        gm = _dynamo_graph(model, bm.batch(4, dynamic=True), model.caches())
    node = next(n for n in gm.graph.nodes if n.op == "call_function" and "example_value" in n.meta)
    node.meta.pop("example_value")  # a value Dynamo did not record: nothing to restore, nothing run
    example_values.restore_example_values(gm)
    assert "example_value" not in node.meta and "val" not in node.meta


def test_torch_sources_stamp_follows_module_files(tmp_path, monkeypatch):
    package = tmp_path / "torch"
    (package / "sub").mkdir(parents=True)
    (package / "notpkg").mkdir()
    for path in ("__init__.py", "a.py", "sub/__init__.py", "sub/b.py", "notpkg/c.py", "README.txt"):
        (package / path).write_text("x = 1\n")
    monkeypatch.setattr(torch, "__file__", str(package / "__init__.py"))

    def stamp():
        inductor_keys.torch_sources_stamp.cache_clear()
        return inductor_keys.torch_sources_stamp()

    first = stamp()
    assert stamp() == first
    (package / "README.txt").write_text("not a module\n")
    (package / "notpkg" / "c.py").write_text("not in a package\n")  # Inductor's hash skips it too
    assert stamp() == first
    (package / "sub" / "b.py").write_text("x = 22\n")
    assert stamp() != first
    changed = stamp()
    os.utime(package / "a.py", ns=(1, 1))  # same size, other mtime
    assert stamp() != changed
    inductor_keys.torch_sources_stamp.cache_clear()


@pytest.mark.slow
@aot_only
def test_new_process_takes_the_saved_torch_key_and_compiles_from_the_saved_graph(tmp_path):
    cold = run_worker(tmp_path, "--sizes", "4,6", "--compile-sizes", "9")
    assert cold["hashed_torch_sources"]
    saved = glob.glob(os.path.join(str(tmp_path), inductor_keys.STORE, "artifacts", "torch_key-*.bin"))
    assert len(saved) == 1

    # Batch 9 was never compiled: the warm-started process compiles it from the loaded graph,
    # whose values inside pieces were dropped and are restored for Inductor.
    warm = run_worker(tmp_path, "--sizes", "4,6,9", "--compile-sizes", "9")
    assert warm["counters"]["warm_start_loads"] == 1 and warm["dynamo_frames"].get("total", 0) == 0
    assert warm["counters"]["inductor_compiles"] >= 1 and warm["max_error"] < 1e-5
    assert not warm["hashed_torch_sources"]

    # Another torch (its sources' stamp differs): the saved key is not taken.
    os.replace(saved[0], saved[0].replace("torch_key-", "torch_key-0"))
    again = run_worker(tmp_path, "--sizes", "4,6,9", "--compile-sizes", "9")
    assert again["hashed_torch_sources"] and again["max_error"] < 1e-5


def test_prime_is_refused_once_the_process_has_its_key(tmp_path):
    compat.torch_key()  # computed here
    assert not compat.prime_torch_key(b"another key")
    assert compat.torch_key() != b"another key"


class WritesAView(torch.nn.Module):
    def forward(self, x, cache):
        rows = cache[: x.shape[0]].view(-1)  # a view of a view: the first one's value is dropped
        rows.copy_((x * 2).view(-1))
        return x + 1


@aot_only
def test_saved_graph_still_shows_which_inputs_are_written_through_views():
    from torch_ext.backend.split.graph_writes import written_placeholders

    x = torch.randn(4, 8)
    torch._dynamo.mark_dynamic(x, 0)
    gm = _dynamo_graph(WritesAView(), x, torch.zeros(16, 8))
    loaded = warm_graph.load_graph(warm_graph.dump_graph(gm, lambda n: False))
    assert any(v is None for v in _values(loaded).values())  # something was dropped
    written = written_placeholders(loaded)
    assert written.keys() == written_placeholders(gm).keys() and written  # the cache, through its views
