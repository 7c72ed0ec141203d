"""`torch_ext.compile`: torch.compile with the torch_ext backend, guard-free dispatch and warm start."""
from __future__ import annotations

import torch

from torch_ext.backend.backend import TorchExtBackend
from torch_ext.backend.dispatch.dispatcher import GuardFreeDispatcher, forward_of
from torch_ext.backend.warm_start import program as warm_program


def compile(model, config=None, *, dynamic: bool | None = None):
    """torch.compile with the torch_ext backend; with config.guard_free_dispatch, a GuardFreeDispatcher."""
    backend = TorchExtBackend(config)
    if backend.config.guard_free_dispatch:
        return GuardFreeDispatcher(model, backend, dynamic=dynamic, debug_dir=backend.config.debug_dump_dir,
                                   warm_start=True)
    compiled = torch.compile(model, backend=backend, dynamic=dynamic)
    func, self_arg = forward_of(model)
    warm = warm_program.for_forward(model, func, self_arg, backend, dynamic) if func is not None else None
    return compiled if warm is None else warm_program.WarmStartModule(model, compiled, warm)
