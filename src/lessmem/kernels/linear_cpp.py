"""Fused CPU dequant-matmul kernels in C++ (built once by ``_build.load_cpp``).

Three kernels, each parallel over output rows with OpenMP and a vectorizable inner loop;
the weight row is expanded to float in a thread-local buffer of one row (``K`` floats,
in L1/L2), never written back as a float matrix:

- ``int8_linear``   y[m, n] = s[n] · Σ_k x[m, k] · w[n, k]                  (w int8)
- ``w8a8_linear``   y[m, n] = sx[m] · s[n] · Σ_k xq[m, k] · w[n, k]         (int32 sums)
- ``lowbit_linear`` y[m, n] = Σ_g s[n, g] · (Σ_{k∈g} x[m, k] · u[n, k] − z[n, g] · Σ_{k∈g} x[m, k])
                    with u the unsigned 2/3/4-bit codes packed by ``formats.packing.pack_bits``
                    row-major (row n starts at byte n·K·bits/8), z the zero point in code units.

When no compiler is available each function falls back to the pure-torch twin in
``linear_reference`` (same math, slower).

Example:
    >>> import torch
    >>> from lessmem.kernels.linear_cpp import int8_linear
    >>> w = torch.randint(-127, 128, (16, 64), dtype=torch.int8)
    >>> s = torch.rand(16) / 100
    >>> x = torch.randn(1, 64)
    >>> ref = x @ (w.float() * s[:, None]).T
    >>> bool(torch.allclose(int8_linear(x, w, s), ref, atol=1e-4))
    True
"""

from __future__ import annotations

import torch

from . import linear_reference as ref
from ._build import load_cpp

_SOURCE = r"""
#include <torch/extension.h>
#include <vector>
#include <cstdint>

// Small layers run on one thread: a parallel region's wake-up and barrier cost more than
// the work below ~4M weights (and much more on a machine shared with other jobs).
#define PAR_MIN_WORK 4194304

static inline float dotf(const float* a, const float* b, int64_t n) {
  float acc = 0.f;
  #pragma omp simd reduction(+:acc)
  for (int64_t k = 0; k < n; ++k) acc += a[k] * b[k];
  return acc;
}

torch::Tensor int8_linear(torch::Tensor x, torch::Tensor w, torch::Tensor scale) {
  // x [M, K] float32, w [N, K] int8, scale [N] float32 -> y [M, N]
  x = x.contiguous(); w = w.contiguous(); scale = scale.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const int8_t* wp = w.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const bool par = N * K * M >= PAR_MIN_WORK;
  if (M == 1) {
    #pragma omp parallel for schedule(static) if(par)
    for (int64_t n = 0; n < N; ++n) {
      const int8_t* wr = wp + n * K;
      float acc = 0.f;
      #pragma omp simd reduction(+:acc)
      for (int64_t k = 0; k < K; ++k) acc += xp[k] * (float)wr[k];
      yp[n] = acc * sp[n];
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
      for (int64_t m = 0; m < M; ++m) yp[m * N + n] = dotf(xp + m * K, buf.data(), K) * sp[n];
    }
  }
  return y;
}

torch::Tensor w8a8_linear(torch::Tensor xq, torch::Tensor sx, torch::Tensor w, torch::Tensor scale) {
  // xq [M, K] int8, sx [M] float32, w [N, K] int8, scale [N] float32 -> y [M, N] float32
  xq = xq.contiguous(); w = w.contiguous(); sx = sx.contiguous(); scale = scale.contiguous();
  const int64_t M = xq.size(0), K = xq.size(1), N = w.size(0);
  auto y = torch::empty({M, N}, sx.options());
  const int8_t* xp = xq.data_ptr<int8_t>();
  const int8_t* wp = w.data_ptr<int8_t>();
  const float* sxp = sx.data_ptr<float>();
  const float* sp = scale.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  #pragma omp parallel for schedule(static) if(N * K * M >= PAR_MIN_WORK)
  for (int64_t n = 0; n < N; ++n) {
    const int8_t* wr = wp + n * K;
    for (int64_t m = 0; m < M; ++m) {
      const int8_t* xr = xp + m * K;
      int32_t acc = 0;
      #pragma omp simd reduction(+:acc)
      for (int64_t k = 0; k < K; ++k) acc += (int32_t)xr[k] * (int32_t)wr[k];
      yp[m * N + n] = (float)acc * sxp[m] * sp[n];
    }
  }
  return y;
}

// Codes of a row are split by phase so the inner loops need no interleaving: for 4 bits,
// byte j holds codes 2j (low nibble) and 2j+1 (high); with xp[p][j] = x[P*j + p] the dot
// is sum_j sum_p xp[p][j] * ((b[j] >> BITS*p) & mask), one contiguous, vectorizable loop.
// 3 bits: 8 codes in 3 bytes (a 24-bit word per j), phases p = 0..7.
template <int BITS>
static void lowbit_impl(const float* x, const uint8_t* cp, const float* sp, const float* zp,
                        const float* xsum, float* yp, int64_t M, int64_t N, int64_t K, int64_t gs) {
  constexpr int P = (BITS == 3) ? 8 : 8 / BITS;        // codes per unit
  constexpr int UB = (BITS == 3) ? 3 : 1;              // bytes per unit
  constexpr uint32_t MASK = (1u << BITS) - 1;
  const int64_t G = K / gs, JG = gs / P, row_bytes = K * BITS / 8;
  std::vector<float> xg((size_t)M * K);               // x permuted the same way, per group
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < G; ++g)
      for (int64_t jj = 0; jj < JG; ++jj)
        for (int p = 0; p < P; ++p) xg[m * K + g * gs + p * JG + jj] = x[m * K + g * gs + jj * P + p];
  #pragma omp parallel if(N * K * M >= PAR_MIN_WORK)
  {
    std::vector<float> buf(K);                          // one row's codes as floats, phase-major per group
    std::vector<uint32_t> wv(JG);
    #pragma omp for schedule(static)
    for (int64_t n = 0; n < N; ++n) {
      const uint8_t* b = cp + n * row_bytes;
      const float* s = sp + n * G;
      const float* z = zp + n * G;
      for (int64_t g = 0; g < G; ++g) {                 // unpack: buf[g*gs + p*JG + jj] = code(P*(g*JG+jj) + p)
        const uint8_t* bg = b + g * JG * UB;
        float* dst = buf.data() + g * gs;
        if (BITS == 3) {
          for (int64_t jj = 0; jj < JG; ++jj)
            wv[jj] = (uint32_t)bg[3 * jj] | ((uint32_t)bg[3 * jj + 1] << 8) | ((uint32_t)bg[3 * jj + 2] << 16);
          for (int p = 0; p < P; ++p) {
            #pragma omp simd
            for (int64_t jj = 0; jj < JG; ++jj) dst[p * JG + jj] = (float)((wv[jj] >> (BITS * p)) & MASK);
          }
        } else {
          for (int p = 0; p < P; ++p) {
            #pragma omp simd
            for (int64_t jj = 0; jj < JG; ++jj) dst[p * JG + jj] = (float)((bg[jj] >> (BITS * p)) & MASK);
          }
        }
      }
      for (int64_t m = 0; m < M; ++m) {
        const float* xm = xg.data() + m * K;
        float acc = 0.f;
        for (int64_t g = 0; g < G; ++g)
          acc += s[g] * (dotf(xm + g * gs, buf.data() + g * gs, gs) - z[g] * xsum[m * G + g]);
        yp[m * N + n] = acc;
      }
    }
  }
  (void)UB;
}

torch::Tensor lowbit_linear(torch::Tensor x, torch::Tensor codes, int64_t bits, torch::Tensor scale,
                            torch::Tensor zero, int64_t group_size) {
  // x [M, K] float32, codes packed uint8 (N*K*bits/8), scale/zero [N, K/group_size] float32
  x = x.contiguous(); codes = codes.contiguous(); scale = scale.contiguous(); zero = zero.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = scale.size(0);
  auto xsum = x.view({M, K / group_size, group_size}).sum(-1).contiguous();  // [M, G]
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  if (bits == 2) lowbit_impl<2>(xp, cp, scale.data_ptr<float>(), zero.data_ptr<float>(), xsum.data_ptr<float>(), y.data_ptr<float>(), M, N, K, group_size);
  else if (bits == 3) lowbit_impl<3>(xp, cp, scale.data_ptr<float>(), zero.data_ptr<float>(), xsum.data_ptr<float>(), y.data_ptr<float>(), M, N, K, group_size);
  else lowbit_impl<4>(xp, cp, scale.data_ptr<float>(), zero.data_ptr<float>(), xsum.data_ptr<float>(), y.data_ptr<float>(), M, N, K, group_size);
  return y;
}
"""

