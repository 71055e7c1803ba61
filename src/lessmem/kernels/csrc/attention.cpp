// Fused dequant-attention CPU kernel over a quantized KV history (see kernels/attention_cpp.py
// for the algorithm and kernels/attention.py for the Python entry points). Code rows are laid
// out as lessmem.formats.kvlayout.KVLayout describes; built by kernels/_build.py.
#include <torch/extension.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

namespace {
constexpr int TILE = 32;
// KVLayout.packing ids, given by the Python side (attention_cpp.PACKING_IDS) as -D flags
#if !defined(LESSMEM_PACK_SPLIT) || !defined(LESSMEM_PACK_STREAM) || !defined(LESSMEM_PACK_MIXED)
#error "build with -DLESSMEM_PACK_SPLIT=<id> -DLESSMEM_PACK_STREAM=<id> -DLESSMEM_PACK_MIXED=<id> (see kernels/attention_cpp.py)"
#endif
constexpr int PACK_SPLIT = LESSMEM_PACK_SPLIT, PACK_STREAM = LESSMEM_PACK_STREAM, PACK_MIXED = LESSMEM_PACK_MIXED;
constexpr int MAX_RUNS = 4;  // runs of equal bits in a mixed row (formats/kvlayout.py)
const float NEG_INF = -std::numeric_limits<float>::infinity();

// exp(x) for x <= 0 (softmax after max subtraction), vectorizable: 2^n · p(r) with
// x = n·ln2 + r, |r| <= ln2/2, p a degree-6 Taylor/Horner polynomial (rel. err ~2e-7);
// x < -87 (including -inf) gives exactly 0.
inline float exp_neg(float x) {
  const float xc = x < -87.f ? -87.f : x;
  const float n = std::nearbyint(xc * 1.44269504088896341f);
  const float r = xc - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.f / 720.f;
  p = p * r + 1.f / 120.f; p = p * r + 1.f / 24.f; p = p * r + 1.f / 6.f;
  p = p * r + 0.5f; p = p * r + 1.f; p = p * r + 1.f;
  const int32_t e = ((int32_t)n + 127) << 23;
  float two_n; std::memcpy(&two_n, &e, 4);
  return x < -87.f ? 0.f : p * two_n;
}

#if defined(__AVX2__) && defined(__FMA__)
// exp_neg of eight lanes: the same steps with the multiply-adds fused (GCC did not
// vectorize the scalar function's loop: one exp per score and query row was a third of a
// decode's attention time)
inline __m256 exp_neg8(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.f);
  const __m256 xc = _mm256_max_ps(x, lo);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(xc, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), xc);
  r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.f / 720.f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120.f)); p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6.f)); p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f)); p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  const __m256 res = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
  return _mm256_blendv_ps(res, _mm256_setzero_ps(), _mm256_cmp_ps(x, lo, _CMP_LT_OQ));
}

// the eight lanes of v summed in pairs: ((0+1)+(2+3))+((4+5)+(6+7)), in registers (read
// back from a store as eight floats, the loads waited for the wide store)
inline float hsum8(__m256 v) {
  const __m256 h = _mm256_hadd_ps(v, v);  // 128-bit halves: [0+1, 2+3, ..], [4+5, 6+7, ..]
  const __m256 q = _mm256_hadd_ps(h, h);  // lane 0: (0+1)+(2+3); lane 4: (4+5)+(6+7)
  return _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(q), _mm256_extractf128_ps(q, 1)));
}

// Σ exp_neg(s[i] − m) over n scores, each replaced by its exponential
inline float exp_rows(float* __restrict__ s, int64_t n, float m) {
  int64_t i = 0;
  __m256 acc = _mm256_setzero_ps();
  const __m256 vm = _mm256_set1_ps(m);
  for (; i + 8 <= n; i += 8) {
    const __m256 p = exp_neg8(_mm256_sub_ps(_mm256_loadu_ps(s + i), vm));
    _mm256_storeu_ps(s + i, p);
    acc = _mm256_add_ps(acc, p);
  }
  float sum = hsum8(acc);
  for (; i < n; ++i) { const float p = exp_neg(s[i] - m); s[i] = p; sum += p; }
  return sum;
}
#else
inline float exp_rows(float* __restrict__ s, int64_t n, float m) {
  float sum = 0.f;
  for (int64_t i = 0; i < n; ++i) { const float p = exp_neg(s[i] - m); s[i] = p; sum += p; }
  return sum;
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
// Lane j of the result = the sum of a[j]'s eight lanes, ((0+1)+(2+3))+((4+5)+(6+7)), by a
// transposing tree of horizontal adds (no serial reduction per sum).
inline __m256 hsum8x8(const __m256* a) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// Eight dot products q·k_j of length D (a multiple of 8) at once, k_j = k + j·D: one
// accumulator per key row, then hsum8x8.
inline void dot8(const float* __restrict__ q, const float* __restrict__ k, int64_t D, float* __restrict__ out) {
  __m256 a[8];
  for (int j = 0; j < 8; ++j) a[j] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; d += 8) {
    const __m256 qv = _mm256_loadu_ps(q + d);
    for (int j = 0; j < 8; ++j) a[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + j * D + d), a[j]);
  }
  _mm256_storeu_ps(out, hsum8x8(a));
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
// Eight 3-bit codes of a stream row from their three bytes: one broadcast, shifted per lane.
inline __m256i stream3_codes8(const uint8_t* b) {
  const __m256i sh = _mm256_setr_epi32(0, 3, 6, 9, 12, 15, 18, 21);
  const int w = (int)((unsigned)b[0] | ((unsigned)b[1] << 8) | ((unsigned)b[2] << 16));
  return _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(w), sh), _mm256_set1_epi32(7));
}
#endif

// n halves as floats (eight at a time with F16C; the scalar conversion does not vectorize)
inline void half_to_float(const at::Half* __restrict__ h, float* __restrict__ out, int64_t n) {
  int64_t i = 0;
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + i))));
#endif
  for (; i < n; ++i) out[i] = (float)h[i];
}

// a[0:D] += Σ_i w[i] · v[i·D : (i+1)·D] for n rows v: the accumulator stays in registers
// across the tile (32 lanes a pass) instead of being loaded and stored once per token.
inline void pv_rows(float* __restrict__ a, const float* __restrict__ w, const float* __restrict__ v, int64_t n,
                    int64_t D) {
#if defined(__AVX2__) && defined(__FMA__)
  if (D % 32 == 0) {
    for (int64_t d0 = 0; d0 < D; d0 += 32) {
      __m256 r0 = _mm256_loadu_ps(a + d0), r1 = _mm256_loadu_ps(a + d0 + 8);
      __m256 r2 = _mm256_loadu_ps(a + d0 + 16), r3 = _mm256_loadu_ps(a + d0 + 24);
      for (int64_t i = 0; i < n; ++i) {
        const __m256 b = _mm256_set1_ps(w[i]);
        const float* vp = v + i * D + d0;
        r0 = _mm256_fmadd_ps(b, _mm256_loadu_ps(vp), r0); r1 = _mm256_fmadd_ps(b, _mm256_loadu_ps(vp + 8), r1);
        r2 = _mm256_fmadd_ps(b, _mm256_loadu_ps(vp + 16), r2); r3 = _mm256_fmadd_ps(b, _mm256_loadu_ps(vp + 24), r3);
      }
      _mm256_storeu_ps(a + d0, r0); _mm256_storeu_ps(a + d0 + 8, r1);
      _mm256_storeu_ps(a + d0 + 16, r2); _mm256_storeu_ps(a + d0 + 24, r3);
    }
    return;
  }
#endif
  for (int64_t i = 0; i < n; ++i) {
    const float p = w[i];
    const float* __restrict__ vp = v + i * D;
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) a[d] += p * vp[d];
  }
}

// max of n floats (eight lanes at a time: the scalar loop is a chain of dependent compares)
inline float max_of(const float* __restrict__ s, int64_t n) {
  int64_t i = 0;
  float mx = NEG_INF;
#if defined(__AVX2__) && defined(__FMA__)
  if (n >= 8) {
    __m256 m = _mm256_loadu_ps(s);
    for (i = 8; i + 8 <= n; i += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(s + i));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));  // in registers, as hsum8
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    mx = _mm_cvtss_f32(h);
  }
#endif
  for (; i < n; ++i) mx = std::max(mx, s[i]);
  return mx;
}

// w[i] = p[i]·a[i] for n entries, returning Σ p[i]·z[i] (eight partial sums, then pairs)
inline float scale_weights(const float* __restrict__ p, const float* __restrict__ a, const float* __restrict__ z,
                           float* __restrict__ w, int64_t n) {
  int64_t i = 0;
  float sum = 0.f;
#if defined(__AVX2__) && defined(__FMA__)
  if (n >= 8) {
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
      const __m256 pv = _mm256_loadu_ps(p + i);
      _mm256_storeu_ps(w + i, _mm256_mul_ps(pv, _mm256_loadu_ps(a + i)));
      acc = _mm256_fmadd_ps(pv, _mm256_loadu_ps(z + i), acc);
    }
    sum = hsum8(acc);
  }
#endif
  for (; i < n; ++i) { w[i] = p[i] * a[i]; sum += p[i] * z[i]; }
  return sum;
}

#if defined(__AVX512F__) && defined(__AVX512DQ__)
#define LM_AVX512 1
#endif
#if defined(LM_AVX512) || (defined(__AVX2__) && defined(__FMA__))
// The folded paths that unpack code rows in registers: AVX-512 (16 lanes) or its AVX2 twin.
#define LM_FOLD 1
// Row layouts of 64 channels they unpack (formats/kvlayout.py): split rows of 8, 4 or 2
// bits (byte j: channels j, j + 64/p, ... for p codes a byte) and little-endian bit streams
// of 2, 3 or 4 bits (8-bit streams are split rows). Every layout of the same codes then
// computes the same sums.
enum RowKind { ROW_NONE = 0, ROW_SPLIT8, ROW_SPLIT4, ROW_SPLIT2, ROW_STREAM3, ROW_STREAM2, ROW_STREAM4 };

