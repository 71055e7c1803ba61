"""Fused GGUF dequant-matmul on CPU in C++: ``y = x · W_hatᵀ`` with W held as raw GGUF blocks.

The weight ``W [N, K]`` stays in the bytes a ``.gguf`` file stores (uint8
``[N, K / block_size * type_size]``), for all ten block types of ``formats.gguf``
(Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q2_K Q3_K Q4_K Q5_K Q6_K). Per output row ``n`` (rows split
across threads with OpenMP):

    for each block b of row n:        c[0:QK] = decode(block)      (QK = 32 or 256 floats, L1)
        for each input row m:         acc[m][j] += x[m, b·QK + j] · c[j]   (j mod 32 lanes)
    y[m, n] = Σ_j acc[m][j]

so the float matrix is never materialised: one block's floats live in a stack buffer.
The block decoders do the float32 operations of ``formats.gguf.dequantize_gguf`` in the
same order (``d·(q − 8)``, ``d·q + m``, ``(d·sc)·q − (dmin·m)`` …, built with
``-ffp-contract=off`` so no multiply-add is fused), hence decode to bit-identical floats;
``gguf_dequantize`` exposes them (used above ``FUSED_MAX_ROWS`` rows: decode once, BLAS).
The dot products use explicit fused multiply-adds, so ``y`` equals the float64 reference
to float32 rounding (relative error ~1e-6), not bit for bit. Activations stay float32
(no int8 quantization of ``x`` as llama.cpp does).

When no compiler is available the functions fall back to ``gguf_linear_reference``.

Example:
    >>> import torch
    >>> from lessmem.formats.gguf import quantize_gguf, dequantize_gguf
    >>> from lessmem.kernels.gguf_linear_cpp import gguf_linear
    >>> w = torch.randn(8, 256)
    >>> raw = torch.from_numpy(quantize_gguf(w, "q4_k"))
    >>> x = torch.randn(1, 256)
    >>> ref = x.double() @ dequantize_gguf(raw, "q4_k", (8, 256)).double().T
    >>> bool(torch.allclose(gguf_linear(x, raw, "q4_k", 8).double(), ref, atol=1e-4))
    True
"""

from __future__ import annotations

import torch

from ..formats.gguf import gguf_type
from . import gguf_linear_reference as ref
from ._build import load_cpp

