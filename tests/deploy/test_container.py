"""The image of the top-level Containerfile, built and run with podman (issue 51).

Built as `make image` builds it: by deploy/container/build-image.py, on the local Debian bases it makes (no
container registry is reachable here: mmdebstrap roots, `podman import`, cached under ~/.cache/fanout-gateway/)
with its Python packages from a wheelhouse filled on the host; its build stage kept under a name of its own
(--build-stage-tag), so a run on unchanged sources takes it from podman's cache instead of compiling again.
The image is then run on the host's network with free ports: /readyz, a WebSocket subscribe and an admin
publish through it, its HEALTHCHECK, its user, and `podman stop`'s SIGTERM drain (close 1012, exit 0).

This sandbox refuses crun's cgroup set-up and the default ulimits: the script's containers.conf (runc, no
default ulimits), which the test also runs the image with (CONTAINERS_CONF)."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from tests import web
from tests.packaging.test_wheel import compiled_modules

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "deploy" / "container" / "build-image.py"
IMAGE = "localhost/fanout-gateway:test"
#: the build stage kept by name, so the next run's build of unchanged sources comes from podman's cache
BUILD_STAGE = "localhost/fanout-gateway-build:test"
ADMIN_TOKEN = "container-test-admin-token"

needs_podman = pytest.mark.skipif(
    not all(shutil.which(tool) for tool in ("podman", "runc", "mmdebstrap")),
    reason="podman, runc and mmdebstrap are not installed (`make podman` installs them)",
)
pytestmark = pytest.mark.timeout(900)


def run(
    *args: str, timeout: float = 600, check: bool = True, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env)
    assert not check or done.returncode == 0, (args, done.stdout[-3000:], done.stderr[-3000:])
    return done


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_make_image_is_the_script_on_the_local_bases_or_on_a_registry_base() -> None:
    """`make image` runs the script the image below is built with, on the local bases; BASE_IMAGE names a
    registry image instead (make -n: the commands only, nothing runs)."""
    for extra, expected in (
        ([], "deploy/container/build-image.py"),
        (["BASE_IMAGE=python:3.11-slim"], "deploy/container/build-image.py --base-image python:3.11-slim"),
    ):
        done = run("make", "-n", "-C", str(ROOT), "image", *extra)
        (line,) = [line for line in done.stdout.splitlines() if "build-image.py" in line]
        assert re.fullmatch(r"\.venv/bin/python " + re.escape(expected), line.strip()), line


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The image, built by the script `make image` runs (on the local bases); its report: figures and the
    containers.conf it ran podman with."""
    report = tmp_path_factory.mktemp("image") / "report.json"
    run(
        sys.executable,
        str(SCRIPT),
        "--quiet",
        "--tag",
        IMAGE,
        "--build-stage-tag",
        BUILD_STAGE,
        "--report",
        str(report),
        timeout=900,
    )
    built: dict[str, Any] = json.loads(report.read_text())
    assert built["image"] == IMAGE and built["containers_conf"]
    yield built
    run(
        "podman",
        "image",
        "prune",
        "-f",
        check=False,  # the replaced builds' layers (the named build stage stays)
        env={**os.environ, "CONTAINERS_CONF": built["containers_conf"]},
    )


@pytest.fixture(scope="module")
def podman_env(image: dict[str, Any]) -> dict[str, str]:
    return {**os.environ, "CONTAINERS_CONF": image["containers_conf"]}


