// Fused CPU dequant-matmul kernels: int8_linear, w8a8_linear, lowbit_linear (2/3/4-bit).
// Compiled at first use by lessmem/kernels/_build.py; the Python wrappers, argument checks
// and the math in words are in lessmem/kernels/linear_cpp.py; the pure-torch twin is
// lessmem/kernels/linear_reference.py.
#include <torch/extension.h>
#include <vector>
#include <cstdint>
#include <cstring>
#include <algorithm>
#include <cmath>
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(LESSMEM_NO_SIMD)
#include <immintrin.h>
#define LM_AVX2 1
#if defined(__AVX512VNNI__) && defined(__AVX512VL__) && !defined(LESSMEM_NO_VNNI)
#define LM_VNNI 1
#endif
#if defined(__AVX512VBMI__) && defined(__AVX512VL__) && !defined(LESSMEM_NO_VBMI)
#define LM_VBMI 1
#endif
#endif

// Small layers run on one thread: a parallel region's wake-up and barrier cost more than
// the work below 64k multiply-adds. (It was 4M while lessmem let OpenMP threads sleep
// between regions; with the brief spin lessmem sets, the wake-up is cheap and every decode
// linear of a 135M model gains from the second thread, as the GGUF kernel's did.)
// -DPAR_MIN_WORK=N overrides it (benchmarks).
#ifndef PAR_MIN_WORK
#define PAR_MIN_WORK 65536
#endif


static inline float h2f(const at::Half h) {
#ifdef LM_AVX2
  return _cvtsh_ss(h.x);
#else
  return static_cast<float>(h);
#endif
}

// Float dot products with explicit 8-lane accumulators: an `omp simd reduction` here ends
// every call with a 64-lane scalar sum, more than the whole dot costs at K = 576.
#ifdef LM_AVX2
static inline float hsum8(__m256 v) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}
#endif

static inline float dotf(const float* a, const float* b, int64_t n) {
  float acc = 0.f;
  int64_t k = 0;
#ifdef LM_AVX2
  __m256 v0 = _mm256_setzero_ps(), v1 = _mm256_setzero_ps();
  for (; k + 16 <= n; k += 16) {
    v0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + k), _mm256_loadu_ps(b + k), v0);
    v1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + k + 8), _mm256_loadu_ps(b + k + 8), v1);
  }
  acc = hsum8(_mm256_add_ps(v0, v1));
#endif
  for (; k < n; ++k) acc += a[k] * b[k];
  return acc;
}

static inline float dot_f32_i8(const float* x, const int8_t* w, int64_t n) {
  float acc = 0.f;
  int64_t k = 0;
#ifdef LM_AVX2
  __m256 v0 = _mm256_setzero_ps(), v1 = _mm256_setzero_ps();
  for (; k + 16 <= n; k += 16) {
    const __m128i b = _mm_loadu_si128((const __m128i*)(w + k));
    const __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
    const __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)));
    v0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k), w0, v0);
    v1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 8), w1, v1);
  }
  acc = hsum8(_mm256_add_ps(v0, v1));
#endif
  for (; k < n; ++k) acc += x[k] * (float)w[k];
  return acc;
}

torch::Tensor int8_linear(torch::Tensor x, torch::Tensor w, torch::Tensor scale) {
  // x [M, K] float32, w [N, K] int8, scale [N] float16 -> y [M, N] float32
  x = x.contiguous(); w = w.contiguous(); scale = scale.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const int8_t* wp = w.data_ptr<int8_t>();
  const at::Half* sp = scale.data_ptr<at::Half>();
  float* yp = y.data_ptr<float>();
  const bool par = N * K * M >= PAR_MIN_WORK;
  if (M == 1) {
    #pragma omp parallel for schedule(static) if(par)
    for (int64_t n = 0; n < N; ++n) {
      lm_prefetch_row_ahead(wp + n * K, K);
      yp[n] = dot_f32_i8(xp, wp + n * K, K) * h2f(sp[n]);
    }
    return y;
  }
  #pragma omp parallel if(par)
  {
    std::vector<float> buf(K);
    #pragma omp for schedule(static)
    for (int64_t n = 0; n < N; ++n) {
      const int8_t* wr = wp + n * K;
      #pragma omp simd
      for (int64_t k = 0; k < K; ++k) buf[k] = (float)wr[k];
      const float s = h2f(sp[n]);
      for (int64_t m = 0; m < M; ++m) yp[m * N + n] = dotf(xp + m * K, buf.data(), K) * s;
    }
  }
  return y;
}

