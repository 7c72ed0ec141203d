import pytest
import torch
import torch._dynamo

import torch_ext


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Every test starts and ends with fresh Dynamo state and torch_ext uninstalled."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    yield
    torch_ext.uninstall()
    torch._dynamo.reset()


@pytest.fixture
def installed():
    torch_ext.install()
    yield
    torch_ext.uninstall()
