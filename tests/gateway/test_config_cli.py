"""Configuration loading and the `gateway serve` command, on the real process."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from websockets.sync.client import connect as ws_connect

from gateway import cli
from gateway.config import ConfigError, load_config
from gateway.server import resolve_admin_token
from tests import web

ROOT = Path(__file__).resolve().parents[2]


def test_defaults_file_and_environment_overrides(tmp_path):
    base = load_config(environ={})
    assert base.server.port == 8080 and base.ingest.port == 7002 and base.rawtcp.sender_port == 7000
    assert base.rawtcp.hard_lag_bytes == 96 * 1024 * 1024
    override = tmp_path / "o.toml"
    override.write_text(
        '[server]\nport = 9001\n[longpoll]\npoll_timeout_s = 3\n[[topics.rules]]\npattern = "*"\nkind = "snapshot"\n'
    )
    config = load_config(
        override,
        environ={"GATEWAY_SERVER_PORT": "9002", "GATEWAY_RAWTCP_ENABLED": "false", "GATEWAY_SERVER_LOG_LEVEL": "warning"},
    )
    assert config.server.port == 9002  # the environment wins over the file
    assert config.longpoll.poll_timeout_s == 3.0 and config.rawtcp.enabled is False
    assert config.server.log_level == "warning"
    assert [r.config.kind.value for r in config.topic_rules()] == ["snapshot"]


@pytest.mark.parametrize(
    "text, environ, message",
    [
        ("[server]\nprot = 1\n", {}, "unknown config key 'server.prot'"),
        ('[server]\nport = "x"\n', {}, "'server.port' must be int"),
        ("[nosuch]\na = 1\n", {}, "unknown config key 'nosuch'"),
        ("", {"GATEWAY_SERVER_PROT": "1"}, "environment variable GATEWAY_SERVER_PROT names no key of [server]"),
        ("", {"GATEWAY_TOPICS_RULES": "[]"}, "cannot be set from the environment"),
        ("", {"GATEWAY_SERVER_PORT": "true"}, "GATEWAY_SERVER_PORT='true': 'server.port' must be int, got True"),
        ('[[topics.rules]]\npattern = "*"\nkind = "bogus"\n', {}, "bad topic setting"),
        ('[[topics.rules]]\npattern = "*"\ncapacity = 0\n', {}, "capacity must be an integer in [1, 1048576], not 0"),
    ],
)
def test_bad_config_is_refused_with_a_clear_message(tmp_path, text, environ, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path, environ=environ)
    assert message in str(info.value)


def test_binding_beyond_loopback_needs_a_token():
    with pytest.raises(ConfigError):
        resolve_admin_token(load_config(overrides={"server": {"host": "0.0.0.0"}}, environ={}))
    token, generated = resolve_admin_token(load_config(environ={}))
    assert generated and len(token) >= 20
    config = load_config(overrides={"server": {"host": "0.0.0.0", "admin_token": "s"}}, environ={})
    assert resolve_admin_token(config) == ("s", False)


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


@pytest.mark.timeout(60)
def test_gateway_serve_runs_on_the_embedded_default_config(tmp_path):
    if not all(_port_free(p) for p in (8080, 7000, 7001, 7002)):
        pytest.skip("a default port (8080, 7000-7002) is taken on this machine")
    ready = tmp_path / "ready.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway", "serve", "--ready-file", str(ready)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 30
        while not ready.exists():
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline
            time.sleep(0.1)
        ports = json.loads(ready.read_text())
        assert ports["http_port"] == 8080 and ports["ingest_port"] == 7002
        assert (ports["raw_sender_port"], ports["raw_receiver_port"]) == (7000, 7001)
        base = "http://127.0.0.1:8080"
        assert web.get(f"{base}/healthz").json() == {"status": "ok"}
        headers = {"Authorization": f"Bearer {ports['admin_token']}"}
        assert web.post(f"{base}/api/topics/demo/publish", json={"data": 1}, headers=headers).json()["seqs"] == [0]
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=20)
    assert f"admin token (development, loopback only): {ports['admin_token']}" in out
    assert "core: compiled (" in out or "core: pure Python (" in out  # which build of the core runs


def test_gateway_serve_reports_config_errors(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[server]\nport = 'no'\n")
    result = subprocess.run(
        [sys.executable, "-m", "gateway", "serve", "--config", str(bad)], cwd=ROOT, capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 2 and "config error" in result.stderr


def test_gateway_serve_refuses_an_unknown_key_of_a_known_section_and_ignores_other_gateway_variables(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
    result = subprocess.run(
        [sys.executable, "-m", "gateway", "serve"],
        check=False,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
        env={**env, "GATEWAY_SERVER_PROT": "1", "GATEWAY_INTERFACE": "CGI/1.1"},
    )
    assert result.returncode == 2 and "config error" in result.stderr
    assert "GATEWAY_SERVER_PROT names no key of [server]" in result.stderr and "port" in result.stderr


@pytest.fixture
def cli_run(monkeypatch, capsys):
    """`gateway ARGS` for the commands that start nothing (`token`, `check-config`): gateway.cli.main in this
    process, with no GATEWAY_* variable but `env`'s; what it answered (`returncode`, `stdout`, `stderr`). The
    program itself (`python -m gateway`) is run by the `serve` tests above."""

    def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        with monkeypatch.context() as patch:
            for name in [k for k in os.environ if k.startswith("GATEWAY_")]:
                patch.delenv(name)
            for name, value in (env or {}).items():
                patch.setenv(name, value)
            patch.chdir(ROOT)
            capsys.readouterr()
            status = cli.main(list(args))
            out = capsys.readouterr()
        return subprocess.CompletedProcess(["gateway", *args], status, out.out, out.err)

    return run


def test_gateway_token_mints_a_token_the_gateway_accepts(cli_run):
    from gateway.testing import TEST_JWT_SECRET, run_gateway

    minted = cli_run(
        "token",
        "--sub",
        "alice",
        "--subscribe",
        "private.*",
        "--publish",
        "chat.*",
        "--ttl",
        "60",
        env={"GATEWAY_AUTH_JWT_SECRET": TEST_JWT_SECRET},
    )
    assert minted.returncode == 0, minted.stderr
    token = minted.stdout.strip()
    with run_gateway() as gw, ws_connect(f"{gw.ws_url}?token={token}") as ws:
        ws.send(json.dumps({"op": "rpc", "id": 1, "method": "whoami"}))
        reply = next(e for e in json.loads(ws.recv(timeout=5)) if e.get("id") == 1)
        assert reply["result"]["user"] == "alice"
    unset = cli_run("token", "--sub", "alice")
    assert unset.returncode == 2 and "auth.jwt_secret is empty" in unset.stderr


def test_gateway_check_config_prints_the_values_in_force_with_secrets_masked(tmp_path, cli_run):
    override = tmp_path / "prod.toml"
    override.write_text('[server]\nport = 9000\nadmin_token = "hunter2"\n')
    checked = cli_run("check-config", str(override), env={"GATEWAY_LIMITS_PUBLISH_RATE": "7.5"})
    assert checked.returncode == 0, checked.stderr
    effective = json.loads(checked.stdout)
    assert effective["server"]["port"] == 9000 and effective["limits"]["publish_rate"] == 7.5
    assert effective["server"]["admin_token"] == "<set>" and "hunter2" not in checked.stdout
    beyond = cli_run("check-config", env={"GATEWAY_SERVER_HOST": "0.0.0.0"})
    assert beyond.returncode == 2 and "admin_token" in beyond.stderr  # what `serve` would refuse
