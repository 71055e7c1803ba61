"""Batched, GIL-free reads of block files (the disk tier's hot path while decoding).

A tiered cache reads every offloaded block of a layer at every decoding step (hundreds of
~50 KB files per step at 8k tokens). Done one file at a time in Python, each read takes
and drops the GIL several times (open, read, CRC, a tensor per part), and a prefetch
thread doing that slows the decoding thread's own Python down about as much as it saves.
``read_blocks`` does a whole batch in one C++ call with the GIL released: open, read into
one buffer reused across steps (no fresh memory to fault in), check the framing of
:mod:`lessmem.offload.serialize` (magic, lengths, CRC-32 over header and payload — by
carry-less multiplication, 3-4x zlib's speed — and that the header equals the one
expected for the key), then cut each part as a view of that buffer. A block that fails any check comes
back as None, and the caller reads it again through the checked Python path
(``DiskTier.get``), which reports the corruption or the miss. Without a compiler (or
``LESSMEM_NO_CPP=1``) ``available()`` is False and callers use the Python path.
"""

from __future__ import annotations

import torch

from ..kernels._build import load_cpp
from .serialize import HEADER_BYTES, MAGIC

_DTYPE_CODES = {torch.uint8: 0, torch.int8: 1, torch.int16: 2, torch.int32: 3, torch.int64: 4,
                torch.float16: 5, torch.bfloat16: 6, torch.float32: 7, torch.float64: 8, torch.bool: 9}