@needs_podman
def test_the_image_runs_as_its_own_user_with_the_gateway_and_its_health_check(
    image: dict[str, Any], podman_env: dict[str, str]
) -> None:
    (inspected,) = json.loads(run("podman", "image", "inspect", IMAGE, env=podman_env).stdout)
    config = inspected["Config"]
    assert config["User"] == "10001:10001"
    assert config["Entrypoint"] == ["gateway", "serve"]
    assert config["StopSignal"] == "SIGTERM"
    assert "/readyz" in " ".join(inspected["Healthcheck"]["Test"])  # kept by --format docker
    print(f"\nimage {image['size'] / 1e6:.0f} MB (base {image['base_size'] / 1e6:.0f} MB), built in {image['build_s']:.0f} s")
    # one container for the three looks (each a command of its own in it, with the image's user, PATH and ENV):
    # only the serving set (no compiler, no pip, no extras); listening on every address, it starts only with an
    # admin token
    script = (
        "command -v gcc pip; /opt/fanout-gateway/bin/python -c 'import matplotlib' 2>&1; echo '--- refused'; "
        'gateway check-config; echo "--- exit $?"; GATEWAY_SERVER_ADMIN_TOKEN="$1" gateway check-config 2>&1; '
        'echo "--- with a token, exit $?"'
    )
    looked = run("podman", "run", "--rm", "--entrypoint", "sh", IMAGE, "-c", script, "sh", ADMIN_TOKEN, env=podman_env)
    listed, _, rest = looked.stdout.partition("--- refused\n")
    assert "gcc" not in listed and "/pip" not in listed and "No module named 'matplotlib'" in listed, listed
    assert (
        re.search(r"^--- exit 2$", rest, re.MULTILINE) and "refusing to bind 0.0.0.0 without server.admin_token" in looked.stderr
    ), looked
    assert rest.endswith("--- with a token, exit 0\n"), looked


@needs_podman
def test_the_container_serves_a_subscribe_and_a_publish_and_drains_on_podman_stop(
    image: dict[str, Any], podman_env: dict[str, str]
) -> None:
    port = free_port()
    name = f"fanout-gateway-test-{port}"
    started = time.monotonic()
    run(
        "podman",
        "run",
        "-d",
        "--name",
        name,
        "--network",
        "host",
        "-e",
        f"GATEWAY_SERVER_PORT={port}",
        "-e",
        f"GATEWAY_SERVER_ADMIN_TOKEN={ADMIN_TOKEN}",
        "-e",
        "GATEWAY_INGEST_PORT=0",
        "-e",
        "GATEWAY_RAWTCP_SENDER_PORT=0",
        "-e",
        "GATEWAY_RAWTCP_RECEIVER_PORT=0",
        "-e",
        "GATEWAY_SERVER_DRAIN_DELAY_S=0.5",
        IMAGE,
        env=podman_env,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if web.get(base + "/readyz", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            state = run("podman", "inspect", "--format", "{{.State.Status}}", name, env=podman_env).stdout.strip()
            assert state == "running" and time.monotonic() < deadline, (
                state,
                run("podman", "logs", name, check=False, env=podman_env).stderr[-3000:],
            )
            time.sleep(0.05)
        print(f"\npodman run to /readyz 200: {time.monotonic() - started:.2f} s")
        assert run("podman", "healthcheck", "run", name, check=False, env=podman_env).returncode == 0
        assert run("podman", "exec", name, "id", "-u", env=podman_env).stdout.strip() == "10001"

        with connect(f"ws://127.0.0.1:{port}/ws", open_timeout=10) as ws:
            ws.send(json.dumps({"op": "subscribe", "topic": "prices.eurusd", "id": 1}))
            assert any(entry["type"] == "subscribed" for entry in json.loads(ws.recv(timeout=10)))
            published = web.post(
                f"{base}/api/topics/prices.eurusd/publish",
                json={"data": {"bid": 1.0842}},
                headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
                timeout=10,
            )
            assert published.status_code == 200, published.text
            entries = json.loads(ws.recv(timeout=10))
            assert [(e["type"], e["topic"], e["data"]) for e in entries] == [("msg", "prices.eurusd", {"bid": 1.0842})]

            stopping = subprocess.Popen(
                ["podman", "stop", "-t", "30", name], env=podman_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
            with pytest.raises(ConnectionClosed) as closed:
                while True:
                    ws.recv(timeout=15)
            assert closed.value.rcvd is not None and closed.value.rcvd.code == 1012, closed.value
            assert closed.value.rcvd.reason.startswith("restarting: reconnect in ")
            stopping.communicate(timeout=40)
        assert stopping.returncode == 0
        exit_code = run("podman", "inspect", "--format", "{{.State.ExitCode}}", name, env=podman_env).stdout.strip()
        logs = run("podman", "logs", name, env=podman_env)
        assert exit_code == "0", logs.stdout[-2000:] + logs.stderr[-3000:]
        assert f"core: compiled ({compiled_modules()} modules, mypyc)" in logs.stdout + logs.stderr
    finally:
        run("podman", "rm", "-f", "-t", "0", name, check=False, env=podman_env)
