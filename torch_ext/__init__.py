"""torch_ext: wrap-semantics HOP tracing for torch.compile, and a piecewise Inductor backend.

Importing torch_ext patches nothing; `install()` does, and `uninstall()` undoes it exactly.
"""
import importlib

from torch_ext import config
from torch_ext.install import install, installed, is_installed, uninstall

__all__ = [
    "config",
    "install",
    "uninstall",
    "installed",
    "is_installed",
    "CompileConfig",
    "backend",
    "compile",
    "wait_compiled",
]


def __getattr__(name):
    # The backend pulls in Inductor; load it only when asked for. import_module, not
    # `from torch_ext import backend`, whose attribute lookup would land here again.
    if name in ("CompileConfig", "backend"):
        backend_pkg = importlib.import_module("torch_ext.backend")  # callable, like make_backend
        return backend_pkg if name == "backend" else backend_pkg.CompileConfig
    if name == "compile":  # torch.compile with the torch_ext backend (guard-free dispatch if configured)
        from torch_ext.backend.dispatch.entry import compile

        return compile
    if name == "wait_compiled":  # programs CompileConfig.background_compile compiles on its thread
        from torch_ext.backend.warm_start.background import wait_compiled

        return wait_compiled
    raise AttributeError(f"module 'torch_ext' has no attribute {name!r}")
