"""The CUDA source of decode_linear's path for 2-32 rows (kernels/decode_linear_mma.py compiles and launches it):
weights streamed into tensor-core fragments from registers.

Why not Triton: at 8 rows every Triton design measured (tl.dot, a tile per row, split-K) tied or lost
to cuBLAS, which runs these shapes at ~1.4x their bytes' floor (bench/results/NOTES_issue25.md). The
loss is in what surrounds the math: tl.dot stages the weight through shared memory and its pipeliner
keeps few bytes in flight. Here each lane loads 16-byte runs of two weight rows straight into the
registers `mma.sync.m16n8k16` reads. The sum over k does not care in which order the columns come,
so a lane's 16 consecutive columns are used as the fragment's columns {2t, 2t+1, 2t+8, 2t+9} of four
successive mmas, and x (the B operand) is loaded in the same order. Nothing goes through shared memory
until the warps' partial sums are added.

A block owns 16 x MT features and all K: its WARPS warps take interleaved 64-column chunks (U at a time
per warp, the next U loaded while the last are multiplied; with XPF x too, a round ahead: at 16-32
rows a chunk's x is more bytes than its weights), then add their partial sums in a fixed
order (deterministic). Rows (the batch) are the mma's n: 8 per n-tile, NT tiles (rows past M read as 0).
Under programmatic dependent launch the first chunks' weights are loaded before `griddepcontrol.wait`:
no kernel of the graph writes weights (the rewrite checks), x is read only after the wait.

With a gate (GATE_EPILOGUE: a gated MLP's merged gate/up projection) the epilogue writes
silu(gate) * up itself: a fragment's rows g and g + 8 are the gate's and the up's weight rows of one
output feature, so the lane that holds one half holds the other, and no kernel of its own runs the
product. The rewrite uses it only where kernels/decode_linear.py's GATE_EPILOGUE_ROWS says (measured).

What the source asks for is not always what runs: with XPF 0 / 1 ptxas issues a round's loads only after
the previous round's mma (the disassembly shows it; see Stage), which keeps registers few and blocks an
SM many. XPF 2, the ordered pipeline, keeps the loads ahead of the mma at the cost of registers: it pays
where the SMs hold one block each anyway (decode_linear_mma.default_config has the numbers). XPF 3 is
the ordered pipeline with x copied through shared memory (cp.async, XS slots a warp), for 17-32 rows,
where x's registers are more than 16 warps can hold.

Defines set per variant: MT, NT, WARPS, U, NORM, GATED, GATE_EPILOGUE, XPF, XS; DTYPE is replaced by bf16 / f16.
"""

from torch_ext.kernels.decode_linear_mma_pipelines import PIPELINES

__all__ = ["KERNEL", "SOURCE", "build_source"]

SOURCE = r"""
typedef unsigned int u32;
typedef unsigned short u16;
struct __align__(16) u32x4 { u32 x, y, z, w; };

// Streamed once per step: no L1 allocation. In the ordered pipeline (XPF 2, 3) a plain load: ptxas moves
// a non-coherent (.nc) load past __syncwarp, and sinks it below the mma it was issued ahead of.
__device__ __forceinline__ u32x4 load_weight(const u16* p) {
  u32x4 v;
#if XPF >= 2
  asm volatile("ld.global.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
#else
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
#endif
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
// silu in float, rounded to 16 bits after: a fast division. An IEEE one calls a slow-path subroutine, and
// with it the gate epilogue's kernel spills under its 6-blocks-an-SM bound (KERNEL: 176 bytes at 4 warps).
__device__ __forceinline__ float silu(float h) { return __fdividef(h, 1.f + __expf(-h)); }
// x's prologue on a pair of 16-bit values, rounding where eager rounds (kernels/decode_linear.py:
// prologue_reference): RMSNorm (times inv_rms, round, times the norm weight, round), then silu(x) * up.
__device__ __forceinline__ u16 prologue(u16 v, u16 g, u16 up, float inv_rms) {
#if NORM
  v = from_float(to_float(v) * inv_rms);
  v = from_float(to_float(g) * to_float(v));
#endif
#if GATED
  const float h = to_float(v);
  v = from_float(silu(h));
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
"""

