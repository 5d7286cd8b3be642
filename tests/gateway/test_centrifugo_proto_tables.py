"""The Centrifugo Protobuf tables (gateway/centrifugo/client_proto.py `SCHEMA`) against the descriptor protoc made
from centrifugal/protocol's client.proto, as centrifuge-python ships it (`centrifuge.protocol.client_pb2`).

Every table reachable from `Command` and `Reply` is walked beside the descriptor's message in the same place,
field by field: each field of a table must be a field of that name in the descriptor, with its number, a type of
its kind (so its wire type: a varint never read as bytes, an int64 never as a zigzag sint64) and its cardinality
(singular, repeated, map). A table may leave fields out (the gateway never reads or writes them: they are skipped
when they come); it may not name one the descriptor lacks or has otherwise. Every table must be reached: one
that is not is checked against nothing."""

from __future__ import annotations

from typing import Any

import pytest
from centrifuge.protocol import client_pb2 as pb  # type: ignore[import-untyped]
from google.protobuf.descriptor import Descriptor, FieldDescriptor  # type: ignore[import-untyped]

from gateway.centrifugo.client_proto import LEN, SCHEMA, VARINT

pytestmark = pytest.mark.unit

#: the descriptor's scalar types each kind of our tables reads and writes, the same way on the wire
SCALAR_TYPES = {
    "u": {FieldDescriptor.TYPE_UINT32, FieldDescriptor.TYPE_UINT64},
    "i": {FieldDescriptor.TYPE_INT32, FieldDescriptor.TYPE_INT64},
    "b": {FieldDescriptor.TYPE_BOOL},
    "s": {FieldDescriptor.TYPE_STRING},
    "y": {FieldDescriptor.TYPE_BYTES},
}
#: the wire type of each descriptor type our tables could meet (proto3 encoding)
WIRE_TYPES = {
    **dict.fromkeys(
        (
            FieldDescriptor.TYPE_INT32,
            FieldDescriptor.TYPE_INT64,
            FieldDescriptor.TYPE_UINT32,
            FieldDescriptor.TYPE_UINT64,
            FieldDescriptor.TYPE_SINT32,
            FieldDescriptor.TYPE_SINT64,
            FieldDescriptor.TYPE_BOOL,
            FieldDescriptor.TYPE_ENUM,
        ),
        VARINT,
    ),
    **dict.fromkeys((FieldDescriptor.TYPE_STRING, FieldDescriptor.TYPE_BYTES, FieldDescriptor.TYPE_MESSAGE), LEN),
    **dict.fromkeys((FieldDescriptor.TYPE_FIXED64, FieldDescriptor.TYPE_SFIXED64, FieldDescriptor.TYPE_DOUBLE), 1),
    **dict.fromkeys((FieldDescriptor.TYPE_FIXED32, FieldDescriptor.TYPE_SFIXED32, FieldDescriptor.TYPE_FLOAT), 5),
}
TYPE_NAMES = {number: name[5:].lower() for name, number in vars(FieldDescriptor).items() if name.startswith("TYPE_")}


def our_wire_type(kind: str) -> int:
    return VARINT if kind in ("u", "i", "b") else LEN


def cardinality(kind: str) -> str:
    return "map" if kind.startswith("map:") else "repeated" if kind.startswith("*") else "singular"


def their_cardinality(field: Any) -> str:
    if not field.is_repeated:
        return "singular"
    entry = field.message_type
    return "map" if entry is not None and entry.GetOptions().map_entry else "repeated"


Tables = dict[str, dict[str, tuple[int, str]]]


def compare(schema: Tables, table: str, message: Descriptor, seen: dict[str, set[str]]) -> list[str]:
    """Where `schema[table]` and `message` differ, one line each, with the tables they lead to compared too
    (`seen`: the descriptors each table was compared with)."""
    if message.full_name in seen.setdefault(table, set()):
        return []
    seen[table].add(message.full_name)
    drift = []
    for name, (number, kind) in schema[table].items():
        where = f"{table}.{name} (against {message.name})"
        field = message.fields_by_name.get(name)
        if field is None:
            drift.append(f"{where}: no such field in client.proto")
            continue
        if field.number != number:
            drift.append(f"{where}: number {number}, client.proto's is {field.number}")
        if WIRE_TYPES[field.type] != our_wire_type(kind):
            drift.append(
                f"{where}: wire type {our_wire_type(kind)}, client.proto's {TYPE_NAMES[field.type]} is {WIRE_TYPES[field.type]}"
            )
        if cardinality(kind) != their_cardinality(field):
            drift.append(f"{where}: {cardinality(kind)}, client.proto's is {their_cardinality(field)}")
            continue
        if kind in SCALAR_TYPES:
            if field.type not in SCALAR_TYPES[kind]:
                drift.append(f"{where}: kind {kind!r}, client.proto's type is {TYPE_NAMES[field.type]}")
            continue
        if field.type != FieldDescriptor.TYPE_MESSAGE:
            drift.append(f"{where}: a message, client.proto's type is {TYPE_NAMES[field.type]}")
            continue
        target = field.message_type
        if kind.startswith("map:"):  # map<K, V>: entries {1: key, 2: value}, our tables' keys are strings
            key, value = target.fields_by_number[1], target.fields_by_number[2]
            if key.type != FieldDescriptor.TYPE_STRING:
                drift.append(f"{where}: string keys, client.proto's are {TYPE_NAMES[key.type]}")
            if value.type != FieldDescriptor.TYPE_MESSAGE:
                drift.append(f"{where}: message values, client.proto's are {TYPE_NAMES[value.type]}")
                continue
            target = value.message_type
        drift += compare(schema, kind.removeprefix("*").removeprefix("map:"), target, seen)
    return drift


def test_every_table_field_has_client_protos_number_wire_type_and_cardinality() -> None:
    seen: dict[str, set[str]] = {}
    drift = compare(SCHEMA, "Command", pb.Command.DESCRIPTOR, seen) + compare(SCHEMA, "Reply", pb.Reply.DESCRIPTOR, seen)
    assert drift == [], "\n".join(drift)
    assert set(SCHEMA) == set(seen), f"tables checked against nothing: {sorted(set(SCHEMA) - set(seen))}"


def test_a_drifted_table_is_found() -> None:
    """The comparison itself, on a table changed the ways a drift would be: a number, a kind (so a wire type),
    a cardinality, a name; and a message table that is wrong further down."""
    drifted = {
        **SCHEMA["SubscribeResult"],
        "epoch": (7, "s"),
        "offset": (9, "s"),
        "publications": (7, "Publication"),
        "recovering": (12, "b"),
    }
    assert compare({**SCHEMA, "SubscribeResult": drifted}, "SubscribeResult", pb.SubscribeResult.DESCRIPTOR, {}) == [
        "SubscribeResult.epoch (against SubscribeResult): number 7, client.proto's is 6",
        "SubscribeResult.publications (against SubscribeResult): singular, client.proto's is repeated",
        "SubscribeResult.offset (against SubscribeResult): wire type 2, client.proto's uint64 is 0",
        "SubscribeResult.offset (against SubscribeResult): kind 's', client.proto's type is uint64",
        "SubscribeResult.recovering (against SubscribeResult): no such field in client.proto",
    ]
    nested = {**SCHEMA, "ClientInfo": {**SCHEMA["ClientInfo"], "chan_info": (5, "y")}}
    assert compare(nested, "Reply", pb.Reply.DESCRIPTOR, {}) == [
        "ClientInfo.chan_info (against ClientInfo): number 5, client.proto's is 4"
    ]