inline int load_u32(const uint8_t* p) { uint32_t w; std::memcpy(&w, p, 4); return (int)w; }
#endif

#ifdef LM_AVX512
// query rows a scores_fold / pv_fold call takes at once
constexpr int SCORE_ROWS = 4, PV_ROWS = 4;

// A side's 64 codes as four vectors of 16 floats: channels 0-15, 16-31, 32-47, 48-63.
template <int L>
inline void codes64(const uint8_t* p, __m512* c) {
  if (L == ROW_SPLIT8) {
    for (int k = 0; k < 4; ++k)
      c[k] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * k))));
  } else if (L == ROW_SPLIT4) {  // byte j: channel j (low nibble), j + 32 (high)
    const __m512i a = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)));
    const __m512i m15 = _mm512_set1_epi32(15);
    c[0] = _mm512_cvtepi32_ps(_mm512_and_si512(a, m15));
    c[1] = _mm512_cvtepi32_ps(_mm512_and_si512(b, m15));
    c[2] = _mm512_cvtepi32_ps(_mm512_srli_epi32(a, 4));
    c[3] = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
  } else if (L == ROW_SPLIT2) {  // byte j: channels j, j + 16, j + 32, j + 48
    const __m512i a = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m512i m3 = _mm512_set1_epi32(3);
    c[0] = _mm512_cvtepi32_ps(_mm512_and_si512(a, m3));
    c[1] = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(a, 2), m3));
    c[2] = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(a, 4), m3));
    c[3] = _mm512_cvtepi32_ps(_mm512_srli_epi32(a, 6));
  } else if (L == ROW_STREAM2) {  // 16 codes in 4 bytes
    const __m512i sh = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i m3 = _mm512_set1_epi32(3);
    for (int k = 0; k < 4; ++k)
      c[k] = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srlv_epi32(_mm512_set1_epi32(load_u32(p + 4 * k)), sh), m3));
  } else if (L == ROW_STREAM4) {  // 16 codes in 8 bytes; lanes 0-7 from the first 4, 8-15 from the next
    const __m512i sh = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 4, 8, 12, 16, 20, 24, 28);
    const __m512i m15 = _mm512_set1_epi32(15);
    for (int k = 0; k < 4; ++k) {
      const __m512i w = _mm512_mask_set1_epi32(_mm512_set1_epi32(load_u32(p + 8 * k)), (__mmask16)0xFF00,
                                               load_u32(p + 8 * k + 4));
      c[k] = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srlv_epi32(w, sh), m15));
    }
  } else {  // ROW_STREAM3: 16 codes in 6 bytes; lanes 0-7 from bits 0-23, 8-15 from 24-47
    const __m512i sh = _mm512_setr_epi32(0, 3, 6, 9, 12, 15, 18, 21, 0, 3, 6, 9, 12, 15, 18, 21);
    const __m512i m7 = _mm512_set1_epi32(7);
    for (int k = 0; k < 4; ++k) {
      const uint8_t* b = p + 6 * k;
      const int lo = (int)((unsigned)b[0] | ((unsigned)b[1] << 8) | ((unsigned)b[2] << 16));
      const int hi = (int)((unsigned)b[3] | ((unsigned)b[4] << 8) | ((unsigned)b[5] << 16));
      const __m512i w = _mm512_mask_set1_epi32(_mm512_set1_epi32(lo), (__mmask16)0xFF00, hi);
      c[k] = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srlv_epi32(w, sh), m7));
    }
  }
}

// Lane j of the result = the sum of v[j]'s 16 lanes (a transposing tree of adds: 45
// instructions for 16 sums instead of a serial reduction each).
inline __m512 hsum16x16(const __m512* v) {
  __m512 t[8], u[4];
  for (int j = 0; j < 8; ++j)  // 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    t[j] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * j], v[2 * j + 1]), _mm512_unpackhi_ps(v[2 * j], v[2 * j + 1]));
  for (int j = 0; j < 4; ++j)  // 128-bit lane: partial sums of tokens 4j .. 4j+3
    u[j] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * j], t[2 * j + 1], 0x44), _mm512_shuffle_ps(t[2 * j], t[2 * j + 1], 0xEE));
  const __m512 w01 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88), _mm512_shuffle_f32x4(u[0], u[1], 0xDD));
  const __m512 w23 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x88), _mm512_shuffle_f32x4(u[2], u[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w01, w23, 0x88), _mm512_shuffle_f32x4(w01, w23, 0xDD));
}

// Folded keys of 64 channels, R query rows: sc[r·ld + i] = q[r]·c_i for the n code rows c_i
// (rb bytes apart), unpacked into registers and used by every row at once (no float copy of
// the keys in memory).
template <int L, int R>
inline void scores_fold(const float* const* q, const uint8_t* codes, int64_t rb, int64_t n, float* sc, int64_t ld) {
  __m512 qv[R][4];
  for (int r = 0; r < R; ++r)
    for (int k = 0; k < 4; ++k) qv[r][k] = _mm512_loadu_ps(q[r] + 16 * k);
  for (int64_t i0 = 0; i0 < n; i0 += 16) {
    const int64_t m = std::min<int64_t>(16, n - i0);
    __m512 v[R][16];
    for (int64_t i = 0; i < 16; ++i) {
      if (i >= m) { for (int r = 0; r < R; ++r) v[r][i] = _mm512_setzero_ps(); continue; }
      __m512 c[4];
      codes64<L>(codes + (i0 + i) * rb, c);
      for (int r = 0; r < R; ++r)
        v[r][i] = _mm512_fmadd_ps(qv[r][3], c[3], _mm512_fmadd_ps(qv[r][2], c[2],
                  _mm512_fmadd_ps(qv[r][1], c[1], _mm512_mul_ps(qv[r][0], c[0]))));
    }
    for (int r = 0; r < R; ++r)
      _mm512_mask_storeu_ps(sc + r * ld + i0, (__mmask16)((1u << m) - 1), hsum16x16(v[r]));
  }
}

// Folded values of 64 channels, R rows: acc[r·64 : (r+1)·64] += Σ_i w[r·ld + i]·c_i, the
// accumulators in registers across the n code rows.
template <int L, int R>
inline void pv_fold(float* acc, const float* w, int64_t ld, const uint8_t* codes, int64_t rb, int64_t n) {
  __m512 a[R][4];
  for (int r = 0; r < R; ++r)
    for (int k = 0; k < 4; ++k) a[r][k] = _mm512_loadu_ps(acc + r * 64 + 16 * k);
  for (int64_t i = 0; i < n; ++i) {
    __m512 c[4];
    codes64<L>(codes + i * rb, c);
    for (int r = 0; r < R; ++r) {
      const __m512 b = _mm512_set1_ps(w[r * ld + i]);
      for (int k = 0; k < 4; ++k) a[r][k] = _mm512_fmadd_ps(b, c[k], a[r][k]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int k = 0; k < 4; ++k) _mm512_storeu_ps(acc + r * 64 + 16 * k, a[r][k]);
}

#elif defined(LM_FOLD)
// The AVX2 twin of the above, eight lanes: a 64-channel row is eight blocks of 8 channels,
// each unpacked when used (code8), so only the block in use takes a register. The sums are
// the ones the unfolded AVX2 path computes from float rows (dot8's chain and tree per key,
// pv_rows' token-ordered multiply-adds per value lane; only a tile's last n mod 8 keys, which
// that path summed in a scalar loop, may differ in the last bit), without writing those rows.
constexpr int SCORE_ROWS = 4, PV_ROWS = 4;

// channels 8k .. 8k+7 of a 64-channel code row as floats
template <int L>
inline __m256 code8(const uint8_t* p, int k) {
  if (L == ROW_SPLIT8)
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * k))));
  if (L == ROW_SPLIT4) {  // byte j: channel j (low nibble), j + 32 (high)
    const __m256i a = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * (k & 3))));
    return _mm256_cvtepi32_ps(k < 4 ? _mm256_and_si256(a, _mm256_set1_epi32(15)) : _mm256_srli_epi32(a, 4));
  }
  if (L == ROW_SPLIT2) {  // byte j: channels j, j + 16, j + 32, j + 48
    const __m256i a = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * (k & 1))));
    return _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(a, 2 * (k >> 1)), _mm256_set1_epi32(3)));
  }
  if (L == ROW_STREAM2) {  // 8 codes in 2 bytes
    const int w = (int)((unsigned)p[2 * k] | ((unsigned)p[2 * k + 1] << 8));
    const __m256i sh = _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14);
    return _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(w), sh), _mm256_set1_epi32(3)));
  }
  if (L == ROW_STREAM4) {  // 8 codes in 4 bytes
    const __m256i sh = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
    return _mm256_cvtepi32_ps(
        _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(load_u32(p + 4 * k)), sh), _mm256_set1_epi32(15)));
  }
  return _mm256_cvtepi32_ps(stream3_codes8(p + 3 * k));  // ROW_STREAM3: 8 codes in 3 bytes
}

// sc[r·ld + i] = q[r]·c_i for the n code rows c_i (rb bytes apart), R query rows: eight
// keys at a time, each key's blocks multiplied into one accumulator per row, then hsum8x8.
template <int L, int R>
inline void scores_fold(const float* const* q, const uint8_t* codes, int64_t rb, int64_t n, float* sc, int64_t ld) {
  for (int64_t i0 = 0; i0 < n; i0 += 8) {
    const int64_t m = std::min<int64_t>(8, n - i0);
    __m256 v[R][8];
    for (int64_t i = 0; i < 8; i += 2) {  // two keys at a time: 2R independent chains, one q load for both
      __m256 a0[R], a1[R];
      for (int r = 0; r < R; ++r) a0[r] = a1[r] = _mm256_setzero_ps();
      if (i < m) {
        const uint8_t* p0 = codes + (i0 + i) * rb;
        const uint8_t* p1 = i + 1 < m ? p0 + rb : p0;  // (a lone last key: its result is not stored)
        for (int k = 0; k < 8; ++k) {
          const __m256 c0 = code8<L>(p0, k), c1 = code8<L>(p1, k);
          for (int r = 0; r < R; ++r) {
            const __m256 qk = _mm256_loadu_ps(q[r] + 8 * k);
            a0[r] = _mm256_fmadd_ps(qk, c0, a0[r]);
            a1[r] = _mm256_fmadd_ps(qk, c1, a1[r]);
          }
        }
      }
      for (int r = 0; r < R; ++r) { v[r][i] = a0[r]; v[r][i + 1] = a1[r]; }
    }
    for (int r = 0; r < R; ++r) {
      const __m256 s = hsum8x8(v[r]);
      if (m == 8) { _mm256_storeu_ps(sc + r * ld + i0, s); continue; }
      alignas(32) float t[8];
      _mm256_store_ps(t, s);
      std::copy(t, t + m, sc + r * ld + i0);
    }
  }
}

