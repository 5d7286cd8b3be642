"""A command is converted to the Struct its `op` names, not to the `Command` union: msgspec builds a union's
type information again on every call (~7.5 us a command, half the CPU of a flood of refused commands), a
Struct's once. The answers stay msgspec's own, whichever way a command goes."""

from __future__ import annotations

import time

import msgspec
import pytest

from gateway import schema
from gateway.errors import BadCommand

pytestmark = pytest.mark.unit

COMMANDS = [
    {"op": "subscribe", "topic": "t"},
    {"op": "subscribe", "topic": "t", "since": {"epoch": "e", "seq": 3}, "id": 1},
    {"op": "unsubscribe", "topic": "t", "id": "a"},
    {"op": "publish", "topic": "t", "data": [1, {"x": None}]},
    {"op": "auth", "token": "x" * 700},
    {"op": "rpc", "method": "echo", "params": {"a": 1}},
    {"op": "ping", "id": None},
    # refused ones: the same message as the union gives
    {},
    {"op": "x"},
    {"op": 1},
    {"op": None},
    {"op": ["ping"]},
    {"op": "Ping"},
    {"op": "auth"},
    {"op": "auth", "token": 1},
    {"op": "auth", "token": "t", "extra": 1},
    {"op": "subscribe", "topic": ""},
    {"op": "subscribe", "topic": "a", "since": {"epoch": "e", "seq": "1"}},
    {"op": "ping", "id": 1.5},
    {"op": "ping", "id": True},
    {"op": "ping", "id": 2**53},
    {"op": "ping", "id": "x" * 129},
]


def _union(value):
    try:
        return msgspec.convert(value, schema.Command, strict=True)
    except msgspec.ValidationError as exc:
        return str(exc)


def _ours(value):
    try:
        return schema.command(value)
    except BadCommand as exc:
        return exc.message


@pytest.mark.parametrize("value", COMMANDS, ids=[repr(c)[:40] for c in COMMANDS])
def test_a_command_converts_as_the_union_does(value):
    assert _ours(value) == _union(value)


@pytest.mark.parametrize(
    "request_id",
    [None, 0, -1, 2**53 - 1, -(2**53 - 1), 2**53, -(2**53), "", "x" * 128, "x" * 129, "é" * 128, True, False, 1.0, [], {}],
)
def test_a_request_id_is_taken_when_valid_as_the_conversion_says(request_id):
    try:
        expected = msgspec.convert(request_id, schema.RequestId, strict=True)
    except msgspec.ValidationError:
        expected = None
    got = schema.request_id_of({"op": "ping", "id": request_id})
    assert got == expected and type(got) is type(expected)


def test_converting_a_command_costs_a_struct_not_a_union():
    value = {"op": "auth", "token": "x" * 700, "id": 7}

    def per_command_us() -> float:
        start = time.perf_counter()
        for _ in range(5000):
            schema.command(value)
            schema.request_id_of(value)
        return (time.perf_counter() - start) / 5000 * 1e6

    best = min(per_command_us() for _ in range(3))
    assert best < 3.0, f"{best:.2f} us a command (with the union: 5-9 us)"
