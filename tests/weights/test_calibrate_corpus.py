"""The built-in calibration text is the evaluator's built-in corpus (one definition)."""

from lessmem.base.corpus import load_text, pydoc_corpus
from lessmem.weights.calibrate import builtin_corpus, calibration_ids, describe


def test_builtin_corpus_is_the_evaluators():
    assert builtin_corpus is pydoc_corpus
    assert builtin_corpus() == load_text("pydoc")[1]
    assert describe(None).startswith("built-in corpus")


def test_default_calibration_reads_the_corpus():
    from lessmem.models import tiny_tokenizer

    tok = tiny_tokenizer()
    ids = calibration_ids(None, tok, 2, 32)
    want = tok(pydoc_corpus(), add_special_tokens=False)["input_ids"][:64]
    assert ids.flatten().tolist() == want
