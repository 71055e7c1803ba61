// Fused GGUF dequant-matmul (gguf_linear) and block dequantizer (gguf_dequantize) for the
// ten GGUF block types and IQ4_NL / IQ4_XS. Compiled at first use (with -ffp-contract=off) by
// lessmem/kernels/_build.py; the Python wrappers and the design in words are in
// lessmem/kernels/gguf_linear_cpp.py; the reference twin is gguf_linear_reference.py.
#include <torch/extension.h>
#include <c10/util/Half.h>
#include <cstdint>
#include <cmath>
#include <cstring>
#include <algorithm>
#include <vector>
#include <ATen/Parallel.h>
#include <ATen/CPUGeneratorImpl.h>
#include <mutex>
#include <unordered_map>
#if defined(__F16C__) || defined(__SSE2__) || defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#define PAR_MIN_WORK 65536

static inline float h2f(const uint8_t* p) {
  uint16_t b; std::memcpy(&b, p, 2);
#ifdef __F16C__
  return _cvtsh_ss(b);
#else
  return c10::detail::fp16_ieee_to_fp32_value(b);
#endif
}

// ---------------------------------------------------------------- 16-float vectors
// V16 is one AVX-512 register, two AVX2 registers, or 16 floats (any other CPU).
#if defined(__AVX512F__)
struct V16 { __m512 v; };
static inline V16 vzero() { return {_mm512_setzero_ps()}; }
static inline V16 vset(float a) { return {_mm512_set1_ps(a)}; }
static inline V16 vload(const float* p) { return {_mm512_loadu_ps(p)}; }
static inline void vstore(float* p, V16 a) { _mm512_storeu_ps(p, a.v); }
static inline V16 vcodes(const uint8_t* q) { return {_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)q)))}; }
static inline V16 vadd(V16 a, V16 b) { return {_mm512_add_ps(a.v, b.v)}; }
static inline V16 vsub(V16 a, V16 b) { return {_mm512_sub_ps(a.v, b.v)}; }
static inline V16 vmul(V16 a, V16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
static inline V16 vfma(V16 a, V16 b, V16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
static inline float vsum(V16 a) { return _mm512_reduce_add_ps(a.v); }
#elif defined(__AVX2__) && defined(__FMA__)
struct V16 { __m256 lo, hi; };
static inline V16 vzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
static inline V16 vset(float a) { return {_mm256_set1_ps(a), _mm256_set1_ps(a)}; }
static inline V16 vload(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
static inline void vstore(float* p, V16 a) { _mm256_storeu_ps(p, a.lo); _mm256_storeu_ps(p + 8, a.hi); }
static inline V16 vcodes(const uint8_t* q) {
  return {_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)q))),
          _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(q + 8))))};
}
static inline V16 vadd(V16 a, V16 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
static inline V16 vsub(V16 a, V16 b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
static inline V16 vmul(V16 a, V16 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
static inline V16 vfma(V16 a, V16 b, V16 c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
static inline float vsum(V16 a) { float t[16]; vstore(t, a); float s = 0.f; for (int i = 0; i < 16; ++i) s += t[i]; return s; }
#else
struct V16 { float f[16]; };
static inline V16 vzero() { V16 r; for (int i = 0; i < 16; ++i) r.f[i] = 0.f; return r; }
static inline V16 vset(float a) { V16 r; for (int i = 0; i < 16; ++i) r.f[i] = a; return r; }
static inline V16 vload(const float* p) { V16 r; std::memcpy(r.f, p, 64); return r; }
static inline void vstore(float* p, V16 a) { std::memcpy(p, a.f, 64); }
static inline V16 vcodes(const uint8_t* q) { V16 r; for (int i = 0; i < 16; ++i) r.f[i] = (float)q[i]; return r; }
static inline V16 vadd(V16 a, V16 b) { for (int i = 0; i < 16; ++i) a.f[i] += b.f[i]; return a; }
static inline V16 vsub(V16 a, V16 b) { for (int i = 0; i < 16; ++i) a.f[i] -= b.f[i]; return a; }
static inline V16 vmul(V16 a, V16 b) { for (int i = 0; i < 16; ++i) a.f[i] *= b.f[i]; return a; }
static inline V16 vfma(V16 a, V16 b, V16 c) { for (int i = 0; i < 16; ++i) c.f[i] = __builtin_fmaf(a.f[i], b.f[i], c.f[i]); return c; }
static inline float vsum(V16 a) { float s = 0.f; for (int i = 0; i < 16; ++i) s += a.f[i]; return s; }
#endif

// ---------------------------------------------------------------- block decoders
// decode<T>(block, q, a, b): byte ops only. q[QK] gets every element's unsigned code and
// each group g of 16 elements its float32 factors, so that the weight is
//   sym  (ASYM = 0):  w = a[g] * ((float)q - OFF)       (Q4_0 Q5_0 Q8_0 Q3_K Q6_K)
//   asym (ASYM = 1):  w = a[g] * (float)q + b[g]        (Q4_1 Q5_1 Q2_K Q4_K Q5_K)
// -- the float32 operations of formats/gguf*.py's dequantizers, in their order ((float)q -
// OFF is exact, and x - y == x + (-y) in IEEE, so K-quants' (d*sc)*q - (dmin*m) is b = -(dmin*m)).
// IQ4_NL / IQ4_XS: the code is kvalues_iq4nl[index] + 128 (OFF 128), so (float)q - OFF is the
// table level exactly and w = scale * level, as formats/gguf_iquants.py decodes.
enum { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14,
       IQ4_NL = 20, IQ4_XS = 23 };

template <int T> struct Traits;  // QK elements per block, TS bytes per block
template <> struct Traits<Q4_0> { static constexpr int QK = 32, TS = 18, ASYM = 0, OFF = 8; };
template <> struct Traits<Q4_1> { static constexpr int QK = 32, TS = 20, ASYM = 1, OFF = 0; };
template <> struct Traits<Q5_0> { static constexpr int QK = 32, TS = 22, ASYM = 0, OFF = 16; };
template <> struct Traits<Q5_1> { static constexpr int QK = 32, TS = 24, ASYM = 1, OFF = 0; };
template <> struct Traits<Q8_0> { static constexpr int QK = 32, TS = 34, ASYM = 0, OFF = 128; };
template <> struct Traits<Q2_K> { static constexpr int QK = 256, TS = 84, ASYM = 1, OFF = 0; };
template <> struct Traits<Q3_K> { static constexpr int QK = 256, TS = 110, ASYM = 0, OFF = 4; };
template <> struct Traits<Q4_K> { static constexpr int QK = 256, TS = 144, ASYM = 1, OFF = 0; };
template <> struct Traits<Q5_K> { static constexpr int QK = 256, TS = 176, ASYM = 1, OFF = 0; };
template <> struct Traits<Q6_K> { static constexpr int QK = 256, TS = 210, ASYM = 0, OFF = 32; };
template <> struct Traits<IQ4_NL> { static constexpr int QK = 32, TS = 18, ASYM = 0, OFF = 128; };
template <> struct Traits<IQ4_XS> { static constexpr int QK = 256, TS = 136, ASYM = 0, OFF = 128; };

static inline void nibbles32(const uint8_t* qs, uint8_t* q) {  // low nibbles 0..15, high 16..31
  #pragma omp simd
  for (int j = 0; j < 16; ++j) { q[j] = qs[j] & 15; q[j + 16] = qs[j] >> 4; }
}
// Q5_0/Q5_1 high bits: bit i of a byte -> 16 in byte i of a u64 (OR-ed into the codes;
// a per-lane variable shift does not vectorize, this is ~5x faster).
struct BitTable {
  uint64_t t[256];
  BitTable() {
    for (int v = 0; v < 256; ++v) {
      uint64_t r = 0;
      for (int i = 0; i < 8; ++i) if ((v >> i) & 1) r |= (uint64_t)16 << (8 * i);
      t[v] = r;
    }
  }
};
static const BitTable BITS5;

// nibbles and bit 4 together; with SSE2 in two 16-byte registers, so the 16-byte loads
// of the codes that follow are forwarded from the stores (8-byte stores would stall them)
static inline void nibbles_high5(const uint8_t* qs, const uint8_t* qh, uint8_t* q) {
#if defined(__SSE2__)
  const __m128i m4 = _mm_set1_epi8(15), v = _mm_loadu_si128((const __m128i*)qs);
  const __m128i lo = _mm_or_si128(_mm_and_si128(v, m4), _mm_set_epi64x((long long)BITS5.t[qh[1]], (long long)BITS5.t[qh[0]]));
  const __m128i hi = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(v, 4), m4),
                                  _mm_set_epi64x((long long)BITS5.t[qh[3]], (long long)BITS5.t[qh[2]]));
  _mm_storeu_si128((__m128i*)q, lo);
  _mm_storeu_si128((__m128i*)(q + 16), hi);
#else
  nibbles32(qs, q);
  for (int i = 0; i < 4; ++i) {  // q[8i + bit] |= 16 * bit(qh[i])
    uint64_t v; std::memcpy(&v, q + 8 * i, 8);
    v |= BITS5.t[qh[i]];
    std::memcpy(q + 8 * i, &v, 8);
  }
#endif
}

template <int T> static inline void decode(const uint8_t* b, uint8_t* q, float* a, float* c);

// Q4_0: d, qs[16]; element j in the low nibble of qs[j], j+16 in the high. w = d*(q-8)
template <> inline void decode<Q4_0>(const uint8_t* b, uint8_t* q, float* a, float*) {
  nibbles32(b + 2, q); a[0] = a[1] = h2f(b);
}
// Q4_1: d, m, qs[16]. w = d*q + m
template <> inline void decode<Q4_1>(const uint8_t* b, uint8_t* q, float* a, float* c) {
  nibbles32(b + 4, q); a[0] = a[1] = h2f(b); c[0] = c[1] = h2f(b + 2);
}
// Q5_0: d, qh (bit j of a little-endian u32 = bit 4 of element j), qs[16]. w = d*(q-16)
template <> inline void decode<Q5_0>(const uint8_t* b, uint8_t* q, float* a, float*) {
  nibbles_high5(b + 6, b + 2, q); a[0] = a[1] = h2f(b);
}
// Q5_1: d, m, qh, qs[16]. w = d*q + m
template <> inline void decode<Q5_1>(const uint8_t* b, uint8_t* q, float* a, float* c) {
  nibbles_high5(b + 8, b + 4, q); a[0] = a[1] = h2f(b); c[0] = c[1] = h2f(b + 2);
}
// Q8_0: d, qs[32] int8. w = q*d; codes held as q ^ 0x80 = q + 128, OFF 128
template <> inline void decode<Q8_0>(const uint8_t* b, uint8_t* q, float* a, float*) {
  #pragma omp simd
  for (int j = 0; j < 32; ++j) q[j] = b[2 + j] ^ 0x80;
  a[0] = a[1] = h2f(b);
}
// Q2_K: scales[16] (lo nibble scale, hi min), qs[64], d, dmin. Element 128h + 32k + l is
// (qs[32h + l] >> 2k) & 3; group s = e/16. w = (d*sc)*q - (dmin*m)
template <> inline void decode<Q2_K>(const uint8_t* b, uint8_t* q, float* a, float* c) {
  const uint8_t* sc = b; const uint8_t* qs = b + 16;
  for (int h = 0; h < 2; ++h)
    for (int k = 0; k < 4; ++k) {
      #pragma omp simd
      for (int l = 0; l < 32; ++l) q[128 * h + 32 * k + l] = (qs[32 * h + l] >> (2 * k)) & 3;
    }
  const float d = h2f(b + 80), dmin = h2f(b + 82);
  for (int s = 0; s < 16; ++s) { a[s] = d * (float)(sc[s] & 15); c[s] = -(dmin * (float)(sc[s] >> 4)); }
}
// Q3_K: hmask[32], qs[64], scales[12] (16 six-bit, signed - 32), d. Low 2 bits as Q2_K;
// bit 2 of element e is (hmask[e % 32] >> (e / 32)) & 1; w = (d*sc) * (code - 4).
template <> inline void decode<Q3_K>(const uint8_t* b, uint8_t* q, float* a, float*) {
  const uint8_t* hm = b; const uint8_t* qs = b + 32; const uint8_t* s12 = b + 96;
  for (int h = 0; h < 2; ++h)
    for (int k = 0; k < 4; ++k) {
      const int g = 4 * h + k;
      #pragma omp simd
      for (int l = 0; l < 32; ++l)
        q[32 * g + l] = ((qs[32 * h + l] >> (2 * k)) & 3) | (((hm[l] >> g) & 1) << 2);
    }
  const float d = h2f(b + 108);
  for (int s = 0; s < 16; ++s) {
    const int lo = s < 8 ? (s12[s] & 15) : (s12[s - 8] >> 4);
    const int hi = (s12[8 + (s & 3)] >> (2 * (s >> 2))) & 3;
    a[s] = d * (float)((lo | (hi << 4)) - 32);
  }
}
// Q4_K / Q5_K: d, dmin, scales[12] (8 six-bit scales and mins), [qh[32]], qs[128].
// Element 64c + 32h + l is (qs[32c + l] >> 4h) & 15 (| bit (2c+h) of qh[l] << 4 for Q5_K).
static inline void scale_min_k4(const uint8_t* s, int j, int& sc, int& mn) {
  if (j < 4) { sc = s[j] & 63; mn = s[j + 4] & 63; }
  else { sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4); mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4); }
}
template <bool FIVE> static inline void decode_q45k(const uint8_t* b, uint8_t* q, float* a, float* c) {
  const uint8_t* s = b + 4; const uint8_t* qh = b + 16; const uint8_t* qs = b + (FIVE ? 48 : 16);
  for (int cc = 0; cc < 4; ++cc)
    for (int h = 0; h < 2; ++h) {
      const int sh = 4 * h, hb = 2 * cc + h;
      #pragma omp simd
      for (int l = 0; l < 32; ++l) {
        uint8_t v = (qs[32 * cc + l] >> sh) & 15;
        if (FIVE) v |= ((qh[l] >> hb) & 1) << 4;
        q[64 * cc + 32 * h + l] = v;
      }
    }
  const float d = h2f(b), dmin = h2f(b + 2);
  for (int j = 0; j < 8; ++j) {
    int sc, mn; scale_min_k4(s, j, sc, mn);
    a[2 * j] = a[2 * j + 1] = d * (float)sc;
    c[2 * j] = c[2 * j + 1] = -(dmin * (float)mn);
  }
}
template <> inline void decode<Q4_K>(const uint8_t* b, uint8_t* q, float* a, float* c) { decode_q45k<false>(b, q, a, c); }
template <> inline void decode<Q5_K>(const uint8_t* b, uint8_t* q, float* a, float* c) { decode_q45k<true>(b, q, a, c); }
// Q6_K: ql[128], qh[64], scales[16] int8, d. In half h, quarter k, lane l (e = 128h+32k+l):
// low 4 bits (ql[64h + 32(k%2) + l] >> 4(k/2)) & 15, high 2 bits (qh[32h + l] >> 2k) & 3.
template <> inline void decode<Q6_K>(const uint8_t* b, uint8_t* q, float* a, float*) {
  const uint8_t* ql = b; const uint8_t* qh = b + 128; const int8_t* sc = (const int8_t*)(b + 192);
  for (int h = 0; h < 2; ++h)
    for (int k = 0; k < 4; ++k) {
      const uint8_t* lq = ql + 64 * h + 32 * (k & 1);
      const uint8_t* hq = qh + 32 * h;
      const int ls = 4 * (k >> 1), hs = 2 * k;
      #pragma omp simd
      for (int l = 0; l < 32; ++l) q[128 * h + 32 * k + l] = ((lq[l] >> ls) & 15) | (((hq[l] >> hs) & 3) << 4);
    }
  const float d = h2f(b + 208);
  for (int s = 0; s < 16; ++s) a[s] = d * (float)sc[s];
}