// acc[r·64 : (r+1)·64] += Σ_i w[r·ld + i]·c_i over the n code rows, R rows, in passes over
// NB blocks of 8 channels: a pass keeps its R×NB accumulators in registers across the rows.
// NB is the most that fits in the 16 registers with the code block, the R weights and a mask
// (none may spill: a spilled accumulator chains every multiply-add through a store), and
// R·NB >= 8 independent accumulators keep two FMA units of 4 cycles' latency busy.
template <int R> constexpr int pv_pass_blocks() { return R == 1 ? 8 : R == 2 ? 4 : R == 3 ? 3 : 2; }
template <int L, int R, int Q0, int NB>
inline void pv_fold_pass(float* acc, const float* w, int64_t ld, const uint8_t* codes, int64_t rb, int64_t n) {
  __m256 a[R][NB];
  for (int r = 0; r < R; ++r)
    for (int k = 0; k < NB; ++k) a[r][k] = _mm256_loadu_ps(acc + r * 64 + 8 * (Q0 + k));
  for (int64_t i = 0; i < n; ++i) {
    const uint8_t* p = codes + i * rb;
    __m256 b[R];
    for (int r = 0; r < R; ++r) b[r] = _mm256_broadcast_ss(w + r * ld + i);
    for (int k = 0; k < NB; ++k) {
      const __m256 c = code8<L>(p, Q0 + k);
      for (int r = 0; r < R; ++r) a[r][k] = _mm256_fmadd_ps(b[r], c, a[r][k]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int k = 0; k < NB; ++k) _mm256_storeu_ps(acc + r * 64 + 8 * (Q0 + k), a[r][k]);
}
template <int L, int R, int Q0 = 0>
inline void pv_fold(float* acc, const float* w, int64_t ld, const uint8_t* codes, int64_t rb, int64_t n) {
  constexpr int NB = pv_pass_blocks<R>() < 8 - Q0 ? pv_pass_blocks<R>() : 8 - Q0;
  pv_fold_pass<L, R, Q0, NB>(acc, w, ld, codes, rb, n);
  if constexpr (Q0 + NB < 8) pv_fold<L, R, Q0 + NB>(acc, w, ld, codes, rb, n);
}
#endif

#ifdef LM_FOLD
// The two above over any number of rows, SCORE_ROWS / PV_ROWS at a time.
template <int L>
void scores_fold_rows(const float* const* q, int64_t rows, const uint8_t* codes, int64_t rb, int64_t n, float* sc,
                      int64_t ld) {
  for (int64_t r0 = 0; r0 < rows; r0 += SCORE_ROWS) {
    const float* const* qr = q + r0; float* s = sc + r0 * ld;
    switch (std::min<int64_t>(SCORE_ROWS, rows - r0)) {
      case 1: scores_fold<L, 1>(qr, codes, rb, n, s, ld); break;
      case 2: scores_fold<L, 2>(qr, codes, rb, n, s, ld); break;
      case 3: scores_fold<L, 3>(qr, codes, rb, n, s, ld); break;
      default: scores_fold<L, 4>(qr, codes, rb, n, s, ld); break;
    }
  }
}
template <int L>
void pv_fold_rows(float* acc, int64_t rows, const float* w, int64_t ld, const uint8_t* codes, int64_t rb, int64_t n) {
  for (int64_t r0 = 0; r0 < rows; r0 += PV_ROWS) {
    float* a = acc + r0 * 64; const float* wr = w + r0 * ld;
    switch (std::min<int64_t>(PV_ROWS, rows - r0)) {
      case 1: pv_fold<L, 1>(a, wr, ld, codes, rb, n); break;
      case 2: pv_fold<L, 2>(a, wr, ld, codes, rb, n); break;
      case 3: pv_fold<L, 3>(a, wr, ld, codes, rb, n); break;
      default: pv_fold<L, 4>(a, wr, ld, codes, rb, n); break;
    }
  }
}
// F<layout>(args...) for a RowKind known only at run time
#define LM_ROW_DISPATCH(kind, F, ...) switch (kind) { \
  case ROW_SPLIT8: F<ROW_SPLIT8>(__VA_ARGS__); break; case ROW_SPLIT4: F<ROW_SPLIT4>(__VA_ARGS__); break; \
  case ROW_SPLIT2: F<ROW_SPLIT2>(__VA_ARGS__); break; case ROW_STREAM2: F<ROW_STREAM2>(__VA_ARGS__); break; \
  case ROW_STREAM4: F<ROW_STREAM4>(__VA_ARGS__); break; default: F<ROW_STREAM3>(__VA_ARGS__); break; }
#endif

// The history may arrive as segments (blocks fetched from different places, never
// concatenated): segment i holds tokens [i·seg, i·seg + T_i), each with its own codes,
// scales and zero points laid out as one contiguous [B, H, T_i, ·] stream; every segment
// but the last has seg tokens (a multiple of tg).
struct QSide {
  std::vector<const uint8_t*> codes; std::vector<const at::Half*> scale;
  std::vector<const uint8_t*> zp; std::vector<int64_t> T, R;  // per segment: tokens, scale rows
  const float* lut;
  float lut16[16] = {0.f};  // the level table padded to 16 entries (bits <= 4: looked up in registers)
  int packing, bits, tg, dg, rb;  // rb: bytes per row
  // a mixed row (PACK_MIXED): runs of nrun[i] channels at rbits[i] bits, one after another,
  // each a bit stream of a multiple of 8 channels
  int nruns = 0, rbits[MAX_RUNS] = {}, nrun[MAX_RUNS] = {};
  int dkeep = 0;  // channels before a trailing 0-bit run (all D otherwise): folded scores skip the rest
  float zc;              // constant zero (symmetric int) when zp is absent
  int64_t srow;          // scale entries per scale row = D / dg
  int64_t seg;           // tokens per segment (all but the last)
  bool has_zp;
};

#if defined(__AVX2__) && defined(__FMA__)
// Levels of 8 codes (ints 0..15 in the lanes) from a table of at most 16 in two registers:
// a permute each, a blend on the index (one permute when the table has 8 entries or fewer).
template <int BITS>
inline __m256 levels8(__m256i i, __m256 lo, __m256 hi) {
  if (BITS <= 3) return _mm256_permutevar8x32_ps(lo, i);
  const __m256 up = _mm256_castsi256_ps(_mm256_cmpgt_epi32(i, _mm256_set1_epi32(7)));
  return _mm256_blendv_ps(_mm256_permutevar8x32_ps(lo, i), _mm256_permutevar8x32_ps(hi, i), up);
}
#endif

// One token's D codes, as floats, from its packed row (see formats/kvlayout.py).
inline void unpack_row(const uint8_t* p, int packing, int bits, int D, float* out) {
  if (packing == PACK_SPLIT) {  // byte j: codes of channels j, j + D/p, ... (p = 8 / bits)
    if (bits == 8) {
#pragma omp simd
      for (int d = 0; d < D; ++d) out[d] = (float)p[d];
      return;
    }
    if (bits == 4) {
      const int h = D / 2;
#pragma omp simd
      for (int j = 0; j < h; ++j) { out[j] = (float)(p[j] & 15); out[j + h] = (float)(p[j] >> 4); }
      return;
    }
    if (bits == 2) {
      const int q = D / 4;
#pragma omp simd
      for (int j = 0; j < q; ++j) {
        const uint8_t b = p[j];
        out[j] = (float)(b & 3); out[j + q] = (float)((b >> 2) & 3);
        out[j + 2 * q] = (float)((b >> 4) & 3); out[j + 3 * q] = (float)(b >> 6);
      }
      return;
    }
    const int per = 8 / bits, n = D / per;  // any other bits dividing 8
    const unsigned m = (1u << bits) - 1;
    for (int i = 0; i < per; ++i)
      for (int j = 0; j < n; ++j) out[i * n + j] = (float)((p[j] >> (bits * i)) & m);
    return;
  }
#if defined(__AVX2__) && defined(__FMA__)
  if (bits == 3 && D % 8 == 0) {  // eight codes in three bytes
    for (int g = 0; g < D / 8; ++g) _mm256_storeu_ps(out + 8 * g, _mm256_cvtepi32_ps(stream3_codes8(p + 3 * g)));
    return;
  }
#endif
  const unsigned mask = (1u << bits) - 1;  // PACK_STREAM: little-endian bit stream
  for (int d = 0; d < D; ++d) {
    const int bit = d * bits, byte = bit >> 3, sh = bit & 7;
    unsigned w = p[byte];
    if (sh + bits > 8) w |= (unsigned)p[byte + 1] << 8;
    out[d] = (float)((w >> sh) & mask);
  }
}

// A mixed row: runs of equal bits, each a multiple of 8 channels packed as a little-endian
// bit stream (8 codes of b bits in b bytes); a 0-bit run stores nothing and its codes are 0.
// ``limit``: stop after that many channels (q.dkeep: a trailing 0-bit run is not written).
inline void unpack_mixed(const uint8_t* p, const QSide& q, float* out, int limit) {
  for (int i = 0, done = 0; i < q.nruns && done < limit; done += q.nrun[i], ++i) {
    const int b = q.rbits[i], n = q.nrun[i];
    if (b == 0) {
      std::fill(out, out + n, 0.f);
      out += n;
      continue;
    }
    const uint64_t m = (1u << b) - 1;
#if defined(__AVX2__) && defined(__FMA__)
    if (b <= 4) {  // the 8 codes in one 32-bit word: broadcast, shift each lane, mask
      const __m256i sh = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(b));
      const __m256i mv = _mm256_set1_epi32((int)m);
      for (int g = 0; g < n; g += 8, p += b, out += 8) {
        uint32_t w = 0;
        for (int j = 0; j < b; ++j) w |= (uint32_t)p[j] << (8 * j);
        _mm256_storeu_ps(out, _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)w), sh), mv)));
      }
      continue;
    }
