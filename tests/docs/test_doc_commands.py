"""Every command that README.md and docs/ show runs as written in a fresh shell after the README's two
commands (`make run`, `make test`: the checkout's .venv exists, nothing is activated).

What each test holds to, for every command of a ```sh block and every inline `code` that starts with a
program of ours:
- no program needs an activated venv: never a bare `python -m ...` (the venv's `.venv/bin/...` or a console
  script), and every `.venv/bin/X` named exists after the set-up;
- our programs (the console scripts, our modules run with `-m`, a script of the checkout run by the venv's
  python) know every flag the command passes (`PROGRAM [SUBCOMMAND] --help` lists it);
- the README's one-minute demo runs for real: the gateway, a subscriber, the curl publish and the ingest
  line, with the ports and the admin token substituted (the commands that run long — benchmarks, Spark on a
  cluster — are held to the first two rules; docs/pipeline.md's are run by tests/pipeline).
"""

from __future__ import annotations

import functools
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from websockets.sync.client import connect as ws_connect

from loadtest.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
VENV_BIN = Path(sys.prefix) / "bin"
#: How each program of ours is found: the checkout's venv, or the documented wheel venv (the same scripts).
OURS = {"gateway", "fanout-loadtest", "fanout-pipeline"}
OUR_MODULES = {"gateway", "loadtest", "loadtest.bare_server", "pipeline", "pipeline.bench"}
PLAIN_PYTHON_MODULES = {"venv"}  # `python3 -m venv` makes the venv: it needs none


def _joined_lines(block: str) -> list[str]:
    joined = re.sub(r"\\\n\s*", " ", block)
    out = []
    for line in joined.splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith(("#", "> ")):  # comments; `> ` is what one types into a program
            continue
        out.append(re.sub(r"\s+", " ", stripped.split("  #")[0].strip()))
    return out


def documented() -> list[tuple[str, str]]:
    """(file, command) for every command of the docs: sh blocks, and inline code that starts with a program."""
    found = []
    for doc in DOCS:
        text = doc.read_text()
        name = str(doc.relative_to(ROOT))
        for block in re.findall(r"```(?:sh|bash)\n(.*?)```", text, re.S):
            found += [(name, line) for line in _joined_lines(block)]
        prose = re.sub(r"```.*?```", "", text, flags=re.S)
        for span in re.findall(r"`([^`\n]+(?:\n[^`\n]+)?)`", prose):
            span = re.sub(r"\s+", " ", span).strip()
            if span.startswith((".venv/bin/", "python -m", "python3 -m", *(f"{p} " for p in OURS))):
                found.append((name, span))
    return found


