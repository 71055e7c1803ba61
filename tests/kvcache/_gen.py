"""Shared by the tiered-cache tests and their subprocesses: tiny model, prompt, greedy decode."""

from __future__ import annotations

import torch

from lessmem.kvcache import PRESETS
from lessmem.kvcache.cache import prefill_chunks
from lessmem.kvcache.tiered import cache_kwargs

CFG = PRESETS["int4"].replace(window=16, block_size=16)


def model(layers: int = 4):
    from lessmem.models import tiny_random

    return tiny_random("llama", num_layers=layers, seed=1)


def prompt(n: int = 150, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 250, (1, n), generator=g)


def chunked_prefill(m, cache, ids, chunk: int = 32) -> torch.Tensor:
    """The library's chunked prefill (the last position's logits only), what caches' own
    ``prefill`` methods run."""
    return prefill_chunks(m, cache, ids, chunk)


def decode(m, cache, logits, steps: int, check=None) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy: feed argmax ``steps`` times; returns tokens and the logits of every step."""
    toks, all_logits = [], [logits]
    with torch.no_grad():
        for _ in range(steps):
            t = logits.argmax(-1)
            toks.append(int(t[0]))
            logits = m(t[:, None], **cache_kwargs(m, cache)).logits[:, -1].float()
            all_logits.append(logits)
            if check is not None:
                check()
    return toks, all_logits


def run_saved_prompt(spec, steps: int = 8) -> dict:
    """Fill a tiered cache from ``prompt()`` (or restore it from ``spec``'s tiers), decode
    ``steps`` tokens; what happened, for the restart and shared-prefix tests."""
    from lessmem.kvcache.tiered import TieredKVCache

    m = model()
    calls = {"n": 0}
    m.register_forward_pre_hook(lambda *a: calls.__setitem__("n", calls["n"] + 1))
    cache = TieredKVCache(m.config, CFG, tiers=spec, block_tokens=32, device_budget=20000,
                          model_id="tiny-llama-seed1")
    logits = cache.prefill(m, prompt())
    prefill_calls = calls["n"]
    toks, lg = decode(m, cache, logits, steps)
    out = {"logits": torch.stack(lg), "toks": toks, "prefill_calls": prefill_calls,
           "skipped": cache.prefill_skipped, "stats": cache.offload_stats(),
           "blocks": sum(len(la.block_keys) for la in cache.tiered), "layers": len(cache.tiered)}
    cache.close()
    return out