torch::Tensor w8a8_linear(torch::Tensor xq, torch::Tensor sx, torch::Tensor w, torch::Tensor scale) {
  // xq [M, K] int8, sx [M] float32, w [N, K] int8, scale [N] float16 -> y [M, N] float32
  xq = xq.contiguous(); w = w.contiguous(); sx = sx.contiguous(); scale = scale.contiguous();
  const int64_t M = xq.size(0), K = xq.size(1), N = w.size(0);
  auto y = torch::empty({M, N}, sx.options());
  const int8_t* xp = xq.data_ptr<int8_t>();
  const int8_t* wp = w.data_ptr<int8_t>();
  const float* sxp = sx.data_ptr<float>();
  const at::Half* sp = scale.data_ptr<at::Half>();
  float* yp = y.data_ptr<float>();
  #pragma omp parallel for schedule(static) if(N * K * M >= PAR_MIN_WORK)
  for (int64_t n = 0; n < N; ++n) {
    const int8_t* wr = wp + n * K;
    lm_prefetch_row_ahead(wr, K);
    const float s = h2f(sp[n]);
    for (int64_t m = 0; m < M; ++m) {
      const int8_t* xr = xp + m * K;
      int32_t acc = 0;                                // (auto-vectorized integer reduction)
      for (int64_t k = 0; k < K; ++k) acc += (int32_t)xr[k] * (int32_t)wr[k];
      yp[m * N + n] = (float)acc * sxp[m] * s;
    }
  }
  return y;
}

// ---- lowbit ---------------------------------------------------------------------------
// Activations: per (row m, group g) 16-bit fixed point, q = round(x / d), d = amax_g / 32258,
// split q = 256·hi + lo with hi in [-126, 126], lo in [-128, 127] (int8), so u8 codes × s8
// halves run on dpbusd / maddubs: Σ_k u·x̂ = d · (256 · Σ u·hi + Σ u·lo). The int8 halves are stored per
// 32-code block in the byte order decode32 produces (kperm), so no shuffle in the hot loop.
// kperm(pos): which code of the block sits at byte pos of the decoded vector.
template <int BITS>
static inline int kperm(int pos) {
#ifdef LM_AVX2
  if (BITS == 2) return (pos % 8) * 4 + pos / 8;    // qword lane p, byte i <- code 4i + p
  if (BITS == 4) return (pos % 16) * 2 + pos / 16;  // 128-bit half h, byte i <- code 2i + h
#endif
  return pos;                                       // 3-bit, and the scalar build: natural
}

// xq [M, 2K] int8: block j (32 codes) of row m at bytes [64j, 64j + 64) of row m:
// 32 hi then 32 lo, in kperm order, so one cache line feeds both dot products.
// d [M, G] = the step, a [M, G] = d · Σ_{k∈g} q (for the zero-point term).
template <int BITS>
static void prep_act(const float* x, int64_t M, int64_t K, int64_t gs, int64_t GS, int8_t* xq,
                     float* dl, float* a) {               // dl, a: row stride GS ≥ G
  const int64_t G = K / gs;
  int perm[32];
  for (int p = 0; p < 32; ++p) perm[p] = kperm<BITS>(p);
  std::vector<int32_t> q(gs);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < G; ++g) {
      const float* xg = x + m * K + g * gs;
      float amax = 0.f;
      for (int64_t k = 0; k < gs; ++k) amax = std::max(amax, std::fabs(xg[k]));
      const float d = amax / 32258.f;
      const float id = d > 0.f ? 1.f / d : 0.f;
      int32_t sum = 0;
      for (int64_t k = 0; k < gs; ++k) {
        const float v = std::nearbyint(xg[k] * id);
        q[k] = (int32_t)std::min(32258.f, std::max(-32258.f, v));
        sum += q[k];
      }
      dl[m * GS + g] = d;
      a[m * GS + g] = d * (float)sum;
      for (int64_t b0 = 0; b0 < gs; b0 += 32) {
        int8_t* dst = xq + m * 2 * K + 2 * (g * gs + b0);
        for (int p = 0; p < 32; ++p) {
          const int32_t v = q[b0 + perm[p]];
          const int32_t hi = ((v + 128 + 32768) >> 8) - 128;      // floor((v + 128) / 256)
          dst[p] = (int8_t)hi;                                    // in [-126, 126]
          dst[32 + p] = (int8_t)(v - 256 * hi);                   // in [-128, 127]
        }
      }
    }
}