// IQ4_NL / IQ4_XS: 4-bit indices into kvalues_iq4nl (-127 -104 -83 -65 -49 -35 -22 -10 1 13 25
// 38 53 69 89 113), held as level + 128. Per run of 32: index j in the low nibble of qs[j],
// j + 16 in the high nibble.
alignas(16) static const uint8_t KV_IQ4NL_128[16] = {1, 24, 45, 63, 79, 93, 106, 118,
                                                     129, 141, 153, 166, 181, 197, 217, 241};
static inline void iq4_codes32(const uint8_t* qs, uint8_t* q) {
#if defined(__SSSE3__)
  const __m128i tbl = _mm_load_si128((const __m128i*)KV_IQ4NL_128), m4 = _mm_set1_epi8(15);
  const __m128i v = _mm_loadu_si128((const __m128i*)qs);
  _mm_storeu_si128((__m128i*)q, _mm_shuffle_epi8(tbl, _mm_and_si128(v, m4)));
  _mm_storeu_si128((__m128i*)(q + 16), _mm_shuffle_epi8(tbl, _mm_and_si128(_mm_srli_epi16(v, 4), m4)));
#else
  for (int j = 0; j < 16; ++j) { q[j] = KV_IQ4NL_128[qs[j] & 15]; q[j + 16] = KV_IQ4NL_128[qs[j] >> 4]; }
#endif
}
// IQ4_NL: d, qs[16]. w = d * level
template <> inline void decode<IQ4_NL>(const uint8_t* b, uint8_t* q, float* a, float*) {
  iq4_codes32(b + 2, q); a[0] = a[1] = h2f(b);
}
// IQ4_XS: d, scales_h (u16 LE), scales_l[4], qs[128]; sub-block ib of 32 has the 6-bit scale
// ls = (nibble ib%2 of scales_l[ib/2]) | (bits 2ib..2ib+1 of scales_h) << 4. w = (d*(ls-32)) * level
template <> inline void decode<IQ4_XS>(const uint8_t* b, uint8_t* q, float* a, float*) {
  const int sh = b[2] | (b[3] << 8); const uint8_t* sl = b + 4; const uint8_t* qs = b + 8;
  const float d = h2f(b);
  for (int ib = 0; ib < 8; ++ib) {
    iq4_codes32(qs + 16 * ib, q + 32 * ib);
    const int ls = ((sl[ib >> 1] >> (4 * (ib & 1))) & 15) | (((sh >> (2 * ib)) & 3) << 4);
    a[2 * ib] = a[2 * ib + 1] = d * (float)(ls - 32);
  }
}

