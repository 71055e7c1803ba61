// The affine KV quantizer of lessmem/kvcache/codec.py (_affine: formats "uint" and "int" at
// one bit width) as one loop over a grouped view's rows, for the CPU: a prefill chunk's or a
// flushed block's keys and values. It computes, row by row, the same float32 operations as
// formats/integer.py's choose_qparams + quantize_grouped (fp16 scales, rounded up for the
// asymmetric format; round half to even), so the codes, scales and zero points are equal bit
// for bit to the torch path's (tested), without its dozen tensor passes.
#include <torch/extension.h>
#include <c10/util/BFloat16.h>
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

// One decode token per cache layer written into the room after its window (a serving step's
// appends, kvcache.layer.append_rows): token b of k / v (float32 [B, H, 1, D], rows of D
// contiguous) goes to position at[b] of dk[b] / dv[b] ([1, H, capacity, D] buffers, float32,
// float16 or bfloat16, rows of D contiguous), converted as Tensor.copy_ converts (round to
// nearest even). One call where the step made two views and two copy_ calls a layer and row.
namespace {
template <typename T>
void put_row(const float* src, int64_t src_h, uint8_t* dst, int64_t H, int64_t D, int64_t sh, int64_t st,
             int64_t at) {
  for (int64_t h = 0; h < H; ++h) {
    T* d = reinterpret_cast<T*>(dst) + h * sh + at * st;
    const float* s = src + h * src_h;
    for (int64_t i = 0; i < D; ++i) d[i] = static_cast<T>(s[i]);
  }
}

void put(const torch::Tensor& buf, const float* src, int64_t src_h, int64_t at) {
  const int64_t H = buf.size(1), D = buf.size(3), sh = buf.stride(1), st = buf.stride(2);
  auto* dst = static_cast<uint8_t*>(buf.data_ptr());
  switch (buf.scalar_type()) {
    case torch::kFloat32: put_row<float>(src, src_h, dst, H, D, sh, st, at); break;
    case torch::kFloat16: put_row<c10::Half>(src, src_h, dst, H, D, sh, st, at); break;
    default: put_row<c10::BFloat16>(src, src_h, dst, H, D, sh, st, at); break;
  }
}
}  // namespace

void write_rows(std::vector<torch::Tensor> dk, std::vector<torch::Tensor> dv, std::vector<int64_t> at,
                torch::Tensor k, torch::Tensor v) {
  LM_CHECK_VALUE(k.scalar_type() == torch::kFloat32 && v.scalar_type() == torch::kFloat32 && k.dim() == 4
                 && k.sizes() == v.sizes() && k.size(2) == 1 && k.is_cpu() && v.is_cpu() && k.stride(3) == 1
                 && v.stride(3) == 1, "write_rows: k and v must be float32 [B, H, 1, D] on the CPU with rows of "
                 "D contiguous");
  const int64_t B = k.size(0), H = k.size(1), D = k.size(3);
  LM_CHECK_VALUE((int64_t)dk.size() == B && (int64_t)dv.size() == B && (int64_t)at.size() == B,
                 "write_rows: one key buffer, value buffer and position per row of k");
  for (int64_t b = 0; b < B; ++b) {
    for (const auto* t : {&dk[b], &dv[b]}) {
      const auto st = t->scalar_type();
      LM_CHECK_VALUE(t->is_cpu() && t->dim() == 4 && t->size(0) == 1 && t->size(1) == H && t->size(3) == D
                     && t->stride(3) == 1 && at[b] >= 0 && at[b] < t->size(2)
                     && (st == torch::kFloat32 || st == torch::kFloat16 || st == torch::kBFloat16),
                     "write_rows: buffer ", b, " must be a CPU float32/float16/bfloat16 [1, H, capacity, D] "
                     "with rows of D contiguous and position ", at[b], " inside it");
    }
  }
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  for (int64_t b = 0; b < B; ++b) {
    put(dk[b], kp + b * k.stride(0), k.stride(1), at[b]);
    put(dv[b], vp + b * v.stride(0), v.stride(1), at[b]);
  }
}