#ifdef LM_AVX2
// 32 codes of one block (4·BITS bytes at p, up to 16 bytes read) as bytes, order kperm.
template <int BITS>
static inline __m256i decode32(const uint8_t* p) {
  if (BITS == 2) {
    int64_t w;
    std::memcpy(&w, p, 8);
    const __m256i v = _mm256_srlv_epi64(_mm256_set1_epi64x(w), _mm256_setr_epi64x(0, 2, 4, 6));
    return _mm256_and_si256(v, _mm256_set1_epi8(3));
  }
  const __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)p));
  if (BITS == 4)
    return _mm256_and_si256(_mm256_srlv_epi64(v, _mm256_setr_epi64x(0, 0, 4, 4)), _mm256_set1_epi8(15));
#ifdef LM_VBMI
  // qword q <- the 3 bytes of unit q (codes 8q..8q+7); byte i <- bits [3i, 3i+8) of it
  const __m256i sh = _mm256_setr_epi8(0, 1, 2, -1, -1, -1, -1, -1, 3, 4, 5, -1, -1, -1, -1, -1,
                                      6, 7, 8, -1, -1, -1, -1, -1, 9, 10, 11, -1, -1, -1, -1, -1);
  const __m256i ms = _mm256_set1_epi64x(0x15120f0c09060300LL);  // 0, 3, 6, ... 21
  return _mm256_and_si256(_mm256_multishift_epi64_epi8(ms, _mm256_shuffle_epi8(v, sh)),
                          _mm256_set1_epi8(7));
#else
  // dword 2q <- unit q bits 0..23, dword 2q+1 <- bits 12..23; then 4 codes of 3 bits -> 4 bytes
  const __m256i sh = _mm256_setr_epi8(0, 1, 2, -1, 1, 2, -1, -1, 3, 4, 5, -1, 4, 5, -1, -1,
                                      6, 7, 8, -1, 7, 8, -1, -1, 9, 10, 11, -1, 10, 11, -1, -1);
  const __m256i w = _mm256_srlv_epi32(_mm256_shuffle_epi8(v, sh), _mm256_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4));
  __m256i r = _mm256_and_si256(w, _mm256_set1_epi32(0x7));
  r = _mm256_or_si256(r, _mm256_and_si256(_mm256_slli_epi32(w, 5), _mm256_set1_epi32(0x700)));
  r = _mm256_or_si256(r, _mm256_and_si256(_mm256_slli_epi32(w, 10), _mm256_set1_epi32(0x70000)));
  return _mm256_or_si256(r, _mm256_and_si256(_mm256_slli_epi32(w, 15), _mm256_set1_epi32(0x7000000)));
#endif
}

static inline __m256i dot_u8s8(__m256i acc, __m256i u, __m256i s) {
#ifdef LM_VNNI
  return _mm256_dpbusd_epi32(acc, u, s);
#else  // |u·s| ≤ 15·127: the int16 pair sums of maddubs cannot saturate
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}
#endif

