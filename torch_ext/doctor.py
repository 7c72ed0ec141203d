"""`python -m torch_ext doctor`: the facts a bug report needs, one aligned line each.

Versions (torch_ext, torch and whether CI tests it, triton, Python, the helper packages), CUDA,
the backend's cache directory (where it is, why there, its size, whether the backend would use
it), whether install() is active, and the environment variables that change compiling.

`install()` patches the process that calls it: to see it active, call `print(report())` from
your own program after installing.
"""
from __future__ import annotations

import importlib.metadata
import os
import platform
import stat
import sys
from pathlib import Path

import torch
from torch._inductor.runtime.cache_dir_utils import cache_dir as inductor_cache_dir

import torch_ext
from torch_ext import compat
from torch_ext.backend.compile.cache import UnsafeCacheDirError, ensure_private_dir
from torch_ext.backend.config import default_cache_dir

ENV_PREFIXES = ("TORCH_EXT_", "TORCHINDUCTOR_", "TORCHDYNAMO_", "TORCH_COMPILE", "TORCH_LOGS", "XDG_CACHE_HOME",
                "CUDA_VISIBLE_DEVICES", "TRITON_")
# Importing torch._dynamo sets it to Inductor's default, so it cannot tell whether the user set it;
# its value is the "Inductor cache" line.
ENV_SET_BY_TORCH = ("TORCHINDUCTOR_CACHE_DIR",)


def package_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def torch_line() -> str:
    release = torch.__version__.split("+")[0]
    tested = ", ".join(compat.TESTED_TORCH_VERSIONS)
    if release in compat.TESTED_TORCH_VERSIONS:
        return f"{torch.__version__} (tested; CI runs {tested})"
    return f"{torch.__version__} (NOT a tested version; CI runs {tested})"


def cuda_line() -> str:
    built = f"torch built with CUDA {torch.version.cuda}" if torch.version.cuda else "torch built without CUDA"
    if getattr(torch.version, "hip", None):
        built = f"torch built with ROCm {torch.version.hip}"
    if not torch.cuda.is_available():
        return f"not available; {built}"
    devices = []
    for i in range(torch.cuda.device_count()):
        major, minor = torch.cuda.get_device_capability(i)
        devices.append(f"{i}: {torch.cuda.get_device_name(i)} (sm_{major}{minor})")
    return f"{len(devices)} device(s), {built}; " + "; ".join(devices)


def cache_dir_source() -> str:
    if os.environ.get("TORCH_EXT_CACHE_DIR"):
        return "from $TORCH_EXT_CACHE_DIR"
    return "from $XDG_CACHE_HOME" if os.environ.get("XDG_CACHE_HOME") else "the default"


def cache_lines(path: str) -> list[tuple[str, str]]:
    """Where the backend's default cache is and whether it could use it; creates nothing."""
    rows = [("cache dir", f"{path}  ({cache_dir_source()}; CompileConfig.cache_dir overrides it)")]
    if not os.path.exists(path):
        parent = next((p for p in Path(path).parents if p.exists()), Path("/"))
        can = "can" if os.access(parent, os.W_OK) else "CANNOT"
        rows.append(("", f"does not exist yet; the first compile {can} create it (under {parent})"))
        return rows
    size, files = _tree_size(path)
    models = sum(1 for entry in os.scandir(path) if entry.is_dir()) if os.path.isdir(path) else 0
    st = os.stat(path)
    owner = "you" if not hasattr(os, "getuid") or st.st_uid == os.getuid() else f"uid {st.st_uid}"
    writable = "writable" if os.access(path, os.W_OK) else "NOT writable"
    rows.append(("", f"{size / 2**20:.1f} MiB in {files} files, {models} model dirs; mode "
                     f"{stat.S_IMODE(st.st_mode):o}, owner {owner}, {writable}"))
    try:
        ensure_private_dir(path)  # the backend's own check (path exists: it creates nothing)
        rows.append(("", "the backend will use it"))
    except UnsafeCacheDirError as e:
        rows.append(("", f"the backend REFUSES it: {e}"))
    return rows


def _tree_size(path: str) -> tuple[int, int]:
    size = files = 0
    for root, _, names in os.walk(path):
        for name in names:
            try:
                size += os.lstat(os.path.join(root, name)).st_size
                files += 1
            except OSError:  # removed while we walk (another process's temp file)
                pass
    return size, files


def _inductor_cache_line() -> str:
    path = inductor_cache_dir()
    if not os.path.isdir(path):
        return f"{path} (does not exist yet)"
    size, files = _tree_size(path)
    return f"{path}  ({size / 2**20:.1f} MiB in {files} files)"


def facts() -> list[tuple[str, str]]:
    location = Path(torch_ext.__file__).resolve().parent
    env = [f"{k}={v}" for k, v in sorted(os.environ.items())
           if k.startswith(ENV_PREFIXES) and k not in ENV_SET_BY_TORCH]
    installed = "active in this process" if torch_ext.is_installed() else \
        "not active in this process (it patches the process that calls it)"
    return [
        ("torch_ext", f"{package_version('torch_ext')} at {location}"),
        ("torch", torch_line()),
        ("triton", package_version("triton")),
        ("python", f"{platform.python_version()} ({platform.python_implementation()}) {sys.executable}"),
        ("platform", f"{platform.platform()}, {os.cpu_count()} CPUs"),
        ("CUDA", cuda_line()),
        *cache_lines(default_cache_dir()),
        ("Inductor cache", _inductor_cache_line()),
        ("install()", installed),
        *((name, package_version(name)) for name in ("depyf", "expecttest", "tqdm", "filelock")),
        ("env", "; ".join(env) if env else "(no TORCH_EXT_/TORCHINDUCTOR_/... variables set)"),
    ]


def report() -> str:
    rows = facts()
    width = max(len(label) for label, _ in rows)
    return "\n".join(f"{label:<{width}}  {value}" for label, value in rows)


def main() -> int:
    print(report())
    return 0