SOURCE = r"""
#include <torch/extension.h>
#include <zlib.h>
#include <fcntl.h>
#include <unistd.h>
#include <sys/stat.h>
#include <cstring>
#include <mutex>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <thread>
#if defined(__PCLMUL__) && defined(__SSE4_1__)
#include <immintrin.h>
#endif

namespace {
const c10::ScalarType kTypes[] = {at::kByte, at::kChar, at::kShort, at::kInt, at::kLong,
                                  at::kHalf, at::kBFloat16, at::kFloat, at::kDouble, at::kBool};
constexpr int64_t kFixed = FIXED_BYTES;  // magic (8) + hlen u32 + plen u64 + crc u32, little-endian

// zlib's CRC-32 (crc32_z(crc, p, n), same value), by carry-less multiplication where the CPU
// has it: four 128-bit lanes are folded forward over the data (x^544 and x^480 mod P, the
// reflected constants of the CRC-32 polynomial), then folded into one; the 128-bit
// remainder R has the same CRC register as everything before it, so zlib finishes R and
// the tail. 3-4x zlib's table method here (the disk tier checks every block it reads).
uint32_t crc32_of(uint32_t crc, const uint8_t* p, size_t n) {
  if (n == 0) return crc;  // zlib answers 0 for a null pointer
#if defined(__PCLMUL__) && defined(__SSE4_1__)
  if (n < 128) return crc32_z(crc, p, n);
  const __m128i k4 = _mm_set_epi64x(0x1c6e41596LL, 0x154442bd4LL);  // fold by 64 bytes
  const __m128i k1 = _mm_set_epi64x(0x0ccaa009eLL, 0x1751997d0LL);  // fold by 16 bytes
  auto load = [](const uint8_t* q) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(q)); };
  auto fold = [](__m128i x, __m128i k, __m128i d) {
    return _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(x, k, 0x00), _mm_clmulepi64_si128(x, k, 0x11)), d);
  };
  __m128i x0 = _mm_xor_si128(load(p), _mm_cvtsi32_si128((int)~crc)), x1 = load(p + 16),
          x2 = load(p + 32), x3 = load(p + 48);
  p += 64; n -= 64;
  for (; n >= 64; p += 64, n -= 64) {
    x0 = fold(x0, k4, load(p)); x1 = fold(x1, k4, load(p + 16));
    x2 = fold(x2, k4, load(p + 32)); x3 = fold(x3, k4, load(p + 48));
  }
  x0 = fold(fold(fold(x0, k1, x1), k1, x2), k1, x3);
  for (; n >= 16; p += 16, n -= 16) x0 = fold(x0, k1, load(p));
  uint8_t r[16];
  _mm_storeu_si128(reinterpret_cast<__m128i*>(r), x0);
  return crc32_z(crc32_z(0xFFFFFFFFu, r, 16), p, n);
#else
  return crc32_z(crc, p, n);
#endif
}

// Reused read buffers ("arenas"): one batch of files lands in one arena. An arena is free
// when nothing but this pool references it or its storage (no caller holds a part of a
// block read into it), so it is never overwritten under a reader. Reuse spares the
// allocation and the page faults of fresh memory at every decoding step.
std::mutex pool_mu;
std::vector<torch::Tensor> pool;
constexpr size_t kPoolMax = 3;  // the layer attending, the layer prefetched, one in between

bool is_free(const torch::Tensor& t) { return t.use_count() == 1 && t.storage().use_count() == 1; }

torch::Tensor arena(int64_t bytes) {
  std::lock_guard<std::mutex> lock(pool_mu);
  int best = -1, spare = -1;
  for (int i = 0; i < (int)pool.size(); ++i) {
    if (!is_free(pool[i])) continue;
    if (pool[i].numel() >= bytes && (best < 0 || pool[i].numel() < pool[best].numel())) best = i;
    if (spare < 0 || pool[i].numel() < pool[spare].numel()) spare = i;
  }
  if (best >= 0) return pool[best];
  auto t = torch::empty({bytes + bytes / 4}, torch::kUInt8);  // room to grow with the context
  if (pool.size() < kPoolMax) pool.push_back(t);
  else if (spare >= 0) pool[spare] = t;
  return t;
}

// The file into dst[0, size); false when it is missing, not ``size`` bytes, or unreadable.
bool read_file(const std::string& path, uint8_t* dst, int64_t size) {
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  struct stat st;
  bool ok = fstat(fd, &st) == 0 && st.st_size == size;
  int64_t got = 0;
  while (ok && got < size) {
    const ssize_t r = pread(fd, dst + got, size - got, got);
    if (r <= 0) break;
    got += r;
  }
  close(fd);
  return ok && got == size;
}

bool verify(const uint8_t* p, int64_t n, const std::string& header) {
  if (n < kFixed) return false;
  if (std::memcmp(p, "MAGIC_BYTES", 8) != 0) return false;
  uint32_t hlen, crc; uint64_t plen;
  std::memcpy(&hlen, p + 8, 4); std::memcpy(&plen, p + 12, 8); std::memcpy(&crc, p + 20, 4);
  if ((uint64_t)n != kFixed + (uint64_t)hlen + plen || hlen != header.size()) return false;
  if (std::memcmp(p + kFixed, header.data(), hlen) != 0) return false;
  return crc32_of(0, p + kFixed, (size_t)(hlen + plen)) == crc;
}
}  // namespace

// paths[i]: a block file of sizes[i] bytes whose header must equal headers[i]; parts[i]:
// (name, offset into the payload, bytes, dtype code, shape) of each tensor. Returns per
// file a dict name -> view of one arena holding the batch, or None when the file is
// missing, has another size, or fails a check.
pybind11::list read_blocks(
    std::vector<std::string> paths, std::vector<std::string> headers, std::vector<int64_t> sizes,
    std::vector<std::vector<std::tuple<std::string, int64_t, int64_t, int64_t, std::vector<int64_t>>>> parts,
    int64_t threads) {
  TORCH_CHECK(paths.size() == headers.size() && paths.size() == parts.size() && paths.size() == sizes.size(),
              "read_blocks: paths, headers, sizes and parts must have the same length");
  const size_t n = paths.size();
  std::vector<int64_t> starts(n);
  int64_t end = 0;
  for (size_t i = 0; i < n; ++i) {  // each payload 64-byte aligned, so parts view as their dtype
    TORCH_CHECK(sizes[i] >= 0, "read_blocks: negative size");
    const int64_t pad = (64 - (kFixed + (int64_t)headers[i].size()) % 64) % 64;
    starts[i] = (end + 63) / 64 * 64 + pad;
    end = starts[i] + sizes[i];
  }
  std::vector<char> ok(n, 0);
  torch::Tensor buf;
  {
    pybind11::gil_scoped_release no_gil;
    buf = arena(std::max<int64_t>(end, 1));
    uint8_t* base = buf.data_ptr<uint8_t>();
    const int nt = (int)std::max<int64_t>(1, std::min<int64_t>(threads, (int64_t)n));
#pragma omp parallel for schedule(dynamic, 1) num_threads(nt) if (nt > 1)
    for (int64_t i = 0; i < (int64_t)n; ++i)
      ok[i] = read_file(paths[i], base + starts[i], sizes[i]) && verify(base + starts[i], sizes[i], headers[i]);
  }
  pybind11::list out(n);
  for (size_t i = 0; i < n; ++i) {
    out[i] = pybind11::none();
    if (!ok[i]) continue;
    const int64_t start = starts[i] + kFixed + (int64_t)headers[i].size();
    const int64_t plen = starts[i] + sizes[i] - start;
    pybind11::dict views;
    bool good = true;
    for (const auto& [name, off, nbytes, code, shape] : parts[i]) {
      if (off < 0 || off + nbytes > plen || code < 0 || code > 9) { good = false; break; }
      const auto dt = kTypes[code];
      int64_t numel = 1;
      bool neg = false;
      for (auto d : shape) { neg |= d < 0; numel *= d; }
      if (neg || numel * (int64_t)c10::elementSize(dt) != nbytes) { good = false; break; }
      const int64_t esize = (int64_t)c10::elementSize(dt);
      if ((start + off) % esize) { good = false; break; }
      // a view of the arena's storage made directly (narrow + view + view cost ~2 us a part)
      auto v = at::detail::make_tensor<c10::TensorImpl>(c10::Storage(buf.storage()), buf.key_set(),
                                                        caffe2::TypeMeta::fromScalarType(dt));
      v.unsafeGetTensorImpl()->set_sizes_contiguous(shape);
      v.unsafeGetTensorImpl()->set_storage_offset((start + off) / esize);
      views[pybind11::str(name)] = pybind11::cast(std::move(v));
    }
    if (good) out[i] = std::move(views);
  }
  return out;
}

// Ask the OS to read these files into the page cache (posix_fadvise WILLNEED); returns
// how many files it could open.
int64_t advise_now(const std::vector<std::string>& paths) {
  int64_t n = 0;
  for (const auto& path : paths) {
    const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) continue;
    posix_fadvise(fd, 0, 0, POSIX_FADV_WILLNEED);
    close(fd);
    ++n;
  }
  return n;
}

int64_t advise(std::vector<std::string> paths) {
  pybind11::gil_scoped_release no_gil;
  return advise_now(paths);
}

// The same from one native worker thread, so a prefetch hint costs the decoding thread
// neither a Python thread nor the GIL. Tickets complete in order. The state is created
// per process (a forked child starts its own worker) and never destroyed (the worker may
// still wait on it while the interpreter exits).
struct Advisor {
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::pair<int64_t, std::vector<std::string>>> queue;
  int64_t issued = 0;
  std::atomic<int64_t> done{0};
};
std::atomic<Advisor*> advisor{nullptr};
std::atomic<pid_t> advisor_pid{0};
std::mutex advisor_mu;

Advisor* get_advisor() {
  std::lock_guard<std::mutex> lock(advisor_mu);
  if (advisor.load() == nullptr || advisor_pid.load() != getpid()) {
    Advisor* a = new Advisor();
    advisor.store(a);
    advisor_pid.store(getpid());
    std::thread([a] {
      for (;;) {
        std::unique_lock<std::mutex> lk(a->mu);
        a->cv.wait(lk, [a] { return !a->queue.empty(); });
        auto job = std::move(a->queue.front());
        a->queue.pop_front();
        lk.unlock();
        advise_now(job.second);
        {  // under the lock: a waiter between its check and its wait would miss the notify
          std::lock_guard<std::mutex> done_lock(a->mu);
          a->done.store(job.first);
        }
        a->cv.notify_all();
      }
    }).detach();
  }
  return advisor.load();
}

int64_t advise_async(std::vector<std::string> paths) {
  Advisor* a = get_advisor();
  std::lock_guard<std::mutex> lock(a->mu);
  const int64_t ticket = ++a->issued;
  a->queue.emplace_back(ticket, std::move(paths));
  a->cv.notify_all();
  return ticket;
}

// Whether the hint with this ticket has been carried out (``wait``: block until it is).
bool advise_done(int64_t ticket, bool wait) {
  Advisor* a = get_advisor();
  if (a->done.load() >= ticket || !wait) return a->done.load() >= ticket;
  pybind11::gil_scoped_release no_gil;
  std::unique_lock<std::mutex> lk(a->mu);
  a->cv.wait(lk, [a, ticket] { return a->done.load() >= ticket || a->issued < ticket; });
  return a->done.load() >= ticket;
}

int64_t checksum(torch::Tensor data, int64_t crc) {
  TORCH_CHECK(data.dtype() == torch::kUInt8 && data.is_contiguous() && data.device().is_cpu(),
              "checksum: a contiguous uint8 CPU tensor");
  pybind11::gil_scoped_release no_gil;
  return crc32_of((uint32_t)crc, data.data_ptr<uint8_t>(), (size_t)data.numel());
}
""".replace("FIXED_BYTES", str(HEADER_BYTES)).replace("MAGIC_BYTES", MAGIC.decode())


