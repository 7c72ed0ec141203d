"""Launching a CUfunction (an NVRTC-compiled kernel of ours, kernels/decode_linear_mma.py) with the driver's
cuLaunchKernelEx through ctypes: torch.cuda._compile_kernel's own launcher calls cuLaunchKernel, which
takes no launch attributes, and programmatic dependent launch (PDL) is one. A CUDA graph capture records
a launch with that attribute as a programmatic edge, as it does Triton's launches with launch_pdl."""
from __future__ import annotations

import ctypes
import functools

import torch

__all__ = ["driver", "launch"]


class _LaunchAttribute(ctypes.Structure):  # CUlaunchAttribute: an id, then a 64-byte value union
    _fields_ = [("id", ctypes.c_uint), ("pad", ctypes.c_uint), ("value", ctypes.c_int), ("rest", ctypes.c_byte * 60)]


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttribute)), ("num_attrs", ctypes.c_uint)]


_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION


@functools.lru_cache(maxsize=None)
def driver():
    """libcuda through ctypes (the driver API: launches, function attributes)."""
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuLaunchKernelEx.argtypes = [ctypes.POINTER(_LaunchConfig), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    return lib


def launch(func, blocks: int, threads: int, args: list, pdl: bool, device_index: int, shared: int = 0) -> None:
    """cuLaunchKernelEx on the device's current stream, with `shared` bytes of dynamic shared memory and
    the PDL attribute where pdl (a capture records it as a programmatic edge)."""
    from torch_ext import compat

    attr = _LaunchAttribute(id=_PROGRAMMATIC_STREAM_SERIALIZATION, value=1)
    cfg = _LaunchConfig(grid=(ctypes.c_uint * 3)(blocks, 1, 1), block=(ctypes.c_uint * 3)(threads, 1, 1), shared=shared,
                        stream=ctypes.c_void_p(compat.current_raw_stream(device_index)),
                        attrs=ctypes.pointer(attr) if pdl else None, num_attrs=1 if pdl else 0)
    params = (ctypes.c_void_p * len(args))(*[ctypes.cast(ctypes.pointer(a), ctypes.c_void_p) for a in args])
    if torch.cuda.current_device() == device_index:
        result = driver().cuLaunchKernelEx(ctypes.byref(cfg), func, params, None)
    else:  # the function belongs to the device's context
        with torch.cuda.device(device_index):
            result = driver().cuLaunchKernelEx(ctypes.byref(cfg), func, params, None)
    if result != 0:
        raise RuntimeError(f"torch_ext: cuLaunchKernelEx failed with CUDA error {result}")
