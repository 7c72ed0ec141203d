"""`python -m torch_ext demo [--part NAME ...]`: what torch_ext adds, each part a short before/after.

Parts run in the order of PARTS; each can run alone. This module imports no part, so `--help`
lists them without compiling anything.
"""
from __future__ import annotations

import importlib
import time

# name -> (module with a `run()`, what the part shows)
PARTS = {
    "beyond": ("torch_ext.demo.beyond_torch", "regions torch refuses, compiled with torch_ext.install()"),
    "torch29": ("torch_ext.demo.torch29", "a region returning a dataclass on torch 2.9.1 (.venv-torch2.9.1)"),
    "backend": ("torch_ext.demo.piecewise_backend",
                "in-place attention layers: plain Inductor, then the torch_ext backend cold/warm"),
}


def main(parts: list[str] | None = None) -> int:
    import torch

    chosen = [name for name in PARTS if not parts or name in parts]
    cuda = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    print(f"torch_ext demo: torch {torch.__version__}, {cuda}; parts: {', '.join(chosen)}")
    start = time.perf_counter()
    for name in chosen:
        importlib.import_module(PARTS[name][0]).run()
    print(f"\ndemo done in {time.perf_counter() - start:.0f} s")
    return 0