// The 16 weights of group g, exactly as the reference decodes them.
template <int T> static inline V16 weights16(const uint8_t* q, const float* a, const float* c, int g) {
  const V16 v = vcodes(q + 16 * g);
  if (Traits<T>::ASYM) return vadd(vmul(vset(a[g]), v), vset(c[g]));
  return vmul(vset(a[g]), vsub(v, vset((float)Traits<T>::OFF)));
}

// ---------------------------------------------------------------- threads
// parallel_chunks(n, chunk, work, f): f(begin, end) over [0, n) in chunks of rows, on torch's
// intra-op threads (at::parallel_for: the one OpenMP pool torch's own ops use, so the
// helpers are already awake between back-to-back calls and no second pool competes with
// it for the cores). Below PAR_MIN_WORK weights x rows one thread is faster.
template <class F> static inline void parallel_chunks(int64_t n, int64_t chunk, int64_t work, F f) {
  const int threads = std::max(1, at::get_num_threads());
  if (threads == 1 || work < PAR_MIN_WORK || n <= chunk) { f(0, n); return; }
  const int64_t nc = (n + chunk - 1) / chunk;
  at::parallel_for(0, nc, 1, [&](int64_t c0, int64_t c1) { f(c0 * chunk, std::min(n, c1 * chunk)); });
}

// ---------------------------------------------------------------- kernels
// y[m, n] = sum_k x[m, k] * w[n, k]; rows n split across threads. The input rows go in
// chunks of NM = 8, 4, 2 or 1 (compile-time, so the accumulators stay in registers); per
// chunk and weight row each block is decoded once to codes and factors (L1) and expanded
// 16 weights at a time in registers, then used for the chunk's NM rows. One or two rows
// get two accumulators each to hide the multiply-add latency.
// xb: the chunk's slices of x for one block, [NM, QK] (see fused_impl).
template <int T, int NM>
static inline void row_dot(const uint8_t* row, const float* xp, int64_t nb, float* out) {
  constexpr int QK = Traits<T>::QK, TS = Traits<T>::TS, NG = QK / 16, NA = NM >= 4 ? 1 : 2;
  alignas(64) uint8_t q[QK];
  float a[NG], c[NG];
  V16 acc[NM][NA];
  for (int m = 0; m < NM; ++m)
    for (int i = 0; i < NA; ++i) acc[m][i] = vzero();
  for (int64_t ib = 0; ib < nb; ++ib) {
    decode<T>(row + ib * TS, q, a, c);
    const float* xb = xp + ib * NM * QK;
    for (int g = 0; g < NG; ++g) {
      const V16 w = weights16<T>(q, a, c, g);
      for (int m = 0; m < NM; ++m) acc[m][g % NA] = vfma(vload(xb + m * QK + 16 * g), w, acc[m][g % NA]);
    }
  }
  for (int m = 0; m < NM; ++m) {
    V16 t = acc[m][0];
    for (int i = 1; i < NA; ++i) t = vadd(t, acc[m][i]);
    out[m] = vsum(t);
  }
}

// The chunks of input rows (8 at a time, then 4, 2, 1) and x re-laid per chunk as
// [block][row][QK]: the rows' slices of one block are contiguous (rows K floats apart share
// L1 sets when K is a multiple of 1024: 4x slower at 8 rows). One layout serves every
// weight that multiplies the same x (gguf_linear_multi).
struct XRows {
  std::vector<std::pair<int64_t, int>> chunks;
  std::vector<float> xp;
  const float* xs = nullptr;
  XRows(const float* x, int64_t M, int64_t K, int64_t QK) {
    const int64_t nb = K / QK;
    for (int64_t m0 = 0; m0 < M;) {
      const int size = M - m0 >= 8 ? 8 : M - m0 >= 4 ? 4 : M - m0 >= 2 ? 2 : 1;
      chunks.emplace_back(m0, size);
      m0 += size;
    }
    if (M > 1) {
      xp.resize(M * K);
      for (const auto& ch : chunks)
        for (int64_t ib = 0; ib < nb; ++ib)
          for (int m = 0; m < ch.second; ++m)
            std::memcpy(&xp[ch.first * K + (ib * ch.second + m) * QK], x + (ch.first + m) * K + ib * QK,
                        QK * sizeof(float));
    }
    xs = M > 1 ? xp.data() : x;
  }
};

// weight rows [n0, n1) of one weight against every input row: y[m * ldy + n]
template <int T>
static void fused_rows(const XRows& X, const uint8_t* w, float* y, int64_t ldy, int64_t K, int64_t n0, int64_t n1) {
  constexpr int QK = Traits<T>::QK, TS = Traits<T>::TS;
  const int64_t nb = K / QK, rb = nb * TS;
  float out[8];
  for (int64_t n = n0; n < n1; ++n) {
    lm_prefetch_row_ahead(w + n * rb, rb);  // a decode step reads each weight row once
    for (const auto& ch : X.chunks) {
      const uint8_t* row = w + n * rb;
      const float* xc = X.xs + ch.first * K;
      switch (ch.second) {
        case 8: row_dot<T, 8>(row, xc, nb, out); break;
        case 4: row_dot<T, 4>(row, xc, nb, out); break;
        case 2: row_dot<T, 2>(row, xc, nb, out); break;
        default: row_dot<T, 1>(row, xc, nb, out);
      }
      for (int m = 0; m < ch.second; ++m) y[(ch.first + m) * ldy + n] = out[m];
    }
  }
}

template <int T>
static void fused_impl(const float* x, const uint8_t* w, float* y, int64_t M, int64_t N, int64_t K) {
  const XRows X(x, M, K, Traits<T>::QK);
  parallel_chunks(N, 16, N * K * M, [&](int64_t n0, int64_t n1) { fused_rows<T>(X, w, y, N, K, n0, n1); });
}

// ---------------------------------------------------------------- int8 activations
// gguf_linear_q8: for Q4_0, Q4_1 and Q8_0 weights, x is quantized per block of 32 as
// llama.cpp's q8_1 does (dx = amax / 127, xq = rint(x / dx), sx = dx * sum(xq)) and each
// block's dot product is an integer sum of u8 x s8 products (VNNI dpbusd, AVX2
// maddubs + madd), then
//   Q4_0  w = dw*(q - 8)  ->  dw*dx*sum(q*xq) - 8*dw*sx
//   Q4_1  w = dw*q + mw   ->  dw*dx*sum(q*xq) + mw*sx
//   Q8_0  w = dw*q        ->  dw*dx*sum(|q| * sign(q)*xq)
// Each (weight row, x row) pair runs the same operations in the same order whatever M is,
// so a row's result does not depend on the rows batched with it.
static void quantize_x_q8(const float* x, int64_t M, int64_t K, int8_t* q, float* d, float* s) {
  const int64_t nb = K / 32;
  for (int64_t i = 0; i < M * nb; ++i) {
    const float* xb = x + i * 32;
    float amax = 0.f;
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(xb[j]));
    const float dd = amax / 127.f, id = dd > 0.f ? 1.f / dd : 0.f;
    int sum = 0;
    for (int j = 0; j < 32; ++j) {
      const int v = (int)std::nearbyint(xb[j] * id);
      q[i * 32 + j] = (int8_t)v;
      sum += v;
    }
    d[i] = dd;
    s[i] = dd * (float)sum;
  }
}

