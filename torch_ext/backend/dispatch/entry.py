"""`torch_ext.compile`: torch.compile with the torch_ext backend, guard-free dispatch and warm start."""
from __future__ import annotations

import inspect
import logging
import threading
import warnings
import weakref

import torch

from torch_ext.backend.backend import TorchExtBackend
from torch_ext.backend.dispatch.dispatcher import GuardFreeDispatcher, forward_of
from torch_ext.backend.warm_start import program as warm_program
from torch_ext.backend.warm_start.module import WarmStartModule

log = logging.getLogger("torch_ext.backend")


class GenerateCallsForwardWarning(UserWarning):
    """generate() was called on torch_ext.compile(model): it calls `model.forward` itself, uncompiled."""


def compile(model, config=None, *, dynamic: bool | None = None):
    """torch.compile with the torch_ext backend; with config.guard_free_dispatch, a GuardFreeDispatcher."""
    backend = _backend_for(model, config)
    if backend.config.guard_free_dispatch:
        compiled = GuardFreeDispatcher(model, backend, dynamic=dynamic, debug_dir=backend.config.debug_dump_dir,
                                       warm_start=True)
    else:
        compiled = torch.compile(model, backend=backend, dynamic=dynamic)
        func, self_arg = forward_of(model)
        warm = warm_program.for_forward(model, func, self_arg, backend, dynamic) if func is not None else None
        if warm is not None:
            compiled = WarmStartModule(model, compiled, warm)
        else:
            _note_backend(compiled, backend)
    owner = getattr(model, "__self__", None)
    if inspect.ismethod(model) and isinstance(owner, torch.nn.Module) and callable(getattr(owner, "generate", None)):
        _no_compile_around(owner)
    if isinstance(model, torch.nn.Module) and callable(getattr(type(model), "generate", None)):
        # Hugging Face's generate() calls self.forward, never this wrapper: say so where it is called.
        object.__setattr__(compiled, "generate", _generate_that_says(model))
    return compiled


def _note_backend(compiled, backend) -> None:
    """torch.compile's result learns its backend (torch_ext.backend.describe reads it)."""
    try:
        object.__setattr__(compiled, "_torch_ext_backend", backend)
    except (AttributeError, TypeError):  # an object that takes no attributes: describe() cannot find it
        pass


# torch_ext.compile calls with the same config object (or none) on modules of one forward share a
# backend: (id(config) or 0, forward's code) -> (config, weakref to the backend).
_backends: dict[tuple[int, object], tuple[object, weakref.ref]] = {}
_backends_lock = threading.Lock()


def _backend_for(model, config) -> TorchExtBackend:
    """One backend for the layers of a model compiled one by one (regional compilation). Dynamo
    guards on the backend object: a backend per call compiled every layer anew and, past
    torch._dynamo.config.recompile_limit (8), ran the remaining layers uncompiled. Shared, they share
    one graph, whose CUDA graphs keep a weight set per layer (runtime/cudagraph/group.py)."""
    func, _ = forward_of(model)
    code = getattr(func, "__code__", None)
    if code is None:
        return TorchExtBackend(config)
    key = (0 if config is None else id(config), code)
    with _backends_lock:
        known = _backends.get(key)
        backend = known[1]() if known is not None and known[0] is config else None
        if backend is None:
            backend = TorchExtBackend(config)
            for stale in [k for k, (_, ref) in _backends.items() if ref() is None]:
                del _backends[stale]
            _backends[key] = (config, weakref.ref(backend))
    return backend


def _no_compile_around(model) -> None:
    """Hugging Face's generate compiles `model.__call__` itself (torch.compile, reduce-overhead) for a
    static cache on a GPU: around a forward torch_ext compiled, that is a second compile of every
    step, with no warm start. Its switch `generation_config.disable_compile` is turned on, said once."""
    config = getattr(model, "generation_config", None)
    if config is None or not hasattr(config, "disable_compile") or config.disable_compile:
        return
    config.disable_compile = True
    name = type(model).__name__
    if getattr(config, "compile_config", None) is not None:
        warnings.warn(f"torch_ext: {name}.generation_config.compile_config is not used: the forward is compiled by "
                      "torch_ext, so generate's own compile is off (generation_config.disable_compile=True)",
                      UserWarning, stacklevel=3)
    else:
        log.info("torch_ext: %s.generate calls the torch_ext-compiled forward; its own compile of __call__ is off "
                 "(generation_config.disable_compile=True)", name)


def _generate_that_says(model):
    said = []

    def generate(*args, **kwargs):
        if not said:
            said.append(True)
            name = type(model).__name__
            warnings.warn(f"torch_ext: compiled({name}).generate() runs {name}.generate, which calls model.forward "
                          "directly: it runs uncompiled. For generate, compile the forward: "
                          "model.forward = torch_ext.compile(model.forward, config)",
                          GenerateCallsForwardWarning, stacklevel=2)
        return model.generate(*args, **kwargs)

    return generate