#endif
    for (int g = 0; g < n; g += 8, p += b, out += 8) {  // the 8 codes in one 64-bit word
      uint64_t w = 0;
      for (int j = 0; j < b; ++j) w |= (uint64_t)p[j] << (8 * j);
      for (int l = 0; l < 8; ++l) out[l] = (float)((w >> (b * l)) & m);
    }
  }
}

// One token's D levels (a side with a level table of <= 16 entries) straight from its codes:
// the unpacked integers index the table in registers, never converted to floats and back.
// False when the layout has no such path (the caller unpacks, then looks up).
inline bool unpack_levels(const uint8_t* p, const QSide& q, int D, float* __restrict__ out) {
#if defined(__AVX2__) && defined(__FMA__)
  if (D % 32) return false;
  const __m256 lo = _mm256_loadu_ps(q.lut16), hi = _mm256_loadu_ps(q.lut16 + 8);
  if (q.packing == PACK_STREAM && q.bits == 3) {  // eight codes in three bytes
    for (int g = 0; g < D / 8; ++g) _mm256_storeu_ps(out + 8 * g, levels8<3>(stream3_codes8(p + 3 * g), lo, hi));
    return true;
  }
  if (q.packing != PACK_SPLIT) return false;
  if (q.bits == 4) {  // byte j: channels j (low nibble) and j + D/2 (high)
    const int h = D / 2;
    const __m256i m15 = _mm256_set1_epi32(15);
    for (int j = 0; j < h; j += 8) {
      const __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(p + j)));
      _mm256_storeu_ps(out + j, levels8<4>(_mm256_and_si256(c, m15), lo, hi));
      _mm256_storeu_ps(out + j + h, levels8<4>(_mm256_srli_epi32(c, 4), lo, hi));
    }
    return true;
  }
  if (q.bits == 2) {  // byte j: channels j, j + D/4, j + D/2, j + 3D/4
    const int k = D / 4;
    const __m256i m3 = _mm256_set1_epi32(3);
    for (int j = 0; j < k; j += 8) {
      const __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(p + j)));
      _mm256_storeu_ps(out + j, levels8<2>(_mm256_and_si256(c, m3), lo, hi));
      _mm256_storeu_ps(out + j + k, levels8<2>(_mm256_and_si256(_mm256_srli_epi32(c, 2), m3), lo, hi));
      _mm256_storeu_ps(out + j + 2 * k, levels8<2>(_mm256_and_si256(_mm256_srli_epi32(c, 4), m3), lo, hi));
      _mm256_storeu_ps(out + j + 3 * k, levels8<2>(_mm256_srli_epi32(c, 6), lo, hi));
    }
    return true;
  }
#endif
  return false;
}

inline void unpack_side(const uint8_t* p, const QSide& q, int D, float* out) {
  if (q.packing == PACK_MIXED) unpack_mixed(p, q, out, D);
  else unpack_row(p, q.packing, q.bits, D, out);
}

// Decoder of one (b, h) stream. Per-channel groups (tg > 1): the group's scales and
// zero points are expanded to D floats once per tg tokens. Per-token groups (tg == 1):
// each token's D/dg scales are applied group by group (x = s·c − s·z, one FMA).
struct RowDecoder {
  const QSide& q; int D; int64_t bh;
  std::vector<float> s, z, c; int64_t cur = -1;
  // the segment of the last token decoded: tokens [s0, s1), this (b, h) stream's bases
  int64_t s0 = 0, s1 = 0; const uint8_t* cb = nullptr; const at::Half* sb = nullptr;
  const uint8_t* zb = nullptr;
  RowDecoder(const QSide& q_, int D_, int64_t bh_) : q(q_), D(D_), bh(bh_), s(D_), z(D_), c(D_) {}
  inline void seek(int64_t t) { if (t < s0 || t >= s1) locate(t); }
  inline void locate(int64_t t) {  // tokens arrive in increasing order: rarely called
    const int64_t n = (int64_t)q.T.size();
    int64_t i = q.seg > 0 ? t / q.seg : 0;
    if (i >= n) i = n - 1;
    s0 = i * q.seg; s1 = s0 + q.T[i];
    cb = q.codes[i] + bh * q.T[i] * q.rb;
    sb = q.scale[i] + bh * q.R[i] * q.srow;
    zb = q.has_zp ? q.zp[i] + bh * q.R[i] * q.srow : nullptr;
  }
  // token t's codes as floats (their levels, for a side with a level table), no scale: the
  // folded paths' input; a mixed row's first q.dkeep channels (its 0-bit channels only
  // shift the score)
  template <int DC>
  inline void raw(int64_t t, float* __restrict__ out) {
    if (t < s0 || t >= s1) locate(t);
    const int D = DC > 0 ? DC : this->D;
    const uint8_t* p = cb + (t - s0) * q.rb;
    if (q.lut && q.bits <= 4 && unpack_levels(p, q, D, out)) return;
    if (q.packing == PACK_MIXED) unpack_mixed(p, q, out, q.dkeep);
    else unpack_row(p, q.packing, q.bits, D, out);
    if (q.lut) lookup(out, D);
  }
  // codes (as floats) -> their levels, in place
  inline void lookup(float* __restrict__ cp, int D) const {
    int d = 0;
#if defined(__AVX2__) && defined(__FMA__)
    if (q.bits <= 4) {  // 16 levels at most, looked up in registers
      const __m256 lo = _mm256_loadu_ps(q.lut16), hi = _mm256_loadu_ps(q.lut16 + 8);
      for (; d + 8 <= D; d += 8)
        _mm256_storeu_ps(cp + d, levels8<4>(_mm256_cvttps_epi32(_mm256_loadu_ps(cp + d)), lo, hi));
    }
#endif
    for (; d < D; ++d) cp[d] = q.lut[(int)cp[d]];
  }
  // folded per-token sides: a[i] = scale and az[i] = scale · zero point of tokens ts..ts+n-1,
  // converted in one go when they lie in one segment (their rows are then consecutive)
  inline void token_scales(int64_t ts, int64_t n, float* __restrict__ a, float* __restrict__ az) {
    seek(ts);
    if (ts + n <= s1) {
      half_to_float(scale_row(ts), a, n);
      const uint8_t* z = zero_row(ts);
      for (int64_t i = 0; i < n; ++i) az[i] = a[i] * (z ? (float)z[i] : q.zc);
      return;
    }
    for (int64_t i = 0; i < n; ++i) {
      seek(ts + i);
      const uint8_t* z = zero_row(ts + i);
      a[i] = (float)*scale_row(ts + i);
      az[i] = a[i] * (z ? (float)*z : q.zc);
    }
  }
  // scale and zero point rows of token t's group (t in the segment last located)
  inline int64_t group_row(int64_t t) const { return (q.tg == 1 ? t - s0 : (t - s0) / q.tg) * q.srow; }
  inline const at::Half* scale_row(int64_t t) const { return sb + group_row(t); }
  inline const uint8_t* zero_row(int64_t t) const { return zb ? zb + group_row(t) : nullptr; }
  template <int DC>
  inline void decode(int64_t t, float* __restrict__ out) {
    const int D = DC > 0 ? DC : this->D;
    float* __restrict__ cp = c.data();
    if (t < s0 || t >= s1) locate(t);
    const int64_t lt = t - s0;
    unpack_side(cb + lt * q.rb, q, D, cp);
    if (q.lut) lookup(cp, D);
    const int ng = D / q.dg;
    const at::Half* sp = scale_row(t);
    const uint8_t* zpp = zero_row(t);
    if (q.tg > 1) {
      const int64_t gg = t / q.tg;  // the group overall: its expanded scales are kept
      if (gg != cur) {
        float* __restrict__ sv = s.data(); float* __restrict__ zv = z.data();
        for (int k = 0; k < ng; ++k) {
          const float a = (float)sp[k], b = zpp ? (float)zpp[k] : q.zc;
          for (int d = k * q.dg; d < (k + 1) * q.dg; ++d) { sv[d] = a; zv[d] = a * b; }
        }
        cur = gg;
      }
      const float* __restrict__ sv = s.data(); const float* __restrict__ zv = z.data();
#pragma omp simd
      for (int d = 0; d < D; ++d) out[d] = sv[d] * cp[d] - zv[d];
      return;
    }
    for (int k = 0; k < ng; ++k) {
      const float a = (float)sp[k];
      const float az = a * (zpp ? (float)zpp[k] : q.zc);
      const int d0 = k * q.dg, d1 = d0 + q.dg;
#pragma omp simd
      for (int d = d0; d < d1; ++d) out[d] = a * cp[d] - az;
    }
  }
};

#ifdef LM_FOLD
// The row layout the folded paths read for a side of D channels, or ROW_NONE (a level table, a mixed row).
inline int row_kind(const QSide& q, int64_t D) {
  if (D != 64 || q.lut) return ROW_NONE;
  if (q.packing == PACK_SPLIT)
    return q.bits == 8 ? ROW_SPLIT8 : q.bits == 4 ? ROW_SPLIT4 : q.bits == 2 ? ROW_SPLIT2 : ROW_NONE;
  if (q.packing != PACK_STREAM) return ROW_NONE;
  return q.bits == 8 ? ROW_SPLIT8 : q.bits == 4 ? ROW_STREAM4 : q.bits == 3 ? ROW_STREAM3
       : q.bits == 2 ? ROW_STREAM2 : ROW_NONE;
}
#endif