// One weight row (codes b) against MT (1..4) activation rows; f [4][GS] the per-group factors
// s[n, g] · d[r, g]: out[r] = Σ_g f[r, g] · (256·Σ u·hi + Σ u·lo). NBT > 0 fixes the blocks
// per group at compile time (unrolled: the common 64/128-wide groups at batch 1).
template <int BITS, int MT, int NBT>
static inline void lowbit_row(const uint8_t* b, const float* f, int64_t GS, const int8_t* xq,
                              int64_t K, int64_t G, int64_t gs, float* out) {
  constexpr int BB = 4 * BITS;                     // bytes per 32-code block
  const int64_t NB = NBT > 0 ? NBT : gs / 32;
#ifdef LM_AVX2
  __m256 tot[MT];
  for (int r = 0; r < MT; ++r) tot[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* bg = b + g * NB * BB;
    const int8_t* xg = xq + 2 * g * NB * 32;
    __m256i ah[MT], al[MT];
    for (int r = 0; r < MT; ++r) { ah[r] = _mm256_setzero_si256(); al[r] = _mm256_setzero_si256(); }
    for (int64_t j = 0; j < NB; ++j) {
      const __m256i u = decode32<BITS>(bg + j * BB);
      for (int r = 0; r < MT; ++r) {
        const int8_t* xr = xg + r * 2 * K + 64 * j;
        ah[r] = dot_u8s8(ah[r], u, _mm256_loadu_si256((const __m256i*)xr));
        al[r] = dot_u8s8(al[r], u, _mm256_loadu_si256((const __m256i*)(xr + 32)));
      }
    }
    for (int r = 0; r < MT; ++r) {
      // 256·Σu·hi + Σu·lo in int32: |lane| ≤ 4·15·32767·gs/32, no overflow below gs ≈ 35000
      const __m256i a = _mm256_add_epi32(_mm256_slli_epi32(ah[r], 8), al[r]);
      tot[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a), _mm256_broadcast_ss(f + r * GS + g), tot[r]);
    }
  }
  for (int r = 0; r < MT; ++r) out[r] = hsum8(tot[r]);
#else
  constexpr uint32_t MASK = (1u << BITS) - 1;
  for (int r = 0; r < MT; ++r) out[r] = 0.f;
  for (int64_t g = 0; g < G; ++g) {
    int32_t ah[MT], al[MT];
    for (int r = 0; r < MT; ++r) { ah[r] = 0; al[r] = 0; }
    for (int64_t k = g * gs; k < (g + 1) * gs; ++k) {
      const int64_t bit = k * BITS;                 // code k: bits [bit, bit + BITS) of the stream
      const uint32_t two = (uint32_t)b[bit >> 3] | ((uint32_t)b[(bit >> 3) + 1] << 8);
      const int32_t u = (int32_t)((two >> (bit & 7)) & MASK);
      const int64_t o = 2 * (k - k % 32) + k % 32;  // natural order: hi at o, lo at o + 32
      for (int r = 0; r < MT; ++r) { ah[r] += u * xq[r * 2 * K + o]; al[r] += u * xq[r * 2 * K + o + 32]; }
    }
    for (int r = 0; r < MT; ++r) out[r] += f[r * GS + g] * (256.f * (float)ah[r] + (float)al[r]);
  }
#endif
}

template <int BITS, int MT>
static inline void lowbit_tile(const uint8_t* b, const float* f, int64_t GS, const int8_t* xq,
                               int64_t K, int64_t G, int64_t gs, float* out) {
  if (MT == 1 && gs == 64) lowbit_row<BITS, MT, 2>(b, f, GS, xq, K, G, gs, out);
  else if (MT == 1 && gs == 128) lowbit_row<BITS, MT, 4>(b, f, GS, xq, K, G, gs, out);
  else lowbit_row<BITS, MT, 0>(b, f, GS, xq, K, G, gs, out);
}