#if defined(__AVX2__) && defined(__FMA__)
static inline __m256i dot_u8s8(__m256i u, __m256i s) {  // 8 int32 lanes, each a sum of 4 u8*s8
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}
static inline float hsum8(__m256 v) {
  __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  a = _mm_add_ps(a, _mm_movehl_ps(a, a));
  a = _mm_add_ss(a, _mm_movehdup_ps(a));
  return _mm_cvtss_f32(a);
}
#endif

// R weight rows (rb bytes apart) against one quantized x row: out[r] = row r · x. Each row
// runs the same operations in the same order whatever R is (the same sums bit for bit);
// R > 1 interleaves rows so their chains of dependent multiply-adds overlap and share x's
// loads (one row alone waited on its own chains).
template <int T, int R>
static inline void rows_dot_q8(const uint8_t* row, int64_t rb, const int8_t* xq, const float* xd, const float* xs,
                               int64_t nb, float* out) {
  constexpr int TS = Traits<T>::TS;
  float accm[R];
  for (int r = 0; r < R; ++r) accm[r] = 0.f;
#if defined(__AVX2__) && defined(__FMA__)
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const __m128i m4 = _mm_set1_epi8(15);
  for (int64_t ib = 0; ib < nb; ++ib) {
    const __m256i x0 = _mm256_loadu_si256((const __m256i*)(xq + ib * 32));
    for (int r = 0; r < R; ++r) {
      const uint8_t* b = row + r * rb + ib * TS;
      __m256i xv = x0, w;
      if (T == Q8_0) {
        w = _mm256_loadu_si256((const __m256i*)(b + 2));
        xv = _mm256_sign_epi8(xv, w);
        w = _mm256_sign_epi8(w, w);
      } else {
        const __m128i v = _mm_loadu_si128((const __m128i*)(b + (T == Q4_1 ? 4 : 2)));
        w = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m4), _mm_and_si128(v, m4));
      }
      const float dw = h2f(b);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u8s8(w, xv)), _mm256_set1_ps(dw * xd[ib]), acc[r]);
      if (T == Q4_1) accm[r] += h2f(b + 2) * xs[ib];
      if (T == Q4_0) accm[r] -= 8.f * dw * xs[ib];
    }
  }
  for (int r = 0; r < R; ++r) out[r] = hsum8(acc[r]) + accm[r];
#else
  for (int r = 0; r < R; ++r) {
    float acc = 0.f;
    for (int64_t ib = 0; ib < nb; ++ib) {
      const uint8_t* b = row + r * rb + ib * TS;
      const int8_t* xb = xq + ib * 32;
      int sum = 0;
      for (int j = 0; j < 32; ++j) {
        const int w = T == Q8_0 ? (int)(int8_t)b[2 + j]
                                : (int)((j < 16 ? b[(T == Q4_1 ? 4 : 2) + j] : b[(T == Q4_1 ? 4 : 2) + j - 16] >> 4) & 15);
        sum += w * (int)xb[j];
      }
      const float dw = h2f(b);
      acc += (float)sum * (dw * xd[ib]);
      if (T == Q4_1) accm[r] += h2f(b + 2) * xs[ib];
      if (T == Q4_0) accm[r] -= 8.f * dw * xs[ib];
    }
    out[r] = acc + accm[r];
  }
#endif
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AVX512VBMI__)
#define LM_Q8_512 1  // the int8-activation AVX-512 path below (Ice Lake, Sapphire Rapids, Zen 4 and later)
#endif

// x quantized once (quantize_x_q8) for every weight that multiplies it. With LM_Q8_512 also
// in the order the 512-bit dot product reads it (rows_dot_q8_512): per x row and pair of blocks
// (2p, 2p+1) 64 bytes, [first 16 of block 2p, first 16 of 2p+1, last 16 of 2p, last 16 of
// 2p+1] (zeros for a missing 2p+1), and the block factors padded with zeros to a multiple
// of 16 blocks (xd16/xs16, nbp per row).
struct XQ8 {
  std::vector<int8_t> q; std::vector<float> d, s;
#ifdef LM_Q8_512
  int64_t nbp = 0;
  std::vector<int8_t> pairs; std::vector<float> d16, s16;
#endif
  // for_q4: a Q4_0/Q4_1 weight reads it (the pair layout is made only then; Q8_0 reads q, d)
  XQ8(const float* x, int64_t M, int64_t K, bool for_q4) : q(M * K), d(M * (K / 32)), s(M * (K / 32)) {
    quantize_x_q8(x, M, K, q.data(), d.data(), s.data());
#ifdef LM_Q8_512
    if (!for_q4) return;
    const int64_t nb = K / 32, np = (nb + 1) / 2;
    nbp = (nb + 15) / 16 * 16;
    pairs.assign(M * np * 64, 0);
    d16.assign(M * nbp, 0.f);
    s16.assign(M * nbp, 0.f);
    for (int64_t m = 0; m < M; ++m) {
      for (int64_t b = 0; b < nb; ++b) {
        int8_t* o = pairs.data() + (m * np + b / 2) * 64 + (b & 1) * 16;
        std::memcpy(o, q.data() + m * K + b * 32, 16);
        std::memcpy(o + 32, q.data() + m * K + b * 32 + 16, 16);
        d16[m * nbp + b] = d[m * nb + b];
        s16[m * nbp + b] = s[m * nb + b];
      }
    }
#endif
  }
};

#ifdef LM_Q8_512
// R weight rows (rb bytes apart) of Q4_0 or Q4_1 against MB x rows in 512-bit registers, two
// blocks a step, where llama.cpp's loop (and rows_dot_q8 above) takes one block at a time and
// converts and broadcasts its scale with scalar instructions.
//  - The two blocks' code bytes go into one register in x's pair order (XQ8::pairs) with one
//    byte permutation (each code byte twice) and one AND (the low nibbles in the first half,
//    the high ones, times 16, in the second). One dpbusd per x row then gives 16 int32 lanes,
//    four per block and half: exact integer sums.
//  - The blocks' f16 scales (and Q4_1's minima) come 16 blocks at a time with one gather.
//    The lanes are scaled by dw*dx (dw*dx/16 for the high halves: a power of two, exact) and
//    added into one float accumulator per (row, x row); the Q4_0 / Q4_1 offset terms
//    (-8*dw*sx, mw*sx) go into a second one, 16 blocks a multiply-add.
//  - More x rows share each unpacked register (a serving batch; benchmarks/results/
//    bench_gguf_linear_q8.json against bench_gguf_linear_q8_before.json).
// Q8_0 stays on rows_dot_q8: a 512-bit version (byte permutation of two loads, |w| against x
// with w's signs) was 1.1-1.3x faster for 4-16 x rows but ~13% slower for one.
// Only the code bytes are loaded (masked loads: nothing past a block's end is read). Each
// (row, x row) pair runs the same operations in the same order whatever R, MB and the other
// rows are, so a row's result does not depend on the rows batched with it.
template <int T>
struct PairPerm {  // byte indices putting blocks 0 and 1's codes in x's pair order (XQ8::pairs)
  alignas(64) uint8_t idx[64];
  uint64_t mask2 = 0, mask1 = 0;  // the code bytes of two blocks / of the first block only
  PairPerm() {
    constexpr int TS = Traits<T>::TS, OFF = T == Q4_1 ? 4 : 2;
    for (int i = 0; i < 16; ++i) {  // 16 code bytes a block, each twice: low nibbles, then high
      idx[i] = idx[32 + i] = (uint8_t)(OFF + i);
      idx[16 + i] = idx[48 + i] = (uint8_t)(TS + OFF + i);
      mask1 |= 1ull << (OFF + i);
      mask2 |= (1ull << (OFF + i)) | (1ull << (TS + OFF + i));
    }
  }
};

