"""The delivery log on disk: one Parquet file, one row per delivered message, with a fixed schema.

The schema is a contract with the Spark audit job: column names, order and types are exactly these.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from loadtest.delivery_stats import DeliveryLog

SCHEMA = pa.schema(
    [
        ("topic", pa.string()),
        ("seq", pa.int64()),
        ("client", pa.string()),
        ("publish_ns", pa.int64()),
        ("deliver_ns", pa.int64()),
        ("batch_id", pa.int64()),
    ]
)


def _decode(codes: np.ndarray, names: tuple[str, ...]) -> pa.Array:
    """Names looked up by code, as a plain (not dictionary) string column."""
    if not names:
        return pa.array([], pa.string()) if codes.size == 0 else pa.nulls(codes.size, pa.string())
    dictionary = pa.array(names, pa.string())
    return pa.DictionaryArray.from_arrays(pa.array(codes, pa.int32()), dictionary).cast(pa.string())


def to_table(log: DeliveryLog) -> pa.Table:
    return pa.Table.from_arrays(
        [
            _decode(log.topic, log.topics),
            pa.array(log.seq, pa.int64()),
            _decode(log.client, log.clients),
            pa.array(log.publish_ns, pa.int64()),
            pa.array(log.deliver_ns, pa.int64()),
            pa.array(log.batch_id, pa.int64()),
        ],
        schema=SCHEMA,
    )


def from_table(table: pa.Table) -> DeliveryLog:
    """A DeliveryLog from a table with SCHEMA; name codes are in order of first appearance."""
    if table.schema != SCHEMA:
        raise ValueError(f"not a delivery log: schema {table.schema}")

    def encode(column: str) -> tuple[tuple[str, ...], np.ndarray]:
        encoded = pc.dictionary_encode(table.column(column)).combine_chunks()
        names = tuple(encoded.dictionary.to_pylist())
        return names, encoded.indices.to_numpy(zero_copy_only=False).astype(np.int32)

    topics, topic = encode("topic")
    clients, client = encode("client")

    def ints(column: str) -> np.ndarray:
        return table.column(column).to_numpy().astype(np.int64)

    return DeliveryLog(topics, clients, topic, ints("seq"), client, ints("publish_ns"), ints("deliver_ns"), ints("batch_id"))


def write(path: Path, log: DeliveryLog) -> None:
    pq.write_table(to_table(log), path, compression="zstd")


def read(path: Path) -> DeliveryLog:
    return from_table(pq.read_table(path, schema=SCHEMA))
