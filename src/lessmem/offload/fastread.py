"""Batched, GIL-free reads of block files (the disk tier's hot path while decoding).

A tiered cache reads every offloaded block of a layer at every decoding step (hundreds of
~50 KB files per step at 8k tokens). Done one file at a time in Python, each read takes
and drops the GIL several times (open, read, CRC, a tensor per part), and a prefetch
thread doing that slows the decoding thread's own Python down about as much as it saves.
``read_blocks`` does a whole batch in one C++ call with the GIL released: open, read into
a fresh tensor, check the framing of :mod:`lessmem.offload.serialize` (magic, lengths,
CRC-32 over header and payload, and that the header equals the one expected for the
key), then cut each part as a view of that tensor. A block that fails any check comes
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

namespace {
const c10::ScalarType kTypes[] = {at::kByte, at::kChar, at::kShort, at::kInt, at::kLong,
                                  at::kHalf, at::kBFloat16, at::kFloat, at::kDouble, at::kBool};
constexpr int64_t kFixed = FIXED_BYTES;  // magic (8) + hlen u32 + plen u64 + crc u32, little-endian

// The whole file as bytes, starting ``pad`` bytes into the tensor (so the payload lands
// 64-byte aligned and each part can be viewed as its dtype); empty when missing or short.
torch::Tensor read_file(const std::string& path, int64_t pad) {
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return torch::empty({0}, torch::kUInt8);
  struct stat st;
  if (fstat(fd, &st) != 0) { close(fd); return torch::empty({0}, torch::kUInt8); }
  auto t = torch::empty({(int64_t)st.st_size + pad}, torch::kUInt8);
  uint8_t* p = t.data_ptr<uint8_t>() + pad;
  int64_t got = 0;
  while (got < st.st_size) {
    const ssize_t r = pread(fd, p + got, st.st_size - got, got);
    if (r <= 0) break;
    got += r;
  }
  close(fd);
  return got == st.st_size ? t : torch::empty({0}, torch::kUInt8);
}

bool verify(const torch::Tensor& t, const std::string& header, int64_t pad) {
  const int64_t n = t.numel() - pad;
  if (n < kFixed) return false;
  const uint8_t* p = t.data_ptr<uint8_t>() + pad;
  if (std::memcmp(p, "MAGIC_BYTES", 8) != 0) return false;
  uint32_t hlen, crc; uint64_t plen;
  std::memcpy(&hlen, p + 8, 4); std::memcpy(&plen, p + 12, 8); std::memcpy(&crc, p + 20, 4);
  if ((uint64_t)n != kFixed + (uint64_t)hlen + plen || hlen != header.size()) return false;
  if (std::memcmp(p + kFixed, header.data(), hlen) != 0) return false;
  return crc32_z(crc32_z(0L, Z_NULL, 0), p + kFixed, (size_t)(hlen + plen)) == crc;
}
}  // namespace

// paths[i]: a block file whose header must equal headers[i]; parts[i]: (offset into the
// payload, bytes, dtype code, shape) of each tensor. Returns per file the parts as views
// of one tensor holding the file, or an empty list when the file is missing or fails a check.
std::vector<std::vector<torch::Tensor>> read_blocks(
    std::vector<std::string> paths, std::vector<std::string> headers,
    std::vector<std::vector<std::tuple<int64_t, int64_t, int64_t, std::vector<int64_t>>>> parts) {
  TORCH_CHECK(paths.size() == headers.size() && paths.size() == parts.size(),
              "read_blocks: paths, headers and parts must have the same length");
  std::vector<torch::Tensor> blobs(paths.size());
  std::vector<char> ok(paths.size(), 0);
  std::vector<int64_t> pads(paths.size());
  for (size_t i = 0; i < paths.size(); ++i) pads[i] = (64 - (kFixed + (int64_t)headers[i].size()) % 64) % 64;
  {
    pybind11::gil_scoped_release no_gil;
    for (size_t i = 0; i < paths.size(); ++i) {
      blobs[i] = read_file(paths[i], pads[i]);
      ok[i] = verify(blobs[i], headers[i], pads[i]);
    }
  }
  std::vector<std::vector<torch::Tensor>> out(paths.size());
  for (size_t i = 0; i < paths.size(); ++i) {
    if (!ok[i]) continue;
    const int64_t start = pads[i] + kFixed + (int64_t)headers[i].size();
    const int64_t plen = blobs[i].numel() - start;
    std::vector<torch::Tensor> views;
    bool good = true;
    for (const auto& [off, nbytes, code, shape] : parts[i]) {
      if (off < 0 || off + nbytes > plen || code < 0 || code > 9) { good = false; break; }
      const auto dt = kTypes[code];
      int64_t numel = 1;
      for (auto d : shape) numel *= d;
      if (numel * (int64_t)c10::elementSize(dt) != nbytes) { good = false; break; }
      views.push_back(blobs[i].narrow(0, start + off, nbytes).view(dt).view(shape));
    }
    if (good) out[i] = std::move(views);
  }
  return out;
}
""".replace("FIXED_BYTES", str(HEADER_BYTES)).replace("MAGIC_BYTES", MAGIC.decode())


_PARTS: dict[int, tuple] = {}  # id(table) -> (table, kernel form): tables are cached, few and shared


def _parts(table: tuple) -> list:
    hit = _PARTS.get(id(table))
    if hit is None or hit[0] is not table:
        if len(_PARTS) > 4096:
            _PARTS.clear()
        hit = _PARTS[id(table)] = (table, [(o, n, _DTYPE_CODES[dt], list(shape)) for _, dt, shape, o, n in table])
    return hit[1]


def _module():
    return load_cpp("lessmem_fastread", SOURCE, functions=["read_blocks"], extra_ldflags=["-lz"])


def available() -> bool:
    """True when the compiled reader builds here (first call builds it)."""
    return _module() is not None


def read_blocks(paths: list[str], headers: list[bytes], tables: list[tuple]) -> list[dict | None]:
    """Blocks of plain tensors from files (see module doc); None where a file is missing or
    fails a check. ``tables[i]``: the block's ``(name, dtype, shape, offset, nbytes)`` entries
    (``serialize._parse_header``)."""
    mod = _module()
    if mod is None:
        raise RuntimeError("the compiled block reader is not available here; use DiskTier.get")
    got = mod.read_blocks(paths, headers, [_parts(t) for t in tables])
    return [dict(zip((e[0] for e in t), views, strict=True)) if views else None
            for t, views in zip(tables, got, strict=True)]
