"""The compile cache as a database: warm start in a new process, concurrent writers, a writer
killed mid-write, damaged entries, unsafe directories."""
from __future__ import annotations

import glob
import json
import logging
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from torch_ext.backend.compile.environment import environment_factors

import backend_models as bm
from torch_ext import compat
from torch_ext.backend import CompileConfig, UnsafeCacheDirError, counters, make_backend
from torch_ext.backend.compile import cache as cache_mod
from torch_ext.backend.compile import environment, inductor_keys

WORKER = os.path.join(os.path.dirname(__file__), "backend_worker.py")
# 3 layers -> 3 unique pieces; general + size 4 -> 6 artifacts.
UNIQUE_VARIANTS = 6


def run_worker(cache_dir, *extra, timeout=300):
    out = subprocess.run([sys.executable, WORKER, str(cache_dir), *extra],
                         capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def model_dirs(cache_dir):
    """The pieces' directories, one per model key."""
    return sorted(p for p in glob.glob(os.path.join(str(cache_dir), "*")) if os.path.basename(p) != inductor_keys.STORE)


def artifacts(cache_dir):
    """The pieces' artifacts (not Inductor's saved torch_key: inductor_keys.py)."""
    return sorted(p for d in model_dirs(cache_dir) for p in glob.glob(os.path.join(d, "artifacts", "*.bin")))


def test_pack_unpack_roundtrip_and_damage():
    payload = os.urandom(1000)
    data = cache_mod.pack(payload)
    assert cache_mod.unpack(data) == payload
    flipped = bytearray(data)
    flipped[-10] ^= 0x01
    for damaged, reason in [(data[:-1], "truncated"), (bytes(flipped), "sha256"), (b"junk" + data, "header"),
                            (data[:20], "header")]:
        with pytest.raises(cache_mod.DamagedEntry, match=reason):
            cache_mod.unpack(damaged)


@pytest.mark.slow
def test_second_process_loads_everything_and_compiles_nothing(tmp_path):
    _compile_and_check(tmp_path)  # this process compiles: the worker runs the same model and config
    assert counters.inductor_compiles == counters.cache_misses == UNIQUE_VARIANTS
    assert len(artifacts(tmp_path)) == UNIQUE_VARIANTS

    warm = run_worker(tmp_path)
    assert warm["max_error"] < 1e-5
    assert warm["counters"]["inductor_compiles"] == 0
    assert warm["counters"]["cache_hits"] == UNIQUE_VARIANTS
    assert warm["counters"]["cache_damaged"] == 0
    assert len(model_dirs(tmp_path)) == 1  # one model key for both processes


@pytest.mark.slow
def test_four_processes_compile_into_one_fresh_cache(tmp_path):
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    cache_dir = tmp_path / "cache"
    procs = [subprocess.Popen([sys.executable, WORKER, str(cache_dir), "--barrier", str(barrier), "--parties", "4"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(4)]
    results = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=300)
        assert p.returncode == 0, stderr[-3000:]
        results.append(json.loads(stdout.strip().splitlines()[-1]))
    for r in results:
        assert r["max_error"] < 1e-5
        c = r["counters"]
        assert c["cache_hits"] + c["cache_misses"] == UNIQUE_VARIANTS
        assert c["cache_damaged"] == 0
    # Entry locks: each artifact was compiled by exactly one of the four.
    assert sum(r["counters"]["inductor_compiles"] for r in results) == UNIQUE_VARIANTS
    assert len(artifacts(cache_dir)) == UNIQUE_VARIANTS
    for path in artifacts(cache_dir):
        cache_mod.unpack(open(path, "rb").read())


@pytest.mark.slow
def test_writer_killed_mid_write_leaves_no_entry_and_no_stuck_lock(tmp_path):
    proc = subprocess.Popen([sys.executable, WORKER, str(tmp_path), "--hang-before-commit"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "HANGING", proc.stderr.read()[-3000:]
        (model_dir,) = model_dirs(tmp_path)
        assert os.listdir(os.path.join(model_dir, "tmp"))  # the full artifact bytes, not yet renamed
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    assert artifacts(tmp_path) == []  # nothing half-written under a final name
    (leftover,) = glob.glob(str(tmp_path / "*" / "tmp" / "*"))
    os.utime(leftover, (time.time() - 7200, time.time() - 7200))  # old: its writer is long gone

    _compile_and_check(tmp_path)  # would wait forever on a lock the dead writer still held
    assert not os.path.exists(leftover)  # swept
    assert counters.cache_damaged == 0
    assert counters.inductor_compiles == UNIQUE_VARIANTS
    assert len(artifacts(tmp_path)) == UNIQUE_VARIANTS


def _compile_and_check(cache_dir, sizes=(4, 6)):
    torch._dynamo.reset()
    model = bm.Decoder(layers=3)
    cfg = CompileConfig(splitting_ops=["torch_ext_test::attention"], cache_dir=str(cache_dir), compile_sizes=[4])
    compiled = torch.compile(model, backend=make_backend(cfg))
    eager_caches, compiled_caches = model.caches(), model.caches()
    for i, n in enumerate(sizes):
        x = bm.batch(n, seed=i, dynamic=(i == 0))
        with torch.no_grad():
            torch.testing.assert_close(compiled(x, compiled_caches), model(x, eager_caches), atol=1e-5, rtol=1e-5)


def _truncate(path):
    data = open(path, "rb").read()
    open(path, "wb").write(data[: len(data) // 2])


def _flip_a_bit(path):
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0x10
    open(path, "wb").write(bytes(data))


def _valid_checksum_bad_payload(path):
    open(path, "wb").write(cache_mod.pack(b"not an Inductor artifact"))


@pytest.mark.parametrize("damage", [_truncate, _flip_a_bit, _valid_checksum_bad_payload],
                         ids=["truncated", "bit_flipped", "unloadable"])
def test_damaged_entry_is_reported_and_recompiled(tmp_path, caplog, damage):
    _compile_and_check(tmp_path)
    paths = artifacts(tmp_path)
    assert len(paths) == UNIQUE_VARIANTS
    victim = paths[0]
    damage(victim)

    counters.reset()
    with caplog.at_level(logging.WARNING, logger="torch_ext.backend.compile.cache"):
        _compile_and_check(tmp_path)
    assert counters.cache_damaged == 1
    assert counters.inductor_compiles == 1
    assert counters.cache_hits == UNIQUE_VARIANTS - 1
    assert any("damaged" in r.getMessage() and os.path.basename(victim) in r.getMessage() for r in caplog.records)
    cache_mod.unpack(open(victim, "rb").read())  # rewritten whole
    assert os.path.exists(victim + ".damaged")  # the bad bytes are kept aside for inspection


def test_world_writable_cache_dir_is_refused(tmp_path):
    root = tmp_path / "shared"
    root.mkdir()
    os.chmod(root, 0o777)
    cfg = CompileConfig(cache_dir=str(root))
    with pytest.raises(UnsafeCacheDirError, match=r"writable by all users.*chmod go-w"):
        make_backend(cfg)

    # Loosened after the backend was made: refused before anything is compiled or loaded.
    os.chmod(root, 0o700)
    backend = make_backend(cfg)
    os.chmod(root, 0o777)
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match="writable by all users"):
        torch.compile(torch.nn.Linear(4, 4), backend=backend)(torch.randn(2, 4))
    assert counters.inductor_compiles == 0


def test_group_writable_model_dir_is_refused(tmp_path):
    _compile_and_check(tmp_path, sizes=(4,))
    (model_dir,) = model_dirs(tmp_path)
    os.chmod(model_dir, 0o770)
    counters.reset()
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match="writable by its group"):
        _compile_and_check(tmp_path, sizes=(4,))
    assert counters.cache_hits == 0


def test_cache_off_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    torch._dynamo.reset()
    model = torch.nn.Linear(4, 4)
    torch.compile(model, backend=make_backend(CompileConfig(cache_dir=None)))(torch.randn(2, 4))
    assert counters.inductor_compiles == 1 and counters.cache_misses == 0
    assert not os.path.exists(tmp_path / "xdg")


def test_same_model_and_config_share_a_directory_and_changes_do_not(tmp_path):
    _compile_and_check(tmp_path, sizes=(4,))
    _compile_and_check(tmp_path, sizes=(4,))
    assert len(model_dirs(tmp_path)) == 1
    torch._dynamo.reset()
    cfg = CompileConfig(splitting_ops=["torch_ext_test::attention"], cache_dir=str(tmp_path),
                        inductor_options={"max_autotune_pointwise": False})
    model = bm.Decoder(layers=3)
    with torch.no_grad():
        torch.compile(model, backend=make_backend(cfg))(bm.batch(4, dynamic=True), model.caches())
    assert len(model_dirs(tmp_path)) == 2


def test_model_key_hashes_traced_sources(tmp_path):
    source = tmp_path / "model.py"
    source.write_text("x = 1\n")
    env = {"torch": "2.x"}
    before = cache_mod.model_key("cfg", [str(source)], env)
    assert before == cache_mod.model_key("cfg", [str(source)], env)
    time.sleep(0.01)
    source.write_text("x = 2\n")
    assert cache_mod.model_key("cfg", [str(source)], env) != before
    assert cache_mod.model_key("other", [str(source)], env) != cache_mod.model_key("cfg", [str(source)], env)


def _graph(device: str = "cpu", collective: bool = False) -> torch.fx.GraphModule:
    """A Dynamo-like graph: a placeholder with a fake example value, optionally an all_reduce."""
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    with torch._subclasses.FakeTensorMode():
        x.meta["example_value"] = torch.empty(4, device=device)
    out = graph.call_function(torch.ops._c10d_functional.all_reduce.default, (x, "sum", "0")) if collective else x
    graph.output(out)
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def _key(gm) -> str:
    return cache_mod.model_key("cfg", [], environment_factors(gm))


@pytest.mark.parametrize("change", ["triton", "cuda", "hip", "torch", "cpu isa", "torch_ext artifact format"])
def test_model_key_changes_with_the_software_and_cpu(monkeypatch, change):
    gm = _graph()
    before = _key(gm)
    assert _key(gm) == before  # unchanged: a hit
    if change == "triton":
        monkeypatch.setattr(environment, "_version", lambda package: "9.9.9")
    elif change in ("cuda", "hip"):
        monkeypatch.setattr(torch.version, change, "99.9")
    elif change == "torch":
        monkeypatch.setattr(torch, "__version__", "2.99.0")
    elif change == "torch_ext artifact format":  # what pieces are compiled from changed (environment.py)
        monkeypatch.setattr(environment, "ARTIFACT_FORMAT", environment.ARTIFACT_FORMAT + 1)
    else:
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "OTHER_ISA")
    assert _key(gm) != before


class _Props:
    def __init__(self, name, major, minor):
        self.name, self.major, self.minor = name, major, minor


def test_model_key_changes_with_the_gpu_model_for_gpu_graphs(monkeypatch):
    cpu_graph = _graph()
    assert "gpus" not in environment_factors(cpu_graph)  # a CPU graph does not depend on the GPU
    monkeypatch.setattr(environment, "_devices", lambda gm: {"cuda"})  # as if its inputs were on CUDA
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    gpus = {"H100": _Props("NVIDIA H100", 9, 0), "A100": _Props("NVIDIA A100", 8, 0)}
    current = ["H100"]
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: gpus[current[0]])
    h100 = _key(cpu_graph)
    assert _key(cpu_graph) == h100
    current[0] = "A100"
    assert _key(cpu_graph) != h100


def test_model_key_holds_the_rank_only_for_graphs_with_collectives(monkeypatch):
    rank = [0]
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda: rank[0])
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda: 2)
    with_collective, plain = _graph(collective=True), _graph()
    assert environment.holds_collectives(with_collective) and not environment.holds_collectives(plain)
    keys = {}
    for rank[0] in (0, 1):
        keys[rank[0]] = (_key(with_collective), _key(plain))
    assert keys[0][0] != keys[1][0]  # per rank
    assert keys[0][1] == keys[1][1]  # shared: the same code on every rank


