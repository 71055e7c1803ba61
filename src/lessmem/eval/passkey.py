"""Long-context retrieval: a 5-digit passkey hidden at a given depth in filler text.

The prompt (after Mohtashami & Jaggi, "Landmark Attention", 2023)::

    <intro> <filler ... filler> <needle> <filler ... filler> <question>

Each part is tokenized on its own and the ids concatenated, so the needle's token
offset is known exactly: it starts after ``round(depth * units)`` whole filler
sentences, i.e. at a fraction of the filler within ``1 / units`` of ``depth``.
The prompt is prefilled through the cache in chunks (so later chunks attend to
already-quantized history), then up to ``answer_tokens`` tokens are decoded
greedily; the trial succeeds when the decoded text contains the passkey.

Example:
    >>> from lessmem.models import tiny_tokenizer
    >>> p = passkey_prompt(tiny_tokenizer(), n_tokens=1024, depth=0.5, passkey=12345)
    >>> p.input_ids.shape[1] <= 1024, abs(p.actual_depth - 0.5) < 0.05
    (True, True)
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable

import torch

from lessmem.eval.caches import cache_kwarg, resolve_configs

INTRO = ("There is an important piece of information hidden inside a lot of irrelevant text. "
         "Find it and memorize it. I will quiz you about it.")
FILLER = " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = " What is the pass key? The pass key is"


@dataclass(frozen=True)
class PasskeyPrompt:
    """Token ids of one passkey trial and where the needle sits."""

    input_ids: torch.Tensor  # [1, T]
    passkey: int
    depth: float  # requested, fraction of the filler before the needle
    needle_start: int  # token offset of the needle in input_ids
    needle_len: int
    filler_start: int  # token offset where the filler begins (after the intro)
    filler_tokens: int  # total filler tokens (before + after the needle)

    @property
    def actual_depth(self) -> float:
        return (self.needle_start - self.filler_start) / max(self.filler_tokens, 1)


def _ids(tok, s: str) -> list[int]:
    return list(tok(s, add_special_tokens=False)["input_ids"])


def passkey_prompt(tok, n_tokens: int, depth: float, passkey: int) -> PasskeyPrompt:
    """Build a prompt of at most ``n_tokens`` tokens with ``passkey`` at ``depth`` (0..1).

    Example:
        >>> from lessmem.models import tiny_tokenizer
        >>> passkey_prompt(tiny_tokenizer(), 1024, 1.5, 12345)
        Traceback (most recent call last):
        ...
        ValueError: depth=1.5; allowed: a number in [0, 1]
    """
    if not isinstance(depth, (int, float)) or not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth={depth!r}; allowed: a number in [0, 1]")
    if not isinstance(passkey, int) or not 10_000 <= passkey <= 99_999:
        raise ValueError(f"passkey={passkey!r}; allowed: a 5-digit integer")
    intro, unit = _ids(tok, INTRO), _ids(tok, FILLER)
    needle, question = _ids(tok, NEEDLE.format(key=passkey)), _ids(tok, QUESTION)
    budget = n_tokens - len(intro) - len(needle) - len(question)
    units = budget // len(unit)
    if units < 2:
        raise ValueError(f"n_tokens={n_tokens} is too short for a passkey prompt; allowed: >= "
                         f"{n_tokens - budget + 2 * len(unit)} with this tokenizer")
    before = round(depth * units)
    ids = intro + unit * before + needle + unit * (units - before) + question
    return PasskeyPrompt(
        input_ids=torch.tensor([ids], dtype=torch.long),
        passkey=passkey,
        depth=float(depth),
        needle_start=len(intro) + len(unit) * before,
        needle_len=len(needle),
        filler_start=len(intro),
        filler_tokens=len(unit) * units,
    )


@torch.inference_mode()
def retrieve(model, tok, prompt: PasskeyPrompt, cache, *, prefill_chunk: int = 512,
             answer_tokens: int = 8) -> tuple[bool, str]:
    """Prefill ``prompt`` through ``cache`` in chunks, decode greedily; (found, answer)."""
    from lessmem.kvcache import KVCache, enable

    if not isinstance(cache, KVCache):  # peers and DynamicCache: the model as it is
        return _retrieve(model, tok, prompt, cache, prefill_chunk, answer_tokens)
    with enable(model):  # lessmem caches attend through the fused kernel
        return _retrieve(model, tok, prompt, cache, prefill_chunk, answer_tokens)


def _retrieve(model, tok, prompt, cache, prefill_chunk, answer_tokens) -> tuple[bool, str]:
    kw = cache_kwarg(model)
    device = next(model.parameters()).device
    ids = prompt.input_ids.to(device)
    T = ids.shape[1]
    for s in range(0, T, prefill_chunk):
        out = model(ids[:, s : s + prefill_chunk], **{kw: cache}, use_cache=True, logits_to_keep=1)
    generated: list[int] = []
    for _ in range(answer_tokens):
        nxt = out.logits[0, -1].argmax()
        generated.append(int(nxt))
        text = tok.decode(generated, skip_special_tokens=True)
        if str(prompt.passkey) in text:
            return True, text
        out = model(nxt.view(1, 1), **{kw: cache}, use_cache=True)
    return False, tok.decode(generated, skip_special_tokens=True)


def passkey_eval(
    model,
    tok,
    configs,
    lengths=(1024, 2048, 4096),
    depths=(0.1, 0.3, 0.5, 0.7, 0.9),
    *,
    seed: int = 0,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, dict]:
    """Passkey accuracy per config (the ``"dynamic"`` baseline always included).

    Returns ``{config: {"found": n, "trials": m, "accuracy": n/m, "by_length":
    {length: accuracy}, "misses": [(length, depth, answer), ...]}}``. The same
    passkeys (drawn from ``seed``) are used for every config.

    Example:
        >>> from lessmem.models import tiny_random, tiny_tokenizer
        >>> r = passkey_eval(tiny_random(), tiny_tokenizer(), [], lengths=(512,), depths=(0.5,))
        >>> r["dynamic"]["trials"]
        1
    """
    from lessmem.eval.caches import BASELINE

    specs = resolve_configs(configs)
    specs = [s for s in specs if s.name == BASELINE] + [s for s in specs if s.name != BASELINE]
    if not specs or specs[0].name != BASELINE:
        specs = resolve_configs([BASELINE]) + specs
    for n in lengths:
        if isinstance(n, bool) or not isinstance(n, int) or n < 64:
            raise ValueError(f"passkey length {n!r}; allowed: integers >= 64")
    rng = random.Random(seed)
    trials = [(n, d, rng.randint(10_000, 99_999)) for n in lengths for d in depths]
    res = {s.name: {"found": 0, "trials": 0, "by_length": {}, "misses": []} for s in specs}
    total, done = len(trials) * len(specs), 0
    for n, d, key in trials:
        prompt = passkey_prompt(tok, n, d, key)
        for s in specs:
            ok, answer = retrieve(model, tok, prompt, s.make(model.config, model=model))
            r = res[s.name]
            r["trials"] += 1
            r["found"] += int(ok)
            bl = r["by_length"].setdefault(n, [0, 0])
            bl[0] += int(ok)
            bl[1] += 1
            if not ok:
                r["misses"].append((n, d, answer))
            done += 1
            if progress:
                progress(done, total)
    for r in res.values():
        r["accuracy"] = r["found"] / r["trials"] if r["trials"] else float("nan")
        r["by_length"] = {n: f / t for n, (f, t) in r["by_length"].items()}
    return res
