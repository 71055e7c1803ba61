"""Every ```python block of README.md runs as written.

Each block runs on its own (a fresh namespace), in an empty temporary directory (so
files it writes, like ``out/``, land there), with the built-in model that the README
uses. A README block must therefore be self-contained and use settings short enough
for the test suite. Calls must use the cache keyword the installed transformers
takes: a block that still passes ``past_key_values=`` where the model's forward takes
``cache=`` fails here, so the README shows the current spelling.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)


def python_blocks(text: str) -> list[tuple[int, str]]:
    """(line number of the block's first code line, code) of each ```python block."""
    return [(text.count("\n", 0, m.start(1)) + 1, m.group(1)) for m in FENCE.finditer(text)]


BLOCKS = python_blocks(README.read_text(encoding="utf-8"))


def test_block_extraction():
    text = "intro\n```python\nx = 1\n```\n```bash\nls\n```\n```python\ny = 2\nz = 3\n```\n"
    assert python_blocks(text) == [(3, "x = 1\n"), (9, "y = 2\nz = 3\n")]
    assert BLOCKS, "README.md has no ```python block"


@pytest.mark.model
@pytest.mark.slow
@pytest.mark.parametrize("line, code", BLOCKS, ids=[f"README.md:{n}" for n, _ in BLOCKS])
def test_readme_block_runs(line, code, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    compiled = compile(code, f"{README}:{line}", "exec")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exec(compiled, {"__name__": "__readme__"})
    stale = [str(w.message) for w in caught if "past_key_values" in str(w.message)]
    assert not stale, f"README.md:{line} uses a deprecated cache keyword: {stale[0]}"
