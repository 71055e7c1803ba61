// Attention of a prompt chunk in bfloat16 on CPUs with AVX512-BF16 dot products (see
// kernels/prompt_attention.py for the Python side and the algorithm). Built by
// kernels/_build.py with -march=native: on a CPU without AVX512-BF16 the module only says so
// (available() is false) and the callers keep torch's flash attention.
#include <torch/extension.h>
#include <c10/util/BFloat16.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#define LM_BF16_DOT 1
#endif

namespace {

#ifdef LM_BF16_DOT
constexpr int R = 4;    // query rows a pass computes together
constexpr int KT = 64;  // keys a tile: four blocks of 16, one lane per key
const float NEG_INF = -std::numeric_limits<float>::infinity();

// exp(x) for x <= 0 on 16 lanes (x < -87, -inf included, gives 0): 2^n · p(r), x = n·ln2 + r,
// p a degree-6 polynomial (relative error ~2e-7), as attention.cpp's exp_neg.
inline __m512 exp_neg16(__m512 x) {
  const __m512 lo = _mm512_set1_ps(-87.f);
  const __m512 xc = _mm512_max_ps(x, lo);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(xc, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), xc);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.f / 720.f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  const __m512 res = _mm512_mul_ps(p, _mm512_castsi512_ps(e));
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, lo, _CMP_GE_OQ), res);
}

inline __m512bh as_bh(__m512i x) { return (__m512bh)x; }

// Keys of one KV head for the score products: per block of 16 keys, D/2 vectors, vector i
// holding channels 2i, 2i+1 of each of the 16 keys (lane j = key j), as one 32-bit word.
// Keys past n are zero (their scores are masked).
void pack_keys(const uint16_t* k, int64_t n, int64_t D, int64_t n_pad, uint32_t* out) {
  const int64_t P = D / 2;
  for (int64_t b = 0; b < n_pad / 16; ++b)
    for (int64_t j = 0; j < 16; ++j) {
      const int64_t t = b * 16 + j;
      for (int64_t i = 0; i < P; ++i) {
        uint32_t w = 0;
        if (t < n) std::memcpy(&w, k + t * D + 2 * i, 4);
        out[(b * P + i) * 16 + j] = w;
      }
    }
}

// Values of one KV head for the weighted sums: per pair of keys (2p, 2p+1), D/16 vectors,
// lane d of vector c holding channel 16c + d of both keys (key 2p in the low half).
void pack_values(const uint16_t* v, int64_t n, int64_t D, int64_t n_pad, uint32_t* out) {
  for (int64_t p = 0; p < n_pad / 2; ++p)
    for (int64_t d = 0; d < D; ++d) {
      const int64_t t = 2 * p;
      const uint32_t lo = t < n ? v[t * D + d] : 0, hi = t + 1 < n ? v[(t + 1) * D + d] : 0;
      out[p * D + d] = lo | (hi << 16);
    }
}

