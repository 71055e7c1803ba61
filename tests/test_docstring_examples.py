"""Every runnable example in the package's docstrings stays runnable and true.

(``tests/formats/test_formats_doctests.py`` also checks that the formats modules have
examples at all; this walks every module.)"""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import lessmem

MODULES = sorted(m.name for m in pkgutil.walk_packages(lessmem.__path__, "lessmem.")
                 if m.name != "lessmem.__main__")  # runs the CLI on import


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    mod = importlib.import_module(name)
    result = doctest.testmod(mod, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples in {name} failed"
