"""Fixtures for the KV-cache tests."""

from __future__ import annotations

import pytest
from kvhelpers import tiny


@pytest.fixture(scope="session")
def llama():
    return tiny("llama")
