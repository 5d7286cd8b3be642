"""OpenTelemetry is the `tracing` extra (pyproject.toml), not a dependency: a gateway told to trace
(`tracing.otlp_endpoint`) without it refuses to start in one line that names the pip command, exit 2, before it
listens; and `gateway trace-receiver`, which reads the exports with opentelemetry-proto, the same. Each runs the
real `gateway` command in a child interpreter where `opentelemetry` cannot be imported (None in sys.modules), as
in a venv without the extra."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PIP_LINE = "pip install 'fanout-gateway[tracing]'"
#: every port on 0 (the kernel's choice): were the check to let a gateway start, it would take no fixed port
EPHEMERAL = {
    "GATEWAY_SERVER_HOST": "127.0.0.1",
    "GATEWAY_SERVER_PORT": "0",
    "GATEWAY_INGEST_PORT": "0",
    "GATEWAY_RAWTCP_SENDER_PORT": "0",
    "GATEWAY_RAWTCP_RECEIVER_PORT": "0",
}
TRACING_ON = {"GATEWAY_TRACING_OTLP_ENDPOINT": "http://127.0.0.1:4318"}


def gateway(
    argv: list[str], env: dict[str, str], without_opentelemetry: bool = True, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    """`gateway ARGV` (gateway.cli), in a child interpreter; without OpenTelemetry unless told otherwise."""
    code = textwrap.dedent(f"""
        import sys
        if {without_opentelemetry!r}:
            sys.modules["opentelemetry"] = None  # `import opentelemetry...` now fails as in a venv without it
        from gateway.cli import main
        sys.exit(main({argv!r}))
    """)
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("GATEWAY_", "FANOUT_", "OTEL_"))}
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=timeout, env={**clean, **EPHEMERAL, **env}
    )


def test_serve_with_tracing_on_and_no_opentelemetry_says_the_pip_command_and_exits_2() -> None:
    ran = gateway(["serve"], TRACING_ON)
    assert ran.returncode == 2, (ran.stdout, ran.stderr)
    lines = ran.stderr.strip().splitlines()
    assert len(lines) == 1 and PIP_LINE in lines[0] and "tracing.otlp_endpoint" in lines[0], ran.stderr
    assert "listening" not in ran.stdout + ran.stderr


def test_check_config_refuses_the_same_and_passes_with_the_extra_or_with_tracing_off() -> None:
    refused = gateway(["check-config"], TRACING_ON)
    assert refused.returncode == 2 and PIP_LINE in refused.stderr, refused.stderr
    installed = gateway(["check-config"], TRACING_ON, without_opentelemetry=False)
    assert installed.returncode == 0, installed.stderr
    assert '"otlp_endpoint": "http://127.0.0.1:4318"' in installed.stdout, installed.stdout
    off = gateway(["check-config"], {})  # no OpenTelemetry, no tracing: nothing is missing
    assert off.returncode == 0, off.stderr


def test_trace_receiver_without_opentelemetry_says_the_pip_command_and_exits_2() -> None:
    ran = gateway(["trace-receiver", "--port", "0"], {})
    assert ran.returncode == 2, (ran.stdout, ran.stderr)
    assert ran.stderr.strip().count("\n") == 0 and PIP_LINE in ran.stderr, ran.stderr
