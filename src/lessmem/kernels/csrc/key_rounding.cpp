// Keys rounded for the scores (lessmem/kvcache/key_rounding.py says what and why; its torch
// loop is the twin this file is tested against). Each token row of a KV head is independent:
// its channels are rounded in order and each error is fed into the channels after it.
#include <torch/extension.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

// w: [B, H, T, D] float32 keys; s, z: [B, H, T/tg, D] float32, each tg-token group's scale
// and zero point per channel; coef: [H, D, D] float32, coef[h][j][k] = U_jk / U_jj; returns
// the codes [B, H, T, D] uint8.
torch::Tensor round_keys_rows(torch::Tensor w, torch::Tensor s, torch::Tensor z, torch::Tensor coef,
                              double qmax) {
  LM_CHECK(w.dim() == 4 && w.scalar_type() == torch::kFloat && w.is_contiguous() && w.is_cpu(),
           "round_keys_rows: w must be a contiguous float32 CPU tensor [B, H, T, D]");
  const int64_t B = w.size(0), H = w.size(1), T = w.size(2), D = w.size(3);
  LM_CHECK(s.dim() == 4 && s.sizes() == z.sizes() && s.size(0) == B && s.size(1) == H && s.size(3) == D &&
           s.size(2) > 0 && T % s.size(2) == 0 && s.is_contiguous() && z.is_contiguous() &&
           s.scalar_type() == torch::kFloat && z.scalar_type() == torch::kFloat,
           "round_keys_rows: s and z must be contiguous float32 [B, H, T/tg, D]");
  LM_CHECK(coef.dim() == 3 && coef.size(0) == H && coef.size(1) == D && coef.size(2) == D &&
           coef.scalar_type() == torch::kFloat && coef.is_contiguous(),
           "round_keys_rows: coef must be contiguous float32 [H, D, D]");
  const int64_t G = s.size(2), tg = T / G;
  auto codes = torch::empty({B, H, T, D}, w.options().dtype(torch::kUInt8));
  const float* wp = w.data_ptr<float>(); const float* sp = s.data_ptr<float>();
  const float* zp = z.data_ptr<float>(); const float* cp = coef.data_ptr<float>();
  uint8_t* out = codes.data_ptr<uint8_t>();
  const float qm = (float)qmax;
  const int64_t rows = B * H * T;
#pragma omp parallel
  {
    std::vector<float> x(D);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t bh = r / T, h = bh % H, o = r * D, g = (bh * G + (r % T) / tg) * D;
      const float* c = cp + h * D * D; const float* sg = sp + g; const float* zg = zp + g;
      for (int64_t d = 0; d < D; ++d) x[d] = wp[o + d];
      for (int64_t j = 0; j < D; ++j) {
        const float q = std::min(std::max(std::nearbyint(x[j] / sg[j]) + zg[j], 0.f), qm);
        out[o + j] = (uint8_t)q;
        const float e = x[j] - (q - zg[j]) * sg[j];
        const float* cj = c + j * D;
#pragma omp simd
        for (int64_t k = j + 1; k < D; ++k) x[k] -= e * cj[k];
      }
    }
  }
  return codes;
}
