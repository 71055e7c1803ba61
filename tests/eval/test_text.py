"""Text sources: the built-in corpus is deterministic; files; wikitext2; bad input."""

import pytest

from lessmem.base.paths import repo_data_file
from lessmem.eval import load_text


def test_pydoc_is_default_and_deterministic():
    name, a = load_text(None)
    assert name == "pydoc" and len(a) > 100_000
    assert load_text("pydoc")[1] == a


def test_file(tmp_path):
    f = tmp_path / "t.txt"
    f.write_text("hello\nworld\n")
    assert load_text(str(f)) == (str(f), "hello\nworld\n")
    (tmp_path / "empty.txt").write_text("  \n")
    with pytest.raises(ValueError, match="is empty"):
        load_text(tmp_path / "empty.txt")


def test_missing_file():
    with pytest.raises(ValueError, match="'missing.txt' is neither a readable file nor one of: pydoc, wikitext2"):
        load_text("missing.txt")


@pytest.mark.skipif(repo_data_file("wikitext-2-raw", "wiki.test.raw") is None,
                    reason="../shared/data/wikitext-2-raw not present next to this checkout")
def test_wikitext2_local_copy():
    name, text = load_text("wikitext2")
    assert name == "wikitext2" and " = Robert Boulter = " in text[:200]
