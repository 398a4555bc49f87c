"""The structured tests' grammar compiler: the session's one for the default model (tests/conftest.py)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def compiler(grammar_compiler):
    return grammar_compiler
