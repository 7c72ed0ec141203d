"""`install()` / `uninstall()`: swap Dynamo's VariableTrackers for the wrap-like HOPs with ours.

Dynamo picks a HOP's VT by name from one module-level table (and falls back to a module global for
BaseHOPs without an entry). install() rebinds those entries; uninstall() puts back exactly what was
there, absent entries included. Code Dynamo already compiled is not re-traced: install before
compiling, or call torch._dynamo.reset().
"""
from __future__ import annotations

import contextlib
import threading

from torch_ext import compat

_MISSING = object()
_lock = threading.Lock()
_saved: dict | None = None  # HOP name -> what the table held before install (or _MISSING)
_saved_base_hop = None


def is_installed() -> bool:
    return _saved is not None


def install() -> None:
    """Trace wrap, checkpoint, nested_compile_region (invoke_subgraph) and BaseHOP bodies with wrap
    semantics. Idempotent."""
    global _saved, _saved_base_hop
    from torch_ext.variables import BASE_HOP_VARIABLE, HOP_VARIABLES

    with _lock:
        if _saved is not None:
            return
        table = compat.hop_variable_registry()
        module = compat.hop_variables_module()
        _saved = {name: table.get(name, _MISSING) for name in HOP_VARIABLES}
        _saved_base_hop = module.BaseHOPVariable
        table.update(HOP_VARIABLES)
        module.BaseHOPVariable = BASE_HOP_VARIABLE


def uninstall() -> None:
    """Restore torch's own VTs exactly. A no-op when not installed."""
    global _saved, _saved_base_hop
    with _lock:
        if _saved is None:
            return
        table = compat.hop_variable_registry()
        for name, previous in _saved.items():
            if previous is _MISSING:
                table.pop(name, None)
            else:
                table[name] = previous
        compat.hop_variables_module().BaseHOPVariable = _saved_base_hop
        _saved, _saved_base_hop = None, None


@contextlib.contextmanager
def installed():
    """`with torch_ext.installed(): ...` — installed inside, previous state restored after."""
    was_installed = is_installed()
    install()
    try:
        yield
    finally:
        if not was_installed:
            uninstall()