def kernel_parts(table: tuple) -> list:
    """A block's ``(name, dtype, shape, offset, nbytes)`` table (``serialize._parse_header``)
    in the form ``read_blocks`` takes; a store computes it once per block it knows."""
    return [(name, o, n, _DTYPE_CODES[dt], list(shape)) for name, dt, shape, o, n in table]


def _module():
    return load_cpp("lessmem_fastread", SOURCE, functions=["read_blocks", "advise", "advise_async", "advise_done", "checksum"], extra_ldflags=["-lz"])


def available() -> bool:
    """True when the compiled reader builds here (first call builds it)."""
    return _module() is not None


def read_blocks(paths: list[str], headers: list[bytes], sizes: list[int],
                parts: list[list], threads: int = 1) -> list[dict | None]:
    """Blocks of plain tensors from files (see module doc); None where a file is missing,
    is not ``sizes[i]`` bytes long, or fails a check. ``parts[i]``: the block's
    :func:`kernel_parts`. The tensors are views of one reused buffer per batch (freed for
    reuse when none of them is referenced). ``threads``: files read and checked in
    parallel (the caller's idle cores while decoding)."""
    mod = _module()
    if mod is None:
        raise RuntimeError("the compiled block reader is not available here; use DiskTier.get")
    return mod.read_blocks(paths, headers, sizes, parts, int(threads))


