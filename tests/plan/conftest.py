"""plan/ must stay torch-free: a fixture that runs code in a fresh interpreter and fails if
it imported torch, numpy or transformers."""

from __future__ import annotations

import subprocess
import sys

import pytest

_CHECK = ("\nimport sys; bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy', 'transformers')];"
          "assert not bad, bad")


@pytest.fixture
def run_torch_free():
    """``run_torch_free(code)``: run ``code`` (then the import check) in ``python -c``; returns
    the CompletedProcess (rc 0 only when nothing heavy was imported)."""
    def run(code: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", code + _CHECK], capture_output=True, text=True, timeout=120)
    return run