template <int T, int R, int MB>
static inline void rows_dot_q8_512(const uint8_t* row, int64_t rb, const XQ8& X, int64_t m0, int64_t nb, float* y,
                                   int64_t ldy) {
  constexpr int TS = Traits<T>::TS;
  static const PairPerm<T> P;
  // scale lanes of pair j (blocks 2j, 2j+1 of a group of 16): from [dw*dx (16), dw*dx/16 (16)]
  alignas(64) static const int32_t SIDX[8][16] = {
#define LM_S(j) {2*j, 2*j, 2*j, 2*j, 2*j+1, 2*j+1, 2*j+1, 2*j+1, 16+2*j, 16+2*j, 16+2*j, 16+2*j, 17+2*j, 17+2*j, 17+2*j, 17+2*j}
      LM_S(0), LM_S(1), LM_S(2), LM_S(3), LM_S(4), LM_S(5), LM_S(6), LM_S(7)};
#undef LM_S
  const int64_t np = (nb + 1) / 2;
  const int8_t* xp[MB];
  const float *xd[MB], *xs[MB];
  for (int m = 0; m < MB; ++m) {
    xp[m] = X.pairs.data() + (m0 + m) * np * 64;
    xd[m] = X.d16.data() + (m0 + m) * X.nbp;
    xs[m] = X.s16.data() + (m0 + m) * X.nbp;
  }
  const __m512i perm = _mm512_load_si512((const void*)P.idx);
  const __m512i nib = _mm512_inserti64x4(_mm512_set1_epi8(0x0F), _mm256_set1_epi8((char)0xF0), 1);
  const __m512i gidx = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                          _mm512_set1_epi32(TS));
  const __m512 sixteenth = _mm512_set1_ps(0.0625f);
  __m512 acc[R][MB], off[R][MB], sc[R][MB], sch[R][MB];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MB; ++m) acc[r][m] = off[r][m] = _mm512_setzero_ps();
  for (int64_t g0 = 0; g0 < nb; g0 += 16) {
    const int64_t ng = std::min<int64_t>(16, nb - g0);
    const __mmask16 gm = (__mmask16)((1u << ng) - 1u);
    for (int r = 0; r < R; ++r) {
      const __m512i dm = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), gm, gidx, row + r * rb + g0 * TS, 1);
      const __m512 dw = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dm));
      const __m512 mw = T == Q4_1 ? _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(dm, 16)))
                                  : _mm512_mul_ps(dw, _mm512_set1_ps(8.f));
      for (int m = 0; m < MB; ++m) {
        const __m512 sx = _mm512_loadu_ps(xs[m] + g0);
        off[r][m] = T == Q4_1 ? _mm512_fmadd_ps(mw, sx, off[r][m]) : _mm512_fnmadd_ps(mw, sx, off[r][m]);
        sc[r][m] = _mm512_mul_ps(dw, _mm512_loadu_ps(xd[m] + g0));
        sch[r][m] = _mm512_mul_ps(sc[r][m], sixteenth);
      }
    }
    for (int64_t j = 0; 2 * j < ng; ++j) {
      const int64_t b = g0 + 2 * j;
      const __mmask64 lm = b + 1 < nb ? P.mask2 : P.mask1;
      const __m512i si = _mm512_load_si512((const void*)SIDX[j]);
      __m512i x[MB];
      for (int m = 0; m < MB; ++m) x[m] = _mm512_loadu_si512((const void*)(xp[m] + (b / 2) * 64));
      for (int r = 0; r < R; ++r) {
        const __m512i raw = _mm512_maskz_loadu_epi8(lm, row + r * rb + b * TS);
        const __m512i w = _mm512_and_si512(_mm512_permutexvar_epi8(perm, raw), nib);
        for (int m = 0; m < MB; ++m) {
          const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, x[m]);
          acc[r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_permutex2var_ps(sc[r][m], si, sch[r][m]), acc[r][m]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MB; ++m)
      y[m * ldy + r] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][m], off[r][m]));
}
#endif

template <int T>
static void fused_q8_rows(const XQ8& X, const uint8_t* w, float* y, int64_t ldy, int64_t M, int64_t K, int64_t n0,
                          int64_t n1) {
  const int64_t nb = K / 32, rb = nb * Traits<T>::TS;
  // weight rows a call (rows_dot_q8): four for the 4-bit types; Q8_0 rows (the tied lm_head
  // here) stream at the memory's speed already and four rows ran slower
  constexpr int R = T == Q8_0 ? 1 : 4;
#ifdef LM_Q8_512
  if constexpr (T != Q8_0) {
    // one x row: four weight rows at a time; more: up to four x rows at a time against one weight
    // row, its blocks unpacked once for them (each (row, x row) pair: the same operations)
    int64_t n = n0;
    if (M == 1) {
      for (; n + 4 <= n1; n += 4) {
        for (int r = 0; r < 4; ++r) lm_prefetch_row_ahead(w + (n + r) * rb, rb);
        rows_dot_q8_512<T, 4, 1>(w + n * rb, rb, X, 0, nb, y + n, ldy);
      }
    }
    for (; n < n1; ++n) {
      lm_prefetch_row_ahead(w + n * rb, rb);
      int64_t m = 0;
      for (; m + 4 <= M; m += 4) rows_dot_q8_512<T, 1, 4>(w + n * rb, rb, X, m, nb, y + m * ldy + n, ldy);
      for (; m + 2 <= M; m += 2) rows_dot_q8_512<T, 1, 2>(w + n * rb, rb, X, m, nb, y + m * ldy + n, ldy);
      for (; m < M; ++m) rows_dot_q8_512<T, 1, 1>(w + n * rb, rb, X, m, nb, y + m * ldy + n, ldy);
    }
    return;
  }
#endif
  int64_t n = n0;
  for (; n + R <= n1; n += R) {
    for (int r = 0; r < R; ++r) lm_prefetch_row_ahead(w + (n + r) * rb, rb);
    for (int64_t m = 0; m < M; ++m)
      rows_dot_q8<T, R>(w + n * rb, rb, X.q.data() + m * K, X.d.data() + m * nb, X.s.data() + m * nb, nb, y + m * ldy + n);
  }
  for (; n < n1; ++n) {
    lm_prefetch_row_ahead(w + n * rb, rb);
    for (int64_t m = 0; m < M; ++m)
      rows_dot_q8<T, 1>(w + n * rb, rb, X.q.data() + m * K, X.d.data() + m * nb, X.s.data() + m * nb, nb, y + m * ldy + n);
  }
}

template <int T>
static void fused_q8_impl(const float* x, const uint8_t* w, float* y, int64_t M, int64_t N, int64_t K) {
  const XQ8 X(x, M, K, T != Q8_0);
  parallel_chunks(N, 16, N * K * M, [&](int64_t n0, int64_t n1) { fused_q8_rows<T>(X, w, y, N, M, K, n0, n1); });
}

// 16 float32 -> bfloat16 bits, rounded to nearest even as torch's .to(torch.bfloat16) does on
// the CPU (a NaN becomes 0xffff, as there)
static inline void store_bf16(uint16_t* out, V16 a) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  const __m512i u = _mm512_castps_si512(a.v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(a.v, a.v, _CMP_UNORD_Q), _mm512_set1_epi32(0xffff));
  _mm256_storeu_si256((__m256i*)out, _mm512_cvtepi32_epi16(r));
#else
  alignas(64) float t[16];
  vstore(t, a);
  for (int j = 0; j < 16; ++j) {
    uint32_t u;
    std::memcpy(&u, t + j, 4);
    const uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    out[j] = (uint16_t)(t[j] != t[j] ? 0xffffu : r);
  }
#endif
}

static inline void store16(float* out, V16 a) { vstore(out, a); }
static inline void store16(uint16_t* out, V16 a) { store_bf16(out, a); }

// every weight of N rows, written as float32 or (uint16_t out) bfloat16 bits in one pass
template <int T, typename O>
static void dequant_impl(const uint8_t* w, O* out, int64_t N, int64_t K) {
  constexpr int QK = Traits<T>::QK, TS = Traits<T>::TS, NG = QK / 16;
  const int64_t nb = K / QK;
  parallel_chunks(N * nb, 256, N * K, [&](int64_t i0, int64_t i1) {
    alignas(64) uint8_t q[QK];
    float a[NG], c[NG];
    for (int64_t i = i0; i < i1; ++i) {
      decode<T>(w + i * TS, q, a, c);
      for (int g = 0; g < NG; ++g) store16(out + i * QK + 16 * g, weights16<T>(q, a, c, g));
    }
  });
}

#define DISPATCH(F, ...) switch (type) { \
  case Q4_0: F<Q4_0>(__VA_ARGS__); break; case Q4_1: F<Q4_1>(__VA_ARGS__); break; \
  case Q5_0: F<Q5_0>(__VA_ARGS__); break; case Q5_1: F<Q5_1>(__VA_ARGS__); break; \
  case Q8_0: F<Q8_0>(__VA_ARGS__); break; case Q2_K: F<Q2_K>(__VA_ARGS__); break; \
  case Q3_K: F<Q3_K>(__VA_ARGS__); break; case Q4_K: F<Q4_K>(__VA_ARGS__); break; \
  case Q5_K: F<Q5_K>(__VA_ARGS__); break; case Q6_K: F<Q6_K>(__VA_ARGS__); break; \
  case IQ4_NL: F<IQ4_NL>(__VA_ARGS__); break; case IQ4_XS: F<IQ4_XS>(__VA_ARGS__); break; \
  default: LM_CHECK(false, "unknown ggml type id ", type); }

