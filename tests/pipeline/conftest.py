"""Fixtures of the pipeline tests: one SparkSession (local[2]) for the whole session."""

from __future__ import annotations

import pytest

from tests.pipeline.pipeline_jvm import fast_jvm


@pytest.fixture(scope="session")
def spark():
    """The SparkSession every ``@pytest.mark.spark`` test shares (starting one costs ~5 s)."""
    pytest.importorskip("pyspark")
    from pipeline.spark import get_session

    with fast_jvm():  # read by the launcher as the JVM starts
        session = get_session("local[2]", "pipeline-tests")
    yield session
    session.stop()