// The format fields of a side (its parts' pointers are set by the caller).
void set_format(QSide& s, const torch::Tensor& lut, int64_t packing, int64_t bits, int64_t tg, int64_t dg,
                double zc, int D, int64_t seg, int64_t rb) {
  s.lut = lut.numel() ? lut.data_ptr<float>() : nullptr;
  for (int64_t i = 0; i < std::min<int64_t>(lut.numel(), 16); ++i) s.lut16[i] = s.lut[i];
  LM_CHECK(packing == PACK_SPLIT || packing == PACK_STREAM || packing == PACK_MIXED, "qattn: unknown packing id ",
           packing);
  s.packing = (int)packing; s.bits = (int)bits; s.tg = (int)tg; s.dg = (int)dg; s.zc = (float)zc;
  s.rb = (int)rb; s.srow = D / dg; s.seg = seg; s.dkeep = D;
  if (packing == PACK_MIXED) {  // bits: 14 bits a run from the lowest, run bits + 16 * channels (KVLayout.kernel_bits)
    int64_t total = 0, bytes = 0;
    s.bits = 0;
    for (int i = 0; i < MAX_RUNS; ++i) {
      const int64_t r = (bits >> (14 * i)) & 16383, b = r & 15, n = r >> 4;
      if (n == 0) break;
      LM_CHECK(b <= 8 && (b == 0 || n % 8 == 0), "qattn: mixed run of ", n, " channels at ", b, " bits");
      s.rbits[s.nruns] = (int)b; s.nrun[s.nruns] = (int)n; ++s.nruns;
      total += n; bytes += b * n / 8; s.bits = std::max(s.bits, (int)b);
    }
    LM_CHECK(total == D && bytes == rb, "qattn: mixed runs of ", total, " channels, ", bytes,
             " bytes; the row has ", D, " channels, ", rb, " bytes");
    if (s.rbits[s.nruns - 1] == 0) s.dkeep = D - s.nrun[s.nruns - 1];
  }
}

// codes[i] [B, H, T_i, rb] uint8, scale[i] fp16 and zp[i] uint8 (empty list: none)
// [B, H, ceil(T_i / tg), D / dg]; all contiguous (checked by the Python caller).
QSide make_side(const std::vector<torch::Tensor>& codes, const std::vector<torch::Tensor>& scale,
                const std::vector<torch::Tensor>& zp, const torch::Tensor& lut, int64_t packing, int64_t bits,
                int64_t tg, int64_t dg, double zc, int D, int64_t seg, std::vector<torch::Tensor>& keep) {
  QSide s;
  s.has_zp = !zp.empty();
  LM_CHECK(!codes.empty() && codes.size() == scale.size() && (!s.has_zp || zp.size() == codes.size()),
              "qattn: each side needs as many scale (and zero point) tensors as code tensors");
  // a part that is not contiguous (or scales not fp16) is converted here and kept alive
  auto fit = [&keep](const torch::Tensor& t, c10::ScalarType dt) -> const torch::Tensor& {
    if (t.scalar_type() == dt && t.is_contiguous()) return t;
    keep.push_back(t.to(dt).contiguous());
    return keep.back();
  };
  for (size_t i = 0; i < codes.size(); ++i) {
    s.codes.push_back(fit(codes[i], torch::kUInt8).data_ptr<uint8_t>());
    s.scale.push_back(fit(scale[i], torch::kFloat16).data_ptr<at::Half>());
    s.zp.push_back(s.has_zp ? fit(zp[i], torch::kUInt8).data_ptr<uint8_t>() : nullptr);
    s.T.push_back(codes[i].size(2));
    s.R.push_back(scale[i].size(2));
  }
  set_format(s, lut, packing, bits, tg, dg, zc, D, seg, codes[0].size(3));
  return s;
}
// A side from a history's pointer table (built once per history object by
// kernels.attention._kernel_table, which keeps the tensors it points into alive):
// [nseg, rb, has_zp, then per segment T, R, codes, scale, zero point], from t[pos] on.
QSide side_from_table(const int64_t* t, int64_t& pos, int64_t len, const torch::Tensor& lut, int64_t packing,
                      int64_t bits, int64_t tg, int64_t dg, double zc, int D, int64_t seg) {
  LM_CHECK(pos + 3 <= len, "qattn_batch: history table too short");
  const int64_t n = t[pos], rb = t[pos + 1];
  QSide s;
  s.has_zp = t[pos + 2] != 0;
  pos += 3;
  LM_CHECK(n > 0 && pos + 5 * n <= len, "qattn_batch: history table too short for ", n, " segments");
  for (int64_t i = 0; i < n; ++i, pos += 5) {
    s.T.push_back(t[pos]); s.R.push_back(t[pos + 1]);
    s.codes.push_back(reinterpret_cast<const uint8_t*>(t[pos + 2]));
    s.scale.push_back(reinterpret_cast<const at::Half*>(t[pos + 3]));
    s.zp.push_back(s.has_zp ? reinterpret_cast<const uint8_t*>(t[pos + 4]) : nullptr);
  }
  set_format(s, lut, packing, bits, tg, dg, zc, D, seg, rb);
  return s;
}
}  // namespace

// Full-precision part (sinks, window, current chunk): float rows read directly, scored
// with the unrotated queries. It may come in pieces (e.g. sinks, window and current
// tokens, never concatenated): piece p holds tokens [off[p], off[p] + L[p]) as
// [B, Hkv, L[p], D] rows, stream bh's first row hs[p] elements after stream bh-1's (L[p]*D
// when contiguous; more for the window, a prefix of a buffer with room to grow). "causal":
// row tq sees fp token j only when j <= L - Tq + tq (the current chunk is the last Tq fp
// tokens).
constexpr int MAX_PIECES = 4;
struct FpPart {
  const void* k[MAX_PIECES] = {}; const void* v[MAX_PIECES] = {}; bool half[MAX_PIECES] = {};
  int64_t off[MAX_PIECES + 1] = {}; int64_t hs[MAX_PIECES] = {}; int np = 0;
  const float* q = nullptr; const float* mask = nullptr; int64_t L = 0; bool causal = false;
  void add(const void* kp, const void* vp, int64_t n, bool is_half, int64_t head_stride) {
    LM_CHECK(np < MAX_PIECES, "qattn: at most ", MAX_PIECES, " full-precision pieces");
    k[np] = kp; v[np] = vp; half[np] = is_half; hs[np] = head_stride; off[np + 1] = off[np] + n; ++np;
    L = off[np];
  }
  // row t of (b, h) stream bh, keys (side 0) or values (side 1): in place when float32,
  // else converted into buf
  inline const float* row(int side, int64_t bh, int64_t t, int64_t D, float* __restrict__ buf) const {
    int p = 0;
    while (t >= off[p + 1]) ++p;
    const int64_t at = bh * hs[p] + (t - off[p]) * D;
    const void* base = side ? v[p] : k[p];
    if (!half[p]) return static_cast<const float*>(base) + at;
    half_to_float(static_cast<const at::Half*>(base) + at, buf, D);
    return buf;
  }
};

// One attention problem of the call: queries [B, Hq, Tq, D] against a quantized
// history of T tokens (K, V) and a full-precision part F; its partial results go to
// pm/pl/pa ([B, Hkv, nitem, rows(, D)]) and the merged ones to oh/of ([B, Hq, Tq, D])
// and lse ([B, Hq, Tq], optional).
struct Job {
  const QSide* K = nullptr; const QSide* V = nullptr;
  int64_t B = 1, Tq = 1, T = 0, nsplit = 1;
  const float* q = nullptr; const float* mask = nullptr;
  FpPart F;
  float* pm = nullptr; float* pl = nullptr; float* pa = nullptr;
  float* oh = nullptr; float* of = nullptr; float* lse = nullptr;
};

// run_items' per-item buffers, one set per thread (see there)
struct Scratch {
  std::vector<float> sc, w, va, vz, ka, kza, qsum, mla, qs, kbuf, vbuf, kz, kbuf_s, wall;
  std::vector<const float*> qrow, qsrow;
  std::vector<int64_t> rtq;
};

inline Scratch& scratch() {
  static thread_local Scratch s;
  return s;
}