_SOURCE = r"""
#include <torch/extension.h>
#include <c10/util/Half.h>
#include <vector>
#include <cstdint>
#include <cstring>
#include <algorithm>
#ifdef __F16C__
#include <immintrin.h>
#endif

// ~1M weights: below this one thread decodes faster than a parallel region wakes up.
#define PAR_MIN_WORK 1048576
#define MB 16  // input rows per pass over a weight row (accumulators: MB x 32 floats)

static inline float h2f(const uint8_t* p) {
  uint16_t b; std::memcpy(&b, p, 2);
#ifdef __F16C__
  return _cvtsh_ss(b);
#else
  return c10::detail::fp16_ieee_to_fp32_value(b);
#endif
}

// ---------------------------------------------------------------- block decoders
// Each writes QK floats, the same float32 operations as formats/gguf*.py's dequantizers.
enum { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

template <int T> struct Traits;
template <> struct Traits<Q4_0> { static constexpr int QK = 32, TS = 18; };
template <> struct Traits<Q4_1> { static constexpr int QK = 32, TS = 20; };
template <> struct Traits<Q5_0> { static constexpr int QK = 32, TS = 22; };
template <> struct Traits<Q5_1> { static constexpr int QK = 32, TS = 24; };
template <> struct Traits<Q8_0> { static constexpr int QK = 32, TS = 34; };
template <> struct Traits<Q2_K> { static constexpr int QK = 256, TS = 84; };
template <> struct Traits<Q3_K> { static constexpr int QK = 256, TS = 110; };
template <> struct Traits<Q4_K> { static constexpr int QK = 256, TS = 144; };
template <> struct Traits<Q5_K> { static constexpr int QK = 256, TS = 176; };
template <> struct Traits<Q6_K> { static constexpr int QK = 256, TS = 210; };

template <int T> static inline void decode(const uint8_t* b, float* out);

// Q4_0: d, qs[16]; element j in the low nibble of qs[j], j+16 in the high. x = d*(q-8)
template <> inline void decode<Q4_0>(const uint8_t* b, float* out) {
  const float d = h2f(b); const uint8_t* qs = b + 2;
  #pragma omp simd
  for (int j = 0; j < 16; ++j) {
    out[j] = d * (float)((int)(qs[j] & 15) - 8);
    out[j + 16] = d * (float)((int)(qs[j] >> 4) - 8);
  }
}
// Q4_1: d, m, qs[16]. x = d*q + m
template <> inline void decode<Q4_1>(const uint8_t* b, float* out) {
  const float d = h2f(b), m = h2f(b + 2); const uint8_t* qs = b + 4;
  #pragma omp simd
  for (int j = 0; j < 16; ++j) {
    out[j] = d * (float)(qs[j] & 15) + m;
    out[j + 16] = d * (float)(qs[j] >> 4) + m;
  }
}
// Q5_0: d, qh (bit j of a little-endian u32 = bit 4 of element j), qs[16]. x = d*(q-16)
template <> inline void decode<Q5_0>(const uint8_t* b, float* out) {
  const float d = h2f(b); uint32_t qh; std::memcpy(&qh, b + 2, 4); const uint8_t* qs = b + 6;
  #pragma omp simd
  for (int j = 0; j < 16; ++j) {
    const int lo = (qs[j] & 15) | (((qh >> j) & 1) << 4), hi = (qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
    out[j] = d * (float)(lo - 16);
    out[j + 16] = d * (float)(hi - 16);
  }
}
// Q5_1: d, m, qh, qs[16]. x = d*q + m
template <> inline void decode<Q5_1>(const uint8_t* b, float* out) {
  const float d = h2f(b), m = h2f(b + 2); uint32_t qh; std::memcpy(&qh, b + 4, 4); const uint8_t* qs = b + 8;
  #pragma omp simd
  for (int j = 0; j < 16; ++j) {
    const int lo = (qs[j] & 15) | (((qh >> j) & 1) << 4), hi = (qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
    out[j] = d * (float)lo + m;
    out[j + 16] = d * (float)hi + m;
  }
}
// Q8_0: d, qs[32] int8. x = q*d
template <> inline void decode<Q8_0>(const uint8_t* b, float* out) {
  const float d = h2f(b); const int8_t* qs = (const int8_t*)(b + 2);
  #pragma omp simd
  for (int j = 0; j < 32; ++j) out[j] = (float)qs[j] * d;
}
// Q2_K: scales[16] (lo nibble scale, hi min), qs[64], d, dmin. Element 128h + 32k + l is
// (qs[32h + l] >> 2k) & 3, sub-block of 16 s = e/16. x = (d*sc)*q - (dmin*m)
template <> inline void decode<Q2_K>(const uint8_t* b, float* out) {
  const uint8_t* sc = b; const uint8_t* qs = b + 16;
  const float d = h2f(b + 80), dmin = h2f(b + 82);
  for (int h = 0; h < 2; ++h)
    for (int k = 0; k < 4; ++k)
      for (int hf = 0; hf < 2; ++hf) {
        const int s = 8 * h + 2 * k + hf;
        const float dl = d * (float)(sc[s] & 15), ml = dmin * (float)(sc[s] >> 4);
        const uint8_t* q = qs + 32 * h + 16 * hf;
        float* o = out + 128 * h + 32 * k + 16 * hf;
        #pragma omp simd
        for (int l = 0; l < 16; ++l) o[l] = dl * (float)((q[l] >> (2 * k)) & 3) - ml;
      }
}
// Q3_K: hmask[32], qs[64], scales[12] (16 six-bit, signed - 32), d. Low 2 bits as Q2_K;
// bit 2 of element e is (hmask[e % 32] >> (e / 32)) & 1, and q = low - 4 when it is 0.
template <> inline void decode<Q3_K>(const uint8_t* b, float* out) {
  const uint8_t* hm = b; const uint8_t* qs = b + 32; const uint8_t* s12 = b + 96;
  const float d = h2f(b + 108);
  for (int h = 0; h < 2; ++h)
    for (int k = 0; k < 4; ++k)
      for (int hf = 0; hf < 2; ++hf) {
        const int s = 8 * h + 2 * k + hf;
        const int lo = s < 8 ? (s12[s] & 15) : (s12[s - 8] >> 4);
        const int hi = (s12[8 + (s & 3)] >> (2 * (s >> 2))) & 3;
        const float dl = d * (float)((int)(int8_t)(uint8_t)(lo | (hi << 4)) - 32);
        const uint8_t* q = qs + 32 * h + 16 * hf;
        const uint8_t* m = hm + 16 * hf;
        const int shift = 4 * h + k;
        float* o = out + 128 * h + 32 * k + 16 * hf;
        #pragma omp simd
        for (int l = 0; l < 16; ++l) {
          const int v = ((q[l] >> (2 * k)) & 3) - (((m[l] >> shift) & 1) ? 0 : 4);
          o[l] = dl * (float)v;
        }
      }
}
// Q4_K / Q5_K: d, dmin, scales[12] (8 six-bit scales and mins), [qh[32]], qs[128].
// Element 64c + 32h + l is (qs[32c + l] >> 4h) & 15 (| bit (2c+h) of qh[l] << 4 for Q5_K).
static inline void scale_min_k4(const uint8_t* s, int j, int& sc, int& mn) {
  if (j < 4) { sc = s[j] & 63; mn = s[j + 4] & 63; }
  else { sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4); mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4); }
}
template <bool FIVE> static inline void decode_q45k(const uint8_t* b, float* out) {
  const float d = h2f(b), dmin = h2f(b + 2);
  const uint8_t* s = b + 4; const uint8_t* qh = b + 16; const uint8_t* qs = b + (FIVE ? 48 : 16);
  for (int c = 0; c < 4; ++c)
    for (int h = 0; h < 2; ++h) {
      int sc, mn; scale_min_k4(s, 2 * c + h, sc, mn);
      const float dl = d * (float)sc, ml = dmin * (float)mn;
      const uint8_t* q = qs + 32 * c;
      float* o = out + 64 * c + 32 * h;
      const int sh = 4 * h, hb = 2 * c + h;
      #pragma omp simd
      for (int l = 0; l < 32; ++l) {
        int v = (q[l] >> sh) & 15;
        if (FIVE) v |= ((qh[l] >> hb) & 1) << 4;
        o[l] = dl * (float)v - ml;
      }
    }
}
template <> inline void decode<Q4_K>(const uint8_t* b, float* out) { decode_q45k<false>(b, out); }
template <> inline void decode<Q5_K>(const uint8_t* b, float* out) { decode_q45k<true>(b, out); }
// Q6_K: ql[128], qh[64], scales[16] int8, d. In half h, quarter k, lane l (e = 128h+32k+l):
// low 4 bits (ql[64h + 32(k%2) + l] >> 4(k/2)) & 15, high 2 bits (qh[32h + l] >> 2k) & 3.
template <> inline void decode<Q6_K>(const uint8_t* b, float* out) {
  const uint8_t* ql = b; const uint8_t* qh = b + 128; const int8_t* sc = (const int8_t*)(b + 192);
  const float d = h2f(b + 208);
  for (int h = 0; h < 2; ++h)
    for (int k = 0; k < 4; ++k)
      for (int hf = 0; hf < 2; ++hf) {
        const float dl = d * (float)sc[8 * h + 2 * k + hf];
        const uint8_t* lq = ql + 64 * h + 32 * (k & 1) + 16 * hf;
        const uint8_t* hq = qh + 32 * h + 16 * hf;
        const int ls = 4 * (k >> 1), hs = 2 * k;
        float* o = out + 128 * h + 32 * k + 16 * hf;
        #pragma omp simd
        for (int l = 0; l < 16; ++l) {
          const int v = (((lq[l] >> ls) & 15) | (((hq[l] >> hs) & 3) << 4)) - 32;
          o[l] = dl * (float)v;
        }
      }
}

// ---------------------------------------------------------------- kernels
template <int T>
static void fused_impl(const float* x, const uint8_t* w, float* y, int64_t M, int64_t N, int64_t K) {
  constexpr int QK = Traits<T>::QK, TS = Traits<T>::TS;
  const int64_t nb = K / QK, rb = nb * TS;
  #pragma omp parallel if(N * K * M >= PAR_MIN_WORK)
  {
    alignas(64) float c[QK];
    alignas(64) float acc[MB][32];
    #pragma omp for schedule(static)
    for (int64_t n = 0; n < N; ++n) {
      const uint8_t* row = w + n * rb;
      for (int64_t m0 = 0; m0 < M; m0 += MB) {
        const int64_t mb = std::min<int64_t>(MB, M - m0);
        for (int64_t m = 0; m < mb; ++m) std::fill(acc[m], acc[m] + 32, 0.f);
        for (int64_t ib = 0; ib < nb; ++ib) {
          decode<T>(row + ib * TS, c);
          for (int64_t m = 0; m < mb; ++m) {
            const float* xb = x + (m0 + m) * K + ib * QK;
            float* a = acc[m];
            for (int j0 = 0; j0 < QK; j0 += 32) {
              #pragma omp simd aligned(a : 64)
              for (int j = 0; j < 32; ++j) a[j] = __builtin_fmaf(xb[j0 + j], c[j0 + j], a[j]);
            }
          }
        }
        for (int64_t m = 0; m < mb; ++m) {
          float s = 0.f;
          for (int j = 0; j < 32; ++j) s += acc[m][j];
          y[(m0 + m) * N + n] = s;
        }
      }
    }
  }
}

template <int T>
static void dequant_impl(const uint8_t* w, float* out, int64_t N, int64_t K) {
  constexpr int QK = Traits<T>::QK, TS = Traits<T>::TS;
  const int64_t nb = K / QK;
  #pragma omp parallel for schedule(static) if(N * K >= PAR_MIN_WORK)
  for (int64_t i = 0; i < N * nb; ++i) decode<T>(w + i * TS, out + i * QK);
}

#define DISPATCH(F, ...) switch (type) { \
  case Q4_0: F<Q4_0>(__VA_ARGS__); break; case Q4_1: F<Q4_1>(__VA_ARGS__); break; \
  case Q5_0: F<Q5_0>(__VA_ARGS__); break; case Q5_1: F<Q5_1>(__VA_ARGS__); break; \
  case Q8_0: F<Q8_0>(__VA_ARGS__); break; case Q2_K: F<Q2_K>(__VA_ARGS__); break; \
  case Q3_K: F<Q3_K>(__VA_ARGS__); break; case Q4_K: F<Q4_K>(__VA_ARGS__); break; \
  case Q5_K: F<Q5_K>(__VA_ARGS__); break; case Q6_K: F<Q6_K>(__VA_ARGS__); break; \
  default: TORCH_CHECK(false, "unknown ggml type id ", type); }

torch::Tensor gguf_linear(torch::Tensor x, torch::Tensor w, int64_t type, int64_t N) {
  // x [M, K] float32, w uint8 raw GGUF rows (N * row_bytes bytes) -> y [M, N] float32
  x = x.contiguous(); w = w.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  auto y = torch::empty({M, N}, x.options());
  DISPATCH(fused_impl, x.data_ptr<float>(), w.data_ptr<uint8_t>(), y.data_ptr<float>(), M, N, K)
  return y;
}

torch::Tensor gguf_dequantize(torch::Tensor w, int64_t type, int64_t N, int64_t K) {
  // w uint8 raw GGUF rows -> float32 [N, K], bit-identical to formats.gguf.dequantize_gguf
  w = w.contiguous();
  auto out = torch::empty({N, K}, torch::dtype(torch::kFloat32));
  DISPATCH(dequant_impl, w.data_ptr<uint8_t>(), out.data_ptr<float>(), N, K)
  return out;
}
"""

