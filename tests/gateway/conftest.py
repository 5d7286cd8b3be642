"""Fixtures of the hook tests in this folder: one real backend per module (tests/gateway/hook_backend.py), and
`app`, the same backend with its records, answers and delays cleared for each test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.gateway.hook_backend import Backend, running_backend


@pytest.fixture(scope="module")
def backend() -> Iterator[Backend]:
    yield from running_backend()


@pytest.fixture
def app(backend: Backend) -> Backend:
    backend.reset()
    return backend