_FUNCS = ["int8_linear", "w8a8_linear", "lowbit_linear"]


def _mod():
    return load_cpp("lessmem_linear", _SOURCE, _FUNCS)


def available() -> bool:
    """True when the C++ kernels compiled (else the torch twins are used)."""
    return _mod() is not None


def _2d(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1]).float().contiguous()


def int8_linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x [..., K] @ (scale[:, None] · w).T`` with w int8 [N, K], scale [N] (fp32 out)."""
    m = _mod()
    x2 = _2d(x)
    if m is None:
        y = ref.int8_linear_ref(x2, w, scale)
    else:
        y = m.int8_linear(x2, w, scale.float())
    return y.view(*x.shape[:-1], w.shape[0])


def w8a8_linear(xq: torch.Tensor, sx: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``(sx · xq) @ (scale · w).T`` for int8 xq [M, K], sx [M], w [N, K], scale [N]."""
    m = _mod()
    if m is None:
        return ref.w8a8_linear_ref(xq, sx, w, scale)
    return m.w8a8_linear(xq, sx.float(), w, scale.float())


def lowbit_linear(x: torch.Tensor, codes: torch.Tensor, bits: int, scale: torch.Tensor,
                  zero: torch.Tensor, group_size: int) -> torch.Tensor:
    """Group-wise 2/3/4-bit dequant-matmul (see the module doc for the formula)."""
    if bits not in (2, 3, 4):
        raise ValueError(f"lowbit_linear bits={bits!r}; allowed: 2, 3, 4")
    n, k = scale.shape[0], x.shape[-1]
    if k % group_size or k % 8:
        raise ValueError(f"in_features={k} must be a multiple of group_size={group_size} and of 8")
    m = _mod()
    x2 = _2d(x)
    if m is None:
        y = ref.lowbit_linear_ref(x2, codes, bits, scale, zero, group_size)
    else:
        y = m.lowbit_linear(x2, codes, bits, scale.float(), zero.float(), group_size)
    return y.view(*x.shape[:-1], n)
