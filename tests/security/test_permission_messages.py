"""Issue 34, item 16: a permission refusal says which rule or pattern refused, and docs/security.md's worked
example (a token-only rule, "A worked example: a token-only topic") does what the document says, run as
the document says: its config file under `gateway serve --config`, its tokens from `gateway token`, its
table of answers checked row by row on a real gateway."""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from core import TopicConfig, TopicKind
from gateway import cli
from gateway.auth.identity import ClientIdentity
from gateway.auth.tokens import Principal
from gateway.testing import make_token, run_gateway
from tests import web
from tests.gateway.gw_helpers import collect, send, ws_connect

ROOT = Path(__file__).resolve().parents[2]
SECURITY = (ROOT / "docs" / "security.md").read_text()
EXAMPLE_TITLE = "### A worked example: a token-only topic"


def example_section() -> str:
    start = SECURITY.index(EXAMPLE_TITLE)
    end = SECURITY.find("\n## ", start)  # the next section (the example has no subsection)
    return SECURITY[start : end if end >= 0 else None]


def fenced(text: str, lang: str) -> str:
    (block,) = re.findall(rf"```{lang}\n(.*?)```", text, re.S)
    return block


def answer_rows(text: str) -> list[tuple[str, str, str, str, str | None]]:
    """(client, op, topic, expected type or error code, expected message or None) of the answers table."""
    rows = []
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not cells[1].startswith("`"):
            continue
        op, topic = cells[1].strip("`").split()
        code = re.match(r"`(\w+)`", cells[2]).group(1)  # type: ignore[union-attr]
        quoted = re.search(r'"(.*)"', cells[2])
        rows.append((cells[0], op, topic, code, quoted.group(1) if quoted else None))
    return rows


class Served:
    """`gateway serve` as the worked example starts it, in a process of its own on free ports."""

    def __init__(self, argv: list[str], env: dict[str, str], ready: Path) -> None:
        ports = {
            "GATEWAY_SERVER_PORT": "0",
            "GATEWAY_INGEST_PORT": "0",
            "GATEWAY_RAWTCP_ENABLED": "false",
            "GATEWAY_SERVER_LOG_LEVEL": "warning",
        }
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gateway", *argv, "--ready-file", str(ready)],
            cwd=ROOT,
            env={**env, **ports},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        deadline = time.monotonic() + 30
        while not ready.exists():
            assert self.proc.poll() is None, self.proc.stdout.read()  # type: ignore[union-attr]
            assert time.monotonic() < deadline
            time.sleep(0.05)
        self.http_port = json.loads(ready.read_text())["http_port"]
        self.ws_url = f"ws://127.0.0.1:{self.http_port}/ws"

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.communicate(timeout=20)


