// The affine KV quantizer of lessmem/kvcache/codec.py (_affine: formats "uint" and "int" at
// one bit width) as one loop over a grouped view's rows, for the CPU: a prefill chunk's or a
// flushed block's keys and values. It computes, row by row, the same float32 operations as
// formats/integer.py's choose_qparams + quantize_grouped (fp16 scales, rounded up for the
// asymmetric format; round half to even), so the codes, scales and zero points are equal bit
// for bit to the torch path's (tested), without its dozen tensor passes.
#include <torch/extension.h>
#include <c10/util/Half.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr float kTiny = 6.2e-5f;   // formats.integer._TINY[float16]
constexpr float kHalfMax = 65504.f;

// _store: a positive scale as float16 (round_up: the smallest float16 >= s)
inline c10::Half store_scale(float s, bool round_up) {
  s = s > 0.f ? s : 1.f;
  s = std::min(std::max(s, kTiny), kHalfMax);
  c10::Half h(s);
  if (round_up && static_cast<float>(h) < s && static_cast<float>(h) < kHalfMax) {
    uint16_t b;
    std::memcpy(&b, &h, 2);
    ++b;  // positive: the next float16 up
    std::memcpy(&h, &b, 2);
  }
  return h;
}

}  // namespace

// xg [G, E] float32 (contiguous, CPU) -> {codes uint8 [G, E], scale float16 [G], zero point
// uint8 [G] (empty when symmetric)}
std::vector<torch::Tensor> affine_codes(torch::Tensor xg, int64_t bits, bool symmetric, double clip_ratio) {
  LM_CHECK(xg.dim() == 2 && xg.scalar_type() == torch::kFloat && xg.is_contiguous() && xg.is_cpu(),
           "affine_codes: xg must be a contiguous float32 CPU tensor [G, E]");
  LM_CHECK(bits >= 1 && bits <= 8, "affine_codes: bits ", bits, " not in 1..8");
  const int64_t G = xg.size(0), E = xg.size(1);
  auto codes = torch::empty({G, E}, torch::dtype(torch::kUInt8));
  auto scale = torch::empty({G}, torch::dtype(torch::kHalf));
  auto zp = torch::empty({symmetric ? 0 : G}, torch::dtype(torch::kUInt8));
  const float* xp = xg.data_ptr<float>();
  uint8_t* cp = codes.data_ptr<uint8_t>();
  c10::Half* sp = scale.data_ptr<c10::Half>();
  uint8_t* zpp = symmetric ? nullptr : zp.data_ptr<uint8_t>();
  const float clip = (float)clip_ratio;
#pragma omp parallel for schedule(static) if (G * E >= 65536)
  for (int64_t g = 0; g < G; ++g) {
    const float* x = xp + g * E;
    uint8_t* c = cp + g * E;
    if (symmetric) {
      const float qmax = (float)((1 << (bits - 1)) - 1), off = (float)(1 << (bits - 1));
      float amax = 0.f;
      for (int64_t i = 0; i < E; ++i) amax = std::max(amax, std::fabs(x[i]));
      const c10::Half h = store_scale(amax * clip / qmax, false);
      const float s = static_cast<float>(h);
      sp[g] = h;
      for (int64_t i = 0; i < E; ++i) {
        const float q = std::min(std::max(std::nearbyint(x[i] / s), -qmax), qmax);
        c[i] = (uint8_t)(q + off);
      }
    } else {
      const float qmax = (float)((1 << bits) - 1);
      float lo = x[0], hi = x[0];
      for (int64_t i = 1; i < E; ++i) { lo = std::min(lo, x[i]); hi = std::max(hi, x[i]); }
      lo = std::min(lo, 0.f) * clip;
      hi = std::max(hi, 0.f) * clip;
      const c10::Half h = store_scale((hi - lo) / qmax, true);
      const float s = static_cast<float>(h);
      sp[g] = h;
      const float z = std::min(std::max(std::nearbyint(-lo / s), 0.f), qmax);
      zpp[g] = (uint8_t)z;
      for (int64_t i = 0; i < E; ++i) {
        const float u = std::min(std::max(std::nearbyint(x[i] / s) + z, 0.f), qmax);
        c[i] = (uint8_t)u;
      }
    }
  }
  return {codes, scale, zp};
}
