"""Slow, obviously-correct twin of ``kv.kv_bytes``: walk every element and every group.

Each token of each request is classified (sink, window, quantized) one by one, every
element's bits are added, and the scale groups are counted as the set of distinct
(layer, head, token-group, channel-group) ids they fall in. Only for tiny models.
"""

from __future__ import annotations

import math


def kv_bytes_reference(model, context: int, batch: int, p) -> int:
    L, H, D = model.layers, model.kv_heads, model.head_dim
    full_layers = set(range(L - p.skip_layers, L))  # which layers: only their count matters
    # tokens leave the window `block` at a time, oldest first, after the sinks
    free = max(0, context - p.sinks - p.window)
    n_quant = 0
    while n_quant + p.block <= free:
        n_quant += p.block
    quantized = [p.sinks <= t < p.sinks + n_quant for t in range(context)]
    bits = 0.0
    for _ in range(batch):
        for layer in range(L):
            for kind in ("k", "v"):
                code_bits = getattr(p, f"{kind}_bits")
                tg = getattr(p, f"{kind}_group_tokens")
                cg = getattr(p, f"{kind}_group_channels") or D
                meta = getattr(p, f"{kind}_scale_bytes") + getattr(p, f"{kind}_zero_point_bytes")
                for _head in range(H):
                    groups = set()
                    q_index = 0
                    for t in range(context):
                        q = quantized[t] and layer not in full_layers
                        for c in range(D):
                            if q:
                                bits += code_bits
                                groups.add((q_index // tg, c // cg))
                            else:
                                bits += 8 * p.full_bytes
                        if q:
                            q_index += 1
                    bits += 8 * meta * len(groups)
    return math.ceil(bits / 8)
