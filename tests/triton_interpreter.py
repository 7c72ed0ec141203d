"""Kernel checks under Triton's CPU interpreter: TRITON_INTERPRET=1 must be set before Triton loads,
so the check runs in a subprocess and prints "WORST <error>" when every case passed."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest


def run_in_interpreter(code: str) -> None:
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    if done.returncode and "only 0-dimensional arrays can be converted to Python scalars" in done.stderr:
        # Triton 3.5/3.6's interpreter hands a kernel's int arguments over as 1-element arrays, which
        # the NumPy here refuses as a loop bound; such kernels run on the GPU machine's tests.
        pytest.skip("this Triton's CPU interpreter cannot run a loop over an int argument with this NumPy")
    assert done.returncode == 0 and "WORST" in done.stdout, done.stdout[-2000:] + done.stderr[-4000:]