template <int DC>
void run_items(const std::vector<Job>& jobs, int64_t Drt, int64_t Hq, int64_t Hkv) {
  const int64_t D = DC > 0 ? DC : Drt;
  const int64_t nrep = Hq / Hkv;
  std::vector<int64_t> first(jobs.size() + 1, 0);  // first item of each job
  for (size_t j = 0; j < jobs.size(); ++j) first[j + 1] = first[j] + jobs[j].B * Hkv * (jobs[j].nsplit + 1);
  const int64_t items = first.back();

  std::vector<int64_t> firstbh(jobs.size() + 1, 0);  // first (b, h) of each job, for the merge
  for (size_t j = 0; j < jobs.size(); ++j) firstbh[j + 1] = firstbh[j] + jobs[j].B * Hkv;
  // one parallel region for the items and their merge (two cost a second fork and join,
  // a few µs of a short history's call)
#pragma omp parallel
  {
#pragma omp for schedule(dynamic, 1)
  for (int64_t gi = 0; gi < items; ++gi) {
    const size_t j = std::upper_bound(first.begin(), first.end(), gi) - first.begin() - 1;
    const Job& J = jobs[j];
    const QSide& K = *J.K; const QSide& V = *J.V; const FpPart& F = J.F;
    const int64_t it = gi - first[j], Tq = J.Tq, T = J.T, nsplit = J.nsplit, rows = nrep * Tq;
    const int64_t nitem = nsplit + 1;  // the last split of each (b, h) is the fp part
    // Folded keys: with per-channel groups of a multiple of TILE tokens, splits start on a
    // group boundary, so each tile lies in one group and q·k = (q∘s)·c − q·(s∘z): the
    // scales go into the query rows once a tile and the key rows are only unpacked.
    const bool kfold = K.tg > 1 && K.tg % TILE == 0 && !K.lut;
    // Folded per-token keys (one scale a token): q·k = s·(q·c) − s·z·Σq, c the code (its
    // level with a table): the rows are only unpacked, the scale applied to the score.
    const bool kfold_tok = K.tg == 1 && K.srow == 1;
    // Folded values: one scale per token, p·v = (p·s)·c − p·s·z, the second term summed
    // per row and taken off the accumulator at the end (c: the code's level with a table).
    const bool vfold = V.tg == 1 && V.srow == 1;
    int64_t per = T > 0 ? (T + nsplit - 1) / nsplit : 0;
    if (kfold) per = (per + K.tg - 1) / K.tg * K.tg;
    const int64_t sp = it % nitem, bh = it / nitem, b = bh / Hkv, h = bh % Hkv;
    const bool fp = sp == nsplit;
    const int64_t t0 = fp ? 0 : sp * per;
    const int64_t t1 = fp ? F.L : std::min(T, t0 + per);
    if (t0 >= t1) continue;
    const bool kf = kfold && !fp, vf = vfold && !fp, kft = kfold_tok && !fp;
    const int64_t Dk = kf ? K.dkeep : D;  // key row length in the tile (folded mixed keys: no 0-bit tail)
#ifdef LM_FOLD
    // folded keys and values of 64 channels in a layout the folded paths read (best-4, best-2, int8,
    // int4, kivi): unpacked in registers and used there (scores_fold / pv_fold), no float
    // rows in between
    const int kkind = row_kind(K, D), vkind = row_kind(V, D);
    const bool fast = (kf || kft) && vf && kkind != ROW_NONE && vkind != ROW_NONE;
#else
    const bool fast = false;
#endif
    RowDecoder kd(K, (int)D, bh), vd(V, (int)D, bh);
    // the item's buffers: the thread's own, reused from item to item and call to call instead
    // of ~20 vectors allocated and zeroed per item; filled as a new vector would be, but the
    // key/value tiles, which every tile writes before it reads them
    Scratch& S = scratch();
    auto zeroed = [](std::vector<float>& v, int64_t n) -> std::vector<float>& { v.assign(n, 0.f); return v; };
    std::vector<float>& sc = zeroed(S.sc, rows * TILE); std::vector<float>& w = zeroed(S.w, TILE);
    std::vector<float>& va = zeroed(S.va, TILE); std::vector<float>& vz = zeroed(S.vz, TILE);
    std::vector<float>& ka = zeroed(S.ka, TILE); std::vector<float>& kza = zeroed(S.kza, TILE);
    std::vector<float>& qsum = zeroed(S.qsum, rows);
    const float* qbase = fp ? F.q : J.q;
    std::vector<const float*>& qrow = S.qrow; qrow.assign(rows, nullptr);
    std::vector<int64_t>& rtq = S.rtq; rtq.assign(rows, 0);
    for (int64_t r = 0; r < rows; ++r) {
      rtq[r] = r % Tq;
      qrow[r] = qbase + ((b * Hq + h * nrep + r / Tq) * Tq + rtq[r]) * D;
      if (kft) {
        float sum = 0.f;
        for (int64_t d = 0; d < D; ++d) sum += qrow[r][d];
        qsum[r] = sum;
      }
    }
    // running max / sum / accumulator in this item's own memory (the partial buffers of
    // neighbouring items share cache lines: writing them per tile made threads fight);
    // zs: the folded values' zero-point sums; qs, kz: the folded query rows and offsets
    std::vector<float>& mla = zeroed(S.mla, rows * (D + 3));
    std::vector<float>& qs = zeroed(S.qs, kf ? rows * D : 0);
    std::vector<float>& kbuf = S.kbuf; if ((int64_t)kbuf.size() < TILE * D) kbuf.resize(TILE * D);
    std::vector<float>& vbuf = S.vbuf; if ((int64_t)vbuf.size() < TILE * D) vbuf.resize(TILE * D);
    float* m = mla.data(); float* l = m + rows; float* zs = l + rows; float* acc = zs + rows;
    std::vector<float>& kz = zeroed(S.kz, rows); std::vector<float>& kbuf_s = zeroed(S.kbuf_s, kf ? 2 * D : 0);
    std::vector<float>& wall = zeroed(S.wall, fast ? rows * TILE : 0);
    std::vector<const float*>& qsrow = S.qsrow; qsrow.assign(fast ? rows : 0, nullptr);
    for (int64_t r = 0; r < (int64_t)qsrow.size(); ++r) qsrow[r] = kf ? qs.data() + r * D : qrow[r];
    std::fill(m, m + rows, NEG_INF);
    int64_t kgroup = -1;
    for (int64_t ts = t0; ts < t1; ts += TILE) {
      const int64_t n = std::min<int64_t>(TILE, t1 - ts);
      float* __restrict__ kb = kbuf.data();  // the tile's keys as float rows (codes when folded)
      float* __restrict__ vb = vbuf.data();
      // (fast: every tile of the item, so a segmented history computes as a joined one)
      if (fast) {  // the tile after next, into the caches while this one is computed
        kd.seek(ts); vd.seek(ts);
        if (ts + 3 * TILE <= kd.s1 && ts + 3 * TILE <= vd.s1 && ts + 3 * TILE <= t1) {
          lm_prefetch(kd.cb + (ts + 2 * TILE - kd.s0) * K.rb, TILE * K.rb);
          lm_prefetch(vd.cb + (ts + 2 * TILE - vd.s0) * V.rb, TILE * V.rb);
        }
      }
      for (int64_t i = 0; i < (fast ? 0 : n); ++i) {
        if (fp) {
          const float* src = F.row(0, bh, ts + i, D, kb + i * D);
          if (src != kb + i * D) std::copy(src, src + D, kb + i * D);
        } else if (kf || kft) {
          kd.template raw<DC>(ts + i, kb + i * Dk);
        } else {
          kd.template decode<DC>(ts + i, kb + i * D);
        }
      }
      if (kft) kd.token_scales(ts, n, ka.data(), kza.data());
      if (kf && ts / K.tg != kgroup) {  // a new key group: scale the query rows
        kgroup = ts / K.tg;
        kd.seek(ts);
        const at::Half* s = kd.scale_row(ts); const uint8_t* z = kd.zero_row(ts);
        float* __restrict__ ks = kbuf_s.data(); float* __restrict__ kzv = ks + D;  // per channel
        if (K.dg == 1) {
          half_to_float(s, ks, D);
          for (int64_t d = 0; d < D; ++d) kzv[d] = z ? (float)z[d] : K.zc;
        } else {
          for (int64_t d = 0; d < D; ++d) { ks[d] = (float)s[d / K.dg]; kzv[d] = z ? (float)z[d / K.dg] : K.zc; }
        }
        for (int64_t r = 0; r < rows; ++r) {
          const float* __restrict__ qr = qrow[r];
          float* __restrict__ o = qs.data() + r * D;
          float off = 0.f;
#pragma omp simd reduction(+:off)
          for (int64_t d = 0; d < D; ++d) { o[d] = qr[d] * ks[d]; off += o[d] * kzv[d]; }
          kz[r] = off;
        }
      }
#ifdef LM_FOLD
      // each token's score is computed alone (its own chain and tree), so a tile crossing a
      // segment boundary is scored run by run with the same result
      for (int64_t t = ts, e; fast && t < ts + n; t = e) {
        kd.seek(t);
        e = std::min(ts + n, kd.s1);
        LM_ROW_DISPATCH(kkind, scores_fold_rows, qsrow.data(), rows, kd.cb + (t - kd.s0) * K.rb, K.rb, e - t,
                        sc.data() + (t - ts), TILE)
      }
#endif
      for (int64_t r = 0; r < rows; ++r) {
        const float* __restrict__ qr = kf ? qs.data() + r * D : qrow[r];
        float* __restrict__ srow = sc.data() + r * TILE;
        int64_t i = fast ? n : 0;  // fast: scored above
#if defined(__AVX2__) && defined(__FMA__)
        if (Dk % 8 == 0)
          for (; i + 8 <= n; i += 8) dot8(qr, kb + i * Dk, Dk, srow + i);
#endif
        for (; i < n; ++i) {
          const float* __restrict__ kp = kb + i * Dk;
          float s = 0.f;
#pragma omp simd reduction(+:s)
          for (int64_t d = 0; d < Dk; ++d) s += qr[d] * kp[d];
          srow[i] = s;
        }
        if (kf) for (int64_t i2 = 0; i2 < n; ++i2) srow[i2] -= kz[r];
        if (kft) {
          const float qz = qsum[r];
#pragma omp simd
          for (int64_t i2 = 0; i2 < n; ++i2) srow[i2] = ka[i2] * srow[i2] - kza[i2] * qz;
        }
        const int64_t tq = rtq[r];
        if (fp) {
          if (F.mask)
            for (int64_t i2 = 0; i2 < n; ++i2) srow[i2] += F.mask[(b * Tq + tq) * F.L + ts + i2];
          if (F.causal)
            for (int64_t i2 = 0; i2 < n; ++i2) if (ts + i2 > F.L - Tq + tq) srow[i2] = NEG_INF;
        } else if (J.mask) {
          for (int64_t i2 = 0; i2 < n; ++i2) srow[i2] += J.mask[(b * Tq + tq) * T + ts + i2];
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        const float mx = max_of(sc.data() + r * TILE, n);
        if (mx == NEG_INF) { for (int64_t i = 0; i < n; ++i) sc[r * TILE + i] = 0.f; continue; }
        const float mnew = std::max(m[r], mx);
        const float corr = (m[r] == NEG_INF) ? 0.f : std::exp(m[r] - mnew);
        if (corr != 1.f) {
          l[r] *= corr; zs[r] *= corr;
          for (int64_t d = 0; d < D; ++d) acc[r * D + d] *= corr;
        }
        m[r] = mnew;
        l[r] += exp_rows(sc.data() + r * TILE, n, mnew);
      }
      if (vf) vd.token_scales(ts, n, va.data(), vz.data());  // folded values: per-token scales
#ifdef LM_FOLD
      if (fast) {
        for (int64_t r = 0; r < rows; ++r)
          zs[r] += scale_weights(sc.data() + r * TILE, va.data(), vz.data(), wall.data() + r * TILE, n);
        for (int64_t t = ts, e; t < ts + n; t = e) {  // run by run, in token order as one call would
          vd.seek(t);
          e = std::min(ts + n, vd.s1);
          LM_ROW_DISPATCH(vkind, pv_fold_rows, acc, rows, wall.data() + (t - ts), TILE, vd.cb + (t - vd.s0) * V.rb,
                          V.rb, e - t)
        }
        continue;
      }
#endif
      for (int64_t i = 0; i < n; ++i) {  // the tile's values as float rows (codes when folded)
        const int64_t t = ts + i;
        if (fp) {
          const float* src = F.row(1, bh, t, D, vb + i * D);
          if (src != vb + i * D) std::copy(src, src + D, vb + i * D);
        } else if (vf) {
          vd.template raw<DC>(t, vb + i * D);
        } else {
          vd.template decode<DC>(t, vb + i * D);
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        const float* __restrict__ p = sc.data() + r * TILE;
        const float* wr = p;
        if (vf) {
          zs[r] += scale_weights(p, va.data(), vz.data(), w.data(), n);
          wr = w.data();
        }
        pv_rows(acc + r * D, wr, vb, n, D);
      }
    }
    if (vf)
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t d = 0; d < D; ++d) acc[r * D + d] -= zs[r];
    std::copy(m, m + rows, J.pm + it * rows);
    std::copy(l, l + rows, J.pl + it * rows);
    std::copy(acc, acc + rows * D, J.pa + it * rows * D);
  }

  // merge (after the loop's barrier): M = max_s m_s, L = Σ_s l_s e^{m_s − M},
  // out = Σ_s acc_s e^{m_s − M} / L, lse = M + log L
#pragma omp for schedule(static)
  for (int64_t gbh = 0; gbh < firstbh.back(); ++gbh) {
    const size_t j = std::upper_bound(firstbh.begin(), firstbh.end(), gbh) - firstbh.begin() - 1;
    const Job& J = jobs[j];
    const int64_t bh = gbh - firstbh[j], b = bh / Hkv, h = bh % Hkv, Tq = J.Tq, rows = nrep * Tq;
    const int64_t nitem = J.nsplit + 1;
    const float* pmp = J.pm; const float* plp = J.pl; const float* pap = J.pa;
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t hq = h * nrep + r / Tq, tq = r % Tq;
      float M = NEG_INF;
      for (int64_t s = 0; s < nitem; ++s) M = std::max(M, pmp[(bh * nitem + s) * rows + r]);
      if (M == NEG_INF) continue;
      float L = 0.f;
      for (int64_t s = 0; s < nitem; ++s) {
        const int64_t base = (bh * nitem + s) * rows + r;
        if (pmp[base] != NEG_INF) L += plp[base] * std::exp(pmp[base] - M);
      }
      const int64_t o = ((b * Hq + hq) * Tq + tq) * D;
      for (int64_t s = 0; s < nitem; ++s) {
        const int64_t base = (bh * nitem + s) * rows + r;
        if (pmp[base] == NEG_INF) continue;
        const float w = std::exp(pmp[base] - M) / L;
        float* dst = (s == J.nsplit ? J.of : J.oh) + o;
        const float* a = pap + base * D;
        for (int64_t d = 0; d < D; ++d) dst[d] += a[d] * w;
      }
      if (J.lse) J.lse[(b * Hq + hq) * Tq + tq] = M + std::log(L);
    }
  }
  }  // omp parallel
}

