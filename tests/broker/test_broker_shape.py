"""The Redis broker stays split along its seams (gateway/broker/redis_broker.py's facade over the link, the
topic lines and publishing): no class in gateway/broker/ has more than 30 methods."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

BROKER = Path(__file__).resolve().parents[2] / "gateway" / "broker"
MAX_METHODS = 30


def test_no_class_in_the_broker_package_has_more_than_30_methods():
    sizes = {}
    for path in sorted(BROKER.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                methods = [n for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
                sizes[f"{path.name}:{node.name}"] = len(methods)
    assert "redis_broker.py:RedisBroker" in sizes
    assert {name: n for name, n in sizes.items() if n > MAX_METHODS} == {}
