"""Choosing a request's next token, and the text it has produced so far.

:func:`sample`: greedy at temperature 0; else softmax at the temperature, cut to the
smallest set of tokens whose probability reaches ``top_p`` (nucleus sampling, Holtzman
et al., 2020, "The Curious Case of Neural Text Degeneration"), drawn with the request's
own seeded generator, so a seeded request gives the same tokens in any batch.

:func:`text_delta`: the text not yet reported to the request's listener. The whole
output is decoded again each time (a token may change how the previous ones decode),
and the tail is held back while it may still turn out to be a stop string or an
incomplete character.
"""

from __future__ import annotations

import torch


def sample(logits: torch.Tensor, params, generator: torch.Generator) -> int:
    """The next token id from float ``logits`` [vocab] under ``params`` (a SamplingParams)."""
    if params.temperature == 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sp, idx = torch.sort(probs, descending=True)
        cut = torch.cumsum(sp, 0) - sp >= params.top_p
        sp[cut] = 0
        probs = torch.zeros_like(probs).scatter_(0, idx, sp)
    return int(torch.multinomial(probs, 1, generator=generator))


def text_delta(tok, r, final: bool = False, drop_last: bool = False, recompute: bool = True) -> str:
    """The text of request ``r`` not yet reported (``r.text`` and ``r.emitted`` updated).
    ``drop_last``: the last token is a stop token (not part of the text); ``recompute``
    False: ``r.text`` was already set (cut at a stop string); ``final``: hold nothing back."""
    if tok is None:
        return ""
    if recompute:
        ids = r.output_ids[:-1] if drop_last else r.output_ids
        r.text = tok.decode(ids, skip_special_tokens=True)
    end = len(r.text)
    if not final:
        if r.text.endswith("\ufffd"):
            end -= 1
        if r.params.stop:
            end -= max(len(s) for s in r.params.stop) - 1
    end = max(end, r.emitted)
    delta = r.text[r.emitted:end]
    r.emitted = end
    return delta