// One pass: query rows q[0..R) (pointers; a short pass repeats its last row and stores only
// `rows`) over the keys 0..last[r] of each row. out rows D floats apart, lse one per row.
template <int D>
void rows_pass(const uint16_t* const* q, int rows, const int64_t* last, const uint32_t* kp,
               const uint32_t* vp, float scale, float* const* out, float* lse) {
  constexpr int P = D / 2, C = D / 16;
  alignas(64) float o[R][D];
  alignas(64) uint16_t pb[R][KT];
  float m[R], l[R];
  int64_t lo_last = last[0], hi_last = last[0];
  for (int r = 0; r < R; ++r) {
    m[r] = NEG_INF;
    l[r] = 0.f;
    for (int d = 0; d < D; ++d) o[r][d] = 0.f;
    lo_last = std::min(lo_last, last[r]);
    hi_last = std::max(hi_last, last[r]);
  }
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t t0 = 0; t0 <= hi_last; t0 += KT) {
    // scores of the tile: one accumulator per row and block of 16 keys
    __m512 s[R][4];
    for (int r = 0; r < R; ++r)
      for (int b = 0; b < 4; ++b) s[r][b] = _mm512_setzero_ps();
    const uint32_t* kt = kp + (t0 / 16) * P * 16;
    for (int i = 0; i < P; ++i) {
      __m512i qb[R];
      for (int r = 0; r < R; ++r) {
        uint32_t w;
        std::memcpy(&w, q[r] + 2 * i, 4);
        qb[r] = _mm512_set1_epi32((int)w);
      }
      for (int b = 0; b < 4; ++b) {
        const __m512i kv = _mm512_loadu_si512(kt + (b * P + i) * 16);
        for (int r = 0; r < R; ++r) s[r][b] = _mm512_dpbf16_ps(s[r][b], as_bh(kv), as_bh(qb[r]));
      }
    }
    const bool masked = t0 + KT - 1 > lo_last;
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    float alpha[R];
    for (int r = 0; r < R; ++r) {
      __m512 mx = _mm512_set1_ps(NEG_INF);
      for (int b = 0; b < 4; ++b) {
        s[r][b] = _mm512_mul_ps(s[r][b], vscale);
        if (masked) {  // keys past this row's last: -inf
          const __m512i idx = _mm512_add_epi32(lane, _mm512_set1_epi32((int)(t0 + 16 * b)));
          const __mmask16 keep = _mm512_cmple_epi32_mask(idx, _mm512_set1_epi32((int)last[r]));
          s[r][b] = _mm512_mask_mov_ps(_mm512_set1_ps(NEG_INF), keep, s[r][b]);
        }
        mx = _mm512_max_ps(mx, s[r][b]);
      }
      const float m_new = std::max(m[r], _mm512_reduce_max_ps(mx));  // finite: key 0 is in every row's first tile
      alpha[r] = m[r] == NEG_INF ? 0.f : std::exp(m[r] - m_new);
      m[r] = m_new;
      const __m512 vm = _mm512_set1_ps(m_new);
      __m512 sum = _mm512_setzero_ps();
      for (int b = 0; b < 4; ++b) {
        const __m512 p = exp_neg16(_mm512_sub_ps(s[r][b], vm));
        sum = _mm512_add_ps(sum, p);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(&pb[r][16 * b]), (__m256i)_mm512_cvtneps_pbh(p));
      }
      l[r] = l[r] * alpha[r] + _mm512_reduce_add_ps(sum);
    }
    // o = o·alpha + Σ p·v over the tile's key pairs, 4 vectors (64 channels) of each row at a time
    const int64_t pairs = std::min<int64_t>(KT, hi_last - t0 + 1 + 1) / 2;  // pairs holding a visible key
    const uint32_t* vt = vp + (t0 / 2) * D;
    for (int c0 = 0; c0 < C; c0 += 4) {
      __m512 a[R][4];
      for (int r = 0; r < R; ++r) {
        const __m512 va = _mm512_set1_ps(alpha[r]);
        for (int c = 0; c < 4; ++c) a[r][c] = _mm512_mul_ps(_mm512_load_ps(&o[r][16 * (c0 + c)]), va);
      }
      for (int64_t p = 0; p < pairs; ++p) {
        __m512i vv[4];
        for (int c = 0; c < 4; ++c) vv[c] = _mm512_loadu_si512(vt + p * D + 16 * (c0 + c));
        for (int r = 0; r < R; ++r) {
          uint32_t w;
          std::memcpy(&w, &pb[r][2 * p], 4);
          const __m512i pw = _mm512_set1_epi32((int)w);
          for (int c = 0; c < 4; ++c) a[r][c] = _mm512_dpbf16_ps(a[r][c], as_bh(vv[c]), as_bh(pw));
        }
      }
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < 4; ++c) _mm512_store_ps(&o[r][16 * (c0 + c)], a[r][c]);
    }
  }
  for (int r = 0; r < rows; ++r) {
    const float inv = 1.f / l[r];
    for (int d = 0; d < D; ++d) out[r][d] = o[r][d] * inv;
    lse[r] = m[r] + std::log(l[r]);
  }
}