torch::Tensor gguf_linear(torch::Tensor x, torch::Tensor w, int64_t type, int64_t N, torch::Tensor bias) {
  // x [..., K] (any float dtype), w uint8 raw GGUF rows (N * row_bytes bytes), bias [N] float32
  // or empty -> y [..., N] in x's dtype (the sums in float32)
  const auto dtype = x.scalar_type();
  auto shape = x.sizes().vec();
  const int64_t K = shape.back(), M = K > 0 ? x.numel() / K : 0;
  auto x2 = x.to(torch::kFloat32).contiguous();
  w = w.contiguous();
  shape.back() = N;
  auto y = torch::empty(shape, x2.options());
  DISPATCH(fused_impl, x2.data_ptr<float>(), w.data_ptr<uint8_t>(), y.data_ptr<float>(), M, N, K)
  if (bias.numel() > 0) y.add_(bias);
  return dtype == torch::kFloat32 ? y : y.to(dtype);
}

bool gguf_q8_supported(int64_t type) { return type == Q4_0 || type == Q4_1 || type == Q8_0; }

torch::Tensor gguf_linear_q8(torch::Tensor x, torch::Tensor w, int64_t type, int64_t N, torch::Tensor bias) {
  // as gguf_linear, with x quantized to int8 per block of 32 (Q4_0, Q4_1, Q8_0 weights only)
  LM_CHECK(gguf_q8_supported(type), "gguf_linear_q8: ggml type ", type, " is not Q4_0, Q4_1 or Q8_0");
  const auto dtype = x.scalar_type();
  auto shape = x.sizes().vec();
  const int64_t K = shape.back(), M = K > 0 ? x.numel() / K : 0;
  auto x2 = x.to(torch::kFloat32).contiguous();
  w = w.contiguous();
  shape.back() = N;
  auto y = torch::empty(shape, x2.options());
  switch (type) {
    case Q4_0: fused_q8_impl<Q4_0>(x2.data_ptr<float>(), w.data_ptr<uint8_t>(), y.data_ptr<float>(), M, N, K); break;
    case Q4_1: fused_q8_impl<Q4_1>(x2.data_ptr<float>(), w.data_ptr<uint8_t>(), y.data_ptr<float>(), M, N, K); break;
    default: fused_q8_impl<Q8_0>(x2.data_ptr<float>(), w.data_ptr<uint8_t>(), y.data_ptr<float>(), M, N, K);
  }
  if (bias.numel() > 0) y.add_(bias);
  return dtype == torch::kFloat32 ? y : y.to(dtype);
}

torch::Tensor gguf_dequantize(torch::Tensor w, int64_t type, int64_t N, int64_t K) {
  // w uint8 raw GGUF rows -> float32 [N, K], bit-identical to formats.gguf.dequantize_gguf
  w = w.contiguous();
  auto out = torch::empty({N, K}, torch::dtype(torch::kFloat32));
  DISPATCH(dequant_impl, w.data_ptr<uint8_t>(), out.data_ptr<float>(), N, K)
  return out;
}

torch::Tensor gguf_dequantize_bf16(torch::Tensor w, int64_t type, int64_t N, int64_t K) {
  // w uint8 raw GGUF rows -> bfloat16 [N, K], bit-identical to gguf_dequantize(...).to(bfloat16)
  w = w.contiguous();
  auto out = torch::empty({N, K}, torch::dtype(torch::kBFloat16));
  DISPATCH(dequant_impl, w.data_ptr<uint8_t>(), reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()), N, K)
  return out;
}

// ---------------------------------------------------------------- the op's CPU backend
// torch.ops.lessmem.gguf_linear / gguf_dequantize (schemas: kernels/linear_ops.py) dispatch
// here for CPU tensors without a Python frame once register_ops() has run (called by the
// Python wrapper for the default build). Arguments are checked first; a bad one is a
// ValueError naming it and what is allowed (the kernels above read buffers unchecked).
#include <torch/library.h>
#include <memory>

static void traits_of(int64_t type, int64_t& qk, int64_t& ts) {
  switch (type) {
    case Q4_0: qk = 32; ts = 18; break; case Q4_1: qk = 32; ts = 20; break;
    case Q5_0: qk = 32; ts = 22; break; case Q5_1: qk = 32; ts = 24; break;
    case Q8_0: qk = 32; ts = 34; break; case Q2_K: qk = 256; ts = 84; break;
    case Q3_K: qk = 256; ts = 110; break; case Q4_K: qk = 256; ts = 144; break;
    case Q5_K: qk = 256; ts = 176; break; case Q6_K: qk = 256; ts = 210; break;
    case IQ4_NL: qk = 32; ts = 18; break; case IQ4_XS: qk = 256; ts = 136; break;
    default: LM_CHECK_VALUE(false, "GGUF type ", type, " is not supported; allowed: the ggml ids 2 (Q4_0), "
                               "3 (Q4_1), 6 (Q5_0), 7 (Q5_1), 8 (Q8_0), 10 (Q2_K), 11 (Q3_K), 12 (Q4_K), "
                               "13 (Q5_K), 14 (Q6_K), 20 (IQ4_NL), 23 (IQ4_XS)");
  }
}

static void check_raw(const torch::Tensor& raw, int64_t type, int64_t N, int64_t K, const char* op) {
  int64_t qk, ts;
  traits_of(type, qk, ts);
  LM_CHECK_VALUE(raw.scalar_type() == torch::kUInt8, op, ": raw dtype ", raw.scalar_type(), "; allowed: uint8");
  LM_CHECK_VALUE(N > 0 && K > 0 && K % qk == 0 && raw.numel() == N * (K / qk) * ts, op, ": raw holds ",
                    raw.numel(), " bytes for ", K, " input features; allowed: in_features a multiple of ", qk,
                    " and [", N, ", ", K, "] = ", (K > 0 && K % qk == 0 ? N * (K / qk) * ts : -1), " bytes");
}

static torch::Tensor op_gguf_linear(const torch::Tensor& x, const torch::Tensor& raw, int64_t type, int64_t N,
                                    const std::optional<torch::Tensor>& bias, bool int8_activations) {
  LM_CHECK_VALUE(x.is_floating_point(), "gguf_linear: x dtype ", x.scalar_type(), "; allowed: a float dtype");
  LM_CHECK_VALUE(x.dim() >= 1, "gguf_linear: x must have a feature dimension");
  check_raw(raw, type, N, x.size(-1), "gguf_linear");
  torch::Tensor b = torch::empty({0}, torch::dtype(torch::kFloat32));
  if (bias.has_value()) {
    LM_CHECK_VALUE(bias->numel() == N, "gguf_linear: bias has ", bias->numel(),
                      " values; allowed: None or out_features = ", N);
    b = bias->to(torch::kFloat32).contiguous();
  }
  if (int8_activations && gguf_q8_supported(type)) return gguf_linear_q8(x, raw, type, N, b);
  return gguf_linear(x, raw, type, N, b);
}

static torch::Tensor op_gguf_dequantize(const torch::Tensor& raw, int64_t type, int64_t N, int64_t K) {
  check_raw(raw, type, N, K, "gguf_dequantize");
  return gguf_dequantize(raw, type, N, K);
}

// ---------------------------------------------------------------- a decode step's glue
// What the lean decode step (lessmem/decode.py) calls between the weight kernels, each one
// C++ call where torch eager spends a dispatch per tensor op (RMSNorm alone is seven).

