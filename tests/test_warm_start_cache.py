"""Warm-start entries are kept like the rest of the cache (tests/test_backend_cache.py): processes
starting together trace and save once, a writer killed mid-write leaves no entry and no stuck lock."""
from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from torch_ext import compat
from torch_ext.backend.compile import cache as cache_mod
from torch_ext.backend.warm_start import program as warm_start

WORKER = os.path.join(os.path.dirname(__file__), "warm_worker.py")
pytestmark = pytest.mark.skipif(not compat.HAS_AOT_COMPILE, reason="this torch has no AOT compile: no warm start")


def entries(cache_dir):
    return sorted(glob.glob(os.path.join(str(cache_dir), warm_start.STORE, "artifacts", "*.bin")))


def finish(proc) -> dict:
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-3000:]
    return json.loads(stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_three_processes_starting_together_trace_and_save_once(tmp_path):
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    cache_dir = tmp_path / "cache"
    procs = [subprocess.Popen([sys.executable, WORKER, str(cache_dir), "--fx-pieces", "--barrier", str(barrier),
                               "--parties", "3"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(3)]
    results = [finish(p) for p in procs]
    for r in results:
        assert r["max_error"] < 1e-5
        assert r["counters"]["warm_start_fallbacks"] == 0
    saves = [r["counters"]["warm_start_saves"] for r in results]
    loads = [r["counters"]["warm_start_loads"] for r in results]
    assert sorted(saves) == [0, 0, 1] and sorted(loads) == [0, 1, 1]  # the entry lock: one traces, two load
    assert results[0]["outputs"] == results[1]["outputs"] == results[2]["outputs"]
    (entry,) = entries(cache_dir)
    cache_mod.unpack(open(entry, "rb").read())


@pytest.mark.slow
def test_writer_killed_mid_write_leaves_no_entry_and_no_stuck_lock(tmp_path):
    proc = subprocess.Popen([sys.executable, WORKER, str(tmp_path), "--fx-pieces", "--hang-before-commit"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "HANGING", proc.stderr.read()[-3000:]
        assert os.listdir(os.path.join(str(tmp_path), warm_start.STORE, "tmp"))  # the bytes, not yet renamed
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    assert entries(tmp_path) == []  # nothing half-written under a final name
    (leftover,) = glob.glob(os.path.join(str(tmp_path), warm_start.STORE, "tmp", "*"))
    os.utime(leftover, (time.time() - 7200, time.time() - 7200))  # old: its writer is long gone

    after = finish(subprocess.Popen([sys.executable, WORKER, str(tmp_path), "--fx-pieces"],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    # It would wait forever on a lock the dead writer still held; it traces and saves instead.
    assert after["counters"]["warm_start_saves"] == 1 and after["counters"]["cache_damaged"] == 0
    assert after["max_error"] < 1e-5
    assert not os.path.exists(leftover)  # swept
    (entry,) = entries(tmp_path)
    cache_mod.unpack(open(entry, "rb").read())
    again = finish(subprocess.Popen([sys.executable, WORKER, str(tmp_path), "--fx-pieces"],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    assert again["counters"]["warm_start_loads"] == 1
