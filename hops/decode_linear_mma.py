"""decode_linear's CUDA path for 2-32 rows: weights streamed into tensor-core fragments from registers.

Why not Triton: at 8 rows every Triton design measured (tl.dot, a tile per row, split-K) tied or lost
to cuBLAS, which runs these shapes at ~1.4x their bytes' floor (bench/results/NOTES_issue25.md). The
loss is in what surrounds the math: tl.dot stages the weight through shared memory and its pipeliner
keeps few bytes in flight. Here each lane loads 16-byte runs of two weight rows straight into the
registers `mma.sync.m16n8k16` reads. The sum over k does not care in which order the columns come,
so a lane's 16 consecutive columns are used as the fragment's columns {2t, 2t+1, 2t+8, 2t+9} of four
successive mmas, and x (the B operand) is loaded in the same order. Nothing goes through shared memory
until the warps' partial sums are added.

A block owns 16 x MT features and all K: its WARPS warps take interleaved 64-column chunks (U at a time
per warp, the next U loaded while the last are multiplied), then add their partial sums in a fixed
order (deterministic). Rows (the batch) are the mma's n: 8 per n-tile, NT tiles (rows past M read as 0).
Under programmatic dependent launch the first chunks' weights are loaded before `griddepcontrol.wait`:
no kernel of the graph writes weights (the rewrite checks), x is read only after the wait.

Compiled with NVRTC (torch.cuda._compile_kernel) on first use per (device, dtype, config); launched with
cuLaunchKernelEx so that CUDA graph capture records the PDL edge, as Triton does for its kernels.
"""
from __future__ import annotations

import ctypes
import functools

import torch

__all__ = ["mma_takes", "decode_linear_mma", "MMA_MAX_ROWS"]

MMA_MAX_ROWS = 32
_DTYPES = {torch.bfloat16: "bf16", torch.float16: "f16"}