_FUNCS = ["gguf_linear", "gguf_dequantize"]
_FLAGS = ["-ffp-contract=off"]  # decoders must not fuse d*q + m into one rounding


def _mod():
    return load_cpp("lessmem_gguf_linear", _SOURCE, _FUNCS, _FLAGS)


def available() -> bool:
    """True when the C++ kernel compiled (else the float64 reference twin is used)."""
    return _mod() is not None


def _check(raw: torch.Tensor, qtype, out_features: int, in_features: int):
    """Validate the raw block tensor against [N, K] in ``qtype``; returns the GGUFType."""
    t = gguf_type(qtype)  # ValueError naming the allowed types
    n, k = int(out_features), int(in_features)
    if k <= 0 or k % t.block_size:
        raise ValueError(f"in_features={k} must be a positive multiple of the {t.name.upper()} "
                         f"block size {t.block_size}")
    if n <= 0:
        raise ValueError(f"out_features={n} must be positive")
    if not isinstance(raw, torch.Tensor) or raw.dtype != torch.uint8:
        raise ValueError(f"raw GGUF blocks must be a uint8 torch.Tensor, got "
                         f"{getattr(raw, 'dtype', type(raw).__name__)}")
    want = n * (k // t.block_size) * t.type_size
    if raw.numel() != want:
        raise ValueError(f"raw holds {raw.numel()} bytes but [{n}, {k}] in {t.name.upper()} needs "
                         f"{want} ({k // t.block_size} blocks of {t.type_size} bytes per row)")
    return t


def gguf_linear(x: torch.Tensor, raw: torch.Tensor, qtype, out_features: int) -> torch.Tensor:
    """``x [..., K] @ W_hat.T`` (float32 ``[..., N]``) with ``W`` as raw GGUF rows ``[N, row_bytes]``."""
    k = x.shape[-1]
    t = _check(raw, qtype, out_features, k)
    x2 = x.reshape(-1, k).float().contiguous()
    m = _mod()
    if m is None:
        y = ref.gguf_linear_ref(x2, raw, t, out_features)
    else:
        y = m.gguf_linear(x2, raw, t.ggml_id, int(out_features))
    return y.view(*x.shape[:-1], int(out_features))


def gguf_dequantize(raw: torch.Tensor, qtype, out_features: int, in_features: int) -> torch.Tensor:
    """float32 ``W_hat [N, K]``, bit-identical to ``formats.gguf.dequantize_gguf``."""
    t = _check(raw, qtype, out_features, in_features)
    m = _mod()
    if m is None:
        return ref.gguf_weight_ref(raw, t, out_features)
    return m.gguf_dequantize(raw, t.ggml_id, int(out_features), int(in_features))