template <int BITS>
static void lowbit_impl(const float* x, const uint8_t* cp, const at::Half* sp, const uint8_t* zp,
                        const float* bias, float* yp, int64_t M, int64_t N, int64_t K, int64_t gs) {
  const int64_t G = K / gs, row_bytes = K * BITS / 8;
  // Per-group vectors padded to GS = G rounded up to 8 (d, a zero-padded), so the per-row
  // prepass below is whole 8-lane steps with no scalar tail; it reads the scales and zero
  // points of row n up to GS, i.e. into row n + 1 (a padded copy on the last row), where the
  // zero padding of a cancels them.
#ifdef LM_AVX2
  const int64_t GS = (G + 7) / 8 * 8;
#else
  const int64_t GS = G;
#endif
  static thread_local std::vector<int8_t> xq_buf;   // reused across calls: no allocation
  static thread_local std::vector<float> da_buf;
  xq_buf.resize(M * 2 * K + 64);
  da_buf.assign(2 * M * GS, 0.f);
  int8_t* xq = xq_buf.data();
  float* dl = da_buf.data();
  float* al = dl + M * GS;
  prep_act<BITS>(x, M, K, gs, GS, xq, dl, al);
  #pragma omp parallel if(N * K * M >= PAR_MIN_WORK)
  {
    std::vector<uint8_t> last, zlast(GS + 8, 0);    // the buffer's last row, padded
    std::vector<at::Half> slast(GS + 8);
    std::vector<float> sf(GS), f(4 * GS);
    #pragma omp for schedule(static)
    for (int64_t n = 0; n < N; ++n) {
      const uint8_t* b = cp + n * row_bytes;
      lm_prefetch_row_ahead(b, row_bytes);
      const at::Half* s = sp + n * G;
      const uint8_t* z = zp + n * G;
      if (n == N - 1) {
        last.assign(row_bytes + 16, 0);
        std::memcpy(last.data(), b, row_bytes);
        b = last.data();
      }
      if ((n * G + GS) > N * G) {                   // the GS-wide reads would pass the end
        std::copy(s, s + G, slast.begin());
        std::copy(z, z + G, zlast.begin());
        s = slast.data();
        z = zlast.data();
      }
#ifdef LM_AVX2
      for (int64_t g = 0; g < GS; g += 8)
        _mm256_storeu_ps(sf.data() + g, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(s + g))));
#else
      for (int64_t g = 0; g < G; ++g) sf[g] = h2f(s[g]);
#endif
      const float bn = bias ? bias[n] : 0.f;
      float out[4], zt[4];
      for (int64_t m0 = 0; m0 < M; m0 += 4) {
        const int64_t mt = std::min<int64_t>(4, M - m0);
        for (int64_t r = 0; r < mt; ++r) {          // f = s·d; zero term Σ_g s·z·d·Σq
          const float* d = dl + (m0 + r) * GS;
          const float* a = al + (m0 + r) * GS;
          float* fr = f.data() + r * GS;
#ifdef LM_AVX2  // (an omp simd reduction here costs a 64-lane scalar sum per row)
          __m256 va = _mm256_setzero_ps();
          for (int64_t g = 0; g < GS; g += 8) {
            const __m256 vs = _mm256_loadu_ps(sf.data() + g);
            _mm256_storeu_ps(fr + g, _mm256_mul_ps(vs, _mm256_loadu_ps(d + g)));
            const __m256 vz = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(z + g))));
            va = _mm256_fmadd_ps(_mm256_mul_ps(vs, vz), _mm256_loadu_ps(a + g), va);
          }
          zt[r] = hsum8(va);
#else
          float acc = 0.f;
          for (int64_t g = 0; g < G; ++g) {
            fr[g] = sf[g] * d[g];
            acc += sf[g] * (float)z[g] * a[g];
          }
          zt[r] = acc;
#endif
        }
        const int8_t* xm = xq + m0 * 2 * K;
        switch (mt) {
          case 4: lowbit_tile<BITS, 4>(b, f.data(), GS, xm, K, G, gs, out); break;
          case 3: lowbit_tile<BITS, 3>(b, f.data(), GS, xm, K, G, gs, out); break;
          case 2: lowbit_tile<BITS, 2>(b, f.data(), GS, xm, K, G, gs, out); break;
          default: lowbit_tile<BITS, 1>(b, f.data(), GS, xm, K, G, gs, out); break;
        }
        for (int64_t r = 0; r < mt; ++r) yp[(m0 + r) * N + n] = out[r] - zt[r] + bn;
      }
    }
  }
}

