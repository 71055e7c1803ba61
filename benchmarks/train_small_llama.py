"""Train a small byte-level Llama on wiki.train.head.raw so the weight-quantization
benchmark has a model made of genuinely trained full-precision weights.

The built-in SmolLM2 file is already Q4_1-quantized, which flatters 4-bit methods; this
model is not. Two sizes (``--size``), vocab = the 259 byte tokens of
``lessmem.models.tiny_tokenizer``, trained with AdamW for ``--steps`` steps on 256-byte
windows, saved as a HF directory (safetensors) under ``$LESSMEM_CACHE/models/<name>``
(never trained on the test split):

- ``small`` -> ``wiki-byte-llama``: 4 layers, hidden 256, 4 heads (head_dim 64, no GQA),
  MLP 768 (3.3M parameters);
- ``medium`` -> ``wiki-byte-llama-m``: 6 layers, hidden 512, 8 heads / 4 KV heads
  (head_dim 64), MLP 1536 (19M parameters): every linear's width a multiple of 256, so
  each GGUF K-quant mix encodes it with its own types (no fallbacks), and big enough for
  2-4-bit differences to show (``bench_gguf_llamacpp.py``).

    python benchmarks/train_small_llama.py --steps 400
    python benchmarks/train_small_llama.py --size medium --steps 300
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch

from lessmem.base.paths import cache_dir, repo_data_file
from lessmem.models import tiny_random, tiny_tokenizer

NAME = "wiki-byte-llama"
SIZES = {  # name, tiny_random shape
    "small": ("wiki-byte-llama", dict(num_layers=4, hidden_size=256, num_heads=4, num_kv_heads=4,
                                      intermediate_size=768)),
    "medium": ("wiki-byte-llama-m", dict(num_layers=6, hidden_size=512, num_heads=8, num_kv_heads=4,
                                         intermediate_size=1536)),
}


def model_dir(size: str = "small"):
    return cache_dir("models", SIZES[size][0])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--size", choices=sorted(SIZES), default="small")
    args = p.parse_args()
    path = repo_data_file("wikitext-2-raw", "wiki.train.head.raw")
    if path is None:
        raise SystemExit("needs ../shared/data/wikitext-2-raw/wiki.train.head.raw")
    tok = tiny_tokenizer()
    text = path.read_text(encoding="utf-8")
    data = torch.tensor(tok(text, add_special_tokens=False)["input_ids"], dtype=torch.long)
    torch.manual_seed(0)
    model = tiny_random("llama", **SIZES[args.size][1], vocab_size=259, seed=0).train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.95))
    t0, log = time.time(), []
    for step in range(args.steps):
        lr = args.lr * min(1.0, (step + 1) / 30) * 0.5 * (1 + math.cos(math.pi * step / args.steps))
        for gr in opt.param_groups:
            gr["lr"] = lr
        starts = torch.randint(0, data.numel() - args.seq - 1, (args.batch,))
        x = torch.stack([data[s:s + args.seq] for s in starts])
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 25 == 0 or step == args.steps - 1:
            log.append({"step": step, "loss": loss.item(), "seconds": time.time() - t0})
            print(f"step {step} loss {loss.item():.3f} ({time.time() - t0:.0f} s)", flush=True)
    model.eval()
    out = model_dir(args.size)
    model.save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(str(out))
    (out / "train_log.json").write_text(json.dumps({"args": vars(args), "log": log}, indent=1))
    print(f"saved {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