@pytest.mark.timeout(60)
def test_the_worked_example_of_security_md_does_what_it_says(tmp_path, monkeypatch, capsys):
    section = example_section()
    config = tmp_path / "permissions.toml"
    config.write_text(fenced(section, "toml"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
    tokens: dict[str, str] = {}
    serve: list[str] = []
    for line in fenced(section, "sh").splitlines():
        words = [str(config) if w == "permissions.toml" else w for w in shlex.split(line, comments=True)]
        if not words:
            continue
        if words[0].endswith("/gateway"):  # the checkout's .venv/bin/gateway: this process's own
            words[0] = "gateway"
        if words[0] == "export":
            name, value = words[1].split("=", 1)
            env[name] = value
            monkeypatch.setenv(name, value)
        elif words[:2] == ["gateway", "serve"]:
            serve = words[1:]
        else:
            assert words[:2] == ["gateway", "token"], line
            assert cli.main(words[1:]) == 0
            tokens[words[words.index("--sub") + 1]] = capsys.readouterr().out.strip()
    rows = answer_rows(section)
    assert serve and set(tokens) == {"reader", "trader"} and len(rows) >= 8
    gw = Served(serve, env, tmp_path / "ready.json")
    try:
        for client, op, topic, code, message in rows:
            query = "" if client == "anonymous" else f"?token={tokens[client]}"
            with ws_connect(gw, query=query) as ws:
                command = {"op": op, "topic": topic, "id": 1} | ({"data": 1} if op == "publish" else {})
                send(ws, **command)
                (answer,) = [e for e in collect(ws, lambda g: any(e.get("id") == 1 for e in g)) if e.get("id") == 1]
                assert answer.get("code", answer["type"]) == code, (client, op, topic, answer)
                if message is not None:
                    assert answer["message"] == message, (client, op, topic)
    finally:
        gw.stop()


def refusal(identity: ClientIdentity, verb: str, name: str, config: TopicConfig) -> str | None:
    if verb == "subscribe":
        return identity.subscribe_refusal(name, config)
    return identity.publish_refusal(name, config)


def test_each_refusal_names_its_reason():
    closed = TopicConfig(anonymous=False, client_publish=True)
    anonymous = ClientIdentity("ws-0", "ws")
    token = ClientIdentity("ws-1", "ws", principal=Principal("bob", math.inf, ("chat.*",), ("chat.*", "news.*")))
    granted = ClientIdentity("ws-2", "ws", principal=Principal("eve", math.inf, (), (), None, proxied=True))
    assert refusal(anonymous, "subscribe", "a", closed) == "is not anonymous and the connection has no token"
    assert refusal(token, "subscribe", "chat.x", closed) is None
    assert (
        refusal(token, "subscribe", "a", closed) == "is not anonymous and the token's subscribe patterns ['chat.*'] do not match"
    )
    assert (
        refusal(token, "publish", "a", closed) == "is not anonymous and the token's publish patterns"
        " ['chat.*', 'news.*'] do not match"
    )
    assert refusal(granted, "publish", "a", closed) == "is not anonymous and the connect hook granted no publish patterns"
    assert (
        refusal(token, "publish", "a", TopicConfig(anonymous=True)) == "does not take client publishes (client_publish = false)"
    )
    assert (
        refusal(token, "publish", "a", TopicConfig(kind=TopicKind.PRIVATE, client_publish=True))
        == "is private: clients never publish to private topics (the ingest and the admin API do)"
    )
    many = ClientIdentity("ws-3", "ws", principal=Principal("m", math.inf, tuple(f"p{i}.*" for i in range(200)), ()))
    assert len(refusal(many, "subscribe", "a", closed)) < 400  # a long list is cut


def test_the_error_entry_names_the_rule_and_a_topic_with_its_own_settings(tmp_path):
    rules = [
        {"pattern": "prices.*", "kind": "ring", "anonymous": False, "client_publish": True},
        {"pattern": "*", "kind": "ring", "anonymous": True},
    ]
    with run_gateway(topics={"rules": rules}) as gw:
        created = web.post(
            f"{gw.http_url}/api/topics",
            json={"name": "own", "kind": "ring", "anonymous": False},
            headers={"Authorization": f"Bearer {gw.admin_token}"},
            timeout=5,
        )
        assert created.status_code == 201, created.text
        with ws_connect(gw, query=f"?token={make_token('bob', publish=['chat.*'])}") as ws:
            send(ws, op="publish", topic="prices.x", data=1, id=1)
            send(ws, op="subscribe", topic="own", id=2)
            send(ws, op="presence", topic="prices.x", id=3)
            got = {e["id"]: e["message"] for e in collect(ws, lambda g: len(g) >= 3)}
            assert got == {
                1: "not allowed to publish to 'prices.x': topic rule 'prices.*' is not anonymous and the token's"
                " publish patterns ['chat.*'] do not match",
                2: "not allowed to subscribe to 'own': topic 'own' (created with its own settings) is not"
                " anonymous and the token has no subscribe patterns",
                3: "not allowed to subscribe to 'prices.x': topic rule 'prices.*' is not anonymous and the token"
                " has no subscribe patterns",
            }
