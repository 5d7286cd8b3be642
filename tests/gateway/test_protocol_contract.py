"""docs/protocol.md and the code say the same thing: every command, field, entry type, error code and close
code the document names exists in the code, and the reverse. Plus the cases that hand-written validation
once answered differently per transport (issue 11), now one answer from one schema."""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from core import errors as core_errors
from gateway import close_codes, schema
from gateway import errors as gateway_errors
from gateway.testing import GatewayHandle, run_gateway
from tests import web
from tests.gateway.gw_helpers import Ingest, auth

DOC = (Path(__file__).resolve().parents[2] / "docs" / "protocol.md").read_text()
ENTRIES_SOURCE = (Path(__file__).resolve().parents[2] / "core" / "entries.py").read_text()


def section(title: str) -> str:
    start = DOC.index(f"## {title}")
    end = DOC.find("\n## ", start + 1)
    return DOC[start : end if end >= 0 else None]


def table_rows(text: str) -> list[list[str]]:
    rows = [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in text.splitlines() if line.startswith("|")]
    return [row for row in rows[2:] if row]  # header and rule skipped


def ticked(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def fields(struct: type[msgspec.Struct]) -> set[str]:
    return set(struct.__struct_fields__)


def test_commands_table_names_every_command_and_its_fields():
    rows = table_rows(section("Commands"))
    documented = {ticked(row[0])[0]: {re.match(r"\w+", f).group() for f in ticked(row[1])} for row in rows}
    in_code = {cls.__struct_config__.tag: fields(cls) - {"id"} for cls in schema.COMMANDS}
    assert documented == in_code


def test_error_codes_table_matches_the_error_classes():
    documented = {code for row in table_rows(section("Error codes")) for code in ticked(row[0])}
    in_code = {
        value.code
        for module in (core_errors, gateway_errors)
        for value in vars(module).values()
        if isinstance(value, type) and issubclass(value, core_errors.RequestError)
    }
    assert documented == in_code


def test_close_codes_table_matches_the_close_codes_module():
    close_table = section("WebSocket").split("Close codes:")[1]
    documented = {int(row[0]) for row in table_rows(close_table)}
    in_code = {value for name, value in vars(close_codes).items() if name.isupper()}
    assert documented == in_code


def test_entry_types_table_matches_the_encoders_and_the_entry_schemas():
    rows = table_rows(section("Entries"))
    documented = {ticked(row[0])[0]: {re.match(r"\w+", f).group() for f in ticked(row[1])} for row in rows}
    assert set(documented) == set(re.findall(r'"type": "(\w+)"', ENTRIES_SOURCE))
    in_schema = {cls.__struct_config__.tag: set(cls.__struct_encode_fields__) for cls in schema.ENTRIES}
    assert documented == in_schema


def test_ingest_section_names_every_record_field():
    records = [line for line in section("TCP ingest").splitlines() if line.startswith("- `{")]
    documented = {key for line in records for key in re.findall(r'"(\w+)":', line.split("`")[1])}
    in_code = fields(schema.PublishRecord) | fields(schema.SyncRecord) | fields(schema.AuthRecord)
    assert documented == in_code


def test_admin_table_names_every_body_field():
    rows = {row[0]: set(ticked(row[1])) for row in table_rows(section("Admin API")) if "POST" in row[0]}
    assert rows["`POST /api/topics`"] == fields(schema.CreateTopic)
    assert rows["`POST /api/topics/NAME/publish`"] == fields(schema.PublishBody)
    assert rows["`POST /api/revocations`"] == fields(schema.RevokeBody)


# -- the same bad field, the same answer --------------------------------------------------------------

_names = itertools.count()


@pytest.fixture(scope="module")
def gw() -> Iterator[GatewayHandle]:
    """One gateway for the module: each test asks about topics of its own."""
    with run_gateway() as handle:
        yield handle


@pytest.mark.parametrize(
    "settings",
    [
        {"capacity": 1.5},
        {"capacity": 10**29},
        {"capacity": True},
        {"hole_timeout": True},
        {"linger": -0.1},
        {"linger": 11},
        {"linger": True},
        {"kind": "private", "linger": 0.01},
        {"client_publish": "false"},
        {"anonymous": "yes"},
        {"kind": "queue"},
        {"capacitty": 8},
    ],
)
def test_bad_topic_settings_are_a_400_json_error_never_stored(gw, settings):
    name = f"t.x{next(_names)}"
    with web.Client(base_url=gw.http_url, headers=auth(gw), timeout=10) as http:
        r = http.post("/api/topics", json={"name": name, **settings})
        assert r.status_code == 400 and r.json()["error"]["code"] == "bad_request", r.text
        assert http.get(f"/api/topics/{name}").status_code == 404


def test_a_negative_seq_gets_the_same_code_on_the_admin_api_and_the_ingest(gw):
    with web.Client(base_url=gw.http_url, headers=auth(gw), timeout=10) as http:
        r = http.post("/api/topics/t.seq/publish", json={"data": 1, "seq": -1})
        assert (r.status_code, r.json()["error"]["code"]) == (400, "bad_seq")
        pub = Ingest(gw)
        pub.send({"topic": "t.seq", "seq": -1, "data": 1}, {"topic": "t.seq", "seq": True, "data": 1})
        assert [pub.readline()["code"] for _ in range(2)] == ["bad_seq", "bad_record"]
        r = http.post("/api/topics/t.seq/publish", json={"data": 1, "seq": True})
        assert (r.status_code, r.json()["error"]["code"]) == (400, "bad_request")


def test_the_openapi_bodies_are_the_schemas(gw):
    with web.Client(base_url=gw.http_url, timeout=10) as http:
        spec = http.get("/api/openapi.json").json()
    create = spec["components"]["schemas"]["CreateTopic"]
    assert set(create["properties"]) == fields(schema.CreateTopic) and create["additionalProperties"] is False
    assert create["properties"]["capacity"]["maximum"] == 1 << 20
    assert set(spec["components"]["schemas"]["PublishBody"]["properties"]) == fields(schema.PublishBody)
    assert set(spec["components"]["schemas"]["RevokeBody"]["properties"]) == fields(schema.RevokeBody)
