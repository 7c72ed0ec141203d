"""The on-disk artifact cache, kept like a database.

Layout: <cache_dir>/<model key>/{artifacts,locks,tmp}/. The model key hashes the config, the
environment (torch, Python, Triton, CUDA versions, CPU ISA, GPU models, the rank where the graph
holds collectives) and the source of every file Dynamo traced for the graph; an artifact
is named by the fingerprint of its piece and variant.

* Writes are atomic: a private temp file in tmp/, fsync, then os.replace onto the final name.
* Every read checks a header holding the payload's length and sha256; a damaged or truncated
  entry is reported (logging WARNING), moved aside and treated as missing, so it is recompiled.
* Processes compiling into one directory take a per-entry file lock (released by the kernel if
  the holder dies), so each entry is compiled once and readers never see half a file.
* Artifacts are code this process will import; a cache directory that other users can write to
  (or that another user owns) is refused with UnsafeCacheDirError.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import stat
import tempfile
import time

import filelock

from torch_ext.backend.counters import counters
from torch_ext.checked_bytes import DamagedEntry, pack, unpack  # noqa: F401 (the entries' framing)

log = logging.getLogger(__name__)

_LOCK_WAIT_LOG_S = 10.0
_STALE_TEMP_S = 3600.0


class UnsafeCacheDirError(PermissionError):
    pass


def ensure_private_dir(path: str) -> None:
    """Create path (mode 0700) if needed; refuse it if anyone but us could write there."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    st = os.stat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeCacheDirError(f"torch_ext cache path {path} is not a directory. Set CompileConfig.cache_dir "
                                  "to a directory, or None to turn the cache off.")
    if st.st_mode & (stat.S_IWOTH | stat.S_IWGRP):
        who = "all users" if st.st_mode & stat.S_IWOTH else "its group"
        raise UnsafeCacheDirError(
            f"torch_ext refuses cache directory {path}: it is writable by {who} "
            f"(mode {stat.S_IMODE(st.st_mode):o}), and cached artifacts are code this process runs. "
            f"Fix: `chmod go-w {path}`, or set CompileConfig.cache_dir to a private directory.")
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        raise UnsafeCacheDirError(
            f"torch_ext refuses cache directory {path}: it belongs to uid {st.st_uid}, not to you "
            f"(uid {os.getuid()}), and cached artifacts are code this process runs. "
            "Set CompileConfig.cache_dir to a directory you own.")


def model_key(config_hash: str, traced_files: list[str], environment: dict[str, str]) -> str:
    """Directory key: config, the environment (versions, hardware, rank: backend/compile/environment.py),
    and the source of the files Dynamo traced."""
    h = hashlib.sha256()
    h.update(f"config={config_hash}\n".encode())
    for name, value in sorted(environment.items()):
        h.update(f"{name}={value}\n".encode())
    for path in sorted(set(traced_files)):
        h.update(f"file={path} {_file_digest(path)}\n".encode())
    return h.hexdigest()[:32]


def _file_digest(path: str) -> str:
    try:
        st = os.stat(path)
    except OSError:
        return "missing"  # e.g. <string> code: nothing to hash
    return _file_digest_cached(path, st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=4096)
def _file_digest_cached(path: str, mtime_ns: int, size: int) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


class ArtifactStore:
    """Artifacts of one model key: read/write/lock entries by name."""

    def __init__(self, root: str, key: str):
        ensure_private_dir(root)
        self.key = key
        self.directory = os.path.join(root, key)
        ensure_private_dir(self.directory)
        for sub in ("artifacts", "locks", "tmp"):
            ensure_private_dir(os.path.join(self.directory, sub))
        self._sweep_stale_temp_files()

    def _sweep_stale_temp_files(self) -> None:
        """Remove temp files of writers that died mid-write (old enough that no writer owns them)."""
        tmp = os.path.join(self.directory, "tmp")
        cutoff = time.time() - _STALE_TEMP_S
        for entry in os.scandir(tmp):
            try:
                if entry.stat().st_mtime < cutoff:
                    os.unlink(entry.path)
            except FileNotFoundError:
                pass

    def path(self, name: str) -> str:
        return os.path.join(self.directory, "artifacts", name + ".bin")

    def has(self, name: str) -> bool:
        return os.path.exists(self.path(name))

    @contextlib.contextmanager
    def lock(self, name: str):
        """Hold the entry's inter-process lock; says so when another process holds it long."""
        lock = filelock.FileLock(os.path.join(self.directory, "locks", name + ".lock"))
        try:
            lock.acquire(timeout=_LOCK_WAIT_LOG_S)
        except filelock.Timeout:
            log.info("torch_ext cache: waiting for another process to finish %s", self.path(name))
            lock.acquire()
        try:
            yield
        finally:
            lock.release()

    def read(self, name: str) -> bytes | None:
        """The entry's payload, or None if absent or damaged (damage is reported and moved aside)."""
        path = self.path(name)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return None
        try:
            return unpack(data)
        except DamagedEntry as e:
            self.discard(name, str(e))
            return None

    def discard(self, name: str, reason: str) -> None:
        path = self.path(name)
        counters.cache_damaged += 1
        log.warning("torch_ext cache: entry %s is damaged (%s); it is set aside and recompiled", path, reason)
        try:
            os.replace(path, path + ".damaged")
        except FileNotFoundError:
            pass

    def write(self, name: str, payload: bytes) -> None:
        fd, tmp = tempfile.mkstemp(dir=os.path.join(self.directory, "tmp"), prefix=name[:16] + ".")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(pack(payload))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path(name))
        except BaseException:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise
        _fsync_dir(os.path.join(self.directory, "artifacts"))


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
