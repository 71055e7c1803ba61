"""Subprocess: fill a tiered cache from a prompt, save it, decode; print a digest of the logits.

argv: tiers-spec  mode(save|restore)  out.pt
"""

import sys

import torch

torch.set_num_threads(1)

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import _gen  # noqa: E402

from lessmem.kvcache.tiered import TieredKVCache  # noqa: E402

spec, mode, out = sys.argv[1:4]
m = _gen.model()
calls = {"n": 0}
m.register_forward_pre_hook(lambda *a: calls.__setitem__("n", calls["n"] + 1))
cache = TieredKVCache(m.config, _gen.CFG, tiers=spec, block_tokens=32, device_budget=20000,
                      model_id="tiny-llama-seed1")
logits = cache.prefill(m, _gen.prompt())
prefill_calls = calls["n"]
toks, lg = _gen.decode(m, cache, logits, 8)
stats = cache.offload_stats()
torch.save({"logits": torch.stack(lg), "toks": toks, "prefill_calls": prefill_calls,
            "skipped": cache.prefill_skipped, "stats": stats}, out)
cache.close()
