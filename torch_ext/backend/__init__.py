"""The torch_ext piecewise Inductor backend.

    torch.compile(model, backend="torch_ext")                       # default CompileConfig
    torch.compile(model, backend=torch_ext.backend(CompileConfig(splitting_ops=["mylib::attention"])))

Stages, each a subpackage whose docstring says what it owns and may import; data flows one way:
Dynamo graph -> rewrite/ -> split/ -> compile/ (with passes/) -> runtime/ (pieces, CUDA graphs). backend.py
(the Dynamo backend) drives them; warm_start/ and dispatch/ stand on top. config, counters and
dump sit below every stage. The layering is a contract CI checks (.importlinter).
"""
from __future__ import annotations

import sys

from torch_ext.backend.backend import TorchExtBackend
from torch_ext.backend.compile.cache import UnsafeCacheDirError
from torch_ext.backend.compile.compiler import Variant, current_compile_variant
from torch_ext.backend.config import CompileConfig, ConfigError
from torch_ext.backend.torch_compile_modes import from_torch_compile
from torch_ext.backend.counters import counters
from torch_ext.backend.split.splitter import SplitError

__all__ = [
    "CompileConfig",
    "ConfigError",
    "SplitError",
    "TorchExtBackend",
    "UnsafeCacheDirError",
    "Variant",
    "counters",
    "current_compile_variant",
    "describe",
    "make_backend",
    "torch_ext_backend",
]


def describe(compiled) -> list[dict]:
    """What the graphs behind `compiled` (torch_ext.compile's result, or a TorchExtBackend) are: pieces,
    their torch_ext ops and Inductor options, merged projections, the CUDA-graph plan (runtime/summary.py)."""
    backend = compiled if isinstance(compiled, TorchExtBackend) else getattr(compiled, "_torch_ext_backend", None)
    if backend is None:  # GuardFreeDispatcher
        backend = getattr(compiled, "backend", None)
    if backend is None and getattr(compiled, "warm", None) is not None:  # WarmStartModule
        backend = compiled.warm.backend
    if not isinstance(backend, TorchExtBackend):
        raise TypeError(f"torch_ext.backend.describe: {compiled!r} is not compiled by torch_ext.compile")
    return backend.describe()


def make_backend(config: CompileConfig | None = None) -> TorchExtBackend:
    """A Dynamo backend compiling with `config` (the default CompileConfig when None)."""
    return TorchExtBackend(config)


_backends: dict[str, TorchExtBackend] = {}  # by torch.compile mode and options


def torch_ext_backend(gm, example_inputs, *, mode: str | None = None, options: dict | None = None):
    """`backend="torch_ext"`: the backend with the default CompileConfig, shared by all its uses;
    torch.compile's `mode` and `options` pick another (torch_compile_modes.from_torch_compile)."""
    key = repr((mode, sorted((options or {}).items())))
    backend = _backends.get(key)
    if backend is None:
        backend = _backends.setdefault(key, TorchExtBackend(from_torch_compile(mode, options)))
    return backend(gm, example_inputs)


class _CallableModule(type(sys)):
    """`torch_ext.backend(cfg)` is `make_backend(cfg)`, also once this package is imported and
    `torch_ext.backend` names the package itself."""

    def __call__(self, config: CompileConfig | None = None) -> TorchExtBackend:
        return make_backend(config)


sys.modules[__name__].__class__ = _CallableModule
