"""Inductor's per-process key of torch's sources, kept in the cache dir for the next process.

Before it loads its first cached artifact, every process has Inductor hash every torch source file
(`torch_key`: 0.25-0.35 s on the 2-core CPU, a quarter of a warm start; each loaded artifact is
checked against it). Its value only changes when those files do, so it is saved under a stamp of
them (path, size and mtime of every file Inductor reads: what Python's bytecode cache checks) and
handed to Inductor in later processes. torch edited, rebuilt or reinstalled in place changes the
stamp, and the key is computed again.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.machinery
import logging
import os

import torch

from torch_ext import compat
from torch_ext.backend.compile.cache import ArtifactStore

log = logging.getLogger(__name__)

STORE = "inductor_keys"  # <cache_dir>/inductor_keys/{artifacts,locks,tmp}
_primed: set[str] = set()  # cache dirs this process has looked in
_remembered: set[str] = set()


@functools.lru_cache(maxsize=1)
def torch_sources_stamp() -> str:
    """A digest of the path, size and mtime of every file Inductor's torch_key reads (a superset:
    the modules of torch's packages, directories with an __init__.py, recursively; its extra files)."""
    root = os.path.dirname(torch.__file__)
    suffixes = tuple(importlib.machinery.all_suffixes())
    h = hashlib.sha256(f"{torch.__version__} {root}\n".encode())

    def walk(directory: str) -> None:
        with os.scandir(directory) as it:
            entries = sorted(it, key=lambda e: e.name)
        for entry in entries:
            if entry.is_dir():
                if os.path.exists(os.path.join(entry.path, "__init__.py")):
                    walk(entry.path)
            elif entry.name.endswith(suffixes):
                st = entry.stat()
                h.update(f"{entry.path} {st.st_size} {st.st_mtime_ns}\n".encode())

    walk(root)
    # Its extra files (they differ between versions): all of aoti_runtime/, and script.ld.
    inductor = os.path.join(root, "_inductor")
    runtime = os.path.join(inductor, "codegen", "aoti_runtime")
    extra = [os.path.join(runtime, n) for n in sorted(os.listdir(runtime))] if os.path.isdir(runtime) else []
    for path in extra + [os.path.join(inductor, "script.ld")]:
        st = os.stat(path) if os.path.isfile(path) else None
        h.update(f"{path} {st and (st.st_size, st.st_mtime_ns)}\n".encode())
    return h.hexdigest()


def _entry_name() -> str:
    return "torch_key-" + torch_sources_stamp()


def prime(cache_dir: str) -> bool:
    """Hand Inductor the torch_key an earlier process saved in cache_dir for these torch sources
    (once per process and cache dir). True if it was taken."""
    if cache_dir in _primed:
        return False
    _primed.add(cache_dir)
    try:
        value = ArtifactStore(cache_dir, STORE).read(_entry_name())
    except OSError as e:
        log.debug("torch_ext: no saved torch_key (%s)", e)
        return False
    if value is None or not compat.prime_torch_key(value):
        return False
    _remembered.add(cache_dir)  # it is there already
    return True


def remember(cache_dir: str) -> None:
    """Save this process's torch_key in cache_dir (once per process and cache dir). Call it after
    Inductor compiled or loaded an artifact: the key is computed by then."""
    if cache_dir in _remembered:
        return
    _remembered.add(cache_dir)
    try:
        store = ArtifactStore(cache_dir, STORE)
        name = _entry_name()
        if not store.has(name):
            store.write(name, compat.torch_key())
    except OSError as e:  # a read-only or full cache dir costs the next process 0.3 s, no more
        log.debug("torch_ext: cannot save torch_key in %s (%s)", cache_dir, e)
