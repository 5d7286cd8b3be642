"""Fixtures of the pipeline tests: one SparkSession (local[2]) for the whole session."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def spark():
    """The SparkSession every ``@pytest.mark.spark`` test shares (starting one costs ~5 s)."""
    pytest.importorskip("pyspark")
    from pipeline.spark import get_session

    session = get_session("local[2]", "pipeline-tests")
    yield session
    session.stop()
