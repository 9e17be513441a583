"""The serving tests' default stack: the session's small stack (tests/conftest.py) and an openai
client on it.  A file that needs other settings defines its own ``stack`` (and ``client``)."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def stack(small_stack):
    return small_stack


@pytest.fixture(scope="module")
def client(small_client):
    return small_client
