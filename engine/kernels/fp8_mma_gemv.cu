// Small-M FP8 weight-only linear on the f16 tensor cores: y [M, N] = x [M, K] @ (W * s)^T (+ bias)
// for M <= 8, W e4m3 codes [N, K] (K contiguous, rows 16-byte aligned), x and y bf16 or f16.
// engine/kernels/fp8_mma.py compiles it with NVRTC, one cubin per set of the macros below, and
// launches it; its docstring says why it exists and how it is laid out.
//
// One mma.sync.m16n8k16 takes 16 weight rows x 16 k as its A operand and up to 8 rows of x as its
// B operand, so a batch of 1 to 8 costs the same. A lane (g = lane / 4, t = lane % 4) loads 16
// consecutive codes of rows g and g + 8 (one 16-byte load each) and uses them in 4 mmas: in mma q
// the fragment's k slots (2t, 2t + 1, 2t + 8, 2t + 9) hold the real k (16t + 4q + 0..3), a
// permutation of each 64-wide chunk that B's fragment shares (lane (g, t) brings x[g] at the same
// k: a dot product does not care about the order of its terms). One cvt.rn.f16x2.e4m3x2 widens
// two codes; nothing else touches them.
//
// x is staged per warp in shared memory as f16, scaled per row and 128-wide group by 2^-E (E the
// exponent of the group's largest |x|: x / 2^E is exact in f16 down to 2^-14 of the group's
// largest), so the product is the weight-only one, unquantized; each group's f32 sums are
// multiplied by 2^E and by the weight scale of its 128 x 128 block (SCALE_MODE 1), or the rows'
// scales at the end (SCALE_MODE 2: per row / per tensor).
//
// A CTA owns 16 * TILES rows and a k range (k_split, SPLIT programs along grid y); its WARPS
// warps take CHUNKS * 64-wide steps of it in turn and add their partial sums in shared memory at
// the end. With SPLIT > 1 the CTAs of one row tile meet as engine/kernels/gemv.py's do: float32
// partials [SPLIT, M, N] in its workspace, an acq_rel counter, the last CTA sums and resets it.
//
// Macros: TILES (1, 2), WARPS, CHUNKS (even), SPLIT (1: no workspace), SCALE_MODE (1, 2),
// X_F16 (x/y f16, else bf16), HAS_BIAS, USE_GDC (programmatic dependent launch, sm_90),
// EARLY (the first weight loads before griddepcontrol.wait: weights are no kernel's output),
// PIPE (the next step's weights loaded before this step's math).

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;
typedef long long i64;

#define CHUNK 64
#define ITER_K (CHUNK * CHUNKS)
#define GROUPS_PER_ITER (CHUNKS / 2)
#define XROW (ITER_K + 8)  // f16 a staged x row: +16 bytes, so lanes of two rows hit other banks
#define THREADS (WARPS * 32)

struct WTile {
  u32 v[TILES][2][CHUNKS][4];  // [tile][row g / g + 8][chunk][4 words = 16 codes]
};

__device__ __forceinline__ void ld_stream(u32 (&d)[4], const u8* p) {
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3]) : "l"(p));
}

__device__ __forceinline__ void ld_cg4(u32 (&d)[4], const void* p) {
  asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3]) : "l"(p));
}

__device__ __forceinline__ float ld_cg_f32(const float* p) {
  float v;
  asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p));
  return v;
}

__device__ __forceinline__ void e4m3x4_to_f16x2(u32 word, u32& lo, u32& hi) {
  asm("{\n .reg .b16 l, h;\n mov.b32 {l, h}, %2;\n cvt.rn.f16x2.e4m3x2 %0, l;\n cvt.rn.f16x2.e4m3x2 %1, h;\n}"
      : "=r"(lo), "=r"(hi) : "r"(word));
}

