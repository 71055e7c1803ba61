"""Evaluation text: a file, WikiText-2 (test split), or the built-in corpus.

The built-in corpus is Python's own documentation (``pydoc_data.topics``, present
wherever CPython is): the topics joined in sorted key order with blank lines, so the
same interpreter version always yields the same text and the evaluator works offline.

``wikitext2`` is the raw test split: read from ``../shared/data/wikitext-2-raw/
wiki.test.raw`` next to a source checkout when present, otherwise through the
``datasets`` package where a hub is reachable.

Example:
    >>> name, text = load_text("pydoc")
    >>> name, len(text) > 100_000
    ('pydoc', True)
"""

from __future__ import annotations

from pathlib import Path

from lessmem.base.paths import repo_data_file

BUILTIN_TEXTS = ("pydoc", "wikitext2")
DEFAULT_TEXT = "pydoc"


def pydoc_corpus() -> str:
    """Python's documentation topics joined deterministically (sorted keys)."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k].strip() for k in sorted(topics))


def wikitext2() -> str:
    """WikiText-2 raw test split (local shared copy first, then ``datasets``)."""
    local = repo_data_file("wikitext-2-raw", "wiki.test.raw")
    if local is not None:
        return local.read_text(encoding="utf-8")
    try:
        import datasets  # optional, needs a reachable hub
    except ImportError as exc:
        raise ValueError(
            "text 'wikitext2' needs ../shared/data/wikitext-2-raw/wiki.test.raw or the "
            "'datasets' package with a reachable hub; pass --text FILE instead"
        ) from exc
    try:
        ds = datasets.load_dataset("wikitext", "wikitext-2-raw-v1", split="test")
    except Exception as exc:  # network errors come in many types
        raise ValueError(f"could not fetch wikitext2 through datasets: {exc}; pass --text FILE") from exc
    return "".join(ds["text"])


def load_text(source: str | Path | None = None) -> tuple[str, str]:
    """``(name, text)`` for ``"pydoc"`` (default), ``"wikitext2"`` or a path to a text file.

    Example:
        >>> load_text("no/such/file.txt")
        Traceback (most recent call last):
        ...
        ValueError: text 'no/such/file.txt' is neither a readable file nor one of: pydoc, wikitext2
    """
    if source is None or str(source) == "pydoc":
        return "pydoc", pydoc_corpus()
    if str(source) == "wikitext2":
        return "wikitext2", wikitext2()
    path = Path(source).expanduser()
    if not path.is_file():
        raise ValueError(
            f"text {str(source)!r} is neither a readable file nor one of: {', '.join(BUILTIN_TEXTS)}"
        )
    text = path.read_text(encoding="utf-8", errors="replace")
    if not text.strip():
        raise ValueError(f"text file {str(path)!r} is empty")
    return str(path), text
