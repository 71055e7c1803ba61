"""The fused dequant-attention CPU kernel: ``csrc/attention.cpp``, built by ``_build.load_cpp_file``.

One work item = (batch b, KV head h, split s of the history). For each tile of TILE
tokens it unpacks each key row once (codes -> floats, vectorizable split layout),
dequantizes ``k = scale · (lut[c] − z)``, dots it with the n_rep·Tq query rows of that
KV head (GQA: all query heads of the group share the decoded row), then does the
online-softmax update (flash attention: running max m, running sum l, rescale acc
by exp(m_old − m_new)) and accumulates ``p · v`` with the value rows decoded the same
way. Where the format allows, the scales are folded instead of applied per element:
per-channel key groups of a multiple of TILE tokens scale the query rows once a tile
(``q·k = (q∘s)·c − q·(s∘z)``; splits then start on a group boundary), one scale per
key token scales the score (``s·(q·c) − s·z·Σq``), and one scale per value token scales p
(``Σ p·s·c − Σ p·s·z``); with a level table, ``c`` is the code's level, read from the
packed codes in registers (2/4-bit split and 3-bit stream rows). Splits are merged with
their log-sum-exp at the end. Nothing the size of the history is ever materialized in
float.

Three entries share that loop: ``qattn_forward`` (one batch of query rows against one
history, as a ``KVCache`` layer asks), ``qattn_batch`` (a serving step: one decode
row each of many requests, each against its own history and full-precision pieces, in
one parallel region over requests × KV heads × splits) and ``qattn_rows`` (the same with
the query's scaling, the key and value rotations and the final sum done in the call: a
decode row is one call, nothing around it in Python). A fourth, ``qdequant``, decodes one
side's rows to floats the same way (``QuantSide.to_float``: a long prefill chunk's slice
of the history for flash attention, with the output as its one allocation).

Code rows are unpacked as the side's :class:`~lessmem.formats.kvlayout.KVLayout` says:
the caller passes each side's packing (its id in ``PACKING_IDS``; the ids are compiled
into the kernel as the constants ``PACK_SPLIT``/``PACK_STREAM``/``PACK_MIXED`` through ``-D`` flags, so
the C++ never spells them itself), bits, token and channel groups, constant zero and
level table.
"""

from __future__ import annotations

from ._build import load_cpp_file

PACKING_IDS = {"split": 0, "stream": 1, "mixed": 2}  # KVLayout.packing -> the id the kernel receives
FUNCTIONS = ["qattn_forward", "qattn_batch", "qattn_rows", "qdequant"]


def build_flags() -> list[str]:
    """Compiler flags: the packing ids as ``LESSMEM_PACK_*`` macros, and no errno for math."""
    return [f"-DLESSMEM_PACK_{name.upper()}={i}" for name, i in PACKING_IDS.items()] + ["-fno-math-errno"]


def load():
    """The compiled module (``qattn_forward``), or None without a compiler (cached)."""
    return load_cpp_file("lessmem_qattn", "attention.cpp", FUNCTIONS, build_flags())