def _segments(command: str) -> list[list[str]]:
    """The simple commands of a line (split at &&, ||, ;, |), each without its leading VAR=value words."""
    try:
        words = shlex.split(command.replace("[", " ").replace("]", " "))
    except ValueError:
        words = command.split()
    segments: list[list[str]] = [[]]
    for word in words:
        if word in ("&&", "||", ";", "|"):
            segments.append([])
        else:
            segments[-1].append(word)
    out = []
    for seg in segments:
        while seg and (re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", seg[0]) or seg[0] in ("env", "cd")):
            seg = seg[2:] if seg[0] == "cd" else seg[1:]
        if seg:
            out.append(seg)
    return out


COMMANDS = documented()


def test_the_docs_show_commands() -> None:
    files = {name for name, _ in COMMANDS}
    assert {"README.md", "docs/loadtest.md", "docs/pipeline.md", "docs/benchmarks.md"} <= files


@pytest.mark.parametrize(("doc", "command"), COMMANDS, ids=[f"{d}:{c[:60]}" for d, c in COMMANDS])
def test_no_command_needs_an_activated_venv(doc: str, command: str) -> None:
    for seg in _segments(command):
        program = seg[0]
        if program in ("python", "python3") and len(seg) > 2 and seg[1] == "-m":
            assert seg[2] in PLAIN_PYTHON_MODULES, f"{doc}: {command!r} runs a bare {program} (use .venv/bin/...)"
        if program.startswith(".venv/bin/"):
            assert (VENV_BIN / program.rpartition("/")[2]).exists(), f"{doc}: {program} is not installed"


#: Runs each `PROGRAM [SUB] --help` of argv (a JSON list of word lists) in this one fresh interpreter, as the
#: console script (its entry point), `python -m MODULE` or `python SCRIPT` would: its output when it exits 0,
#: else "". One interpreter for all of them: the imports are paid once instead of once per program and subcommand.
_HELP_RUNNER = """
import contextlib, importlib.metadata, io, json, runpy, sys
out = []
for words in json.loads(sys.argv[1]):
    text = io.StringIO()
    sys.argv = [words[0], *words[1:], "--help"]
    try:
        with contextlib.redirect_stdout(text), contextlib.redirect_stderr(text):
            try:
                if words[0].endswith(".py"):
                    runpy.run_path(words[0], run_name="__main__")
                elif words[0] == "-m":
                    sys.argv = [words[1], *words[2:], "--help"]
                    runpy.run_module(words[1], run_name="__main__", alter_sys=True)
                else:
                    name = words[0].rpartition("/")[2]
                    (script,) = importlib.metadata.entry_points(group="console_scripts", name=name)
                    sys.exit(script.load()())
                status = 0
            except SystemExit as exc:
                status = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        status = 1
    out.append(text.getvalue() if status == 0 else "")
print(json.dumps(out))
"""


def _help_calls() -> list[tuple[str, ...]]:
    """Every `PROGRAM [SUB]` whose --help a test of the flags reads (with SUB, also without it: its fallback)."""
    calls: dict[tuple[str, ...], None] = {}
    for _doc, command in COMMANDS:
        for seg in _segments(command):
            found = _our_program(seg)
            if found is None or not any(arg.startswith("--") for arg in found[1]):
                continue
            program, args = found
            sub = next((arg for arg in args if not arg.startswith("-")), None)
            calls[tuple(program)] = None
            if sub:
                calls[(*program, sub)] = None
    return list(calls)


@functools.cache
def _helps() -> dict[tuple[str, ...], str]:
    calls = _help_calls()
    # what follows the venv's python: `-m MODULE ...` or `SCRIPT ...`; a console script by its path
    argvs = [list(call[1:]) if call[0] == str(VENV_BIN / "python") else list(call) for call in calls]
    done = subprocess.run(
        [str(VENV_BIN / "python"), "-c", _HELP_RUNNER, json.dumps(argvs)], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return dict(zip(calls, json.loads(done.stdout.splitlines()[-1]), strict=True))


@functools.cache
def _help(*words: str) -> str:
    if words in _helps():
        return _helps()[words]
    done = subprocess.run([*words, "--help"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    return done.stdout + done.stderr if done.returncode == 0 else ""


def _our_program(seg: list[str]) -> tuple[list[str], list[str]] | None:
    """(how to run the program, its arguments) when `seg` runs one of ours; else None."""
    name = seg[0].rpartition("/")[2]
    if name in OURS:
        return [str(VENV_BIN / name)], seg[1:]
    if name.startswith("python") and seg[0].startswith(".venv/bin/") and len(seg) > 2 and seg[1] == "-m":
        if seg[2] in OUR_MODULES:
            return [str(VENV_BIN / "python"), "-m", seg[2]], seg[3:]
    # a script of the checkout's, by its path (deploy/container/build-image.py); not a file of the reader's, such
    # as docs/client.md's example.py
    if (
        name.startswith("python")
        and seg[0].startswith(".venv/bin/")
        and len(seg) > 1
        and "/" in seg[1]
        and seg[1].endswith(".py")
    ):
        script = ROOT / seg[1]
        assert script.is_file(), f"{seg[1]} is not in the checkout"
        return [str(VENV_BIN / "python"), str(script)], seg[2:]
    return None


@pytest.mark.parametrize(("doc", "command"), COMMANDS, ids=[f"{d}:{c[:60]}" for d, c in COMMANDS])
def test_our_programs_know_every_flag_a_command_passes(doc: str, command: str) -> None:
    for seg in _segments(command):
        found = _our_program(seg)
        if found is None:
            continue
        program, args = found
        flags = {arg.split("=")[0] for arg in args if arg.startswith("--")}
        if not flags:
            continue
        sub = next((arg for arg in args if not arg.startswith("-")), None)
        text = (_help(*program, sub) if sub else "") or _help(*program)
        assert text, f"{doc}: {' '.join(program)} --help failed"
        missing = sorted(f for f in flags if not re.search(re.escape(f) + r"\b", text))
        assert not missing, f"{doc}: {command!r} passes {missing}, which {' '.join(program)} {sub or ''} does not know"


def test_the_readme_demo_runs_as_written(tmp_path: Path) -> None:
    readme = (ROOT / "README.md").read_text()
    demo = re.search(r"## One-minute demo.*?```sh\n(.*?)```", readme, re.S)
    assert demo is not None
    lines = _joined_lines(demo.group(1))
    typed = re.findall(r"(?m)^> (.*)$", demo.group(1))
    assert lines[0].startswith("make run") and lines[1].startswith(".venv/bin/python -m websockets ")
    ports = {"8080": free_port(), "7002": free_port(), "7000": free_port(), "7001": free_port()}
    ready = tmp_path / "ready.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
    env.update(
        GATEWAY_SERVER_PORT=str(ports["8080"]),
        GATEWAY_INGEST_PORT=str(ports["7002"]),
        GATEWAY_RAWTCP_SENDER_PORT=str(ports["7000"]),
        GATEWAY_RAWTCP_RECEIVER_PORT=str(ports["7001"]),
    )
    # `make run` is `.venv/bin/gateway serve` once set up (Makefile)
    gateway = subprocess.Popen(
        [str(VENV_BIN / "gateway"), "serve", "--ready-file", str(ready)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 30
        while not ready.exists():
            assert gateway.poll() is None and time.monotonic() < deadline, "the gateway did not start"
            time.sleep(0.1)
        env["TOKEN"] = json.loads(ready.read_text())["admin_token"]

        def substituted(line: str) -> str:
            for old, new in ports.items():
                line = line.replace(f"127.0.0.1:{old}", f"127.0.0.1:{new}").replace(f"127.0.0.1 {old}", f"127.0.0.1 {new}")
            return line

        url = shlex.split(substituted(lines[1]))[-1]
        with ws_connect(url, open_timeout=10) as ws:
            for text in typed:
                ws.send(text)
            assert json.loads(ws.recv(timeout=10))[0]["type"] == "subscribed"
            for line in lines[2:]:
                if line.startswith("TOKEN="):
                    continue  # the test sets TOKEN itself, from the ready file
                if " nc " in f" {line} " and shutil.which("nc") is None:
                    pytest.skip("nc (Debian's netcat-openbsd) is not installed")
                done = subprocess.run(["bash", "-c", substituted(line)], env=env, capture_output=True, text=True, timeout=30)
                assert done.returncode == 0, (line, done.stderr)
            got: list[dict] = []
            while len(got) < 2:
                got += [e for e in json.loads(ws.recv(timeout=10)) if e["type"] == "msg"]
        assert got == [
            {"type": "msg", "topic": "prices.eurusd", "seq": 0, "data": {"bid": 1.0842}},
            {"type": "msg", "topic": "prices.eurusd", "seq": 1, "data": {"bid": 1.0843}},
        ]
    finally:
        gateway.send_signal(signal.SIGTERM)
        gateway.communicate(timeout=20)
