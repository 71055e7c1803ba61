// Argument checks whose messages are built without iostreams, and the one prefetch helper the
// kernels share. Prepended to every C++ source by lessmem/kernels/_build.py (load_cpp_file),
// so each .cpp uses LM_CHECK / LM_CHECK_VALUE instead of TORCH_CHECK / TORCH_CHECK_VALUE with
// message parts.
//
// Why: TORCH_CHECK formats its message parts through an std::ostringstream compiled into
// this extension. Where the extension carries its own copy of libstdc++'s stream code (seen
// on a CUDA image with Ubuntu's GCC 13.3 and torch 2.11; reproduced here by linking with
// -static-libstdc++), inserting a number uses a locale facet that copy never registered: the
// number is silently dropped, or the process segfaults, so a bad argument killed the process
// instead of raising a ValueError. Numbers here go through std::to_string (vsnprintf), and
// torch only ever receives the finished text as one C string.
#pragma once
#include <torch/extension.h>
#include <string>
#include <type_traits>

namespace lm_check {
inline void put(std::string& s, const char* v) { s += v; }
inline void put(std::string& s, const std::string& v) { s += v; }
inline void put(std::string& s, char v) { s += v; }
inline void put(std::string& s, bool v) { s += v ? "true" : "false"; }
inline void put(std::string& s, c10::ScalarType v) { s += c10::toString(v); }
inline void put(std::string& s, c10::IntArrayRef v) {
  s += '[';
  for (size_t i = 0; i < v.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(v[i]);
  }
  s += ']';
}
template <typename T, std::enable_if_t<std::is_arithmetic_v<T>, int> = 0>
inline void put(std::string& s, T v) { s += std::to_string(v); }
template <typename... A>
inline std::string msg(const A&... a) {
  std::string s;
  (put(s, a), ...);
  return s;
}
}  // namespace lm_check

// As TORCH_CHECK / TORCH_CHECK_VALUE (RuntimeError / ValueError), the parts joined above; the
// message is built only when the check fails.
#define LM_CHECK(cond, ...) TORCH_CHECK(cond, ::lm_check::msg(__VA_ARGS__).c_str())
#define LM_CHECK_VALUE(cond, ...) TORCH_CHECK_VALUE(cond, ::lm_check::msg(__VA_ARGS__).c_str())

// Ask for the cache lines of [p, p + bytes) (a hint: nothing is faulted in, an address past an
// allocation is harmless). Data a kernel streams once (a decode step's weight rows, a KV
// history) otherwise arrives only when the core waits for it.
inline void lm_prefetch(const void* p, int64_t bytes) {
#if defined(__GNUC__)
  for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(static_cast<const char*>(p) + o, 0, 3);
#else
  (void)p; (void)bytes;
#endif
}
// The row ~4 KB after ``row`` (rows of rb bytes), asked for while ``row`` is computed: the
// distance the GEMV kernels use (4 and 8 KB measured alike; 1 KB was slower).
inline void lm_prefetch_row_ahead(const void* row, int64_t rb) {
  lm_prefetch(static_cast<const char*>(row) + (4096 / rb + 1) * rb, rb);
}
