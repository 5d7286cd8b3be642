"""The image of the top-level Containerfile, built and run with podman (issue 51).

No container registry is reachable here, so the bases are made locally: mmdebstrap makes two Debian roots
(the runtime's: python3 alone; the build stage's: with gcc, the headers and venv), `podman import` makes them
images, cached as tarballs under ~/.cache/fanout-gateway/ (about a minute each, once). The Python packages come
from a wheelhouse `pip download` fills on the host (the build runs with PIP_NO_INDEX, as docs/operations.md
shows). The image is then run on the host's network with free ports: /readyz, a WebSocket subscribe and an
admin publish through it, its HEALTHCHECK, its user, and `podman stop`'s SIGTERM drain (close 1012, exit 0).

This sandbox refuses crun's cgroup set-up and the default ulimits: a containers.conf of the test's own
(CONTAINERS_CONF) selects runc and no default ulimits."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import socket
import subprocess
import time
import tomllib
import zipfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

ROOT = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("FANOUT_IMAGE_CACHE", Path.home() / ".cache" / "fanout-gateway"))
#: the Debian release of the bases: this machine's (its apt sources have it)
SUITE = "bookworm"
BASES = {
    "runtime": ["python3", "ca-certificates"],
    "build": ["python3", "python3-venv", "python3-dev", "gcc", "libc6-dev", "ca-certificates"],
}
#: what the bases leave out, as slim images do (dpkg never unpacks it): manuals, translations, documentation
SLIM = [f"--dpkgopt=path-exclude=/usr/share/{folder}/*" for folder in ("doc", "man", "info", "locale")]
IMAGE = "localhost/fanout-gateway:test"
ADMIN_TOKEN = "container-test-admin-token"

pytestmark = [
    pytest.mark.timeout(900),
    pytest.mark.skipif(not all(shutil.which(tool) for tool in ("podman", "runc", "mmdebstrap")),
                       reason="podman, runc and mmdebstrap are not installed (`make podman` installs them)"),
]


def run(*args: str, timeout: float = 600, check: bool = True, env: dict[str, str] | None = None
        ) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env)
    assert not check or done.returncode == 0, (args, done.stdout[-3000:], done.stderr[-3000:])
    return done


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def podman_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    conf = tmp_path_factory.mktemp("podman") / "containers.conf"
    conf.write_text('[containers]\ndefault_ulimits = []\n\n[engine]\nruntime = "runc"\n')
    return {**os.environ, "CONTAINERS_CONF": str(conf)}


def base_image(name: str, env: dict[str, str]) -> str:
    """The local base `name`, imported from its cached mmdebstrap tarball (made first when missing); the
    tarball's name carries a digest of how it is made, so a changed package list makes a new one."""
    packages = BASES[name]
    recipe = hashlib.sha256(json.dumps([SUITE, sorted(packages), SLIM]).encode()).hexdigest()[:12]
    tag = f"localhost/fanout-gateway-base-{name}:{SUITE}-{recipe}"
    tarball = CACHE / f"base-{name}-{SUITE}-{recipe}.tar"
    if not tarball.exists():
        CACHE.mkdir(parents=True, exist_ok=True)
        partial = tarball.with_name(tarball.stem + ".partial.tar")  # mmdebstrap: the suffix says the format
        run("mmdebstrap", "--variant=minbase", *SLIM, "--include=" + ",".join(packages), SUITE, str(partial),
            timeout=600)
        partial.rename(tarball)
        run("podman", "rmi", "-f", tag, check=False, env=env)
    if run("podman", "image", "exists", tag, check=False, env=env).returncode != 0:
        run("podman", "import", "-q", str(tarball), tag, env=env)
    return tag