template <int D>
void run(const uint16_t* q, const uint16_t* k, const uint16_t* v, int64_t G, int64_t M, int64_t N, float scale,
         int64_t causal_offset, int64_t period, float* out, float* lse) {
  const int64_t n_pad = (N + KT - 1) / KT * KT;
  std::vector<uint32_t> kp(G * n_pad * D / 2), vp(G * n_pad * D / 2);
#pragma omp parallel for schedule(static)
  for (int64_t g = 0; g < G; ++g) {
    pack_keys(k + g * N * D, N, D, n_pad, kp.data() + g * n_pad * D / 2);
    pack_values(v + g * N * D, N, D, n_pad, vp.data() + g * n_pad * D / 2);
  }
  constexpr int64_t ROWS_ITEM = 4 * R;  // rows a work item: a few passes over the same keys
  const int64_t per_g = (M + ROWS_ITEM - 1) / ROWS_ITEM;
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t it = 0; it < G * per_g; ++it) {
    // later rows of a causal chunk see more keys: the items go out last rows first
    const int64_t g = it % G, blk = per_g - 1 - it / G;
    const uint32_t* kg = kp.data() + g * n_pad * D / 2;
    const uint32_t* vg = vp.data() + g * n_pad * D / 2;
    for (int64_t m0 = blk * ROWS_ITEM; m0 < std::min(M, (blk + 1) * ROWS_ITEM); m0 += R) {
      const int rows = (int)std::min<int64_t>(R, M - m0);
      const uint16_t* qr[R];
      float* orow[R];
      int64_t last[R];
      for (int r = 0; r < R; ++r) {
        const int64_t m = m0 + std::min(r, rows - 1);
        qr[r] = q + (g * M + m) * D;
        orow[r] = out + (g * M + m) * D;
        last[r] = causal_offset < 0 ? N - 1 : std::min(N - 1, causal_offset + m % period);
      }
      rows_pass<D>(qr, rows, last, kg, vg, scale, orow, lse + g * M + m0);
    }
  }
}
#endif

}  // namespace

bool available() {
#ifdef LM_BF16_DOT
  return true;
#else
  return false;
#endif
}

// out [G, M, D] float32 and lse [G, M] (natural log) of softmax(scale · q kᵀ) v, q [G, M, D],
// k and v [G, N, D], all bfloat16 and contiguous. causal_offset < 0: every row sees every key;
// otherwise row m sees keys 0 .. causal_offset + m mod period (the chunk's query rows of each
// head stacked, `period` of them a head, the chunk being the last keys).
std::vector<torch::Tensor> bf16_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, double scale,
                                          int64_t causal_offset, int64_t period) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "q, k, v must be [G, rows, D]");
  TORCH_CHECK(q.scalar_type() == torch::kBFloat16 && k.scalar_type() == torch::kBFloat16 &&
                  v.scalar_type() == torch::kBFloat16, "q, k, v must be bfloat16");
  TORCH_CHECK(q.is_contiguous() && k.is_contiguous() && v.is_contiguous(), "q, k, v must be contiguous");
  const int64_t G = q.size(0), M = q.size(1), D = q.size(2), N = k.size(1);
  TORCH_CHECK(k.size(0) == G && v.size(0) == G && k.size(2) == D && v.size(2) == D && v.size(1) == N,
              "k and v must be [G, N, D] with q's G and D");
  TORCH_CHECK(N >= 1, "at least one key");
  TORCH_CHECK(causal_offset < 0 || period >= 1, "period must be >= 1");
  auto out = torch::empty({G, M, D}, q.options().dtype(torch::kFloat32));
  auto lse = torch::empty({G, M}, q.options().dtype(torch::kFloat32));
#ifdef LM_BF16_DOT
  const auto* qp = reinterpret_cast<const uint16_t*>(q.data_ptr<c10::BFloat16>());
  const auto* kp = reinterpret_cast<const uint16_t*>(k.data_ptr<c10::BFloat16>());
  const auto* vp = reinterpret_cast<const uint16_t*>(v.data_ptr<c10::BFloat16>());
  if (D == 64)
    run<64>(qp, kp, vp, G, M, N, (float)scale, causal_offset, period, out.data_ptr<float>(), lse.data_ptr<float>());
  else if (D == 128)
    run<128>(qp, kp, vp, G, M, N, (float)scale, causal_offset, period, out.data_ptr<float>(), lse.data_ptr<float>());
  else if (D == 256)
    run<256>(qp, kp, vp, G, M, N, (float)scale, causal_offset, period, out.data_ptr<float>(), lse.data_ptr<float>());
  else
    TORCH_CHECK(false, "head_dim must be 64, 128 or 256, got ", D);
#else
  TORCH_CHECK(false, "this build has no AVX512-BF16 dot products (available() is false)");
#endif
  return {out, lse};
}