// Several weights that multiply the same x (q, k, v; gate, up) in one call and one parallel
// region: y [..., ΣN] float32, weight i's outputs in columns [ΣN_<i, ΣN_≤i). Each weight row
// runs the same kernel, with the same x rounding, as its own gguf_linear(_q8) call, so the
// columns equal those calls bit for bit; x is converted (and quantized to int8) once.
// ``order`` (or None): output column c is column order[c] of those (rows stored permuted).
torch::Tensor gguf_linear_multi(torch::Tensor x, std::vector<torch::Tensor> ws, std::vector<int64_t> types,
                                std::vector<int64_t> Ns, std::vector<std::optional<torch::Tensor>> biases,
                                bool int8_activations, std::optional<torch::Tensor> order) {
  const size_t S = ws.size();
  LM_CHECK_VALUE(S > 0 && types.size() == S && Ns.size() == S && biases.size() == S,
                 "gguf_linear_multi: one type, out_features and bias per weight (", S, " weights)");
  LM_CHECK_VALUE(x.scalar_type() == torch::kFloat32 && x.dim() >= 1 && x.is_cpu(),
                 "gguf_linear_multi: x dtype ", x.scalar_type(), "; allowed: float32 [..., K] on the CPU");
  auto shape = x.sizes().vec();
  const int64_t K = shape.back(), M = K > 0 ? x.numel() / K : 0;
  std::vector<int64_t> off(S + 1, 0);
  std::vector<torch::Tensor> bs(S);
  for (size_t i = 0; i < S; ++i) {
    check_raw(ws[i], types[i], Ns[i], K, "gguf_linear_multi");
    LM_CHECK_VALUE(ws[i].is_cpu(), "gguf_linear_multi: weight ", (int64_t)i, " is not on the CPU");
    ws[i] = ws[i].contiguous();
    off[i + 1] = off[i] + Ns[i];
    if (biases[i].has_value()) {
      LM_CHECK_VALUE(biases[i]->numel() == Ns[i], "gguf_linear_multi: bias ", (int64_t)i, " has ",
                     biases[i]->numel(), " values; allowed: None or out_features = ", Ns[i]);
      bs[i] = biases[i]->to(torch::kFloat32).contiguous();
    }
  }
  auto x2 = x.contiguous();
  const float* xp = x2.data_ptr<float>();
  const int64_t ldy = off[S];
  shape.back() = ldy;
  auto y = torch::empty(shape, x2.options());
  float* yp = y.data_ptr<float>();
  // the x layouts the weights need, made once each: int8 blocks, float rows by block size
  bool any_q8 = false, any_q4 = false, any32 = false, any256 = false;
  std::vector<int> q8(S);
  for (size_t i = 0; i < S; ++i) {
    q8[i] = int8_activations && gguf_q8_supported(types[i]);
    any_q8 |= (bool)q8[i];
    any_q4 |= q8[i] && types[i] != Q8_0;
    if (!q8[i]) { int64_t qk, ts; traits_of(types[i], qk, ts); (qk == 32 ? any32 : any256) = true; }
  }
  std::unique_ptr<XQ8> xq(any_q8 ? new XQ8(xp, M, K, any_q4) : nullptr);
  std::unique_ptr<XRows> x32(any32 ? new XRows(xp, M, K, 32) : nullptr), x256(any256 ? new XRows(xp, M, K, 256) : nullptr);
  // work items: chunks of 16 rows of each weight, one parallel region over all of them
  std::vector<std::pair<int, int64_t>> items;
  for (size_t i = 0; i < S; ++i)
    for (int64_t n0 = 0; n0 < Ns[i]; n0 += 16) items.emplace_back((int)i, n0);
  auto run = [&](int64_t a, int64_t b) {
    for (int64_t it = a; it < b; ++it) {
      const int i = items[it].first;
      const int64_t n0 = items[it].second, n1 = std::min(Ns[i], n0 + 16), type = types[i];
      const uint8_t* w = ws[i].data_ptr<uint8_t>();
      float* yi = yp + off[i];
      if (q8[i]) {
        switch (type) {
          case Q4_0: fused_q8_rows<Q4_0>(*xq, w, yi, ldy, M, K, n0, n1); break;
          case Q4_1: fused_q8_rows<Q4_1>(*xq, w, yi, ldy, M, K, n0, n1); break;
          default: fused_q8_rows<Q8_0>(*xq, w, yi, ldy, M, K, n0, n1);
        }
      } else {
        int64_t qk, ts; traits_of(type, qk, ts);
        const XRows& X = qk == 32 ? *x32 : *x256;
        DISPATCH(fused_rows, X, w, yi, ldy, K, n0, n1)
      }
      if (bs[i].defined())
        for (int64_t m = 0; m < M; ++m)
          for (int64_t n = n0; n < n1; ++n) yi[m * ldy + n] += bs[i].data_ptr<float>()[n];
    }
  };
  const int64_t work = ldy * K * M, n_items = (int64_t)items.size();
  if (at::get_num_threads() == 1 || work < PAR_MIN_WORK || n_items < 2) run(0, n_items);
  else at::parallel_for(0, n_items, 1, run);
  if (!order.has_value()) return y;
  // rows held in another order than the outputs (GGUFLinear.out_perm): output c is column
  // order[c] of what the rows gave (a gather here, not one more op call per layer)
  const auto& o = *order;
  LM_CHECK_VALUE(o.scalar_type() == torch::kInt64 && o.dim() == 1 && o.numel() == ldy && o.is_contiguous(),
                 "gguf_linear_multi: order must be a contiguous int64 vector of ", ldy, " columns");
  const int64_t* op = o.data_ptr<int64_t>();
  for (int64_t c = 0; c < ldy; ++c)
    LM_CHECK_VALUE(op[c] >= 0 && op[c] < ldy, "gguf_linear_multi: order[", c, "] = ", op[c], " is not a column 0..", ldy - 1);
  auto g = torch::empty_like(y);
  float* gp = g.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m)
    for (int64_t c = 0; c < ldy; ++c) gp[m * ldy + c] = yp[m * ldy + op[c]];
  return g;
}

constexpr int64_t RMS_HAND_MAX = 32768;  // at::internal::GRAIN_SIZE: a reduction this small runs on one thread

// torch's float32 sum of one contiguous row of n >= W values, added as its CPU kernel adds
// them (ATen's cascade_sum, contiguous inner reduction, for vectors of W lanes): rows of 4
// vectors summed lane-wise into a cascade of 4 levels (each level takes the one below every
// 16 rows), the vectors left over, the 4 partial vectors, then the scalars past the last whole
// vector and the W lanes one by one. The same additions in the same order give the same bits;
// rms_norm_rows checks that against at::sum once per row length before trusting it.
template <int W>
static float torch_row_sum(const float* x, int64_t n) {
  constexpr int64_t LEVELS = 4, STEP = 16;  // the level step for fewer than 2^16 rows
  const int64_t nv = n / W, rows = nv / 4;
  float acc[LEVELS][4][W] = {};
  auto add_row = [&](int64_t i) {
    for (int k = 0; k < 4; ++k)
      for (int l = 0; l < W; ++l) acc[0][k][l] += x[(i * 4 + k) * W + l];
  };
  int64_t i = 0;
  while (i + STEP <= rows) {
    for (int64_t j = 0; j < STEP; ++j, ++i) add_row(i);
    for (int64_t j = 1; j < LEVELS; ++j) {
      for (int k = 0; k < 4; ++k)
        for (int l = 0; l < W; ++l) { acc[j][k][l] += acc[j - 1][k][l]; acc[j - 1][k][l] = 0.f; }
      if ((i & ((STEP - 1) << (j * 4))) != 0) break;
    }
  }
  for (; i < rows; ++i) add_row(i);
  for (int64_t j = 1; j < LEVELS; ++j)
    for (int k = 0; k < 4; ++k)
      for (int l = 0; l < W; ++l) acc[0][k][l] += acc[j][k][l];
  for (int64_t v = rows * 4; v < nv; ++v)
    for (int l = 0; l < W; ++l) acc[0][0][l] += x[v * W + l];
  for (int k = 1; k < 4; ++k)
    for (int l = 0; l < W; ++l) acc[0][0][l] += acc[0][k][l];
  float total = 0.f;
  for (int64_t k = nv * W; k < n; ++k) total += x[k];
  for (int l = 0; l < W; ++l) total += acc[0][0][l];
  return 0.f + total;  // (the output starts at zero and is added to)
}

static float torch_row_sum_w(int width, const float* x, int64_t n) {
  return width == 16 ? torch_row_sum<16>(x, n) : torch_row_sum<8>(x, n);
}

// The vector width (8 or 16 lanes) with which torch_row_sum adds a row of H squares as
// at::sum does on this machine, or 0 when neither does (then at::sum is called). Found
// once per H on random rows of several magnitudes; the answer holds for the process (torch
// picks its kernel once, by the CPU).
static int sum_width(int64_t H) {
  static std::mutex mu;
  static std::unordered_map<int64_t, int> known;
  std::lock_guard<std::mutex> lock(mu);
  auto it = known.find(H);
  if (it != known.end()) return it->second;
  int found = 0;
  if (H >= 16 && H <= RMS_HAND_MAX) {
    auto g = at::make_generator<at::CPUGeneratorImpl>(1234);
    auto x = at::randn({8, H}, g, torch::kFloat32) * at::logspace(-3, 3, 8, 10.0, torch::kFloat32).unsqueeze(1);
    auto sq = x * x;
    auto ref = at::sum(sq, {-1}).contiguous();
    const float* sp = sq.data_ptr<float>(); const float* rp = ref.data_ptr<float>();
    for (int width : {8, 16}) {
      bool same = true;
      for (int64_t r = 0; r < 8 && same; ++r) {
        const float got = torch_row_sum_w(width, sp + r * H, H);
        same = std::memcmp(&got, rp + r, sizeof(float)) == 0;
      }
      if (same) { found = width; break; }
    }
  }
  known[H] = found;
  return found;
}

