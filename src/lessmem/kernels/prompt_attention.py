"""A prompt chunk's attention in bfloat16 on CPUs with AVX512-BF16: ``csrc/prompt_attention.cpp``.

Where a prompt chunk attends in bfloat16 (``kvcache.view.PROMPT_BF16``), torch's CPU flash
attention ran at 92–106 GFLOP/s on a two-core AMD EPYC (Zen 4, no AMX), well below oneDNN's
bf16 matrix products of the same chunk's linears, and with a causal chunk it multiplies every
masked score too; this kernel ran at 230–368 there (``benchmarks/bench_prompt_attention.py``,
``bench_prompt_attention.json``: GFLOP/s of the dense product). It computes the same thing
with the CPU's bf16 dot-product instruction (``vdpbf16ps``: 32 bf16 products summed into 16
float32 lanes) and skips what a causal row cannot see:

- the keys of a KV head are repacked once a call so that one vector holds channels
  2i, 2i+1 of 16 keys (a score vector is 16 keys of one query row, D/2 dot-product
  instructions, no horizontal sums), the values so that one vector holds 16 channels of two
  consecutive keys (p of two keys broadcast as one word);
- the query heads sharing a KV head are rows of one matrix (GQA without repeating keys);
  four rows go through a tile of 64 keys together: scores in float32, the online softmax
  (running max and sum, FlashAttention: Dao et al. 2022, arXiv:2205.14135) in float32, the
  probabilities rounded to bfloat16 for the weighted sum of the values, accumulated in float32;
- a causal row stops at its last visible key: whole tiles past it are never computed.

Returns the output in float32 and each row's log-sum-exp (natural log), which the caller
merges with the attention over other keys (``kvcache.view._merge``). On a CPU without
AVX512-BF16 (or without a compiler) ``available()`` is false and callers keep torch's flash
attention; head sizes other than 64, 128 and 256 go there too. So do CPUs with AMX-BF16 tiles
(Intel Sapphire Rapids and later): there torch's flash attention multiplies its blocks with
oneDNN's AMX kernels (brgemm), whose tiles do many times the products of this kernel's
vector instruction; this kernel was measured only where the CPU has no AMX.
"""

from __future__ import annotations

import torch

from ._build import cpu_capability, load_cpp_file

HEAD_DIMS = (64, 128, 256)  # head sizes the kernel is compiled for (256: Gemma)


def load():
    """The compiled module, or None without a compiler (cached)."""
    return load_cpp_file("lessmem_prompt_attention", "prompt_attention.cpp", ["available", "bf16_attention"],
                         ["-fno-math-errno"])


def _has_amx_bf16() -> bool:
    return bool(cpu_capability().get("amx_bf16"))


def available() -> bool:
    """True where the kernel computes with AVX512-BF16 (the module built, the CPU has it) and
    the CPU has no AMX-BF16 (torch's flash attention uses its tiles: module doc)."""
    if _has_amx_bf16():
        return False
    m = load()
    return bool(m is not None and m.available())


def supports(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether :func:`bf16_attention` takes these query and key tensors ([B, H, T, D] on
    the CPU, D in ``HEAD_DIMS``, query heads a multiple of the key heads) on this machine."""
    return (q.device.type == "cpu" and k.device.type == "cpu" and q.dim() == 4 and k.dim() == 4
            and q.shape[-1] in HEAD_DIMS and k.shape[-1] == q.shape[-1] and q.shape[0] == k.shape[0]
            and k.shape[1] >= 1 and q.shape[1] % k.shape[1] == 0 and k.shape[2] >= 1 and available())


def bf16_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                   causal: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of ``softmax(scale · q kᵀ) v`` with q, k, v rounded to bfloat16: q
    [B, Hq, Tq, D], k and v [B, Hkv, N, D] (Hq a multiple of Hkv, GQA); out [B, Hq, Tq, D]
    float32, lse [B, Hq, Tq] float32. ``causal``: the queries are the last Tq of the N
    positions and each sees itself and everything before it (N >= Tq). Check
    :func:`supports` first."""
    B, Hq, Tq, D = q.shape
    Hkv, N = k.shape[1], k.shape[2]
    if causal and N < Tq:
        raise ValueError(f"causal attention needs at least as many keys ({N}) as queries ({Tq})")
    rows = Hq // Hkv * Tq
    qg = q.to(torch.bfloat16).reshape(B * Hkv, rows, D).contiguous()
    kg = k.to(torch.bfloat16).reshape(B * Hkv, N, D).contiguous()
    vg = v.to(torch.bfloat16).reshape(B * Hkv, N, D).contiguous()
    out, lse = load().bf16_attention(qg, kg, vg, float(scale), N - Tq if causal else -1, Tq)
    return out.view(B, Hq, Tq, D), lse.view(B, Hq, Tq)


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                        causal: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference twin of :func:`bf16_attention`: the same ``(out, lse)`` in float64 over
    the bf16-rounded q, k and v, by the formula (softmax of every score; GQA by repeating the
    KV heads). The kernel differs from it by its float32 sums and the probabilities it rounds
    to bf16 for the weighted sum of the values."""
    q, k, v = (x.to(torch.bfloat16).double() for x in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = (q @ k.transpose(-1, -2)) * scale
    Tq, N = q.shape[2], k.shape[2]
    if causal:
        seen = torch.arange(N, device=q.device)[None, :] <= torch.arange(Tq, device=q.device)[:, None] + (N - Tq)
        s = s.masked_fill(~seen, float("-inf"))
    return torch.softmax(s, -1) @ v, torch.logsumexp(s, -1)
