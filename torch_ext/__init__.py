"""torch_ext: wrap-semantics HOP tracing for torch.compile, and a piecewise Inductor backend.

Importing torch_ext patches nothing; `install()` does, and `uninstall()` undoes it exactly.
"""
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
]


def __getattr__(name):
    # The backend pulls in Inductor; load it only when asked for.
    if name in ("CompileConfig", "backend"):
        from torch_ext import backend as _backend_pkg

        return getattr(_backend_pkg, "CompileConfig" if name == "CompileConfig" else "make_backend")
    if name == "compile":  # torch.compile with the torch_ext backend (guard-free dispatch if configured)
        from torch_ext.backend.dispatch import compile

        return compile
    raise AttributeError(f"module 'torch_ext' has no attribute {name!r}")
