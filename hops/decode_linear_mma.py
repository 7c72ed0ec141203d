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

With a gate (GATE_EPILOGUE: a gated MLP's merged gate/up projection) the epilogue writes
silu(gate) * up itself: a fragment's rows g and g + 8 are the gate's and the up's weight rows of one
output feature, so the lane that holds one half holds the other, and no kernel of its own runs the
product. The rewrite uses it only where hops/decode_linear.py's GATE_EPILOGUE says (off: measured).

Compiled with NVRTC (torch.cuda._compile_kernel) on first use per (device, dtype, config); launched with
cuLaunchKernelEx so that CUDA graph capture records the PDL edge, as Triton does for its kernels.
"""
from __future__ import annotations

import ctypes
import functools
import warnings

import torch

from torch_ext.hops.cuda_launch import launch

__all__ = ["MMA_MAX_ROWS", "decode_linear_mma", "default_config", "gate_fits", "mma_takes"]

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
// x's prologue on a pair of 16-bit values, rounding where eager rounds (hops/decode_linear.py:
// prologue_reference): RMSNorm (times inv_rms, round, times the norm weight, round), then silu(x) * up.
__device__ __forceinline__ u16 prologue(u16 v, u16 g, u16 up, float inv_rms) {
#if NORM
  v = from_float(to_float(v) * inv_rms);
  v = from_float(to_float(g) * to_float(v));
#endif
#if GATED
  const float h = to_float(v);
  v = from_float(h / (1.f + __expf(-h)));
  v = from_float(to_float(v) * to_float(up));
#endif
  return v;
}
__device__ __forceinline__ u32 prologue_pair(u32 v, u32 g, u32 up, float inv_rms) {
  return (u32)prologue((u16)(v & 0xffff), (u16)(g & 0xffff), (u16)(up & 0xffff), inv_rms)
         | ((u32)prologue((u16)(v >> 16), (u16)(g >> 16), (u16)(up >> 16), inv_rms) << 16);
}
__device__ __forceinline__ void prologue_x4(u32x4& v, const u32x4& g, const u32x4& up, float inv_rms) {
  v.x = prologue_pair(v.x, g.x, up.x, inv_rms);
  v.y = prologue_pair(v.y, g.y, up.y, inv_rms);
  v.z = prologue_pair(v.z, g.z, up.z, inv_rms);
  v.w = prologue_pair(v.w, g.w, up.w, inv_rms);
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

struct Prologue {
  const u16* norm_weight;
  const u16* up;
  int up_stride;  // elements between up's rows
  float inv_rms[NT];  // of this lane's rows 8j + g
};

// x's raw 16-byte runs for one chunk, in the order load_chunk's weights use (rows past M, chunks past
// the end: zeros).
__device__ __forceinline__ void load_x_chunk(u32x4 (&xr)[NT][2], const u16* x, int x_stride, int chunk, int chunks,
                                             int M, int g, int t) {
  const int col = chunk * 64 + 16 * t;
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    const int row = 8 * j + g;
    xr[j][0] = xr[j][1] = u32x4{0, 0, 0, 0};
    if (row < M && chunk < chunks) {
      const u16* p = x + (long long)row * x_stride + col;
      xr[j][0] = load_x(p);
      xr[j][1] = load_x(p + 8);
    }
  }
}

__device__ __forceinline__ void multiply_chunk(float (&acc)[NT][MT][4], const u32x4 (&w)[MT][2][2],
                                               const u32x4 (&xr)[NT][2], const Prologue& pro, int chunk,
                                               int chunks, int M, int g, int t) {
  if (chunk >= chunks) return;
  const int col = chunk * 64 + 16 * t;
  u32x4 g0 = {0, 0, 0, 0}, g1 = {0, 0, 0, 0};
#if NORM
  g0 = load_x(pro.norm_weight + col);
  g1 = load_x(pro.norm_weight + col + 8);
#endif
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    const int row = 8 * j + g;
    u32x4 x0 = xr[j][0], x1 = xr[j][1];
#if NORM || GATED
    if (row < M) {
      u32x4 up0 = {0, 0, 0, 0}, up1 = {0, 0, 0, 0};
#if GATED
      up0 = load_x(pro.up + (long long)row * pro.up_stride + col);
      up1 = load_x(pro.up + (long long)row * pro.up_stride + col + 8);
#endif
      prologue_x4(x0, g0, up0, pro.inv_rms[j]);
      prologue_x4(x1, g1, up1, pro.inv_rms[j]);
    }
#endif
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
                  const u16* __restrict__ residual, u16* __restrict__ y, const u16* __restrict__ norm_weight,
                  const u16* __restrict__ up, float eps, int M, int N, int K, int x_stride, int up_stride, int pdl,
                  int gate_start, int up_start) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const u16* rows[MT][2];
#if GATE_EPILOGUE
  // Output feature f is silu(Y[gate_start + f]) * Y[up_start + f]: a fragment's rows g and g + 8 are the
  // gate's and the up's weight rows of one feature, so one lane ends up holding both halves.
  const int f0 = blockIdx.x * 8 * MT;
#pragma unroll
  for (int m = 0; m < MT; ++m)
#pragma unroll
    for (int r = 0; r < 2; ++r)  // a feature past N reads row N-1; its output is not written
      rows[m][r] = w + (long long)((r ? up_start : gate_start) + min(f0 + 8 * m + g, N - 1)) * K + 16 * t;
#else
  const int f0 = blockIdx.x * 16 * MT;
#pragma unroll
  for (int m = 0; m < MT; ++m)
#pragma unroll
    for (int r = 0; r < 2; ++r)  // a feature past N reads row N-1; its output is not written
      rows[m][r] = w + (long long)min(f0 + 16 * m + 8 * r + g, N - 1) * K + 16 * t;
#endif
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
#if __CUDA_ARCH__ >= 900
  if (pdl) {  // the weights are in flight; x and y belong to the kernels before until they finish
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;");
  }
#endif
  Prologue pro;
  pro.norm_weight = norm_weight;
  pro.up = up;
  pro.up_stride = up_stride;
#pragma unroll
  for (int j = 0; j < NT; ++j) pro.inv_rms[j] = 1.f;
#if NORM
  {  // each row's mean square, a warp a row (x is a few KB, in L2)
    __shared__ float inv_rms[NT * 8];
    for (int row = warp; row < M; row += WARPS) {
      float sum = 0.f;
      for (int c = lane * 8; c < K; c += 256) {
        const u32x4 v = load_x(x + (long long)row * x_stride + c);
        const u32 words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const float lo = to_float((u16)(words[i] & 0xffff)), hi = to_float((u16)(words[i] >> 16));
          sum += lo * lo + hi * hi;
        }
      }
#pragma unroll
      for (int offset = 16; offset > 0; offset >>= 1) sum += __shfl_xor_sync(0xffffffff, sum, offset);
      if (lane == 0) inv_rms[row] = rsqrtf(sum / K + eps);
    }
    __syncthreads();
#pragma unroll
    for (int j = 0; j < NT; ++j) pro.inv_rms[j] = 8 * j + g < M ? inv_rms[8 * j + g] : 1.f;
  }
#endif
#if XPF
  // x loaded a round ahead too, beside the weights: at 16-32 rows a chunk's x is more bytes than its
  // weights (read from L1 / L2), and loading it just before the mma stalls every round.
  u32x4 xcur[U][NT][2];
#pragma unroll
  for (int u = 0; u < U; ++u) load_x_chunk(xcur[u], x, x_stride, warp + u * WARPS, chunks, M, g, t);
#endif
  for (int c = warp; c < chunks; c += U * WARPS) {
    u32x4 next[U][MT][2][2];
#pragma unroll
    for (int u = 0; u < U; ++u) load_chunk(next[u], rows, c + (U + u) * WARPS, chunks);
#if XPF
    u32x4 xnext[U][NT][2];
#pragma unroll
    for (int u = 0; u < U; ++u) load_x_chunk(xnext[u], x, x_stride, c + (U + u) * WARPS, chunks, M, g, t);
#pragma unroll
    for (int u = 0; u < U; ++u) multiply_chunk(acc, cur[u], xcur[u], pro, c + u * WARPS, chunks, M, g, t);
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int j = 0; j < NT; ++j) xcur[u][j][0] = xnext[u][j][0], xcur[u][j][1] = xnext[u][j][1];
#else
#pragma unroll
    for (int u = 0; u < U; ++u) {
      u32x4 xr[NT][2];
      load_x_chunk(xr, x, x_stride, c + u * WARPS, chunks, M, g, t);
      multiply_chunk(acc, cur[u], xr, pro, c + u * WARPS, chunks, M, g, t);
    }
#endif
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
#if GATE_EPILOGUE
    const int feature = f0 + 8 * m + (l >> 2);
    if (row >= M || feature >= N || (i & 2)) continue;  // slot + 2 holds the up half of this slot's feature
    float gate = 0.f, up_sum = 0.f;
    for (int k = 0; k < WARPS; ++k) gate += partial[k][slot][l], up_sum += partial[k][slot + 2][l];
    if (bias) gate += to_float(bias[gate_start + feature]), up_sum += to_float(bias[up_start + feature]);
    // Rounded where eager rounds: each projection's output, silu's, the product.
    const float h = to_float(from_float(gate));
    u16 out = from_float(to_float(from_float(h / (1.f + __expf(-h)))) * to_float(from_float(up_sum)));
#else
    const int feature = f0 + 16 * m + (l >> 2) + 8 * (i >> 1);
    if (row >= M || feature >= N) continue;
    float sum = 0.f;
    for (int k = 0; k < WARPS; ++k) sum += partial[k][slot][l];
    if (bias) sum += to_float(bias[feature]);
    u16 out = from_float(sum);
#endif
    if (residual) out = from_float(to_float(out) + to_float(residual[(long long)row * N + feature]));
    y[(long long)row * N + feature] = out;
  }
}
"""

@functools.lru_cache(maxsize=None)
def default_config(n: int, device_index: int, rows: int = 8) -> tuple[int, int, int, int]:
    """(features a block / 16, warps, chunks in flight per warp, x loaded a round ahead). H100, chains of
    16 of one Llama projection (bench/decode_linear_op.py --shapes, bench/results/decode_linear_xpf_h100_torch2.11.log),
    x cuBLAS: with x loaded a round ahead, where the blocks fit the SMs about once (o, down: N = 2048,
    128 blocks) 16 warps with one chunk each (8 rows o 0.67x / down 0.80x, 16 rows 0.70x / 0.81x, 32 rows
    0.89x / 0.95x); with more blocks (qkv 6144, gate_up 11264) 8 warps, 2 chunks at one n-tile (8 rows qkv
    0.81x / gate_up 0.90x), one chunk at two (16 rows 0.81x / 0.93x), and at 32 rows 8 warps for qkv
    (0.88x) but 4 for gate_up's 704 blocks (0.93x; 8 warps 1.04x)."""
    sms = torch.cuda.get_device_properties(device_index).multi_processor_count
    blocks = (n + 15) // 16
    if blocks <= sms * 5 // 4:
        return (1, 16, 1, 1)
    if rows <= 8:
        return (1, 8, 2, 1)
    return (1, 4, 1, 1) if rows > 16 and blocks > 4 * sms else (1, 8, 1, 1)


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
    mt, warps, unroll, xpf = _full(default_config(n, index, rows))
    return _kernel(index, _DTYPES[x.dtype], mt, (rows + 7) // 8, warps, unroll, norm_weight is not None,
                   up is not None, gate is not None, xpf) is not None


def gate_fits(gate, n: int) -> bool:
    """gate is [gate_start, up_start, width] naming two slices inside a projection's n outputs (the op's
    reference and fake check it too: hops/decode_linear.py)."""
    return len(gate) == 3 and gate[2] > 0 and all(0 <= start and start + gate[2] <= n for start in gate[:2])


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.lru_cache(maxsize=None)
def _capability(device_index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


def decode_linear_mma(x: torch.Tensor, weight: torch.Tensor, bias, pdl: bool, *, norm_weight=None, eps: float = 0.0,
                      up=None, residual=None, gate=None, config: tuple[int, ...] | None = None) -> torch.Tensor:
    """decode_linear (hops/decode_linear.py: the prologue, F.linear, the gate, the residual add) for the
    tensors mma_takes accepts; config (features a block / 16, warps, chunks in flight per warp) replaces
    the default (bench/decode_linear_op.py), a fourth entry 1 loading x a round ahead too (XPF). With a gate
    a block computes 8 x MT outputs from 16 x MT weight rows: as many blocks as the whole projection
    (2 x width rows) takes without it."""
    n, k = weight.shape
    x2, up2 = _rows(x, k), (_rows(up, k) if up is not None else None)
    rows = x2.shape[0]
    gate_start, up_start, out = gate if gate is not None else (0, 0, n)
    y = torch.empty((rows, out), dtype=x.dtype, device=x.device)
    index = _index(x.device)
    mt, warps, unroll, xpf = _full(config or default_config(n, index, rows))
    func = _kernel(index, _DTYPES[x.dtype], mt, (rows + 7) // 8, warps, unroll, norm_weight is not None,
                   up is not None, gate is not None, xpf)
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
    launch(func, (out + per_block - 1) // per_block, warps * 32, args, pdl, index)
    return y.view(*x.shape[:-1], out)


def _full(config: tuple[int, ...]) -> tuple[int, int, int, bool]:
    """(features a block / 16, warps, chunks in flight, x loaded a round ahead): the last optional."""
    mt, warps, unroll, *rest = config
    return mt, warps, unroll, bool(rest[0]) if rest else False


def _rows(t: torch.Tensor, k: int) -> torch.Tensor:
    """t as (rows, k) rows the kernel loads 16 bytes at a time: contiguous in k, each row 16-byte aligned
    (a slice of a merged projection's output, gate or up, is, with its row stride); else a copy."""
    t2 = t.reshape(-1, k)
    if t2.stride(-1) == 1 and t2.data_ptr() % 16 == 0 and (t2.shape[0] == 1 or t2.stride(0) % 8 == 0):
        return t2
    return t2.clone(memory_format=torch.contiguous_format)  # contiguous() keeps a contiguous misaligned view


@functools.lru_cache(maxsize=None)
def _kernel(device_index: int, dtype: str, mt: int, nt: int, warps: int, unroll: int, norm: bool, gated: bool,
            gate_epilogue: bool = False, xpf: bool = False):
    """The compiled kernel (a CUfunction) for this device and variant, or None where NVRTC is missing or
    the compile fails: said once per variant, and the op runs its reference."""
    from torch_ext import compat

    compile_kernel = compat.cuda_kernel_compiler()
    if compile_kernel is None:
        return None
    defines = dict(MT=mt, NT=nt, WARPS=warps, U=unroll, NORM=int(norm), GATED=int(gated), GATE_EPILOGUE=int(gate_epilogue),
                   XPF=int(xpf))
    source = "".join(f"#define {k} {v}\n" for k, v in defines.items()) + _SOURCE.replace("DTYPE", dtype)
    try:
        with torch.cuda.device(device_index):
            return compile_kernel(source, "decode_linear_mma").func
    except Exception as e:  # NVRTC's or the driver's error: the reference serves these calls
        warnings.warn(f"torch_ext: decode_linear's CUDA path did not compile for {defines} on device {device_index} "
                      f"({type(e).__name__}: {str(e)[:500]}); those calls run F.linear", stacklevel=2)
        return None
