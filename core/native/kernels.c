/* specdec's kernels, batch-invariant by construction: the linears (y = x @ W^T, W in float32, bfloat16
 * or float16) and the per-row ops of exact numerics (RMSNorm, SwiGLU, rotary, attention), in float32.
 *
 * Linears:
 *
 * Every output element is one chain of fused multiply-adds over k = 0..K-1, in that order, starting
 * from zero, whatever the number of rows, the row's place, the column split between threads or the
 * panel it falls in: a row's result has the same bits alone or in any batch (core/native_kernels.py).
 *
 * W is packed once into panels of NR columns, [panels][k][NR] (zero columns past n), so a panel is
 * one contiguous stream; a call walks row blocks of MC rows, and within each, panels, and within
 * each panel, micro-blocks of up to MR rows whose accumulators stay in registers. Built on the
 * machine that runs it (-march=native): AVX-512 or AVX2 with FMA, chosen by the compiler's macros.
 *
 * Half-precision weights (bfloat16, and float16 where the CPU has F16C) are held in the same panels
 * at half the bytes and widened exactly to float32 in registers; activations and accumulators stay
 * float32, so the FMA chain is the float32 kernel's over the widened weights, bit for bit. A
 * bfloat16 panel row interleaves its two halves (element 2i: column i, 2i + 1: column i + LANES), so
 * one load gives both: a 32-bit word shifted left 16 is column i, masked to its top half column i + LANES.
 */
#include <immintrin.h>
#include <pthread.h>
#include <stdint.h>
#include <math.h>
#include <string.h>

#if defined(__AVX512F__)
#define LANES 16
#define MR 8
#define ACC 24
typedef __m512 vf;
#define VZERO() _mm512_setzero_ps()
#define VLOAD(p) _mm512_loadu_ps(p)
#define VSET1(s) _mm512_set1_ps(s)
#define VFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define VSTORE(p, v) _mm512_storeu_ps(p, v)
typedef __m512i vint;
#define VLOADI(p) _mm512_loadu_si512(p)
#define VSHL16(v) _mm512_castsi512_ps(_mm512_slli_epi32(v, 16))
#define VTOP16(v) _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xFFFF0000u)))
#define VLOAD_F16(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#define HAVE_F16 1
#elif defined(__AVX2__) && defined(__FMA__)
#define LANES 8
#define MR 6
#define ACC 12
typedef __m256 vf;
#define VZERO() _mm256_setzero_ps()
#define VLOAD(p) _mm256_loadu_ps(p)
#define VSET1(s) _mm256_set1_ps(s)
#define VFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define VSTORE(p, v) _mm256_storeu_ps(p, v)
typedef __m256i vint;
#define VLOADI(p) _mm256_loadu_si256((const __m256i *)(p))
#define VSHL16(v) _mm256_castsi256_ps(_mm256_slli_epi32(v, 16))
#define VTOP16(v) _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xFFFF0000u)))
#if defined(__F16C__)
#define VLOAD_F16(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define HAVE_F16 1
#endif
#else
#error "specdec's native kernels need AVX2 with FMA or AVX-512"
#endif

#define NR (2 * LANES)
#define MC 64
/* Panel rows a micro-block asks the memory for ahead of its FMAs (2 KB of a bf16 panel): one core's
 * hardware prefetch alone leaves its loads waiting once several rows' FMAs sit between them. */
#define PF_ROWS 32

int specdec_panel_width(void) { return NR; }
int specdec_rows_per_block(void) { return MR; }

/* Weight types of the linears: what a panel's elements are. */
enum { W_F32 = 0, W_BF16 = 1, W_F16 = 2 };
#ifndef HAVE_F16
#define HAVE_F16 0
#endif
/* Bit t set where weight type t runs here (float16 needs F16C). */
int specdec_weight_types(void) { return 1 << W_F32 | 1 << W_BF16 | HAVE_F16 << W_F16; }

/* Row kk of a panel (NR columns from element ``at``), widened exactly to float32: lo gets columns
 * 0..LANES-1, hi columns LANES..NR-1. */
static inline __attribute__((always_inline)) void panel_row(const void *panel, int64_t at, vf *lo, vf *hi, const int wt) {
  if (wt == W_F32) {
    *lo = VLOAD((const float *)panel + at);
    *hi = VLOAD((const float *)panel + at + LANES);
  } else if (wt == W_BF16) {
    const vint both = VLOADI((const uint16_t *)panel + at); /* word i: column i low, column i + LANES high */
    *lo = VSHL16(both);
    *hi = VTOP16(both);
  } else {
#if HAVE_F16
    *lo = VLOAD_F16((const uint16_t *)panel + at);
    *hi = VLOAD_F16((const uint16_t *)panel + at + LANES);
#else
    *lo = *hi = VZERO(); /* not reached: specdec_weight_types() says float16 does not run here */
#endif
  }
}