__device__ __forceinline__ void mma16816(float (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ float act_to_f32(u16 h) {
#if X_F16
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
#else
  return __uint_as_float(((u32)h) << 16);
#endif
}

__device__ __forceinline__ u16 f32_to_act(float f) {
  u16 h;
#if X_F16
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
#else
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
#endif
  return h;
}

__device__ __forceinline__ u32 f32x2_to_f16x2(float lo, float hi) {
  u32 r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

// The weight codes of one step (CHUNKS chunks from kb) for this lane's rows; chunks at or past
// k_hi are not loaded (k_hi and kb are multiples of 128, so a group's two chunks go together).
__device__ __forceinline__ void load_weights(WTile& w, const u8* const (&rows)[TILES][2], int kb, int k_hi) {
#pragma unroll
  for (int c = 0; c < CHUNKS; c++) {
    if (kb + c * CHUNK < k_hi) {
#pragma unroll
      for (int r = 0; r < TILES; r++) {
#pragma unroll
        for (int h = 0; h < 2; h++) ld_stream(w.v[r][h][c], rows[r][h] + kb + c * CHUNK);
      }
    }
  }
}

// x [M, kb .. kb + ITER_K) into this warp's shared rows as f16 scaled per 128-wide group, and
// each group's 2^E into xe [M, GROUPS_PER_ITER]. A lane converts 16 values a pass (two 16-byte
// loads); a group is 8 lanes, which agree on its largest |x| by shuffles.
__device__ __forceinline__ void stage_x(u16* xs, float* xe, const u16* x, i64 stride_xm, int M, int kb, int k_hi, int lane) {
  __syncwarp();  // every lane is done reading the previous step's rows
  const int passes = (M * ITER_K + 511) / 512;
  for (int p = 0; p < passes; p++) {
    const int v = (p * 32 + lane) * 16;
    const int m = v / ITER_K;
    const int kk = v - m * ITER_K;
    const bool ok = m < M && kb + kk < k_hi;
    u32 raw[8] = {0u, 0u, 0u, 0u, 0u, 0u, 0u, 0u};
    if (ok) {
      u32(&lo)[4] = *reinterpret_cast<u32(*)[4]>(raw);
      u32(&hi)[4] = *reinterpret_cast<u32(*)[4]>(raw + 4);
      ld_cg4(lo, x + m * stride_xm + kb + kk);
      ld_cg4(hi, x + m * stride_xm + kb + kk + 8);
    }
    float f[16];
#pragma unroll
    for (int i = 0; i < 8; i++) {
      f[2 * i] = act_to_f32((u16)(raw[i] & 0xFFFFu));
      f[2 * i + 1] = act_to_f32((u16)(raw[i] >> 16));
    }
    float amax = 0.f;
#pragma unroll
    for (int i = 0; i < 16; i++) amax = fmaxf(amax, fabsf(f[i]));
#pragma unroll
    for (int o = 1; o < 8; o <<= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    const u32 e_bits = __float_as_uint(fmaxf(amax, 1e-30f)) & 0x7F800000u;
    const float inv = __uint_as_float(0x7F000000u - e_bits);  // 2^-E
    if (m < M) {
      u32 packed[8];
#pragma unroll
      for (int i = 0; i < 8; i++) packed[i] = f32x2_to_f16x2(f[2 * i] * inv, f[2 * i + 1] * inv);
      uint4* dst = reinterpret_cast<uint4*>(xs + m * XROW + kk);
      dst[0] = make_uint4(packed[0], packed[1], packed[2], packed[3]);
      dst[1] = make_uint4(packed[4], packed[5], packed[6], packed[7]);
      if ((lane & 7) == 0) xe[m * GROUPS_PER_ITER + kk / 128] = __uint_as_float(e_bits);
    }
  }
  __syncwarp();
}

// One step's products: per 128-wide group, 8 mmas a tile into fresh f32 sums, then those sums
// times 2^E (per x row) and the block's weight scale into the running totals.
__device__ __forceinline__ void step_math(float (&acc)[TILES][4], const WTile& w, const u16* xs, const float* xe,
                                          const float* scale, const int (&srow)[TILES], i64 stride_sk,
                                          int M, int kb, int k_hi, int g, int t) {
  const u16* xrow = xs + min(g, M - 1) * XROW + 16 * t;
#pragma unroll
  for (int j = 0; j < GROUPS_PER_ITER; j++) {
    if (kb + j * 128 < k_hi) {
      float part[TILES][4];
#pragma unroll
      for (int r = 0; r < TILES; r++) part[r][0] = part[r][1] = part[r][2] = part[r][3] = 0.f;
#pragma unroll
      for (int h2 = 0; h2 < 2; h2++) {
        const int c = 2 * j + h2;
        const uint4 xa = *reinterpret_cast<const uint4*>(xrow + c * CHUNK);
        const uint4 xb = *reinterpret_cast<const uint4*>(xrow + c * CHUNK + 8);
        const u32 xf[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
#pragma unroll
        for (int r = 0; r < TILES; r++) {
#pragma unroll
          for (int q = 0; q < 4; q++) {
            u32 g_lo, g_hi, g8_lo, g8_hi;
            e4m3x4_to_f16x2(w.v[r][0][c][q], g_lo, g_hi);
            e4m3x4_to_f16x2(w.v[r][1][c][q], g8_lo, g8_hi);
            mma16816(part[r], g_lo, g8_lo, g_hi, g8_hi, xf[2 * q], xf[2 * q + 1]);
          }
        }
      }
      const float sx0 = xe[min(2 * t, M - 1) * GROUPS_PER_ITER + j];
      const float sx1 = xe[min(2 * t + 1, M - 1) * GROUPS_PER_ITER + j];
#pragma unroll
      for (int r = 0; r < TILES; r++) {
#if SCALE_MODE == 1
        const float sw = __ldg(scale + srow[r] + (i64)((kb + j * 128) / 128) * stride_sk);
#else
        const float sw = 1.f;
#endif
        acc[r][0] += part[r][0] * (sw * sx0);
        acc[r][1] += part[r][1] * (sw * sx1);
        acc[r][2] += part[r][2] * (sw * sx0);
        acc[r][3] += part[r][3] * (sw * sx1);
      }
    }
  }
}

extern "C" __global__ void __launch_bounds__(THREADS)
fp8_mma_gemv(const u16* __restrict__ x, const u8* __restrict__ w, const float* __restrict__ scale,
             const u16* __restrict__ bias, u16* __restrict__ out, float* __restrict__ ws, int* __restrict__ cnt,
             int M, int N, int K, int k_split, i64 stride_xm, i64 stride_wn, i64 stride_om, i64 stride_sn,
             i64 stride_sk, int scale_n) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int n0 = blockIdx.x * (16 * TILES);
  const int k_lo = blockIdx.y * k_split;
  const int k_hi = min(k_lo + k_split, K);
  const int stage_bytes = ((M * XROW * 2 + M * GROUPS_PER_ITER * 4) + 15) & ~15;
  u16* xs = reinterpret_cast<u16*>(smem + warp * stage_bytes);
  float* xe = reinterpret_cast<float*>(smem + warp * stage_bytes + M * XROW * 2);

  // Weight rows past N read the last real row (the loads stay unconditional); their sums are not stored.
  const u8* rows[TILES][2];
  int srow[TILES];
#pragma unroll
  for (int r = 0; r < TILES; r++) {
#pragma unroll
    for (int h = 0; h < 2; h++) rows[r][h] = w + (i64)min(n0 + 16 * r + g + 8 * h, N - 1) * stride_wn + 16 * t;
    srow[r] = (int)((i64)(min(n0 + 16 * r, N - 1) / scale_n) * stride_sn);
  }
  float acc[TILES][4];
#pragma unroll
  for (int r = 0; r < TILES; r++) acc[r][0] = acc[r][1] = acc[r][2] = acc[r][3] = 0.f;

  int kb = k_lo + warp * ITER_K;
  const int stride = WARPS * ITER_K;
  WTile wa;
#if EARLY
  if (kb < k_hi) load_weights(wa, rows, kb, k_hi);
#endif
#if USE_GDC
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
#if !EARLY
  if (kb < k_hi) load_weights(wa, rows, kb, k_hi);
#endif
#if PIPE
  WTile wb;
  while (kb < k_hi) {
    int kn = kb + stride;
    if (kn < k_hi) load_weights(wb, rows, kn, k_hi);
    stage_x(xs, xe, x, stride_xm, M, kb, k_hi, lane);
    step_math(acc, wa, xs, xe, scale, srow, stride_sk, M, kb, k_hi, g, t);
    if (kn >= k_hi) break;
    kb = kn;
    kn = kb + stride;
    if (kn < k_hi) load_weights(wa, rows, kn, k_hi);
    stage_x(xs, xe, x, stride_xm, M, kb, k_hi, lane);
    step_math(acc, wb, xs, xe, scale, srow, stride_sk, M, kb, k_hi, g, t);
    kb = kn;
  }
#else
  while (kb < k_hi) {
    stage_x(xs, xe, x, stride_xm, M, kb, k_hi, lane);
    step_math(acc, wa, xs, xe, scale, srow, stride_sk, M, kb, k_hi, g, t);
    kb += stride;
    if (kb < k_hi) load_weights(wa, rows, kb, k_hi);
  }
#endif

  // The warps' partial sums meet in shared memory: red [WARPS][16 * TILES rows][8 x rows].
  __syncthreads();
  float* red = reinterpret_cast<float*>(smem);
#pragma unroll
  for (int r = 0; r < TILES; r++) {
    float* row_g = red + ((warp * TILES + r) * 16 + g) * 8 + 2 * t;
    row_g[0] = acc[r][0];
    row_g[1] = acc[r][1];
    row_g[64] = acc[r][2];  // row g + 8
    row_g[65] = acc[r][3];
  }
  __syncthreads();
  const int outputs = 16 * TILES * M;
  for (int o = threadIdx.x; o < outputs; o += THREADS) {
    const int row = o / M, m = o - row * M;
    float s = 0.f;
#pragma unroll
    for (int wp = 0; wp < WARPS; wp++) s += red[(wp * 16 * TILES + row) * 8 + m];
    const int n = n0 + row;
#if SCALE_MODE == 2
    s *= __ldg(scale + (i64)(min(n, N - 1) / scale_n) * stride_sn);
#endif
    if (n < N) {
#if SPLIT == 1
#if HAS_BIAS
      s += act_to_f32(bias[n]);
#endif
      out[m * stride_om + n] = f32_to_act(s);
#else
      ws[((i64)blockIdx.y * M + m) * N + n] = s;
#endif
    }
  }
#if SPLIT > 1
  __shared__ int last;
  __threadfence();  // this CTA's partials are visible before its arrival is
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(cnt + blockIdx.x, 1) == (int)gridDim.y - 1;
  __syncthreads();
  if (last) {
    __threadfence();
    for (int o = threadIdx.x; o < outputs; o += THREADS) {
      const int row = o / M, m = o - row * M;
      const int n = n0 + row;
      if (n < N) {
        float s = 0.f;
        for (int sp = 0; sp < (int)gridDim.y; sp++) s += ld_cg_f32(ws + ((i64)sp * M + m) * N + n);
#if HAS_BIAS
        s += act_to_f32(bias[n]);
#endif
        out[m * stride_om + n] = f32_to_act(s);
      }
    }
    if (threadIdx.x == 0) atomicExch(cnt + blockIdx.x, 0);  // zero again for the next launch (and graph replay)
  }
#endif
}
