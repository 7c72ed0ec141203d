"""`install()` / `uninstall()`: swap Dynamo's VariableTrackers for the wrap-like HOPs with ours.

Dynamo picks a HOP's VT by name from one module-level table (and falls back to a module global for
BaseHOPs without an entry). install() rebinds those entries; uninstall() puts back exactly what was
there, absent entries included. For `local_map`, install() also maps torch's
`_local_map_wrapped` to our VT in VariableBuilder's id table (torch 2.9.1 has no hook of its own),
and uninstall() removes it again. Code Dynamo already compiled is not re-traced: install before
compiling, or call torch._dynamo.reset().
"""
from __future__ import annotations

import contextlib
import functools
import threading

from torch_ext import compat

_MISSING = object()
_lock = threading.Lock()
_saved: dict | None = None  # HOP name -> what the table held before install (or _MISSING)
_saved_base_hop = None
_saved_id_dispatch: dict | None = None  # id(obj) -> what VariableBuilder's id table held (or _MISSING)
_workarounds_undo: list | None = None  # what workarounds.apply() replaced


def is_installed() -> bool:
    return _saved is not None


def install() -> None:
    """Trace wrap, checkpoint, nested_compile_region (invoke_subgraph), local_map and BaseHOP bodies
    with wrap semantics. Idempotent."""
    global _saved, _saved_base_hop, _saved_id_dispatch, _workarounds_undo
    from torch_ext import workarounds
    from torch_ext.variables import BASE_HOP_VARIABLE, HOP_VARIABLES
    from torch_ext.variables.base import BASE_HOP, remember_torch_vts
    from torch_ext.variables.local_map import builder_id_dispatch_entries

    with _lock:
        if _saved is not None:
            return
        _warn_once_if_untested()
        table = compat.hop_variable_registry()
        module = compat.hop_variables_module()
        _saved = {name: table.get(name, _MISSING) for name in HOP_VARIABLES}
        _saved_base_hop = module.BaseHOPVariable
        # torch's own VTs trace first; ours take over where they refuse (variables/base.py).
        remember_torch_vts({**{k: v for k, v in _saved.items() if v is not _MISSING}, BASE_HOP: _saved_base_hop})
        table.update(HOP_VARIABLES)
        module.BaseHOPVariable = BASE_HOP_VARIABLE
        id_table = compat.builder_id_dispatch()
        entries = {id(obj): handler for obj, handler in builder_id_dispatch_entries().items()}
        _saved_id_dispatch = {key: id_table.get(key, _MISSING) for key in entries}
        id_table.update(entries)
        _workarounds_undo = workarounds.apply()


@functools.lru_cache(maxsize=None)
def _warn_once_if_untested() -> None:
    compat.warn_if_untested()


def uninstall() -> None:
    """Restore torch's own VTs exactly. A no-op when not installed."""
    global _saved, _saved_base_hop, _saved_id_dispatch, _workarounds_undo
    from torch_ext import workarounds
    from torch_ext.variables.base import remember_torch_vts

    with _lock:
        if _saved is None:
            return
        remember_torch_vts({})
        workarounds.restore(_workarounds_undo or [])
        table = compat.hop_variable_registry()
        for name, previous in _saved.items():
            if previous is _MISSING:
                table.pop(name, None)
            else:
                table[name] = previous
        compat.hop_variables_module().BaseHOPVariable = _saved_base_hop
        id_table = compat.builder_id_dispatch()
        for key, previous in (_saved_id_dispatch or {}).items():
            if previous is _MISSING:
                id_table.pop(key, None)
            else:
                id_table[key] = previous
        _saved, _saved_base_hop, _saved_id_dispatch, _workarounds_undo = None, None, None, None


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