# The kernel itself, after the pipelines (kernels/decode_linear_mma_pipelines.py) it runs.
KERNEL = r"""
// The gate epilogue at 4 warps (gate/up at 17-32 rows) held 82-84 registers, a block an SM fewer than the
// plain kernel's 6 (its 704 blocks then take two waves): ask ptxas for 6 (80 registers, no spill).
// (A second argument of 1 elsewhere is not neutral: ptxas then takes up to 128 registers.)
#if GATE_EPILOGUE && WARPS == 4
#define LAUNCH_BOUNDS __launch_bounds__(WARPS * 32, 6)
#else
#define LAUNCH_BOUNDS __launch_bounds__(WARPS * 32)
#endif
extern "C" __global__ void LAUNCH_BOUNDS
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

#if XPF >= 2
  Stage a, b;
  load_weights(a, rows, warp, chunks);
#else
  u32x4 cur[U][MT][2][2];
#pragma unroll
  for (int u = 0; u < U; ++u) load_chunk(cur[u], rows, warp + u * WARPS, chunks);
#endif
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
#if XPF == 3
#pragma unroll
  for (int r = 0; r < XS - 1; ++r) copy_xs(r, x, x_stride, warp + r * U * WARPS, chunks, M, warp, lane);
  for (int c = warp, r = 0; c < chunks; c += 2 * U * WARPS, r += 2) {
    round_(acc, a, b, rows, x, x_stride, pro, r, c, chunks, M, warp, lane);
    round_(acc, b, a, rows, x, x_stride, pro, r + 1, c + U * WARPS, chunks, M, warp, lane);
  }
  asm volatile("cp.async.wait_all;" ::: "memory");  // the copies past the end (zero-filled) land before exit
#elif XPF == 2
  load_xs(a, x, x_stride, warp, chunks, M, g, t);
  for (int c = warp; c < chunks; c += 2 * U * WARPS) {
    round_(acc, a, b, rows, x, x_stride, pro, c, chunks, M, g, t);
    round_(acc, b, a, rows, x, x_stride, pro, c + U * WARPS, chunks, M, g, t);
  }
#else
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
#endif

  // The warps' partial sums, added in warp order.
  __shared__ float partial[WARPS][NT * MT * 4][32];  // (in the x slots instead: no faster, measured)
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
      for (int i = 0; i < 4; ++i) partial[warp][(j * MT + m) * 4 + i][lane] = acc[j][m][i];
  __syncthreads();
#if GATE_EPILOGUE
  // A feature's gate half is in slot (j * MT + m) * 4 + i for i = 0, 1, its up half two slots on: the
  // threads walk the gate halves only (a walk over every slot that skipped the up halves held 110
  // registers a thread at 4 warps, 30 more than the kernel without the gate: 4 blocks an SM, not 6).
  for (int v = threadIdx.x; v < NT * MT * 2 * 32; v += WARPS * 32) {
    const int half = v / 32, l = v % 32;
    const int j = half / (MT * 2), m = (half / 2) % MT, i = half % 2;
    const int slot = (j * MT + m) * 4 + i;
    const int row = 8 * j + 2 * (l & 3) + i;
    const int feature = f0 + 8 * m + (l >> 2);
    if (row >= M || feature >= N) continue;
    float gate = 0.f, up_sum = 0.f;
    for (int k = 0; k < WARPS; ++k) gate += partial[k][slot][l], up_sum += partial[k][slot + 2][l];
    if (bias) gate += to_float(bias[gate_start + feature]), up_sum += to_float(bias[up_start + feature]);
    // Rounded where eager rounds: each projection's output, silu's, the product.
    const float h = to_float(from_float(gate));
    u16 out = from_float(to_float(from_float(silu(h))) * to_float(from_float(up_sum)));
#else
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
#endif
    if (residual) out = from_float(to_float(out) + to_float(residual[(long long)row * N + feature]));
    y[(long long)row * N + feature] = out;
  }
}
"""


def build_source(dtype: str, defines: dict) -> str:
    """The source of one variant: its defines, the helpers (SOURCE), the ordered pipelines (PIPELINES), the
    kernel (KERNEL), DTYPE replaced by bf16 / f16."""
    code = SOURCE + PIPELINES + KERNEL
    return "".join(f"#define {k} {v}\n" for k, v in defines.items()) + code.replace("DTYPE", dtype)