torch::Tensor lowbit_linear(torch::Tensor x, torch::Tensor codes, int64_t bits, torch::Tensor scale,
                            torch::Tensor zero, int64_t group_size, torch::Tensor bias) {
  // x [M, K] float32, codes uint8 (N*K*bits/8), scale [N, G] float16, zero [N, G] uint8,
  // bias [N] float32 or empty (no bias)
  x = x.contiguous(); codes = codes.contiguous(); scale = scale.contiguous(); zero = zero.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = scale.size(0);
  LM_CHECK(group_size % 32 == 0 && K % group_size == 0, "lowbit_linear: bad K/group");
  LM_CHECK(codes.numel() >= N * K * bits / 8, "lowbit_linear: codes too short");
  LM_CHECK(bias.numel() == 0 || bias.numel() == N, "lowbit_linear: bias size");
  bias = bias.contiguous();
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const at::Half* sp = scale.data_ptr<at::Half>();
  const uint8_t* zp = zero.data_ptr<uint8_t>();
  const float* bp = bias.numel() ? bias.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  if (bits == 2) lowbit_impl<2>(xp, cp, sp, zp, bp, yp, M, N, K, group_size);
  else if (bits == 3) lowbit_impl<3>(xp, cp, sp, zp, bp, yp, M, N, K, group_size);
  else lowbit_impl<4>(xp, cp, sp, zp, bp, yp, M, N, K, group_size);
  return y;
}

// Which code paths this build compiled: 0 scalar, 1 AVX2, +2 VNNI dot, +4 VBMI 3-bit decode.
int64_t simd_build() {
#ifdef LM_AVX2
  int64_t f = 1;
#ifdef LM_VNNI
  f += 2;
#endif
#ifdef LM_VBMI
  f += 4;
#endif
  return f;
#else
  return 0;
#endif
}

// ---------------------------------------------------------------- the ops' CPU backends
// torch.ops.lessmem.lowbit_linear / int8_linear / w8a8_linear (schemas: kernels/linear_ops.py)
// dispatch here for CPU tensors without a Python frame once register_ops() has run (the
// Python wrapper calls it for the default build only: a build with other flags, as the
// tests and benchmarks make, must not replace the ops' kernels). Arguments are checked
// first; a bad one is a ValueError naming it and what is allowed (the kernels above read
// unchecked).
#include <torch/library.h>
#include <memory>

#define CHECK_DTYPE(op, name, t, want) LM_CHECK_VALUE((t).scalar_type() == (want), op ": " name " dtype ", \
                                                         (t).scalar_type(), "; allowed: ", (want))

static std::vector<int64_t> out_shape(const torch::Tensor& x, int64_t N) {
  auto s = x.sizes().vec();
  s.back() = N;
  return s;
}

