"""Programmatic dependent launch (PDL, Hopper+) for torch_ext's Triton kernels; imports Triton at its
top, so the ops' modules import it only where a kernel runs.

A kernel launched with PDL may start while the kernel before it in the stream still runs. Ours call
`wait_then_release` before reading anything an earlier kernel may have written (the decode-linear
kernel loads its weights first: nothing in its graph writes them): `gdc_wait` returns once the
kernel before has finished and its writes are visible. The trigger that lets the next kernel start
comes after that wait, as in Inductor's kernels under triton.enable_pdl: a kernel that skips its
wait (its inputs not written by the kernel right before it) relies on every earlier kernel having
finished when it starts.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # an older Triton: has_pdl() is False, the kernels launch without PDL
    gdc_launch_dependents = gdc_wait = None


@triton.jit
def wait_then_release(PDL: tl.constexpr):
    if PDL:
        gdc_wait()  # the kernel before has finished: what it wrote is complete
        gdc_launch_dependents()


@functools.lru_cache(maxsize=None)
def has_pdl(device: torch.device) -> bool:
    """PDL on this device: Hopper or newer, and a Triton with the intrinsics."""
    return gdc_wait is not None and torch.cuda.get_device_capability(device)[0] >= 9


def launch_options(pdl: bool) -> dict:
    """The launch keyword that asks for PDL (absent otherwise: older Tritons lack the option)."""
    return {"launch_pdl": True} if pdl else {}