def advise(paths: list[str]) -> int:
    """Ask the OS to bring these files into the page cache in the background (one
    GIL-free call); returns how many could be opened."""
    mod = _module()
    if mod is None:
        raise RuntimeError("the compiled block reader is not available here")
    return mod.advise(paths)


def advise_async(paths: list[str]) -> int:
    """``advise`` done by a native background thread; returns a ticket for ``advise_done``
    (tickets complete in order)."""
    mod = _module()
    if mod is None:
        raise RuntimeError("the compiled block reader is not available here")
    return mod.advise_async(paths)


def advise_done(ticket: int, wait: bool = False) -> bool:
    """Whether the ``advise_async`` call with this ticket has been carried out; ``wait``:
    block (without the GIL) until it has."""
    mod = _module()
    if mod is None:
        raise RuntimeError("the compiled block reader is not available here")
    return mod.advise_done(int(ticket), bool(wait))


def crc32(data, crc: int = 0) -> int:
    """``zlib.crc32(data, crc)`` computed by the compiled reader's checksum (carry-less
    multiplication where the CPU has it); ``data``: bytes-like or a uint8 tensor."""
    mod = _module()
    if mod is None:
        raise RuntimeError("the compiled block reader is not available here; use zlib.crc32")
    t = data if isinstance(data, torch.Tensor) else torch.frombuffer(bytearray(data), dtype=torch.uint8) \
        if len(data) else torch.empty(0, dtype=torch.uint8)
    return mod.checksum(t.contiguous(), int(crc) & 0xFFFFFFFF) & 0xFFFFFFFF
