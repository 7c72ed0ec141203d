import os
import sys
import zlib
from pathlib import Path

import pytest
import torch
import torch._dynamo

import torch_ext

# This project's snapshots live in expected/ at the repository root, not beside each test file (the
# default for users), and CI's newest torch writes the shared files (torch_ext/snapshots.py).
if not os.environ.get("TORCH_EXT_SNAPSHOT_DIR") and not os.environ.get("TORCH_EXT_EXPECTED_DIR"):
    os.environ["TORCH_EXT_SNAPSHOT_DIR"] = str(Path(__file__).resolve().parent.parent / "expected")
os.environ.setdefault("TORCH_EXT_SNAPSHOT_PRIMARY", "2.15")


def pytest_collection_modifyitems(config, items):
    """TORCH_EXT_TEST_SHARD=K/N keeps the K-th of N shards (1-based), by a stable hash of each test's id,
    plus every test marked `every_version`. The Makefile gives each torch between the newest and the
    oldest one shard, so each test still runs on one of them and CI stays inside its time limit."""
    shard = os.environ.get("TORCH_EXT_TEST_SHARD")
    if not shard:
        return
    try:
        k, n = (int(part) for part in shard.split("/"))
    except ValueError:
        k = n = 0
    if not 1 <= k <= n:
        raise pytest.UsageError(f"TORCH_EXT_TEST_SHARD={shard!r}: expected K/N with 1 <= K <= N, e.g. 2/3")
    kept, dropped = [], []
    for item in items:
        in_shard = zlib.crc32(item.nodeid.encode()) % n == k - 1
        (kept if in_shard or item.get_closest_marker("every_version") else dropped).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Every test starts and ends with fresh Dynamo state and torch_ext uninstalled, and with the
    backend's counters at zero (when a test has loaded the backend)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    entry = sys.modules.get("torch_ext.backend.dispatch.entry")
    if entry is not None:  # torch_ext.compile's shared backends: each test compiles afresh
        entry._backends.clear()
    backend_counters = sys.modules.get("torch_ext.backend.counters")
    if backend_counters is not None:
        backend_counters.counters.reset()
    yield
    torch_ext.uninstall()
    torch._dynamo.reset()


@pytest.fixture
def installed():
    torch_ext.install()
    yield
    torch_ext.uninstall()
