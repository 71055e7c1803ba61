"""The runnable examples in the formats docstrings stay runnable and true."""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = ["lessmem.formats", "lessmem.formats.fp8", "lessmem.formats.codebook",
           "lessmem.formats.integer", "lessmem.formats.packing", "lessmem.formats.qtensor",
           "lessmem.formats.granularity", "lessmem.formats.hadamard"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    mod = importlib.import_module(name)
    result = doctest.testmod(mod, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0, f"{name} has no runnable example"
    assert result.failed == 0
