import sys

import pytest
import torch
import torch._dynamo

import torch_ext


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Every test starts and ends with fresh Dynamo state and torch_ext uninstalled, and with the
    backend's counters at zero (when a test has loaded the backend)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
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
