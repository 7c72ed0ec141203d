"""Triton's cache dir pinned under Inductor's before the backend compiles or loads (compat.pin_triton_cache_dir):
a cold process whose Inductor kernels all come from compile workers would otherwise build Triton's
launchers (and compile our own Triton kernels) into ~/.triton/cache, and the warm process, looking under
Inductor's dir, would build them all again at its first calls."""
from __future__ import annotations

import os

import torch

import torch_ext
from torch_ext import compat
from torch_ext.backend import CompileConfig


def test_unset_it_becomes_inductors_triton_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("TRITON_CACHE_DIR", "recorded")  # so that the test's end puts back what was there
    monkeypatch.delenv("TRITON_CACHE_DIR")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    assert compat.pin_triton_cache_dir(1) == os.path.join(str(tmp_path), "triton", "1")
    assert os.environ["TRITON_CACHE_DIR"] == os.path.join(str(tmp_path), "triton", "1")
    # Inductor's own autotuners read it from here on: the same dir
    from torch._inductor.runtime.cache_dir_utils import triton_cache_dir

    assert triton_cache_dir(0) == os.environ["TRITON_CACHE_DIR"]


def test_a_users_own_dir_is_kept(monkeypatch, tmp_path):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "mine"))
    assert compat.pin_triton_cache_dir(0) == str(tmp_path / "mine")
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "mine")


def test_the_backend_pins_it_before_it_compiles_where_there_is_a_gpu(monkeypatch):
    calls = []
    from torch_ext.backend import backend

    monkeypatch.setattr(compat, "pin_triton_cache_dir", lambda device: calls.append(device))
    monkeypatch.setattr(backend, "_gpu_device", lambda: 0)  # as on a GPU machine (the model stays on the CPU)
    model = torch.nn.Linear(4, 4)
    compiled = torch_ext.compile(model, CompileConfig(warm_start=False, progress_bar=False))
    x = torch.randn(2, 4)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x))
    assert calls and set(calls) == {0}


def test_it_is_pinned_before_the_rewrites_tune_kernels_also_on_the_warm_start_path(monkeypatch, tmp_path):
    """Warm start saves the rewritten graph: rewrite() (whose kernel tuning compiles our Triton kernels)
    runs before _compile. Pinned only in _compile, the cold process put those kernels in ~/.triton/cache
    and the first warm process compiled them again at its first call (1.5-2 s on an H200)."""
    order = []
    from torch_ext.backend import backend

    monkeypatch.setattr(compat, "pin_triton_cache_dir", lambda device: order.append("pin"))
    monkeypatch.setattr(compat, "pin_triton_ptxas", lambda: order.append("ptxas"))
    monkeypatch.setattr(backend, "_gpu_device", lambda: 0)
    real_rewrites = backend.decode_rewrites

    def rewrites(*args, **kwargs):
        order.append("rewrites")
        return real_rewrites(*args, **kwargs)

    monkeypatch.setattr(backend, "decode_rewrites", rewrites)
    model = torch.nn.Linear(4, 4)
    compiled = torch_ext.compile(model, CompileConfig(cache_dir=str(tmp_path / "cache"), progress_bar=False))
    x = torch.randn(2, 4)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x))
    assert "rewrites" in order and order[:2] == ["pin", "ptxas"], order


def test_ptxas_is_the_one_inductor_compiles_with(monkeypatch, tmp_path):
    """Triton's cache key holds the ptxas version: a warm process must compile with the ptxas a cold one
    had (Inductor points TRITON_PTXAS_PATH at torch's own before compiling in the process)."""
    from torch._inductor.runtime import compile_tasks

    monkeypatch.setenv("TRITON_PTXAS_PATH", "recorded")
    monkeypatch.delenv("TRITON_PTXAS_PATH")
    fake_torch = tmp_path / "torch"
    (fake_torch / "_inductor" / "runtime").mkdir(parents=True)
    places = []
    for where in (fake_torch / "bin", fake_torch / "_inductor" / "bin"):  # 2.13 looks in the second
        where.mkdir(exist_ok=True)
        ptxas = where / "ptxas"
        ptxas.write_text("#!/bin/sh\n")
        ptxas.chmod(0o755)
        places.append(str(ptxas))
    monkeypatch.setattr(compile_tasks, "__file__", str(fake_torch / "_inductor" / "runtime" / "compile_tasks.py"))
    compile_tasks._set_triton_ptxas_path.cache_clear()
    try:
        assert compat.pin_triton_ptxas() in places
        monkeypatch.setenv("TRITON_PTXAS_PATH", "/mine/ptxas")  # a user's own is kept
        compile_tasks._set_triton_ptxas_path.cache_clear()
        assert compat.pin_triton_ptxas() == "/mine/ptxas"
    finally:
        compile_tasks._set_triton_ptxas_path.cache_clear()