void run_jobs(const std::vector<Job>& jobs, int64_t D, int64_t Hq, int64_t Hkv) {
  if (D == 64) run_items<64>(jobs, D, Hq, Hkv);
  else if (D == 128) run_items<128>(jobs, D, Hq, Hkv);
  else run_items<0>(jobs, D, Hq, Hkv);
}

// Returns {out_h, out_f, lse}: the quantized-history and full-precision contributions,
// both already divided by the joint softmax denominator, so out = out_f + R_vᵀ·out_h.
// The history of each side is a list of segments (see QSide); seg = tokens per segment.
std::vector<torch::Tensor> qattn_forward(
    torch::Tensor q, std::vector<torch::Tensor> kc, std::vector<torch::Tensor> ks,
    std::vector<torch::Tensor> kz, torch::Tensor klut, int64_t kpack, int64_t kbits, int64_t ktg, int64_t kdg,
    double kzc, std::vector<torch::Tensor> vc, std::vector<torch::Tensor> vs, std::vector<torch::Tensor> vz,
    torch::Tensor vlut, int64_t vpack, int64_t vbits, int64_t vtg, int64_t vdg, double vzc, int64_t seg,
    torch::Tensor mask, int64_t nsplit,
    torch::Tensor qf, torch::Tensor kfp, torch::Tensor vfp, torch::Tensor maskf, bool causal) {
  const int64_t B = q.size(0), Hq = q.size(1), Tq = q.size(2), D = q.size(3);
  const int64_t Hkv = kc[0].size(1);
  int64_t T = 0;
  for (const auto& c : kc) T += c.size(2);
  const int64_t rows = (Hq / Hkv) * Tq;
  std::vector<torch::Tensor> keep;
  keep.reserve(3 * (kc.size() + vc.size()));  // no reallocation: QSide holds raw pointers
  const QSide K = make_side(kc, ks, kz, klut, kpack, kbits, ktg, kdg, kzc, (int)D, seg, keep);
  const QSide V = make_side(vc, vs, vz, vlut, vpack, vbits, vtg, vdg, vzc, (int)D, seg, keep);
  Job J;
  J.K = &K; J.V = &V; J.B = B; J.Tq = Tq; J.T = T; J.nsplit = nsplit < 1 ? 1 : nsplit;
  J.q = q.data_ptr<float>(); J.mask = mask.numel() ? mask.data_ptr<float>() : nullptr;
  if (kfp.numel()) {
    J.F.add(kfp.data_ptr<float>(), vfp.data_ptr<float>(), kfp.size(2), false, kfp.size(2) * D); J.F.q = qf.data_ptr<float>();
    J.F.mask = maskf.numel() ? maskf.data_ptr<float>() : nullptr; J.F.causal = causal;
  }
  const int64_t nitem = J.nsplit + 1;
  auto pm = torch::full({B, Hkv, nitem, rows}, NEG_INF, torch::kFloat32);
  auto pl = torch::empty({B, Hkv, nitem, rows}, torch::kFloat32);  // read only where pm is set
  auto pa = torch::empty({B, Hkv, nitem, rows, D}, torch::kFloat32);
  auto out_h = torch::zeros({B, Hq, Tq, D}, torch::kFloat32);
  auto out_f = torch::zeros({B, Hq, Tq, D}, torch::kFloat32);
  auto lse = torch::full({B, Hq, Tq}, NEG_INF, torch::kFloat32);
  J.pm = pm.data_ptr<float>(); J.pl = pl.data_ptr<float>(); J.pa = pa.data_ptr<float>();
  J.oh = out_h.data_ptr<float>(); J.of = out_f.data_ptr<float>(); J.lse = lse.data_ptr<float>();
  run_jobs({J}, D, Hq, Hkv);
  return {out_h, out_f, lse};
}

// One side's quantized tokens as float32 [B, H, T, D], decoded as the attention loop
// decodes them (levels, then s·c − s·z): a long prefill chunk's slice of the history for
// flash attention. The output is the one allocation (the torch path makes int64 codes and
// a few more temporaries of the output's size for every slice of every layer). The side's
// arguments are qattn_forward's (one part: codes [B, H, T, rb], scale and zero point, if
// any, [B, H, ceil(T / tg), D / dg]) and head_dim D.
torch::Tensor qdequant(std::vector<torch::Tensor> codes, std::vector<torch::Tensor> scale,
                       std::vector<torch::Tensor> zp, torch::Tensor lut, int64_t packing, int64_t bits, int64_t tg,
                       int64_t dg, double zc, int64_t D) {
  LM_CHECK(codes.size() == 1 && codes[0].dim() == 4 && scale.size() == 1 && scale[0].dim() == 4 && zp.size() <= 1,
           "qdequant: one part of 4-D codes and scale, at most one zero point tensor");
  LM_CHECK(D > 0 && tg > 0 && dg > 0 && D % dg == 0, "qdequant: head_dim ", D, " and channel group ", dg);
  std::vector<torch::Tensor> keep;
  keep.reserve(3);
  const QSide S = make_side(codes, scale, zp, lut, packing, bits, tg, dg, zc, (int)D, 0, keep);
  const int64_t B = codes[0].size(0), H = codes[0].size(1), T = codes[0].size(2);
  auto out = torch::empty({B, H, T, D}, torch::kFloat32);
  float* o = out.data_ptr<float>();
  const int64_t step = tg > 1 ? tg * std::max<int64_t>(1, 256 / tg) : 256;  // tokens an item, whole groups
  const int64_t per = (T + step - 1) / step, items = B * H * per;
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < items; ++i) {
    const int64_t bh = i / per, t0 = (i % per) * step, t1 = std::min(T, t0 + step);
    RowDecoder dec(S, (int)D, bh);
    for (int64_t t = t0; t < t1; ++t) dec.decode<0>(t, o + (bh * T + t) * D);
  }
  return out;
}