def test_pieces_inductor_cannot_save_run_and_are_said_once(tmp_path, monkeypatch, caplog):
    """torch 2.9.1 cannot save a piece that needs gradients; such pieces run, are kept in memory,
    and the warning comes once, not once per piece."""
    from torch_ext.backend.compile.compiler import InductorCompiler

    def refuse(self, *args, **kwargs):
        raise RuntimeError("no AOTAutograd entry")

    base = torch._inductor.CompiledArtifact
    for cls in (base, *base.__subclasses__()):  # 2.13+: the artifact is a subclass with its own save
        if "save" in cls.__dict__:
            monkeypatch.setattr(cls, "save", refuse)
    monkeypatch.setattr(InductorCompiler, "_said_unsaveable", False)
    with caplog.at_level(logging.WARNING, logger="torch_ext.backend"):
        _compile_and_check(tmp_path)
    said = [r for r in caplog.records if "cannot be saved to the cache" in r.getMessage()]
    assert len(said) == 1 and "no AOTAutograd entry" in said[0].getMessage()
    assert counters.inductor_compiles == UNIQUE_VARIANTS and artifacts(tmp_path) == []


@pytest.mark.slow  # three Inductor compiles of a small graph
@pytest.mark.skipif(not compat.has_inductor_pdl(),
                    reason="this Inductor has no triton.enable_pdl: torch_ext adds no options to decode pieces")
