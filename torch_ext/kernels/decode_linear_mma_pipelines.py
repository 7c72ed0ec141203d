"""The ordered pipelines of decode_linear's CUDA path (x modes 2 and 3; kernels/decode_linear_mma_source.py has
the helpers they use and the kernel that runs them, and says why they exist): a round's weights in one of
two register stages used in turn, loaded before the mma they overlap; x in registers beside them (mode 2,
up to 16 rows) or copied through shared memory by cp.async (mode 3, 17-32 rows, where x's registers are
more than 16 warps hold). build_source puts this text between the helpers and the kernel."""

__all__ = ["PIPELINES"]

PIPELINES = r"""
#if XPF == 3
// The ordered pipeline with x through shared memory (17-32 rows, where x's registers are what the
// ordered pipeline cannot afford): a warp copies its rounds' x with cp.async, XS - 1 rounds ahead, and
// reads it back just before the mma. The copy is coalesced (a lane copies 16 bytes of a 128-byte row
// run: 4 whole rows an instruction; the mma's own layout would fetch every 32-byte sector twice with L1
// bypassed), the read takes the mma's layout; 16-byte units are swizzled by the row's parity so the 8
// lanes of a read phase (2 rows, 4 units each) hit distinct banks. x holds no registers while in flight.
extern __shared__ u32x4 x_slots[];  // [XS][WARPS][U][NT * 8 rows][8 units of 16 bytes]

__device__ __forceinline__ u32x4* x_slot(int round, int u, int warp) {
  return x_slots + (((round % XS) * WARPS + warp) * U + u) * NT * 64;
}

__device__ __forceinline__ int x_unit(int row, int unit) { return row * 8 + (unit ^ (row & 1)); }

struct Stage {
  u32x4 w[U][MT][2][2];
};

__device__ __forceinline__ void load_weights(Stage& s, const u16* const (&rows)[MT][2], int c, int chunks) {
#pragma unroll
  for (int u = 0; u < U; ++u) load_chunk(s.w[u], rows, c + u * WARPS, chunks);
}

// Round `round`'s x (chunks c, c + WARPS, ...) into its slots, as one cp.async group; rows past M and
// chunks past the end are filled with zeros (a source size of 0 reads nothing).
__device__ __forceinline__ void copy_xs(int round, const u16* x, int x_stride, int c, int chunks, int M, int warp,
                                        int lane) {
  const int unit = lane & 7;
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int chunk = c + u * WARPS;
    u32x4* slot = x_slot(round, u, warp);
#pragma unroll
    for (int i = 0; i < 2 * NT; ++i) {
      const int row = (lane >> 3) + 4 * i;
      const bool inside = row < M && chunk < chunks;
      const u16* p = inside ? x + (long long)row * x_stride + chunk * 64 + unit * 8 : x;
      const u32 dst = (u32)__cvta_generic_to_shared(slot + x_unit(row, unit));
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(p), "r"(inside ? 16 : 0));
    }
  }
  asm volatile("cp.async.commit_group;");
}

// Multiply `cur` (round `round`: chunks c, c + WARPS, ...) while `next`'s weights and the x of round
// `round` + XS - 1 (into the slots round - 1 read: hence the first __syncwarp) are loaded.
__device__ __forceinline__ void round_(float (&acc)[NT][MT][4], const Stage& cur, Stage& next,
                                       const u16* const (&rows)[MT][2], const u16* x, int x_stride,
                                       const Prologue& pro, int round, int c, int chunks, int M, int warp, int lane) {
  const int g = lane >> 2, t = lane & 3;
  load_weights(next, rows, c + U * WARPS, chunks);
  __syncwarp();
  copy_xs(round + XS - 1, x, x_stride, c + (XS - 1) * U * WARPS, chunks, M, warp, lane);
  asm volatile("cp.async.wait_group %0;" ::"n"(XS - 1) : "memory");
  __syncwarp();  // the other lanes' copies of this round are visible
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const u32x4* slot = x_slot(round, u, warp);
    u32x4 xr[NT][2];
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h) xr[j][h] = slot[x_unit(8 * j + g, 2 * t + h)];
    multiply_chunk(acc, cur.w[u], xr, pro, c + u * WARPS, chunks, M, g, t);
  }
}
#endif

#if XPF == 2
// The ordered pipeline: a round's operands (U chunks of weights and their x per warp) in one of two
// stages used in turn. Copying `next` into `cur` (XPF 0 / 1) lets ptxas give both the same registers,
// and then it issues the next round's loads only after this round's mma: nothing of the warp's is in
// flight while its tensor cores work. Here the loads are issued, then __syncwarp (ptxas keeps
// coherent loads above it), then the mma.
struct Stage {
  u32x4 w[U][MT][2][2];
  u32x4 x[U][NT][2];
};

__device__ __forceinline__ void load_weights(Stage& s, const u16* const (&rows)[MT][2], int c, int chunks) {
#pragma unroll
  for (int u = 0; u < U; ++u) load_chunk(s.w[u], rows, c + u * WARPS, chunks);
}

__device__ __forceinline__ void load_xs(Stage& s, const u16* x, int x_stride, int c, int chunks, int M, int g, int t) {
#pragma unroll
  for (int u = 0; u < U; ++u) load_x_chunk(s.x[u], x, x_stride, c + u * WARPS, chunks, M, g, t);
}

// Multiply `cur` (chunks c, c + WARPS, ...) while `next` is loaded with the round after it.
__device__ __forceinline__ void round_(float (&acc)[NT][MT][4], const Stage& cur, Stage& next,
                                       const u16* const (&rows)[MT][2], const u16* x, int x_stride,
                                       const Prologue& pro, int c, int chunks, int M, int g, int t) {
  load_weights(next, rows, c + U * WARPS, chunks);
  load_xs(next, x, x_stride, c + U * WARPS, chunks, M, g, t);
  __syncwarp();
#pragma unroll
  for (int u = 0; u < U; ++u) multiply_chunk(acc, cur.w[u], cur.x[u], pro, c + u * WARPS, chunks, M, g, t);
}
#endif


"""