static torch::Tensor op_lowbit_linear(const torch::Tensor& x, const torch::Tensor& codes, int64_t bits,
                                      const torch::Tensor& scale, const torch::Tensor& zero, int64_t group_size,
                                      const std::optional<torch::Tensor>& bias) {
  LM_CHECK_VALUE(bits >= 2 && bits <= 4, "lowbit_linear: bits=", bits, "; allowed: 2, 3, 4");
  LM_CHECK_VALUE(x.is_floating_point() && x.dim() >= 1, "lowbit_linear: x dtype ", x.scalar_type(),
                    "; allowed: a float dtype");
  CHECK_DTYPE("lowbit_linear", "scale", scale, torch::kHalf);
  CHECK_DTYPE("lowbit_linear", "zero", zero, torch::kUInt8);
  CHECK_DTYPE("lowbit_linear", "codes", codes, torch::kUInt8);
  LM_CHECK_VALUE(scale.dim() == 2 && zero.sizes() == scale.sizes(), "lowbit_linear: scale ", scale.sizes(),
                    " / zero ", zero.sizes(), "; allowed: both [N, G]");
  const int64_t N = scale.size(0), K = scale.size(1) * group_size;
  LM_CHECK_VALUE(x.size(-1) == K && group_size > 0 && group_size % 32 == 0 && group_size <= 32768,
                    "lowbit_linear: x has ", x.size(-1), " input features with group_size=", group_size, " and ",
                    scale.size(1), " groups per row; allowed: in_features = groups x group_size = ", K,
                    ", group_size a multiple of 32, at most 32768");
  LM_CHECK_VALUE(codes.numel() == N * K * bits / 8, "lowbit_linear: codes hold ", codes.numel(),
                    " bytes; allowed: N x K x bits / 8 = ", N * K * bits / 8);
  torch::Tensor b = torch::empty({0}, torch::dtype(torch::kFloat32));
  if (bias.has_value()) {
    LM_CHECK_VALUE(bias->numel() == N, "lowbit_linear: bias has ", bias->numel(),
                      " values; allowed: None or out_features = ", N);
    b = bias->to(torch::kFloat32);
  }
  auto y = lowbit_linear(x.reshape({-1, K}).to(torch::kFloat32), codes, bits, scale, zero, group_size, b);
  return y.view(out_shape(x, N));
}

static torch::Tensor op_int8_linear(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& scale) {
  LM_CHECK_VALUE(x.is_floating_point() && x.dim() >= 1, "int8_linear: x dtype ", x.scalar_type(),
                    "; allowed: a float dtype");
  CHECK_DTYPE("int8_linear", "w", w, torch::kInt8);
  CHECK_DTYPE("int8_linear", "scale", scale, torch::kHalf);
  LM_CHECK_VALUE(w.dim() == 2 && x.size(-1) == w.size(1), "int8_linear: x has ", x.size(-1),
                    " input features; allowed: ", w.size(-1), " (w is ", w.sizes(), ")");
  LM_CHECK_VALUE(scale.numel() == w.size(0), "int8_linear: scale has ", scale.numel(),
                    " values; allowed: one per output row (", w.size(0), ")");
  auto y = int8_linear(x.reshape({-1, w.size(1)}).to(torch::kFloat32), w, scale.reshape({-1}));
  return y.view(out_shape(x, w.size(0)));
}

static torch::Tensor op_w8a8_linear(const torch::Tensor& xq, const torch::Tensor& sx, const torch::Tensor& w,
                                    const torch::Tensor& scale) {
  CHECK_DTYPE("w8a8_linear", "xq", xq, torch::kInt8);
  CHECK_DTYPE("w8a8_linear", "w", w, torch::kInt8);
  CHECK_DTYPE("w8a8_linear", "scale", scale, torch::kHalf);
  LM_CHECK_VALUE(xq.dim() == 2 && w.dim() == 2 && xq.size(1) == w.size(1), "w8a8_linear: xq ", xq.sizes(),
                    " and w ", w.sizes(), "; allowed: [M, K] and [N, K]");
  LM_CHECK_VALUE(sx.numel() == xq.size(0) && scale.numel() == w.size(0), "w8a8_linear: sx has ", sx.numel(),
                    " and scale ", scale.numel(), " values; allowed: ", xq.size(0), " (one per row of xq) and ",
                    w.size(0), " (one per row of w)");
  return w8a8_linear(xq, sx.to(torch::kFloat32), w, scale.reshape({-1}));
}

static std::unique_ptr<torch::Library> cpu_impls;

void register_ops() {
  if (cpu_impls) return;
  cpu_impls = std::make_unique<torch::Library>(torch::Library::IMPL, "lessmem", c10::DispatchKey::CPU,
                                               __FILE__, __LINE__);
  cpu_impls->impl("lowbit_linear", &op_lowbit_linear);
  cpu_impls->impl("int8_linear", &op_int8_linear);
  cpu_impls->impl("w8a8_linear", &op_w8a8_linear);
}