// Decode rows of many requests at once (a serving step): request r has one query row
// q[r] [Hq, D] (scaled, rotated like its keys) for its quantized history — its parts'
// pointer table tables[r] (side_from_table; segments of seg[r] tokens, as in
// qattn_forward: read through a table made once per history object, since converting
// each step's thousand part tensors cost more than the attention itself on a cold
// cache) — and qf[r] (scaled, unrotated) for its full-precision pieces fk[r][i], fv[r][i]
// [1, Hkv, L_i, D] (sinks, window, current token: all visible; float32 or float16 rows of D
// read in place, heads any number of rows apart; any other piece is converted first and
// kept for the call). All requests share the formats. One parallel region over requests ×
// KV heads × splits. Returns {out_h, out_f} [R, Hq, D], divided by each row's joint softmax
// sum (as qattn_forward).
std::vector<torch::Tensor> qattn_batch(
    torch::Tensor q, torch::Tensor qf, std::vector<torch::Tensor> tables, int64_t Hkv,
    torch::Tensor klut, int64_t kpack, int64_t kbits, int64_t ktg, int64_t kdg, double kzc,
    torch::Tensor vlut, int64_t vpack, int64_t vbits, int64_t vtg, int64_t vdg, double vzc, std::vector<int64_t> seg,
    std::vector<std::vector<torch::Tensor>> fk, std::vector<std::vector<torch::Tensor>> fv,
    std::vector<int64_t> nsplit) {
  LM_CHECK(q.dim() == 3 && q.scalar_type() == torch::kFloat32 && q.is_contiguous() && qf.sizes() == q.sizes()
              && qf.scalar_type() == torch::kFloat32 && qf.is_contiguous(),
              "qattn_batch: q and qf must be contiguous float32 [R, Hq, D] of one shape");
  const int64_t R = q.size(0), Hq = q.size(1), D = q.size(2);
  LM_CHECK(tables.size() == (size_t)R && seg.size() == (size_t)R && fk.size() == (size_t)R
              && fv.size() == (size_t)R && nsplit.size() == (size_t)R,
              "qattn_batch: one history table, seg, piece list and split count per request (", R, " requests)");
  LM_CHECK(R > 0, "qattn_batch: no requests");
  LM_CHECK(Hkv > 0 && Hq % Hkv == 0, "qattn_batch: query heads ", Hq, " not a multiple of KV heads ", Hkv);
  const int64_t nrep = Hq / Hkv;
  std::vector<QSide> K, V;
  K.reserve(R); V.reserve(R);
  int64_t total_items = 0;
  std::vector<int64_t> Ts(R, 0);
  for (int64_t r = 0; r < R; ++r) {
    const auto& tb = tables[r];
    LM_CHECK(tb.scalar_type() == torch::kInt64 && tb.dim() == 1 && tb.is_contiguous(),
                "qattn_batch: history tables must be contiguous int64 vectors");
    const int64_t* t = tb.data_ptr<int64_t>();
    int64_t pos = 0;
    K.push_back(side_from_table(t, pos, tb.numel(), klut, kpack, kbits, ktg, kdg, kzc, (int)D, seg[r]));
    V.push_back(side_from_table(t, pos, tb.numel(), vlut, vpack, vbits, vtg, vdg, vzc, (int)D, seg[r]));
    for (auto x : K.back().T) Ts[r] += x;
    total_items += Hkv * ((nsplit[r] < 1 ? 1 : nsplit[r]) + 1);
  }
  auto part = torch::empty({total_items * nrep * (D + 2)}, torch::kFloat32);
  float* pp = part.data_ptr<float>();
  auto out_h = torch::zeros({R, Hq, D}, torch::kFloat32);
  auto out_f = torch::zeros({R, Hq, D}, torch::kFloat32);
  std::vector<Job> jobs(R);
  std::vector<torch::Tensor> keep;  // pieces converted for this call
  int64_t used = 0;
  // a piece as the kernel reads it: float32/float16, rows of D contiguous and in order within
  // a head, heads any number of rows apart (a window is a prefix of a buffer with room to grow)
  auto readable = [D](const torch::Tensor& t) {
    const auto dt = t.scalar_type();
    return (dt == torch::kFloat32 || dt == torch::kFloat16) && t.dim() == 4 && t.size(3) == D && t.stride(3) == 1
           && (t.size(2) < 2 || t.stride(2) == D) && (t.size(1) < 2 || t.stride(1) >= t.size(2) * D);
  };
  for (int64_t r = 0; r < R; ++r) {
    Job& J = jobs[r];
    J.K = &K[r]; J.V = &V[r]; J.B = 1; J.Tq = 1; J.nsplit = nsplit[r] < 1 ? 1 : nsplit[r];
    J.T = Ts[r];
    J.q = q.data_ptr<float>() + r * Hq * D;
    J.F.q = qf.data_ptr<float>() + r * Hq * D;
    LM_CHECK(fk[r].size() == fv[r].size(), "qattn_batch: as many value pieces as key pieces");
    for (size_t i = 0; i < fk[r].size(); ++i) {
      torch::Tensor a = fk[r][i], b = fv[r][i];
      LM_CHECK(a.dim() == 4 && a.sizes() == b.sizes() && a.size(0) == 1 && a.size(1) == Hkv && a.size(3) == D,
                  "qattn_batch: full-precision pieces must be [1, Hkv, L, D] keys and values of one shape");
      if (!readable(a) || !readable(b) || b.scalar_type() != a.scalar_type() || (Hkv > 1 && a.stride(1) != b.stride(1))) {
        const auto dt = a.scalar_type() == torch::kFloat16 && b.scalar_type() == torch::kFloat16 ? torch::kFloat16
                                                                                                   : torch::kFloat32;
        keep.push_back(a.to(dt).contiguous()); a = keep.back();
        keep.push_back(b.to(dt).contiguous()); b = keep.back();
      }
      if (a.size(2)) J.F.add(a.data_ptr(), b.data_ptr(), a.size(2), a.scalar_type() == torch::kFloat16, a.stride(1));
    }
    const int64_t n = Hkv * (J.nsplit + 1) * nrep;
    J.pm = pp + used; J.pl = pp + used + n; J.pa = pp + used + 2 * n;
    std::fill(J.pm, J.pm + n, NEG_INF);  // an item with no tokens stays -inf: merged as empty
    used += n * (D + 2);
    J.oh = out_h.data_ptr<float>() + r * Hq * D; J.of = out_f.data_ptr<float>() + r * Hq * D;
  }
  run_jobs(jobs, D, Hq, Hkv);
  return {out_h, out_f};
}

// x [R, Hq, D] times m [D, D] (x @ m), row by row: the same sums whatever R is; m [Hq, D, D]:
// head h's rows times m[h] (a rotation with one matrix per KV head, given per query head).
static torch::Tensor rows_times(const torch::Tensor& x, const torch::Tensor& m) {
  const int64_t n = x.size(0) * x.size(1), Hq = x.size(1), D = x.size(2);
  const bool per_head = m.dim() == 3;
  auto out = torch::zeros_like(x);
  const float* xp = x.data_ptr<float>(); const float* mp = m.data_ptr<float>(); float* op = out.data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) {
    float* __restrict__ o = op + i * D;
    const float* mh = per_head ? mp + (i % Hq) * D * D : mp;
    for (int64_t k = 0; k < D; ++k) {
      const float a = xp[i * D + k];
      const float* __restrict__ row = mh + k * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) o[d] += a * row[d];
    }
  }
  return out;
}

// Decode rows as qattn_batch, the query's scaling and the rotations included, one output:
// q [R, Hq, D] float32 as the model made it (unscaled, unrotated); rk = Rᵀ of the keys'
// rotation (x @ rk rotates; empty: none; [Hq, D, D]: one per query head), rv = R of the values' (y @ rv undoes it; empty:
// none). Returns out [R, Hq, D] = out_f + out_h·rv. Each row's result does not depend on
// the others (rows are rotated one by one, in the same order of sums).
torch::Tensor qattn_rows(
    torch::Tensor q, double scale, torch::Tensor rk, torch::Tensor rv, std::vector<torch::Tensor> tables, int64_t Hkv,
    torch::Tensor klut, int64_t kpack, int64_t kbits, int64_t ktg, int64_t kdg, double kzc,
    torch::Tensor vlut, int64_t vpack, int64_t vbits, int64_t vtg, int64_t vdg, double vzc, std::vector<int64_t> seg,
    std::vector<std::vector<torch::Tensor>> fk, std::vector<std::vector<torch::Tensor>> fv,
    std::vector<int64_t> nsplit) {
  LM_CHECK(q.dim() == 3, "qattn_rows: q must be [R, Hq, D]");
  const int64_t D = q.size(2);
  for (const auto* m : {&rk, &rv})
    LM_CHECK(m->numel() == 0 || (m->dim() == 2 && m->size(0) == D && m->size(1) == D
                                    && m->scalar_type() == torch::kFloat32 && m->is_contiguous())
                || (m == &rk && m->dim() == 3 && m->size(0) == q.size(1) && m->size(1) == D && m->size(2) == D
                    && m->scalar_type() == torch::kFloat32 && m->is_contiguous()),
                "qattn_rows: rotation matrices must be contiguous float32 [D, D] (keys: or [Hq, D, D]), or empty");
  // q · scale as torch multiplies a float32 tensor by a double (the scale rounded to float
  // once, one product each) and out_f + out_h below: loops, not two more tensor ops a layer
  auto qc = q.to(torch::kFloat32).contiguous();
  auto qf = torch::empty_like(qc);
  const float s = (float)scale;
  const float* qp = qc.data_ptr<float>(); float* fp = qf.data_ptr<float>();
  for (int64_t i = 0, n = qc.numel(); i < n; ++i) fp[i] = qp[i] * s;
  auto qh = rk.numel() ? rows_times(qf, rk) : qf;
  auto outs = qattn_batch(qh, qf, tables, Hkv, klut, kpack, kbits, ktg, kdg, kzc, vlut, vpack, vbits, vtg, vdg,
                          vzc, seg, fk, fv, nsplit);
  auto out_h = rv.numel() ? rows_times(outs[0], rv) : outs[0];
  float* op = outs[1].data_ptr<float>(); const float* hp = out_h.data_ptr<float>();
  for (int64_t i = 0, n = outs[1].numel(); i < n; ++i) op[i] += hp[i];
  return outs[1];
}
