"""Every test process, and the ranks and jobs it starts, keeps what this package caches for its
user (`io/own_writes.py`) in a folder of the test session's, not in the user's home; and makes its
vector-math first calls on one thread (`helpers.settle_vector_math`)."""

import os

import pytest

from tests.helpers import settle_vector_math

settle_vector_math()


@pytest.fixture(scope="session", autouse=True)
def _cache_of_the_session(tmp_path_factory):
    held = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("cache"))
    yield
    if held is None:
        os.environ.pop("XDG_CACHE_HOME", None)
    else:
        os.environ["XDG_CACHE_HOME"] = held
