"""decode_linear's CUDA path for 2-32 rows: compiled on first use, launched with PDL.

The kernel (kernels/decode_linear_mma_source.py, where its design is described) streams each lane's weight
rows straight into `mma.sync` fragments. Here: which tensors it takes (`mma_takes`), its launch config
by shape and rows (`default_config`), and the call. Compiled with NVRTC on first use per (device, dtype,
config), or loaded from the compiled-module disk cache (module_cache.py); launched with cuLaunchKernelEx so that CUDA graph capture records
the PDL edge, as Triton does for its kernels.
"""
from __future__ import annotations

import ctypes
import functools
import warnings

import torch

from torch_ext.kernels.cuda_launch import driver, launch
from torch_ext.kernels import module_cache
from torch_ext.kernels.decode_linear_mma_source import build_source

__all__ = ["MMA_MAX_ROWS", "decode_linear_mma", "default_config", "gate_fits", "mma_takes", "variant_attributes"]

MMA_MAX_ROWS = 32
_DTYPES = {torch.bfloat16: "bf16", torch.float16: "f16"}


@functools.lru_cache(maxsize=None)
def default_config(n: int, device_index: int, rows: int) -> tuple[int, int, int, int]:
    """(features a block / 16, warps, chunks in flight per warp, x mode: 1 x loaded a round ahead, 2 the
    ordered pipeline, 3 the same with x through shared memory). H100, chains of 16 of one Llama
    projection (bench/dev/decode_linear_op.py --shapes, bench/results/decode_linear_modes_h100_torch2.11.log,
    decode_linear_x_smem_h100_torch2.11.log), x the time of the config before:
    - where the blocks fit the SMs about once (o, down: N = 2048, 128 blocks), 16 warps; up to 16 rows
      the ordered pipeline (o 0.90x / down 0.87x at 16 rows, 0.90x / 0.89x at 8), above that with x
      through shared memory (o 0.88x / down 0.89x at 32 rows, 0.87x / 0.95x at 24: the pipeline's x
      registers cap 16 warps at 128 there and it spills; at 8-16 rows mode 3 ties or loses);
    - with more blocks (qkv 6144, gate_up 11264) 8 warps; up to 8 rows the ordered pipeline (qkv 0.96x,
      gate_up 0.99x; its x registers leave fewer blocks an SM above that: qkv 1.12x at 16 rows), then x
      a round ahead, with 4 warps at 17-32 rows where there are over 4 blocks an SM (gate_up's 704: 0.93x
      cuBLAS, 8 warps 1.04x)."""
    props = torch.cuda.get_device_properties(device_index)
    blocks = (n + 15) // 16
    if blocks <= props.multi_processor_count * 5 // 4:
        if rows <= 16:
            return (1, 16, 1, 2)
        # x mode 3 where its shared memory fits a block (an H100 or A100, not an sm_86 / sm_89 card's 99 KB)
        return (1, 16, 1, 3) if _shared_bytes(1, (rows + 7) // 8, 16, 1, 3) <= _optin(props) else (1, 16, 1, 1)
    if rows <= 8:
        return (1, 8, 1, 2)
    return (1, 4, 1, 1) if rows > 16 and blocks > 4 * props.multi_processor_count else (1, 8, 1, 1)


def mma_takes(x: torch.Tensor, weight: torch.Tensor, bias=None, norm_weight=None, up=None, residual=None,
              gate=None) -> bool:
    """The tensors this path serves: CUDA of compute capability 8.0+ (mma.sync on 16-bit floats), x of
    1..MMA_MAX_ROWS rows, K a multiple of 64, every operand x's dtype and shape, weight and norm weight
    contiguous and 16-byte aligned (never copied per call), bias and residual contiguous, a gate's two
    slices inside the weight; NVRTC present. x and up may be row-strided views (_rows)."""
    k = x.shape[-1]
    rows = x.numel() // k if k else 0
    n = weight.shape[0] if weight.dim() == 2 else -1
    out = n if gate is None else gate[2]

    def plain(t, shape, aligned=False) -> bool:
        return t is None or (t.dtype == x.dtype and t.device == x.device and tuple(t.shape) == tuple(shape)
                             and t.is_contiguous() and (not aligned or t.data_ptr() % 16 == 0))

    if not (x.is_cuda and x.dtype in _DTYPES and 1 <= rows <= MMA_MAX_ROWS and k % 64 == 0 and n > 0
            and plain(weight, (n, k), aligned=True) and plain(bias, (n,)) and plain(norm_weight, (k,), aligned=True)
            and (up is None or up.dtype == x.dtype and up.shape == x.shape and up.device == x.device)
            and plain(residual, (*x.shape[:-1], out)) and (gate is None or gate_fits(gate, n))):
        return False
    index = _index(x.device)
    if _capability(index) < (8, 0):
        return False
    return _variant(index, x.dtype, n, rows, None, norm_weight, up, gate)[0] is not None


def gate_fits(gate, n: int) -> bool:
    """gate is [gate_start, up_start, width] naming two slices inside a projection's n outputs (the op's
    reference and fake check it too: kernels/decode_linear.py)."""
    return len(gate) == 3 and gate[2] > 0 and all(0 <= start and start + gate[2] <= n for start in gate[:2])


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.lru_cache(maxsize=None)
def _capability(device_index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


def decode_linear_mma(x: torch.Tensor, weight: torch.Tensor, bias, pdl: bool, *, norm_weight=None, eps: float = 0.0,
                      up=None, residual=None, gate=None, config: tuple[int, ...] | None = None) -> torch.Tensor:
    """decode_linear (kernels/decode_linear.py: the prologue, F.linear, the gate, the residual add) for the
    tensors mma_takes accepts; config (features a block / 16, warps, chunks in flight per warp) replaces
    the default (bench/dev/decode_linear_op.py), a fourth entry the x mode (_full). With a gate
    a block computes 8 x MT outputs from 16 x MT weight rows: as many blocks as the whole projection
    (2 x width rows) takes without it."""
    n, k = weight.shape
    x2, up2 = _rows(x, k), (_rows(up, k) if up is not None else None)
    rows = x2.shape[0]
    gate_start, up_start, out = gate if gate is not None else (0, 0, n)
    y = torch.empty((rows, out), dtype=x.dtype, device=x.device)
    index = _index(x.device)
    func, (mt, warps, unroll, mode) = _variant(index, x.dtype, n, rows, config, norm_weight, up, gate)
    if func is None:
        raise RuntimeError("decode_linear_mma: the kernel did not compile (the warning before says why)")
    pdl = pdl and _capability(index) >= (9, 0)  # griddepcontrol: Hopper and newer

    def ptr(t):
        return ctypes.c_void_p(t.data_ptr() if t is not None else 0)

    args = [ptr(x2), ptr(weight), ptr(bias), ptr(residual), ptr(y), ptr(norm_weight), ptr(up2),
            ctypes.c_float(eps), ctypes.c_int(rows), ctypes.c_int(out), ctypes.c_int(k), ctypes.c_int(x2.stride(0)),
            ctypes.c_int(up2.stride(0) if up2 is not None else 0), ctypes.c_int(int(pdl)), ctypes.c_int(gate_start),
            ctypes.c_int(up_start)]
    per_block = (8 if gate is not None else 16) * mt
    launch(func, (out + per_block - 1) // per_block, warps * 32, args, pdl, index,
           x_shared_bytes(mt, (rows + 7) // 8, warps, unroll, mode))
    return y.view(*x.shape[:-1], out)


def _full(config: tuple[int, ...]) -> tuple[int, int, int, int]:
    """(features a block / 16, warps, chunks in flight, x mode): the last optional. x mode 0 loads x
    just before the mma, 1 a round ahead, 2 runs the ordered pipeline, 3 the same with x through shared
    memory (kernels/decode_linear_mma_pipelines.py)."""
    mt, warps, unroll, *rest = config
    mode = int(rest[0]) if rest else 0
    if mode not in (0, 1, 2, 3):  # the source knows no other: it would compile as mode 1 without a word
        raise ValueError(f"decode_linear_mma: config {tuple(config)}: x mode {mode} is not 0, 1, 2 or 3")
    return mt, warps, unroll, mode


# x mode 3's shared-memory slots a warp: the round being multiplied and the one being copied (three, x
# two rounds ahead, ran slower: 128 KB more of shared memory is that much less L1 for the weights' loads).
X_SLOTS = 2


def _shared_bytes(mt: int, nt: int, warps: int, unroll: int, mode: int) -> int:
    """A variant's shared memory, dynamic and static: x's slots, the warps' partial sums, the norm's
    1 / rms (kernels/decode_linear_mma_source.py)."""
    return x_shared_bytes(mt, nt, warps, unroll, mode) + warps * nt * mt * 4 * 32 * 4 + nt * 8 * 4


def _optin(props) -> int:
    """Shared memory a block may ask for on this device (0 where torch does not say)."""
    return getattr(props, "shared_memory_per_block_optin", 0)


def x_shared_bytes(mt: int, nt: int, warps: int, unroll: int, mode: int) -> int:
    """Dynamic shared memory of a variant: x mode 3's slots, nt x 8 rows x 64 columns of 16-bit x a warp
    and chunk in flight."""
    return X_SLOTS * warps * unroll * nt * 8 * 64 * 2 if mode == 3 else 0


def _variant(index: int, dtype: torch.dtype, n: int, rows: int, config, norm_weight, up, gate):
    """(the compiled kernel for these operands, or None: see _kernel; its full config), under config or the
    default for (n, rows)."""
    full = _full(config or default_config(n, index, rows))
    mt, warps, unroll, xpf = full
    return _kernel(index, _DTYPES[dtype], mt, (rows + 7) // 8, warps, unroll, norm_weight is not None, up is not None,
                   gate is not None, xpf), full


def variant_attributes(x: torch.Tensor, weight: torch.Tensor, config: tuple[int, ...] | None = None) -> dict:
    """Registers a thread and blocks an SM of the kernel that would serve F.linear(x, weight)
    (bench/dev/decode_linear_op.py prints them beside the times)."""
    index = _index(x.device)
    func, (mt, warps, unroll, mode) = _variant(index, x.dtype, weight.shape[0], x.numel() // x.shape[-1], config, None,
                                               None, None)
    if func is None:
        return {}
    lib, registers, blocks = driver(), ctypes.c_int(), ctypes.c_int()
    lib.cuFuncGetAttribute(ctypes.byref(registers), 4, func)  # CU_FUNC_ATTRIBUTE_NUM_REGS
    shared = x_shared_bytes(mt, (x.numel() // x.shape[-1] + 7) // 8, warps, unroll, mode)
    lib.cuOccupancyMaxActiveBlocksPerMultiprocessor(ctypes.byref(blocks), func, warps * 32, ctypes.c_size_t(shared))
    return {"registers": registers.value, "blocks an SM": blocks.value}


def _rows(t: torch.Tensor, k: int) -> torch.Tensor:
    """t as (rows, k) rows the kernel loads 16 bytes at a time: contiguous in k, each row 16-byte aligned
    (a slice of a merged projection's output, gate or up, is, with its row stride); else a copy."""
    t2 = t.reshape(-1, k)
    if t2.stride(-1) == 1 and t2.data_ptr() % 16 == 0 and (t2.shape[0] == 1 or t2.stride(0) % 8 == 0):
        return t2
    return t2.clone(memory_format=torch.contiguous_format)  # contiguous() keeps a contiguous misaligned view


@functools.lru_cache(maxsize=None)
def _kernel(device_index: int, dtype: str, mt: int, nt: int, warps: int, unroll: int, norm: bool, gated: bool,
            gate_epilogue: bool = False, xpf: int = 0):
    """The compiled kernel (a CUfunction) for this device and variant, or None where NVRTC is missing or
    the compile fails: said once per variant, and the op runs its reference."""
    compile_kernel = module_cache.compiler()
    if compile_kernel is None:
        return None
    defines = dict(MT=mt, NT=nt, WARPS=warps, U=unroll, NORM=int(norm), GATED=int(gated), GATE_EPILOGUE=int(gate_epilogue),
                   XPF=xpf, XS=X_SLOTS)
    try:
        with torch.cuda.device(device_index):
            func = compile_kernel(build_source(dtype, defines), "decode_linear_mma").func
            shared = x_shared_bytes(mt, nt, warps, unroll, xpf)
            if shared:  # above 48 KB, static included, a kernel must ask for its dynamic shared memory
                result = driver().cuFuncSetAttribute(func, 8, shared)  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
                if result != 0:
                    raise RuntimeError(f"cuFuncSetAttribute({shared} bytes of shared memory) failed with CUDA error {result}")
            return func
    except Exception as e:  # NVRTC's or the driver's error: the reference serves these calls
        warnings.warn(f"torch_ext: decode_linear's CUDA path did not compile for {defines} on device {device_index} "
                      f"({type(e).__name__}: {str(e)[:500]}); those calls run F.linear", stacklevel=2)
        return None
