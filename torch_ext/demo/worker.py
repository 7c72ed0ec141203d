"""Run a demo step in a new Python process and read its findings: the last stdout line, as JSON.

The demo measures cold and warm starts, which only a fresh process shows honestly (Inductor reads
some of its cache settings once per process), and runs torch 2.9.1 in another venv's interpreter.
"""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

PACKAGE_PARENT = Path(__file__).resolve().parents[2]  # as cwd, `python -m torch_ext...` finds this torch_ext


class WorkerFailed(RuntimeError):
    pass


def run_worker(python: str | os.PathLike, module: str, *args: str, env: dict | None = None,
               timeout: float = 600) -> dict:
    done = subprocess.run([str(python), "-m", module, *args], cwd=PACKAGE_PARENT, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})})
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise WorkerFailed(f"`{Path(python).name} -m {module}` failed: {tail}")
    return json.loads(lines[-1])