def test_a_piece_compiled_with_other_inductor_options_is_not_loaded(tmp_path, monkeypatch):
    """The options torch_ext picks for a decode piece (PDL, combo kernels, the launch-order pass) are in
    its artifact's name: a process that picks others (another torch_ext, EARLY_LAUNCH off) compiles anew
    instead of loading code compiled with the old ones."""
    import torch

    import torch_ext
    from torch_ext.backend import CompileConfig, counters
    from torch_ext.backend.compile import decode_options
    from torch_ext.backend.rewrite import decode_linear as rewrite

    monkeypatch.setattr(rewrite, "DEVICES", ("cpu",))
    monkeypatch.setattr(decode_options, "_has_cuda", lambda: True)
    monkeypatch.setattr(decode_options, "_gpu_has_pdl", lambda: True)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64)).eval()
    x = torch.randn(1, 64)

    def process():
        torch._dynamo.reset()
        counters.reset()
        config = CompileConfig(cache_dir=str(tmp_path), decode_linear=True, warm_start=False, progress_bar=False)
        with torch.no_grad():
            torch.testing.assert_close(torch_ext.compile(model, config, dynamic=False)(x), model(x))
        return counters.cache_hits, counters.cache_misses

    assert process() == (0, 1)
    assert process() == (1, 0)
    monkeypatch.setattr(decode_options, "EARLY_LAUNCH", False)
    assert process() == (0, 1)
