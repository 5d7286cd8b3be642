"""Fixtures of the cluster tests: a real redis-server on a free port, and gateway processes on it.

Skipped when /usr/bin/redis-server is missing (`make test` installs it)."""

from __future__ import annotations

import os
import shutil

import pytest

from loadtest.redisproc import REDIS_SERVER
from tests.cluster.cluster_helpers import NodeFactory, RedisServer

if not (os.path.exists(REDIS_SERVER) or shutil.which("redis-server")):
    pytest.skip(f"{REDIS_SERVER} is missing: `make redis` (part of `make test`) installs it", allow_module_level=True)


@pytest.fixture
def redis_server(tmp_path):
    server = RedisServer(tmp_path / "redis")
    server.start()
    yield server
    server.stop()


@pytest.fixture
def nodes(tmp_path, redis_server):
    """`nodes.start(name, **config_sections)` starts `python -m gateway serve` on the Redis; all are
    stopped (or killed) after the test."""
    factory = NodeFactory(tmp_path, redis_server)
    yield factory
    factory.stop_all()


@pytest.fixture(scope="module")
def module_redis(tmp_path_factory):
    """One redis-server for a module whose tests do not stop or stall it (each test uses topics of its own)."""
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def module_nodes(tmp_path_factory, module_redis):
    """`nodes` for the module: gateways that several tests share (a start is most of a short test's cost)."""
    factory = NodeFactory(tmp_path_factory.mktemp("nodes"), module_redis)
    yield factory
    factory.stop_all()