_SOURCE = r"""
typedef unsigned int u32;
typedef unsigned short u16;
struct __align__(16) u32x4 { u32 x, y, z, w; };

// Streamed once per step: no L1 allocation.
__device__ __forceinline__ u32x4 load_weight(const u16* p) {
  u32x4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
__device__ __forceinline__ u32x4 load_x(const u16* p) {
  u32x4 v;
  asm volatile("ld.global.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
__device__ __forceinline__ void mma(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.DTYPE.DTYPE.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
__device__ __forceinline__ float to_float(u16 v) {
  float f;
  asm("cvt.f32.DTYPE %0, %1;" : "=f"(f) : "h"(v));
  return f;
}
__device__ __forceinline__ u16 from_float(float f) {
  u16 v;
  asm("cvt.rn.DTYPE.f32 %0, %1;" : "=h"(v) : "f"(f));
  return v;
}
__device__ __forceinline__ u32 pair(const u32x4& a, const u32x4& b, int i) {  // 32-bit word i of a:b
  return i == 0 ? a.x : i == 1 ? a.y : i == 2 ? a.z : i == 3 ? a.w : i == 4 ? b.x : i == 5 ? b.y : i == 6 ? b.z : b.w;
}

// w[MT][2][2]: per m-tile, rows g and g+8, columns 16t..16t+7 and 16t+8..16t+15 of a 64-column chunk.
__device__ __forceinline__ void load_chunk(u32x4 (&w)[MT][2][2], const u16* const (&rows)[MT][2], int chunk,
                                           int chunks) {
#pragma unroll
  for (int m = 0; m < MT; ++m)
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
      for (int h = 0; h < 2; ++h)
        w[m][r][h] = chunk < chunks ? load_weight(rows[m][r] + chunk * 64 + h * 8) : u32x4{0, 0, 0, 0};
}

__device__ __forceinline__ void multiply_chunk(float (&acc)[NT][MT][4], const u32x4 (&w)[MT][2][2],
                                               const u16* x, int chunk, int chunks, int M, int K, int g,
                                               int t) {
  if (chunk >= chunks) return;
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    const int row = 8 * j + g;
    u32x4 x0 = {0, 0, 0, 0}, x1 = {0, 0, 0, 0};
    if (row < M) {
      const u16* p = x + (long long)row * K + chunk * 64 + 16 * t;
      x0 = load_x(p);
      x1 = load_x(p + 8);
    }
#pragma unroll
    for (int s = 0; s < 4; ++s)
#pragma unroll
      for (int m = 0; m < MT; ++m)
        mma(acc[j][m], pair(w[m][0][0], w[m][0][1], 2 * s), pair(w[m][1][0], w[m][1][1], 2 * s),
            pair(w[m][0][0], w[m][0][1], 2 * s + 1), pair(w[m][1][0], w[m][1][1], 2 * s + 1),
            pair(x0, x1, 2 * s), pair(x0, x1, 2 * s + 1));
  }
}

extern "C" __global__ void __launch_bounds__(WARPS * 32)
decode_linear_mma(const u16* __restrict__ x, const u16* __restrict__ w, const u16* __restrict__ bias,
                  const u16* __restrict__ residual, u16* __restrict__ y, int M, int N, int K, int pdl) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int f0 = blockIdx.x * 16 * MT;
  const u16* rows[MT][2];
#pragma unroll
  for (int m = 0; m < MT; ++m)
#pragma unroll
    for (int r = 0; r < 2; ++r)  // a feature past N reads row N-1; its output is not written
      rows[m][r] = w + (long long)min(f0 + 16 * m + 8 * r + g, N - 1) * K + 16 * t;
  const int chunks = K / 64;
  float acc[NT][MT][4];
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[j][m][i] = 0.f;

  u32x4 cur[U][MT][2][2];
#pragma unroll
  for (int u = 0; u < U; ++u) load_chunk(cur[u], rows, warp + u * WARPS, chunks);
  if (pdl) {  // the weights are in flight; x and y belong to the kernels before until they finish
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;");
  }
  for (int c = warp; c < chunks; c += U * WARPS) {
    u32x4 next[U][MT][2][2];
#pragma unroll
    for (int u = 0; u < U; ++u) load_chunk(next[u], rows, c + (U + u) * WARPS, chunks);
#pragma unroll
    for (int u = 0; u < U; ++u) multiply_chunk(acc, cur[u], x, c + u * WARPS, chunks, M, K, g, t);
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int r = 0; r < 2; ++r)
#pragma unroll
          for (int h = 0; h < 2; ++h) cur[u][m][r][h] = next[u][m][r][h];
  }

  // The warps' partial sums, added in warp order.
  __shared__ float partial[WARPS][NT * MT * 4][32];
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
      for (int i = 0; i < 4; ++i) partial[warp][(j * MT + m) * 4 + i][lane] = acc[j][m][i];
  __syncthreads();
  for (int v = threadIdx.x; v < NT * MT * 4 * 32; v += WARPS * 32) {
    const int slot = v / 32, l = v % 32;
    const int j = slot / (MT * 4), m = (slot / 4) % MT, i = slot % 4;
    const int row = 8 * j + 2 * (l & 3) + (i & 1);
    const int feature = f0 + 16 * m + (l >> 2) + 8 * (i >> 1);
    if (row >= M || feature >= N) continue;
    float sum = 0.f;
    for (int k = 0; k < WARPS; ++k) sum += partial[k][slot][l];
    if (bias) sum += to_float(bias[feature]);
    u16 out = from_float(sum);
    if (residual) out = from_float(to_float(out) + to_float(residual[(long long)row * N + feature]));
    y[(long long)row * N + feature] = out;
  }
}
"""

# Launch config per row count: (features a block / 16, warps, chunks in flight per warp).
_CONFIG = {1: (1, 8, 2), 2: (1, 8, 2), 3: (1, 8, 2), 4: (1, 8, 2)}


