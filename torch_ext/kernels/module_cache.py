"""Compiled CUDA modules of our NVRTC kernels, kept on disk: a new process loads the image NVRTC made
before instead of compiling the source again (tens to hundreds of ms a variant, paid at a program's
first call in a warm process, where the kernel timing that compiles them in a cold one is read from
its cache).

Kept under Inductor's cache directory (TORCHINDUCTOR_CACHE_DIR or its per-user default), so a
process with warm Inductor caches has warm kernels too, and TORCHINDUCTOR_FORCE_DISABLE_CACHES turns
this off as it does Inductor's. The key is the source, the kernel's name, the device's compute
capability, torch's and NVRTC's versions. Each file is framed as the artifact cache's are (its length and
SHA-256 in a header, checked_bytes.py): a damaged file, or one the driver refuses, is compiled again and
replaced, never run. Files are written whole (a temporary
file renamed), so processes sharing the directory never read half of one.
"""
from __future__ import annotations

import hashlib
import logging
import os
import tempfile

import torch

from torch_ext import compat
from torch_ext.checked_bytes import DamagedEntry, pack, unpack

log = logging.getLogger("torch_ext.kernels")

SUBDIR = "torch_ext_cuda_modules"


def compiler():
    """compile(source, name) -> a kernel with `.func` (its CUfunction) for the current device, through
    the disk cache where Inductor's caches are on; None where NVRTC is missing."""
    if not compat.nvrtc_available():
        return None
    return compiled


def compiled(source: str, name: str):
    """The kernel `name` of `source` for the current device: loaded from the disk cache, else compiled
    with NVRTC and saved."""
    path = _path(source, name)
    if path is not None:
        kernel = _load(path)
        if kernel is not None:
            return kernel
    image, lowered = compat.nvrtc_compile(source, name)
    kernel = compat.load_cuda_module(image, lowered)  # raises before a refused image is saved
    if path is not None:
        _save(path, image, lowered)
    return kernel


def _path(source: str, name: str) -> str | None:
    root = compat.inductor_cache_root()
    if root is None:
        return None
    major, minor = torch.cuda.get_device_capability()
    key = hashlib.sha256("\0".join((source, name, f"sm_{major}{minor}", torch.__version__, str(torch.version.cuda),
                                    compat.nvrtc_version())).encode()).hexdigest()
    return os.path.join(root, SUBDIR, f"{key}.bin")


def _load(path: str):
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return None
    except OSError as e:
        log.warning("torch_ext: cannot read the compiled kernel %s (%s); compiling it again", path, e)
        return None
    try:
        lowered, _, image = unpack(data).partition(b"\n")  # the kernel's lowered name, then the image
    except DamagedEntry as e:
        log.warning("torch_ext: the compiled kernel %s is damaged (%s); compiling it again", path, e)
        return None
    try:
        return compat.load_cuda_module(image, lowered.decode())
    except Exception as e:  # the driver refuses it (another driver, a foreign file): compile again
        log.warning("torch_ext: the driver refused the compiled kernel %s (%s: %s); compiling it again", path,
                    type(e).__name__, e)
        return None


def _save(path: str, image: bytes, lowered: str) -> None:
    data = pack(lowered.encode() + b"\n" + image)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    except OSError as e:  # a read-only or full disk costs the next process a compile, nothing else
        log.warning("torch_ext: cannot save the compiled kernel to %s (%s)", path, e)