/* np panels side by side for mr rows: few rows alone leave the FMA units waiting on each chain's
 * latency, so they take more columns at once (more independent chains, each element's unchanged). */
#define NP(mr) ((ACC / (2 * (mr))) < 1 ? 1 : (ACC / (2 * (mr))) > 4 ? 4 : (ACC / (2 * (mr))))

static inline __attribute__((always_inline)) void micro(const float *x, int64_t ldx, int64_t k, const void *panel,
                                                        int64_t pstride, float *y, int64_t ldy, int64_t cols,
                                                        const int mr, const int np, const int wt) {
  vf acc[MR][4][2];
#pragma GCC unroll 8
  for (int r = 0; r < mr; r++)
#pragma GCC unroll 4
    for (int j = 0; j < np; j++) acc[r][j][0] = acc[r][j][1] = VZERO();
  for (int64_t kk = 0; kk < k; kk++) {
    vf w[4][2];
#pragma GCC unroll 4
    for (int j = 0; j < np; j++) { /* (past a panel's end: a hint, never a fault) */
      const char *ahead = (const char *)panel + (j * pstride + (kk + PF_ROWS) * NR) * (wt == W_F32 ? 4 : 2);
      _mm_prefetch(ahead, _MM_HINT_T0);
      if (wt == W_F32) _mm_prefetch(ahead + 64, _MM_HINT_T0); /* a float32 panel row is two cache lines */
    }
#pragma GCC unroll 4
    for (int j = 0; j < np; j++) panel_row(panel, j * pstride + kk * NR, &w[j][0], &w[j][1], wt);
#pragma GCC unroll 8
    for (int r = 0; r < mr; r++) {
      const vf b = VSET1(x[r * ldx + kk]);
#pragma GCC unroll 4
      for (int j = 0; j < np; j++) {
        acc[r][j][0] = VFMA(b, w[j][0], acc[r][j][0]);
        acc[r][j][1] = VFMA(b, w[j][1], acc[r][j][1]);
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < mr; r++)
#pragma GCC unroll 4
    for (int j = 0; j < np; j++) {
      float *out = y + r * ldy + j * NR;
      if (j < np - 1 || cols == NR) {
        VSTORE(out, acc[r][j][0]);
        VSTORE(out + LANES, acc[r][j][1]);
      } else {
        float tmp[NR];
        VSTORE(tmp, acc[r][j][0]);
        VSTORE(tmp + LANES, acc[r][j][1]);
        memcpy(out, tmp, (size_t)cols * sizeof(float));
      }
    }
}

#define CASE(m)                                                              \
  case m:                                                                    \
    if (np == NP(m))                                                         \
      micro(x, ldx, k, panel, pstride, y, ldy, cols, m, NP(m), wt);          \
    else                                                                     \
      micro(x, ldx, k, panel, pstride, y, ldy, cols, m, 1, wt);              \
    break;

/* mr rows against np panels (NP(mr), or 1); ``cols``: the width of the last of them. */
static inline __attribute__((always_inline)) void block(const float *x, int64_t ldx, int64_t k, const void *panel,
                                                        int64_t pstride, float *y, int64_t ldy, int64_t cols, int mr,
                                                        int np, const int wt) {
  switch (mr) {
    CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6)
#if MR > 6
    CASE(7) CASE(8)
#endif
  }
}

/* Panels a block of rows walks together: each group's weights stay in cache while every micro-block of
 * the rows uses them (walking all panels per micro-block streams the whole matrix from memory each time). */
#define GROUP 4

/* Panels p0..p1 of y = x @ W^T: x [m, k] row-major, packed W of type ``wt`` as above, y [m, n]
 * row-major. Calls on disjoint panel ranges may run at once (each writes its own columns). */
static inline __attribute__((always_inline)) void gemm(const float *x, int64_t m, int64_t k, const void *packed,
                                                       int64_t n, float *y, int64_t p0, int64_t p1, const int wt) {
  const int64_t pstride = k * NR; /* elements */
  const int64_t esize = wt == W_F32 ? 4 : 2;
  const int64_t group = m <= MR ? p1 - p0 : GROUP; /* one micro-block: nothing to reuse, widest np */
  for (int64_t i0 = 0; i0 < m; i0 += MC) {
    const int64_t rows = m - i0 < MC ? m - i0 : MC;
    for (int64_t g = p0; g < p1; g += group) {
      const int64_t g1 = g + group < p1 ? g + group : p1;
      for (int64_t i = 0; i < rows; i += MR) {
        const int mr = (int)(rows - i < MR ? rows - i : MR);
        const int np = NP(mr);
        for (int64_t p = g; p < g1;) {
          const int take = p + np <= g1 ? np : 1;
          const int64_t c0 = (p + take - 1) * NR, cols = n - c0 < NR ? n - c0 : NR;
          block(x + (i0 + i) * k, k, k, (const char *)packed + p * pstride * esize, pstride, y + (i0 + i) * n + p * NR, n,
                cols, mr, take, wt);
          p += take;
        }
      }
    }
  }
}

#define GEMM_ARGS const float *x, int64_t m, int64_t k, const void *packed, int64_t n, float *y, int64_t p0, int64_t p1
void specdec_gemm(GEMM_ARGS) { gemm(x, m, k, packed, n, y, p0, p1, W_F32); }
void specdec_gemm_bf16(GEMM_ARGS) { gemm(x, m, k, packed, n, y, p0, p1, W_BF16); }
void specdec_gemm_f16(GEMM_ARGS) {
  if (HAVE_F16) gemm(x, m, k, packed, n, y, p0, p1, W_F16);
}

/* ---------------------------------------------------------------- per-row ops of exact numerics
 * Each row's result depends on that row's data alone, in a fixed order of operations; GCC's vector
 * extensions give the machine's own width. */
typedef float vx __attribute__((vector_size(4 * LANES)));
typedef float vxu __attribute__((vector_size(4 * LANES), aligned(4)));
typedef int32_t vi __attribute__((vector_size(4 * LANES)));

static inline vx vload(const float *p) { return *(const vxu *)p; }
static inline void vstore(float *p, vx v) { *(vxu *)p = v; }

static inline float hsum(vx v) { /* lanes added in a fixed tree: halves, quarters, ... (one shuffle each) */
#if LANES == 16
  v += __builtin_shuffle(v, (vi){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
  v += __builtin_shuffle(v, (vi){4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11});
  v += __builtin_shuffle(v, (vi){2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13});
  v += __builtin_shuffle(v, (vi){1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14});
#else
  v += __builtin_shuffle(v, (vi){4, 5, 6, 7, 0, 1, 2, 3});
  v += __builtin_shuffle(v, (vi){2, 3, 0, 1, 6, 7, 4, 5});
  v += __builtin_shuffle(v, (vi){1, 0, 3, 2, 5, 4, 7, 6});
#endif
  return v[0];
}

/* exp(x) for x <= 0 (a softmax's shifted scores, a SiLU's -|x|): range reduction to 2^n * exp(r),
 * |r| <= ln2/2, and a degree-6 polynomial: relative error about 2e-7; below -87 it is 0. */
static inline vx vexp(vx x) {
  const vx lo = (vx){} - 87.0f;
  const vi under = x < lo;
  x = (vx)((vi)x & ~under) + (vx)((vi)lo & under); /* max(x, -87) without a branch */
  const float magic = 12582912.0f;                 /* 1.5 * 2^23: adding it rounds to an integer */
  vx n = x * 1.44269504088896341f + magic;
  n = n - magic;
  const vx r = x - n * 0.693359375f + n * 2.12194440e-4f;
  vx p = (vx){} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
  return (vx)((vi)(p * (vx)bits) & ~under);
}

static inline float sexp(float x) { /* the same function on one value: a lane of vexp */
  vx v = (vx){} + x;
  return vexp(v)[0];
}

/* y[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w, rows of n (x and y rows ``ldx`` and ``n`` apart). */
void specdec_rms_norm(const float *x, int64_t rows, int64_t ldx, int64_t n, const float *w, float eps, float *y) {
  for (int64_t r = 0; r < rows; r++) {
    const float *xr = x + r * ldx;
    float *yr = y + r * n;
    vx acc = (vx){};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) {
      const vx v = vload(xr + i);
      acc += v * v;
    }
    float ss = hsum(acc);
    for (; i < n; i++) ss += xr[i] * xr[i];
    const float inv = 1.0f / sqrtf(ss / (float)n + eps);
    for (i = 0; i + LANES <= n; i += LANES) vstore(yr + i, vload(xr + i) * inv * vload(w + i));
    for (; i < n; i++) yr[i] = xr[i] * inv * w[i];
  }
}

/* h[r] = silu(gate) * up for rows [gate | up] of 2 * n (``ldx`` apart): silu(g) = g / (1 + exp(-g)). */
void specdec_swiglu(const float *x, int64_t rows, int64_t ldx, int64_t n, float *h) {
  for (int64_t r = 0; r < rows; r++) {
    const float *g = x + r * ldx, *u = g + n;
    float *hr = h + r * n;
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) {
      const vx gv = vload(g + i);
      const vi neg = gv < (vx){};
      const vx e = vexp((vx)((vi)gv | ((vi){} + INT32_MIN))); /* exp(-|g|): the sign bit set */
      const vx sig = (vx)(((vi)(1.0f / (1.0f + e)) & ~neg) | ((vi)(e / (1.0f + e)) & neg));
      vstore(hr + i, gv * sig * vload(u + i));
    }
    for (; i < n; i++) {
      const float e = sexp(g[i] < 0 ? g[i] : -g[i]);
      const float sig = g[i] < 0 ? e / (1.0f + e) : 1.0f / (1.0f + e);
      hr[i] = g[i] * sig * u[i];
    }
  }
}

/* Rotary on rows of ``heads`` heads of d (pairs adjacent), ``ldx`` apart: out [rows, heads, d];
 * ``cs`` [rows, d/2, 2] holds each row's (cos, sin) per pair. */
void specdec_rotary(const float *x, int64_t rows, int64_t ldx, int64_t heads, int64_t d, const float *cs, float *out) {
  for (int64_t r = 0; r < rows; r++) {
    const float *c = cs + r * d;
    for (int64_t hh = 0; hh < heads; hh++) {
      const float *a = x + r * ldx + hh * d;
      float *o = out + (r * heads + hh) * d;
      for (int64_t i = 0; i < d; i += 2) {
        o[i] = a[i] * c[i] - a[i + 1] * c[i + 1];
        o[i + 1] = a[i] * c[i + 1] + a[i + 1] * c[i];
      }
    }
  }
}

/* Keys and values as stored: float32, or bfloat16 widened exactly (its bits are a float32's top half). */
typedef uint16_t vh __attribute__((vector_size(2 * LANES), aligned(2)));
typedef uint32_t vu __attribute__((vector_size(4 * LANES)));

static inline __attribute__((always_inline)) vx kv_load(const void *base, int64_t at, const int bf16) {
  if (!bf16) return vload((const float *)base + at);
  const vu wide = __builtin_convertvector(*(const vh *)((const uint16_t *)base + at), vu);
  return (vx)(wide << 16);
}

static inline __attribute__((always_inline)) float kv_at(const void *base, int64_t at, const int bf16) {
  if (!bf16) return ((const float *)base)[at];
  const uint32_t bits = (uint32_t)((const uint16_t *)base)[at] << 16;
  float f;
  memcpy(&f, &bits, 4);
  return f;
}

#define MAX_VECS 16 /* head sizes up to 16 vectors (256 floats with AVX-512) keep their output in registers */

/* One (row, head): scores of keys j < length it may see, exps, then the weighted values, each in key order.
 * ``d`` is a constant where the caller specialises it (the loops unroll; the output lives in registers). */
static inline __attribute__((always_inline)) void attend_head(
    const float *qh, const void *keys, const void *values, int64_t off, int64_t pos_stride, int64_t length,
    const uint8_t *see, float scale, float *o, float *scratch, const int64_t d, const int bf16) {
  float top = -INFINITY;
  for (int64_t j = 0; j < length; j++) {
    if (see && !see[j]) {
      scratch[j] = -INFINITY;
      continue;
    }
    const int64_t kj = off + j * pos_stride;
    vx acc = (vx){};
    int64_t i = 0;
    for (; i + LANES <= d; i += LANES) acc += vload(qh + i) * kv_load(keys, kj + i, bf16);
    float s = hsum(acc);
    for (; i < d; i++) s += qh[i] * kv_at(keys, kj + i, bf16);
    s *= scale;
    scratch[j] = s;
    if (s > top) top = s;
  }
  for (int64_t j = 0; j < length; j += LANES) vstore(scratch + j, vexp(vload(scratch + j) - top)); /* lanes past length: unused */
  const int64_t vecs = d / LANES;
  vx out[MAX_VECS];
  for (int64_t c = 0; c < vecs && c < MAX_VECS; c++) out[c] = (vx){};
  for (int64_t i = vecs <= MAX_VECS ? vecs * LANES : 0; i < d; i++) o[i] = 0.0f;
  float total = 0.0f;
  for (int64_t j = 0; j < length; j++) {
    const float p = scratch[j];
    if (p == 0.0f) continue;
    total += p;
    const int64_t vj = off + j * pos_stride;
    if (vecs <= MAX_VECS) {
      for (int64_t c = 0; c < vecs; c++) out[c] += p * kv_load(values, vj + c * LANES, bf16);
    } else {
      for (int64_t c = 0; c < vecs; c++) vstore(o + c * LANES, vload(o + c * LANES) + p * kv_load(values, vj + c * LANES, bf16));
    }
    for (int64_t i = vecs * LANES; i < d; i++) o[i] += p * kv_at(values, vj + i, bf16);
  }
  const float inv = 1.0f / total;
  if (vecs <= MAX_VECS)
    for (int64_t c = 0; c < vecs; c++) vstore(o + c * LANES, out[c] * inv);
  else
    for (int64_t c = 0; c < vecs; c++) vstore(o + c * LANES, vload(o + c * LANES) * inv);
  for (int64_t i = vecs * LANES; i < d; i++) o[i] *= inv;
}

/* Attention of each query row over its own sequence's keys, one (row, head) at a time: scores and
 * exps per key, their sum and the weighted values in key order, one key at a time. Keys a row may not
 * see weigh exactly 0 and are skipped, so a row's bits depend only on the keys it sees and their order
 * (a token tree's node gets its chain twin's bits although siblings lie between its ancestors).
 * q [rows, heads, d] float32, rows ``ldq`` apart; row r's keys of KV head g at keys + slot[r] * slot_stride
 * + g * head_stride + j * pos_stride (elements), values likewise, float32 or (``bf16``) bfloat16; it sees
 * keys j < limit[r], and of those where allowed[r * allowed_len + j] != 0 when ``allowed`` is given.
 * out [rows, heads, d] float32; ``scratch``: at least max(limit) + LANES floats. */
static inline __attribute__((always_inline)) void attention(
    const float *q, int64_t rows, int64_t ldq, int64_t heads, int64_t kv_heads, int64_t d, const void *keys,
    const void *values, const int64_t *slot, int64_t slot_stride, int64_t head_stride, int64_t pos_stride,
    const int64_t *limit, const uint8_t *allowed, int64_t allowed_len, float scale, float *out, float *scratch,
    const int bf16) {
  const int64_t group = heads / kv_heads;
  for (int64_t r = 0; r < rows; r++) {
    const uint8_t *see = allowed ? allowed + r * allowed_len : 0;
    for (int64_t hh = 0; hh < heads; hh++) {
      const float *qh = q + r * ldq + hh * d;
      const int64_t off = slot[r] * slot_stride + (hh / group) * head_stride;
      float *o = out + (r * heads + hh) * d;
      /* the same function whatever the branch: a constant d only lets the compiler unroll it */
      if (d == 64)
        attend_head(qh, keys, values, off, pos_stride, limit[r], see, scale, o, scratch, 64, bf16);
      else if (d == 128)
        attend_head(qh, keys, values, off, pos_stride, limit[r], see, scale, o, scratch, 128, bf16);
      else
        attend_head(qh, keys, values, off, pos_stride, limit[r], see, scale, o, scratch, d, bf16);
    }
  }
}

#define ATTENTION_ARGS                                                                                               \
  const float *q, int64_t rows, int64_t ldq, int64_t heads, int64_t kv_heads, int64_t d, const void *keys,          \
      const void *values, const int64_t *slot, int64_t slot_stride, int64_t head_stride, int64_t pos_stride,          \
      const int64_t *limit, const uint8_t *allowed, int64_t allowed_len, float scale, float *out, float *scratch

/* y = x @ W^T over every panel for weight type ``wt`` */
static void gemm_of(int wt, GEMM_ARGS) {
  if (wt == W_BF16)
    specdec_gemm_bf16(x, m, k, packed, n, y, p0, p1);
  else if (wt == W_F16)
    specdec_gemm_f16(x, m, k, packed, n, y, p0, p1);
  else
    specdec_gemm(x, m, k, packed, n, y, p0, p1);
}

/* ---------------------------------------------------------------- a team of threads for one layer
 * A layer's GEMMs split by panels (columns) and its attention by rows, over ``threads``: each output is
 * still computed whole by one thread, in the one order, so no split changes a bit. A job is cut into
 * TEAM_CHUNKS chunks per thread, which the caller and the helpers claim in turn: a helper that does not
 * get a core claims nothing, and the caller does its chunks. Helpers are created on first use; between
 * jobs they spin for a moment (a layer's next GEMM follows within microseconds, and waking a sleeping
 * thread costs about as much as a small GEMM's share), then wait on a condition variable (no long spin:
 * on 2 cores a spinning helper would take the core another process needs). One caller at a time: a
 * call that finds the team busy (another Python thread's forward) runs its job alone. */
#define MAX_TEAM 16
#define TEAM_SPINS 4000 /* pause instructions a helper (or the caller) spins before it sleeps */
#define TEAM_CHUNKS 4

typedef struct { /* one attention call (the `attention` arguments) and each thread's scratch, split by rows */
  const float *q;
  int64_t rows, ldq, heads, kv_heads, d;
  const void *keys, *values;
  const int64_t *slot;
  int64_t slot_stride, head_stride, pos_stride;
  const int64_t *limit;
  const uint8_t *allowed;
  int64_t allowed_len;
  float scale;
  float *out, *scratch;
  int64_t scratch_stride;
  int bf16;
} attention_job;

typedef struct {
  int wt;
  const float *x;
  int64_t m, k, n, panels;
  const void *packed;
  float *y;
  int threads, chunks; /* threads that may take part (each has scratch), chunks the job is cut into */
  const attention_job *att; /* set: the job is this attention, not a GEMM */
} team_job;

static pthread_mutex_t team_lock = PTHREAD_MUTEX_INITIALIZER; /* one caller at a time */
static pthread_mutex_t team_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t team_go = PTHREAD_COND_INITIALIZER, team_finished = PTHREAD_COND_INITIALIZER;
static int team_size = 0, team_done = 0; /* helpers alive; chunks of this round finished */
static long team_round = 0, team_born[MAX_TEAM]; /* a member starts waiting for the round after its birth's */
static uint64_t team_next = 0; /* (round << 32) | the next chunk to claim: a claim names its round */
static team_job team_work;

/* The first row of part ``part`` of ``parts``: rows split where the keys read so far (the sum of limits,
 * each row's cost) cross part / parts of the total. Each row is still computed whole by one thread. */
static int64_t attention_split(const attention_job *a, int part, int parts) {
  if (part <= 0) return 0;
  if (part >= parts) return a->rows;
  int64_t total = 0, seen = 0;
  for (int64_t r = 0; r < a->rows; r++) total += a->limit[r] + 1;
  const int64_t want = total * part / parts;
  int64_t r = 0;
  while (r < a->rows && seen + a->limit[r] + 1 <= want) seen += a->limit[r++] + 1;
  return r;
}

static void attention_part(const attention_job *a, int part, int parts, int thread) {
  const int64_t r0 = attention_split(a, part, parts), r1 = attention_split(a, part + 1, parts);
  if (r1 <= r0) return;
  attention(a->q + r0 * a->ldq, r1 - r0, a->ldq, a->heads, a->kv_heads, a->d, a->keys, a->values, a->slot + r0,
            a->slot_stride, a->head_stride, a->pos_stride, a->limit + r0, a->allowed ? a->allowed + r0 * a->allowed_len : 0,
            a->allowed_len, a->scale, a->out + r0 * a->heads * a->d, a->scratch + thread * a->scratch_stride, a->bf16);
}

/* Chunk ``chunk`` of the job, on thread ``thread`` (whose scratch it uses). */
static void team_part(const team_job *j, int chunk, int thread) {
  if (j->att) {
    attention_part(j->att, chunk, j->chunks, thread);
    return;
  }
  const int64_t p0 = j->panels * chunk / j->chunks, p1 = j->panels * (chunk + 1) / j->chunks;
  if (p1 > p0) gemm_of(j->wt, j->x, j->m, j->k, j->packed, j->n, j->y, p0, p1);
}

/* The next unclaimed chunk of round ``round``, or -1 when none is left (or that round is over). */
static int team_claim(uint32_t round, int chunks) {
  uint64_t v = __atomic_load_n(&team_next, __ATOMIC_ACQUIRE);
  for (;;) {
    if ((uint32_t)(v >> 32) != round || (int)(uint32_t)v >= chunks) return -1;
    if (__atomic_compare_exchange_n(&team_next, &v, v + 1, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) return (int)(uint32_t)v;
  }
}

/* Claim and run chunks of ``job`` (round ``round``) until none is left; the last one finished wakes the caller. */
static void team_work_on(const team_job *job, uint32_t round, int thread, int wake) {
  int c;
  while ((c = team_claim(round, job->chunks)) >= 0) {
    team_part(job, c, thread);
    if (__atomic_add_fetch(&team_done, 1, __ATOMIC_ACQ_REL) == job->chunks && wake) {
      pthread_mutex_lock(&team_mu);
      pthread_cond_signal(&team_finished);
      pthread_mutex_unlock(&team_mu);
    }
  }
}

static void *team_member(void *arg) {
  const int thread = (int)(intptr_t)arg; /* 1..team_size */
  long seen = team_born[thread];
  for (;;) {
    for (int i = 0; i < TEAM_SPINS && __atomic_load_n(&team_round, __ATOMIC_ACQUIRE) == seen; i++) _mm_pause();
    pthread_mutex_lock(&team_mu);
    while (team_round == seen) pthread_cond_wait(&team_go, &team_mu);
    seen = team_round;
    const team_job job = team_work;
    pthread_mutex_unlock(&team_mu);
    if (thread < job.threads) team_work_on(&job, (uint32_t)seen, thread, 1);
  }
  return NULL;
}

/* ``job`` over up to ``threads`` threads (this one included); alone where the team is busy or cannot grow. */
static void team_run(int threads, int64_t units, team_job job) {
  if (threads > MAX_TEAM) threads = MAX_TEAM;
  if (threads <= 1 || pthread_mutex_trylock(&team_lock) != 0) {
    job.threads = job.chunks = 1;
    team_part(&job, 0, 0);
    return;
  }
  while (team_size < threads - 1) {
    pthread_t t;
    team_born[team_size + 1] = team_round; /* (no round runs now: this caller holds the team) */
    if (pthread_create(&t, NULL, team_member, (void *)(intptr_t)(team_size + 1)) != 0) break;
    pthread_detach(t);
    team_size++;
  }
  if (threads > team_size + 1) threads = team_size + 1;
  job.threads = threads;
  job.chunks = units < (int64_t)threads * TEAM_CHUNKS ? (int)units : threads * TEAM_CHUNKS;
  pthread_mutex_lock(&team_mu);
  team_work = job;
  team_done = 0;
  const long round = team_round + 1;
  __atomic_store_n(&team_next, (uint64_t)(uint32_t)round << 32, __ATOMIC_RELEASE);
  __atomic_store_n(&team_round, round, __ATOMIC_RELEASE); /* (a spinning helper reads it, then the job under the lock) */
  pthread_cond_broadcast(&team_go);
  pthread_mutex_unlock(&team_mu);
  team_work_on(&job, (uint32_t)round, 0, 0);
  for (int i = 0; i < TEAM_SPINS && __atomic_load_n(&team_done, __ATOMIC_ACQUIRE) < job.chunks; i++) _mm_pause();
  pthread_mutex_lock(&team_mu);
  while (__atomic_load_n(&team_done, __ATOMIC_ACQUIRE) < job.chunks) pthread_cond_wait(&team_finished, &team_mu);
  pthread_mutex_unlock(&team_mu);
  pthread_mutex_unlock(&team_lock);
}

/* y = x @ W^T with ``threads`` threads, split by panels (columns). */
static void gemm_team(int threads, int wt, const float *x, int64_t m, int64_t k, const void *packed, int64_t n, float *y) {
  const int64_t panels = (n + NR - 1) / NR;
  const team_job job = {wt, x, m, k, n, panels, packed, y, 1, 1, 0};
  team_run(threads > panels ? (int)panels : threads, panels, job);
}

/* `attention` with ``threads`` threads, split by rows (each row whole on one thread: the same bits at
 * any count); thread t's scratch at scratch + t * scratch_stride (at least max(limit) + LANES floats). */
static void attention_team(int threads, const attention_job *a) {
  const team_job job = {0, 0, 0, 0, 0, 0, 0, 0, 1, 1, a};
  team_run(threads > a->rows ? (int)a->rows : threads, a->rows, job);
}

#define ATTENTION_THREADS_CALL(bf16)                                                                                 \
  const attention_job job = {q, rows, ldq, heads, kv_heads, d, keys, values, slot, slot_stride, head_stride,          \
                             pos_stride, limit, allowed, allowed_len, scale, out, scratch, scratch_stride, bf16};      \
  attention_team(threads, &job)

void specdec_attention_threads(ATTENTION_ARGS, int64_t scratch_stride, int threads) { ATTENTION_THREADS_CALL(0); }
void specdec_attention_threads_bf16(ATTENTION_ARGS, int64_t scratch_stride, int threads) { ATTENTION_THREADS_CALL(1); }

/* y = x @ W^T over every panel of weight type ``wt``, split by columns over ``threads`` (`gemm_team`). */
void specdec_gemm_threads(int wt, const float *x, int64_t m, int64_t k, const void *packed, int64_t n, float *y,
                          int threads) {
  gemm_team(threads, wt, x, m, k, packed, n, y);
}

/* ---------------------------------------------------------------- one decoder layer in one call
 * The exact path's layer for a batch's rows in one call: the same kernels, in the same order, as the
 * per-op path (core/llama_decode.py `layers_with`), so a row's bits are the same either way; what it
 * saves is the Python between them. x [n, hidden] is updated in place; row r writes its key and value
 * at position positions[r] of sequence slot slots[r] (keys + slot * slot_stride + g * head_stride +
 * position * pos_stride, KV head g), then sees that slot's positions below limits[r], and of those
 * where allowed[r * allowed_len + j] != 0 when ``allowed`` is given; the four projections' panels are
 * of weight type ``wt``, keys and values float32. ``work``: at least
 * n * (2 * hidden + qkv_out + (heads + kv) * d + heads * d + 3 * inter) + threads * scratch_stride
 * floats, scratch_stride >= max(limits) + LANES. */
void specdec_decoder_layer_rows(float *x, int64_t n, int64_t hidden, int64_t heads, int64_t kv_heads, int64_t d,
                                int64_t inter, const float *ln1, const float *ln2, float eps, const void *qkv_w,
                                const void *o_w, const void *gu_w, const void *down_w, const float *cos_sin, float *keys,
                                float *values, int64_t slot_stride, int64_t head_stride, int64_t pos_stride,
                                const int64_t *slots, const int64_t *positions, const int64_t *limits,
                                const uint8_t *allowed, int64_t allowed_len, float scale, float *work,
                                int64_t scratch_stride, int wt, int threads) {
  const int64_t qkv_out = (heads + 2 * kv_heads) * d, qk_width = (heads + kv_heads) * d;
  float *normed = work, *qkv = normed + n * hidden, *qk = qkv + n * qkv_out, *att = qk + n * qk_width;
  float *tmp = att + n * heads * d, *gu = tmp + n * hidden, *act = gu + n * 2 * inter, *scratch = act + n * inter;
  specdec_rms_norm(x, n, hidden, hidden, ln1, eps, normed);
  gemm_team(threads, wt, normed, n, hidden, qkv_w, qkv_out, qkv);
  specdec_rotary(qkv, n, qkv_out, heads + kv_heads, d, cos_sin, qk);
  for (int64_t r = 0; r < n; r++)
    for (int64_t g = 0; g < kv_heads; g++) {
      const int64_t at = slots[r] * slot_stride + g * head_stride + positions[r] * pos_stride;
      memcpy(keys + at, qk + r * qk_width + (heads + g) * d, (size_t)d * sizeof(float));
      memcpy(values + at, qkv + r * qkv_out + qk_width + g * d, (size_t)d * sizeof(float));
    }
  specdec_attention_threads(qk, n, qk_width, heads, kv_heads, d, keys, values, slots, slot_stride, head_stride,
                            pos_stride, limits, allowed, allowed_len, scale, att, scratch, scratch_stride, threads);
  gemm_team(threads, wt, att, n, heads * d, o_w, hidden, tmp);
  for (int64_t i = 0; i < n * hidden; i++) x[i] += tmp[i];
  specdec_rms_norm(x, n, hidden, hidden, ln2, eps, normed);
  gemm_team(threads, wt, normed, n, hidden, gu_w, 2 * inter, gu);
  specdec_swiglu(gu, n, 2 * inter, inter, act);
  gemm_team(threads, wt, act, n, inter, down_w, hidden, tmp);
  for (int64_t i = 0; i < n * hidden; i++) x[i] += tmp[i];
}

/* Every decoder layer of a forward in one call: specdec_decoder_layer_rows for layer 0, 1, ... in turn
   (the same kernels in the same order, so the same bits), the weights from per-layer arrays and each
   layer's keys and values layer_stride floats after the previous layer's. */
void specdec_decoder_layers(float *x, int64_t n, int64_t layers, int64_t hidden, int64_t heads, int64_t kv_heads,
                            int64_t d, int64_t inter, const float *const *ln1, const float *const *ln2, float eps,
                            const void *const *qkv_w, const void *const *o_w, const void *const *gu_w,
                            const void *const *down_w, const float *cos_sin, float *keys, float *values,
                            int64_t layer_stride, int64_t slot_stride, int64_t head_stride, int64_t pos_stride,
                            const int64_t *slots, const int64_t *positions, const int64_t *limits,
                            const uint8_t *allowed, int64_t allowed_len, float scale, float *work,
                            int64_t scratch_stride, int wt, int threads) {
  for (int64_t l = 0; l < layers; l++)
    specdec_decoder_layer_rows(x, n, hidden, heads, kv_heads, d, inter, ln1[l], ln2[l], eps, qkv_w[l], o_w[l], gu_w[l],
                               down_w[l], cos_sin, keys + l * layer_stride, values + l * layer_stride, slot_stride,
                               head_stride, pos_stride, slots, positions, limits, allowed, allowed_len, scale, work,
                               scratch_stride, wt, threads);
}