// sum_width for Python (tests: which rows rms_norm_rows adds itself)
int64_t rms_sum_width(int64_t H) { return sum_width(H); }

// RMSNorm of float32 rows x [..., H] with weight w [H]: w · (x · rsqrt(mean(x²) + eps)),
// the float32 steps of transformers' LlamaRMSNorm (and torch.rms_norm) in their order. The
// mean is torch's own (at::mean: at::sum, then a division by H), its sum either added here
// in at::sum's order (torch_row_sum, where sum_width found it: no tensor op at all, ~5 µs
// less a call, 61 calls a decode step) or at::mean itself; either way the bits are the same.
torch::Tensor rms_norm_rows(torch::Tensor x, torch::Tensor w, double eps) {
  LM_CHECK_VALUE(x.scalar_type() == torch::kFloat32 && w.scalar_type() == torch::kFloat32 && x.dim() >= 1
                 && w.dim() == 1 && w.size(0) == x.size(-1) && x.is_cpu() && w.is_cpu(),
                 "rms_norm_rows: x must be float32 [..., H] and w float32 [H], on the CPU");
  auto xc = x.contiguous();
  auto out = torch::empty_like(xc);
  const int64_t H = xc.size(-1), R = H > 0 ? xc.numel() / H : 0;
  const float* xp = xc.data_ptr<float>();
  auto wc = w.contiguous();
  const float* wp = wc.data_ptr<float>(); float* op = out.data_ptr<float>();
  const float e = (float)eps;
  // (beyond RMS_HAND_MAX values at::sum may split the rows across threads: its own call)
  const int width = R * H <= RMS_HAND_MAX ? sum_width(H) : 0;
  torch::Tensor var;
  if (width == 0) var = at::mean(xc * xc, {-1}, true);  // x.pow(2) is x * x, exactly
  const float* vp = width ? nullptr : var.data_ptr<float>();
  std::vector<float> sq(width ? H : 0);
  for (int64_t r = 0; r < R; ++r) {
    float v;
    if (width) {
      for (int64_t h = 0; h < H; ++h) sq[h] = xp[r * H + h] * xp[r * H + h];
      v = torch_row_sum_w(width, sq.data(), H) / (float)H;
    } else {
      v = vp[r];
    }
    const float inv = 1.f / std::sqrt(v + e);
    for (int64_t h = 0; h < H; ++h) op[r * H + h] = wp[h] * (xp[r * H + h] * inv);
  }
  return out;
}

// One head's rotary embedding: x·cos + swap(x)·sin, swap exchanging the two halves and sin
// sign-folded ([-sin_lo, sin_hi]): the multiplies and the add of transformers'
// q·cos + rotate_half(q)·sin, one rounding each.
static void rope_row(const float* r, const float* c, const float* s, float* o, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t d = 0; d < half; ++d) o[d] = r[d] * c[d] + r[d + half] * s[d];
  for (int64_t d = half; d < D; ++d) o[d] = r[d] * c[d] + r[d - half] * s[d];
}

static void check_rope_tables(const torch::Tensor& cos, const torch::Tensor& sin, int64_t B, int64_t D,
                              const char* fn) {
  LM_CHECK_VALUE(cos.scalar_type() == torch::kFloat32 && sin.scalar_type() == torch::kFloat32 && cos.is_cpu()
                 && sin.is_cpu() && cos.numel() == B * D && sin.numel() == B * D && D % 2 == 0,
                 fn, ": cos and sin must be float32 on the CPU holding B x D = ", B * D, " values (D even)");
}

// The rotary embedding of queries or keys x [B, n, 1, D] (made contiguous first), cos/sin
// [B, 1, 1, D] (or [B, 1, D]), each head by rope_row.
torch::Tensor rope_rows(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  LM_CHECK_VALUE(x.scalar_type() == torch::kFloat32 && x.dim() == 4 && x.size(2) == 1 && x.is_cpu(),
                 "rope_rows: x must be float32 [B, heads, 1, D] on the CPU");
  const int64_t B = x.size(0), H = x.size(1), D = x.size(3);
  check_rope_tables(cos, sin, B, D, "rope_rows");
  auto xc = x.contiguous(); auto cc = cos.contiguous(); auto sc = sin.contiguous();
  auto out = torch::empty_like(xc);
  const float* xp = xc.data_ptr<float>(); const float* cp = cc.data_ptr<float>(); const float* sp = sc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h) rope_row(xp + (b * H + h) * D, cp + b * D, sp + b * D, op + (b * H + h) * D, D);
  return out;
}

// One decode token's fused q/k/v projection y [B, 1, (Hq + 2·Hkv)·D] (gguf_linear_multi's
// columns: q, k, v) split into heads, q and k rotated as rope_rows does (the same bits):
// {q [B, Hq, 1, D], k [B, Hkv, 1, D], v [B, Hkv, 1, D] (a view of y)}. One call where the
// step made three slices, three views and two rope_rows calls.
std::vector<torch::Tensor> qkv_rope_rows(torch::Tensor y, torch::Tensor cos, torch::Tensor sin, int64_t Hq,
                                         int64_t Hkv, int64_t D) {
  LM_CHECK_VALUE(y.scalar_type() == torch::kFloat32 && y.dim() == 3 && y.size(1) == 1 && y.is_cpu()
                 && y.is_contiguous() && Hq > 0 && Hkv > 0 && D > 0 && y.size(2) == (Hq + 2 * Hkv) * D,
                 "qkv_rope_rows: y must be contiguous float32 [B, 1, (Hq + 2 Hkv) D] on the CPU");
  const int64_t B = y.size(0), N = y.size(2);
  check_rope_tables(cos, sin, B, D, "qkv_rope_rows");
  auto cc = cos.contiguous(); auto sc = sin.contiguous();
  auto q = torch::empty({B, Hq, 1, D}, y.options()), k = torch::empty({B, Hkv, 1, D}, y.options());
  const float* yp = y.data_ptr<float>(); const float* cp = cc.data_ptr<float>(); const float* sp = sc.data_ptr<float>();
  float* qp = q.data_ptr<float>(); float* kp = k.data_ptr<float>();
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < Hq; ++h) rope_row(yp + b * N + h * D, cp + b * D, sp + b * D, qp + (b * Hq + h) * D, D);
    for (int64_t h = 0; h < Hkv; ++h)
      rope_row(yp + b * N + (Hq + h) * D, cp + b * D, sp + b * D, kp + (b * Hkv + h) * D, D);
  }
  auto v = y.narrow(2, (Hq + Hkv) * D, Hkv * D).view({B, Hkv, 1, D});
  return {q, k, v};
}

// silu(y[..., :n]) · y[..., n:] for y [..., 2n] (the fused gate/up output): torch's own silu
// (at::silu on the same view, so the same bits as F.silu) and the product in one loop, where
// the step made two slices, a silu and a mul.
torch::Tensor silu_mul_rows(torch::Tensor y) {
  LM_CHECK_VALUE(y.scalar_type() == torch::kFloat32 && y.dim() >= 1 && y.size(-1) % 2 == 0 && y.is_cpu()
                 && y.is_contiguous(), "silu_mul_rows: y must be contiguous float32 [..., 2n] on the CPU");
  const int64_t n = y.size(-1) / 2, R = n > 0 ? y.numel() / (2 * n) : 0;
  auto g = at::silu(y.narrow(-1, 0, n)).contiguous();
  auto shape = y.sizes().vec();
  shape.back() = n;
  auto out = torch::empty(shape, y.options());
  const float* gp = g.data_ptr<float>(); const float* yp = y.data_ptr<float>(); float* op = out.data_ptr<float>();
  for (int64_t r = 0; r < R; ++r)
    for (int64_t i = 0; i < n; ++i) op[r * n + i] = gp[r * n + i] * yp[r * 2 * n + n + i];
  return out;
}

static std::unique_ptr<torch::Library> cpu_impls;

void register_ops() {
  if (cpu_impls) return;
  cpu_impls = std::make_unique<torch::Library>(torch::Library::IMPL, "lessmem", c10::DispatchKey::CPU,
                                               __FILE__, __LINE__);
  cpu_impls->impl("gguf_linear", &op_gguf_linear);
  cpu_impls->impl("gguf_dequantize", &op_gguf_dequantize);
}