def fill_wheelhouse(wheelhouse: Path, base: str, env: dict[str, str]) -> None:
    """Every wheel the image's build installs, for the base's own Python: the serving set, pip, setuptools and
    [build-system]'s packages at constraints.txt's pins, then what their markers ask for on that Python (the
    lock is resolved on a newer 3.11: redis needs async-timeout below 3.11.3)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    wanted = ["pip", "setuptools", *project["project"]["dependencies"], *project["build-system"]["requires"]]
    probe = "import json, os, platform, sys; print(json.dumps({'python_full_version': platform.python_version(), " \
            "'python_version': '.'.join(platform.python_version_tuple()[:2]), 'implementation_version': " \
            "platform.python_version()}))"
    markers = {**{key: str(value) for key, value in default_environment().items()},
                               **json.loads(run("podman", "run", "--rm", base, "python3", "-c", probe, env=env).stdout)}
    assert markers["platform_machine"] == platform.machine()
    wheelhouse.mkdir(parents=True, exist_ok=True)
    for _ in range(5):
        run(str(ROOT / ".venv" / "bin" / "pip"), "download", "-q", "--only-binary=:all:", "-d", str(wheelhouse),
            "-c", str(ROOT / "constraints.txt"), *wanted)
        have = {canonicalize_name(parse_wheel_filename(w.name)[0]) for w in wheelhouse.glob("*.whl")}
        missing = set()
        for wheel in wheelhouse.glob("*.whl"):
            with zipfile.ZipFile(wheel) as archive:
                (metadata,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1]
                lines = archive.read(metadata).decode().splitlines()
            for line in lines:
                if line.startswith("Requires-Dist: "):
                    requirement = Requirement(line.removeprefix("Requires-Dist: "))
                    if (not requirement.marker or requirement.marker.evaluate({**markers, "extra": ""})) \
                            and canonicalize_name(requirement.name) not in have:
                        missing.add(str(requirement).split(";")[0])
        if not missing:
            return
        wanted += sorted(missing)
    raise AssertionError(f"the wheelhouse still lacks {missing}")


@pytest.fixture(scope="module")
def image(podman_env: dict[str, str]) -> Iterator[dict[str, float]]:
    runtime, build = base_image("runtime", podman_env), base_image("build", podman_env)
    wheelhouse = CACHE / "wheelhouse"
    fill_wheelhouse(wheelhouse, build, podman_env)
    started = time.monotonic()
    run("podman", "build", "--format", "docker", "--network", "host", "-f", str(ROOT / "Containerfile"),
        "--build-arg", f"BASE_IMAGE={runtime}", "--build-arg", f"BUILD_IMAGE={build}",
        "--build-arg", "PIP_NO_INDEX=1", "--build-arg", "PIP_FIND_LINKS=/wheelhouse",
        "-v", f"{wheelhouse}:/wheelhouse:ro", "-t", IMAGE, str(ROOT), timeout=900, env=podman_env)
    built = time.monotonic() - started
    size = int(run("podman", "image", "inspect", "--format", "{{.Size}}", IMAGE, env=podman_env).stdout)
    base_size = int(run("podman", "image", "inspect", "--format", "{{.Size}}", runtime, env=podman_env).stdout)
    yield {"build_s": built, "size": size, "base_size": base_size}
    run("podman", "image", "prune", "-f", check=False, env=podman_env)  # the replaced builds' layers


def test_the_image_runs_as_its_own_user_with_the_gateway_and_its_health_check(
        image: dict[str, float], podman_env: dict[str, str]) -> None:
    (inspected,) = json.loads(run("podman", "image", "inspect", IMAGE, env=podman_env).stdout)
    config = inspected["Config"]
    assert config["User"] == "10001:10001"
    assert config["Entrypoint"] == ["gateway", "serve"]
    assert config["StopSignal"] == "SIGTERM"
    assert "/readyz" in " ".join(inspected["Healthcheck"]["Test"])  # kept by --format docker
    print(f"\nimage {image['size'] / 1e6:.0f} MB (base {image['base_size'] / 1e6:.0f} MB), built in "
          f"{image['build_s']:.0f} s")
    # only the serving set: no compiler, no pip, no extras
    listed = run("podman", "run", "--rm", "--entrypoint", "sh", IMAGE, "-c",
                 "command -v gcc pip; /opt/fanout-gateway/bin/python -c 'import matplotlib' 2>&1",
                 check=False, env=podman_env).stdout
    assert "gcc" not in listed and "/pip" not in listed and "No module named 'matplotlib'" in listed, listed
    # listening on every address, it starts only with an admin token
    refused = run("podman", "run", "--rm", "--entrypoint", "gateway", IMAGE, "check-config",
                  check=False, env=podman_env)
    assert refused.returncode == 2 and "refusing to bind 0.0.0.0 without server.admin_token" in refused.stderr
    run("podman", "run", "--rm", "-e", f"GATEWAY_SERVER_ADMIN_TOKEN={ADMIN_TOKEN}", "--entrypoint", "gateway", IMAGE,
        "check-config", env=podman_env)


def test_the_container_serves_a_subscribe_and_a_publish_and_drains_on_podman_stop(
        image: dict[str, float], podman_env: dict[str, str]) -> None:
    port = free_port()
    name = f"fanout-gateway-test-{port}"
    started = time.monotonic()
    run("podman", "run", "-d", "--name", name, "--network", "host",
        "-e", f"GATEWAY_SERVER_PORT={port}", "-e", f"GATEWAY_SERVER_ADMIN_TOKEN={ADMIN_TOKEN}",
        "-e", "GATEWAY_INGEST_PORT=0", "-e", "GATEWAY_RAWTCP_SENDER_PORT=0", "-e", "GATEWAY_RAWTCP_RECEIVER_PORT=0",
        "-e", "GATEWAY_SERVER_DRAIN_DELAY_S=0.5", IMAGE, env=podman_env)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(base + "/readyz", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            state = run("podman", "inspect", "--format", "{{.State.Status}}", name, env=podman_env).stdout.strip()
            assert state == "running" and time.monotonic() < deadline, (
                state, run("podman", "logs", name, check=False, env=podman_env).stderr[-3000:])
            time.sleep(0.05)
        print(f"\npodman run to /readyz 200: {time.monotonic() - started:.2f} s")
        assert run("podman", "healthcheck", "run", name, check=False, env=podman_env).returncode == 0
        assert run("podman", "exec", name, "id", "-u", env=podman_env).stdout.strip() == "10001"

        with connect(f"ws://127.0.0.1:{port}/ws", open_timeout=10) as ws:
            ws.send(json.dumps({"op": "subscribe", "topic": "prices.eurusd", "id": 1}))
            assert any(entry["type"] == "subscribed" for entry in json.loads(ws.recv(timeout=10)))
            published = httpx.post(f"{base}/api/topics/prices.eurusd/publish", json={"data": {"bid": 1.0842}},
                                   headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=10)
            assert published.status_code == 200, published.text
            entries = json.loads(ws.recv(timeout=10))
            assert [(e["type"], e["topic"], e["data"]) for e in entries] == [("msg", "prices.eurusd", {"bid": 1.0842})]

            stopping = subprocess.Popen(["podman", "stop", "-t", "30", name], env=podman_env,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
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
        assert "core: compiled (10 modules, mypyc)" in logs.stdout + logs.stderr
    finally:
        run("podman", "rm", "-f", "-t", "0", name, check=False, env=podman_env)
