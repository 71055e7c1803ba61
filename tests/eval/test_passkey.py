"""Passkey prompts put the needle where asked; the retrieval loop and bad input."""

import pytest
import torch

from lessmem.eval import passkey_eval, passkey_prompt
from lessmem.eval.passkey import retrieve
from lessmem.models import tiny_random, tiny_tokenizer


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.mark.parametrize("n_tokens", [1024, 2048])
@pytest.mark.parametrize("depth", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_needle_at_requested_depth(tok, n_tokens, depth):
    p = passkey_prompt(tok, n_tokens, depth, 48213)
    unit = len(tok(" The grass is green. The sky is blue. The sun is yellow. Here we go. "
                   "There and back again.", add_special_tokens=False)["input_ids"])
    assert p.input_ids.shape[1] <= n_tokens
    assert p.input_ids.shape[1] > n_tokens - unit
    assert abs(p.actual_depth - depth) <= unit / p.filler_tokens / 2 + 1e-9
    needle = tok.decode(p.input_ids[0, p.needle_start : p.needle_start + p.needle_len])
    assert needle == " The pass key is 48213. Remember it. 48213 is the pass key."
    assert tok.decode(p.input_ids[0]).endswith("What is the pass key? The pass key is")


def test_bad_passkey_input(tok):
    with pytest.raises(ValueError, match=r"depth=-0.1; allowed: a number in \[0, 1\]"):
        passkey_prompt(tok, 1024, -0.1, 12345)
    with pytest.raises(ValueError, match="passkey=123; allowed: a 5-digit integer"):
        passkey_prompt(tok, 1024, 0.5, 123)
    with pytest.raises(ValueError, match="n_tokens=100 is too short"):
        passkey_prompt(tok, 100, 0.5, 12345)
    with pytest.raises(ValueError, match="passkey length 10; allowed"):
        passkey_eval(tiny_random(), tok, [], lengths=(10,))


class _EchoModel(torch.nn.Module):
    """Greedily emits the digits of a fixed passkey, whatever the input (tests the loop)."""

    def __init__(self, tok, key):
        super().__init__()
        self.seq = tok(str(key), add_special_tokens=False)["input_ids"]
        self.step = 0
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.vocab = 272

    def forward(self, input_ids, cache=None, use_cache=True, logits_to_keep=0):
        logits = torch.zeros(1, input_ids.shape[1], self.vocab)
        logits[0, -1, self.seq[min(self.step, len(self.seq) - 1)]] = 1.0
        if input_ids.shape[1] == 1:
            self.step += 1
        return type("Out", (), {"logits": logits})()


def test_retrieve_finds_a_key_the_model_emits(tok):
    p = passkey_prompt(tok, 512, 0.5, 55555)
    ok, answer = retrieve(_EchoModel(tok, 55555), tok, p, cache=None)
    assert ok and answer == "55555"
    p2 = passkey_prompt(tok, 512, 0.5, 12345)
    ok2, answer2 = retrieve(_EchoModel(tok, 55555), tok, p2, cache=None)
    assert not ok2 and "12345" not in answer2


def test_passkey_eval_structure(tok):
    from lessmem.eval.caches import available_peers

    other = "hf-fp8" if "hf-fp8" in available_peers() else "int8"  # fp8 peer: transformers 5
    r = passkey_eval(tiny_random(), tok, [other], lengths=(512,), depths=(0.2, 0.8), seed=3)
    assert list(r) == ["dynamic", other]
    for v in r.values():
        assert v["trials"] == 2 and 0.0 <= v["accuracy"] <= 1.0
        assert set(v["by_length"]) == {512}
        assert len(v["misses"]) == v["trials"] - v["found"]