def mma_takes(x: torch.Tensor, weight: torch.Tensor, bias, residual) -> bool:
    """The shapes this path serves (decode_linear's kernel_takes has checked the rest): a CUDA device of
    compute capability 8.0+ (mma.sync bf16), 16-bit x, 2..MMA_MAX_ROWS rows, addresses 16-byte aligned."""
    k = x.shape[-1]
    rows = x.numel() // k if k else 0
    return (x.is_cuda and x.dtype in _DTYPES and 1 <= rows <= MMA_MAX_ROWS and k % 64 == 0
            and x.data_ptr() % 16 == 0 and weight.data_ptr() % 16 == 0
            and torch.cuda.get_device_capability(x.device) >= (8, 0) and _compiler_available())


@functools.lru_cache(maxsize=None)
def _compiler_available() -> bool:
    from torch_ext import compat

    return compat.cuda_kernel_compiler() is not None


def decode_linear_mma(x: torch.Tensor, weight: torch.Tensor, bias, pdl: bool, residual=None,
                      config: tuple[int, int, int] | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) (+ residual) for x of at most MMA_MAX_ROWS rows; config (features a
    block / 16, warps, chunks in flight per warp) replaces the default (bench/decode_linear_op.py)."""
    n, k = weight.shape
    x2 = x.reshape(-1, k).contiguous()
    rows = x2.shape[0]
    y = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    n_tiles = (rows + 7) // 8
    mt, warps, unroll = config or _CONFIG[n_tiles]
    res2 = residual.reshape(-1, n).contiguous() if residual is not None else None
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    func = _kernel(index, _DTYPES[x.dtype], mt, n_tiles, warps, unroll)
    args = [ctypes.c_void_p(x2.data_ptr()), ctypes.c_void_p(weight.data_ptr()),
            ctypes.c_void_p(bias.data_ptr() if bias is not None else 0),
            ctypes.c_void_p(res2.data_ptr() if res2 is not None else 0), ctypes.c_void_p(y.data_ptr()),
            ctypes.c_int(rows), ctypes.c_int(n), ctypes.c_int(k), ctypes.c_int(int(pdl))]
    _launch(func, ((n + 16 * mt - 1) // (16 * mt),), (warps * 32,), args, pdl, index)
    return y.view(*x.shape[:-1], n)


@functools.lru_cache(maxsize=None)
def _kernel(device_index: int, dtype: str, mt: int, nt: int, warps: int, unroll: int):
    from torch_ext import compat

    source = (f"#define MT {mt}\n#define NT {nt}\n#define WARPS {warps}\n#define U {unroll}\n"
              + _SOURCE.replace("DTYPE", dtype))
    with torch.cuda.device(device_index):
        return compat.cuda_kernel_compiler()(source, "decode_linear_mma").func


class _LaunchAttribute(ctypes.Structure):  # CUlaunchAttribute: an id, then a 64-byte value union
    _fields_ = [("id", ctypes.c_uint), ("pad", ctypes.c_uint), ("value", ctypes.c_int), ("rest", ctypes.c_byte * 60)]


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttribute)), ("num_attrs", ctypes.c_uint)]


_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION


@functools.lru_cache(maxsize=None)
def _driver():
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuLaunchKernelEx.argtypes = [ctypes.POINTER(_LaunchConfig), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    return lib


def _launch(func, grid: tuple, block: tuple, args: list, pdl: bool, device_index: int) -> None:
    from torch_ext import compat

    attr = _LaunchAttribute(id=_PROGRAMMATIC_STREAM_SERIALIZATION, value=1)
    cfg = _LaunchConfig(grid=(ctypes.c_uint * 3)(*grid, *[1] * (3 - len(grid))),
                        block=(ctypes.c_uint * 3)(*block, *[1] * (3 - len(block))), shared=0,
                        stream=ctypes.c_void_p(compat.current_raw_stream(device_index)),
                        attrs=ctypes.pointer(attr) if pdl else None, num_attrs=1 if pdl else 0)
    params = (ctypes.c_void_p * len(args))(*[ctypes.cast(ctypes.pointer(a), ctypes.c_void_p) for a in args])
    result = _driver().cuLaunchKernelEx(ctypes.byref(cfg), func, params, None)
    if result != 0:
        raise RuntimeError(f"decode_linear_mma: cuLaunchKernelEx failed with CUDA error {result}")
