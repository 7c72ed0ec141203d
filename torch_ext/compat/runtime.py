"""What the backend calls at run time: CUDA graph capture and recovery, custom ops called directly."""
from __future__ import annotations

import torch


def non_owning_storage(data_ptr: int, device: torch.device, nbytes: int):
    """A storage over memory it does not own (torch's cudagraph trees use the same private helper,
    present from 2.9.1 to 2.13): captured outputs kept this way let the graph pool reuse them."""
    return torch._C._construct_storage_from_data_pointer(data_ptr, device, nbytes)


_DATA_PTRS_EQUAL = getattr(torch._C, "_tensors_data_ptrs_at_indices_equal", None)


def address_check(expected: list, n: int) -> tuple[list, list]:
    """(indices, ptrs) for data_ptrs_equal from (position, data_ptr) pairs over n arguments."""
    ptrs: list = [None] * n
    for i, ptr in expected:
        ptrs[i] = ptr
    return [i for i, _ in expected], ptrs


def data_ptrs_equal(args: list, ptrs: list, indices: list) -> bool:
    """Whether args[i].data_ptr() == ptrs[i] for every i in indices (`ptrs` by position, like `args`,
    which must be a list): one C++ call, the check torch's cudagraph trees run on each replay
    (private; in 2.9.1, 2.11, 2.14.1 and 2.15, missing from the 2.13.0 CPU wheel: a Python loop there)."""
    if _DATA_PTRS_EQUAL is not None:
        return _DATA_PTRS_EQUAL(args, ptrs, indices)
    return all(args[i].data_ptr() == ptrs[i] for i in indices)


_CURRENT_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def current_raw_stream(device_index: int) -> int:
    """The device's current CUDA stream as an int (cudaStream_t): one C++ call, where
    torch.cuda.current_stream builds a Stream object (~10 us; private, in 2.9.1 through 2.15)."""
    if _CURRENT_RAW_STREAM is not None:
        return _CURRENT_RAW_STREAM(device_index)
    return torch.cuda.current_stream(device_index).cuda_stream


def rng_state_before_capture(device_index: int):
    """A copy of the device's default CUDA generator state, for recover_from_failed_capture."""
    return torch.cuda.default_generators[device_index].clone_state()


def recover_from_failed_capture(device_index: int, pool, rng_state) -> None:
    """Undo what a failed capture leaves behind (2.9.1 through 2.14.1, seen on 2.11): when
    cudaStreamEndCapture fails (the capture was invalidated, e.g. by a host sync), CUDAGraph.capture_end
    throws before it runs the generators' capture epilogue and before it ends the allocator's routing
    into the pool: the default generator stays in capture mode, and every later random op on the
    device raises "Offset increment outside graph capture encountered unexpectedly". The device
    allocator's routing is ended here; the pinned-host allocator's (2.11+) has no Python binding,
    so the pool id stays taken there: later captures must use a new pool ("beginAllocateToPool:
    already recording to mempool_id" otherwise, seen on 2.11)."""
    torch.cuda.default_generators[device_index].graphsafe_set_state(rng_state)
    try:
        torch._C._cuda_endAllocateToPool(device_index, pool)
    except RuntimeError:  # capture_end got that far itself
        pass


def python_custom_op_def(op: torch._ops.OpOverload):
    """The CustomOpDef of an op defined with torch.library.custom_op (its kernels run through Python
    autograd, version and alias-checking layers), or None. The registry is private. Its `_backend_fns`
    (device type, None for all -> the user's kernel, wrapped to honour disabled kernels) is what
    the op's backend kernel calls, on 2.9.1 through 2.14.1."""
    from torch._library import custom_ops

    opdef = getattr(custom_ops, "OPDEFS", {}).get(op._schema.name)
    if opdef is None or getattr(opdef, "_opoverload", None) is not op \
            or not isinstance(getattr(opdef, "_backend_fns", None), dict):
        return None
    return opdef


_mode_checks = (torch._C._is_torch_function_mode_enabled, torch._C._len_torch_dispatch_stack,
                torch._C._is_any_autocast_enabled, torch._C._are_functorch_transforms_active)


def no_modes_or_autocast_active() -> bool:
    """No torch-function or dispatch mode, autocast or functorch transform is active (0.3 us)."""
    a, b, c, d = _mode_checks
    return not (a() or b() or c() or d())




def nvrtc_available() -> bool:
    """Whether torch's NVRTC helpers that nvrtc_compile and load_cuda_module call (private, in 2.9.1
    through 2.15) and the NVRTC library they load are present: the kernels built with them fall back
    to their reference where not."""
    try:
        from torch.cuda._utils import _cuda_load_module, _get_nvrtc_library, _nvrtc_compile  # noqa: F401

        _get_nvrtc_library()
    except Exception:  # ImportError, OSError (no libnvrtc), AttributeError (a CPU build's torch.version.cuda)
        return False
    return True


def nvrtc_compile(source: str, name: str) -> tuple[bytes, str]:
    """(the module image NVRTC makes of `source` for the current device, the kernel's lowered name):
    a cubin and the name to look up on 2.11 through 2.15; PTX (the driver finishes it at load) and
    `name` itself (extern "C" kernels only) on 2.9.1."""
    from torch.cuda._utils import _nvrtc_compile

    out = _nvrtc_compile(source, name)
    return out if isinstance(out, tuple) else (out, name)


def load_cuda_module(image: bytes, lowered_name: str):
    """The kernel `lowered_name` of a module image nvrtc_compile made (torch's private loader, a
    _CudaKernel with `.func`; 2.9.1 through 2.15). Raises where the driver refuses the image."""
    from torch.cuda._utils import _cuda_load_module

    return _cuda_load_module(image, [lowered_name])[lowered_name]


def nvrtc_version() -> str:
    """NVRTC's version as major.minor (part of a compiled module's cache key)."""
    import ctypes

    from torch.cuda._utils import _get_nvrtc_library

    major, minor = ctypes.c_int(), ctypes.c_int()
    _get_nvrtc_library().nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    return f"{major.value}.{minor.value}"


def inductor_cache_root() -> str | None:
    """Inductor's cache directory (TORCHINDUCTOR_CACHE_DIR or its per-user default), or None where
    TORCHINDUCTOR_FORCE_DISABLE_CACHES asks for no caches."""
    from torch._inductor import config
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    if getattr(config, "force_disable_caches", False):
        return None
    return cache_dir()
