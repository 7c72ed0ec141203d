"""Patch a module's attribute now if the module is imported, else right after its first import.

install() wraps a function of a module that is costly to import (Inductor's compile_fx: 0.8 s on a
2-core CPU); a process that never compiles with Inductor, or compiles on another thread, should not
pay that import where install() runs. Python has no post-import hook, so a one-shot meta-path finder
wraps the module's loader: the patch lands as the module finishes executing, before any importer can
take the name from it.
"""
from __future__ import annotations

import importlib
import importlib.abc
import inspect
import sys
import threading
from typing import Callable

_lock = threading.Lock()


def patch_when_imported(module_name: str, attribute: str, wrap: Callable) -> Callable[[], None]:
    """setattr(module, attribute, wrap(original)) now or at the module's first import; returns the undo
    (puts the original back, or drops the waiting patch)."""
    state = {"original": None, "module": None}

    def apply(module):
        with _lock:
            if state["module"] is None:
                state["original"] = inspect.getattr_static(module, attribute)
                setattr(module, attribute, wrap(getattr(module, attribute)))
                state["module"] = module

    # A module in sys.modules may still be executing in another thread: import_module waits for it.
    finder = _PatchingFinder(module_name, apply)
    if module_name in sys.modules:
        apply(importlib.import_module(module_name))
    else:
        sys.meta_path.insert(0, finder)
        if module_name in sys.modules:  # imported by another thread meanwhile, before the finder was in
            finder.remove()
            apply(importlib.import_module(module_name))
        # Left open: a thread whose import had found the module's spec, but not yet entered it in
        # sys.modules, as the finder went in. The backend applies the workarounds' Inductor options to
        # each graph it compiles itself (workarounds.inductor_patches), whatever compile_fx is.

    def undo():
        finder.remove()
        with _lock:
            if state["module"] is not None:
                setattr(state["module"], attribute, state["original"])
                state["module"] = None

    return undo


class _PatchingFinder(importlib.abc.MetaPathFinder):
    """Finds `name` with the finders after it, and runs `after(module)` once the module has executed."""

    def __init__(self, name: str, after: Callable):
        self.name, self.after = name, after

    def remove(self) -> None:
        try:
            sys.meta_path.remove(self)
        except ValueError:
            pass

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        for finder in list(sys.meta_path):
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _PatchingLoader(spec.loader, self)
                return spec
        return None


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, inner, finder: _PatchingFinder):
        self._inner, self._finder = inner, finder

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        self._inner.exec_module(module)
        self._finder.remove()  # one-shot: here, not in find_spec (importlib is iterating sys.meta_path)
        self._finder.after(module)

    def __getattr__(self, name):  # get_source, get_filename, ...: the real loader's
        return getattr(self._inner, name)
