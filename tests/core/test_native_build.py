"""The compiled core (setup.py, core/native.py): built where it can be, the same behaviour as its sources, and
never used once a source is not the one it was compiled from (a digest, not file times, decides)."""

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

import core
import core.engine

CORE_DIR = Path(core.__file__).parent
SUFFIX = core.native._SUFFIX
PURE = os.environ.get("FANOUT_PURE_PYTHON", "") not in ("", "0")

# A few cycles of every topic kind, printed as JSON: the two builds must print the same.
EXERCISE = """
import json, sys
import core
from core import Engine, EngineConfig, TopicConfig, TopicKind, TopicRule
rules = (TopicRule("auto.*", TopicConfig(batch_depth="auto", capacity=8)),)
engine = Engine(EngineConfig(rules=rules), instance_id="t")
engine.create_topic("snap", TopicConfig(kind=TopicKind.SNAPSHOT))
engine.create_topic("priv", TopicConfig(kind=TopicKind.PRIVATE))
out = []
for client in ("a", "b"):
    engine.connect(client)
    for topic in ("auto.x", "snap", "priv", "ring1"):
        try:
            engine.subscribe(client, topic)
        except Exception as exc:
            out.append(["refused", client, topic, type(exc).__name__])
for n in range(20):
    for topic in ("auto.x", "snap"):
        engine.publish(topic, {"n": n})
    engine.publish("priv", {"n": n}, owner="a" if n % 3 else "b")
for _ in range(12):
    batches = engine.run_cycle()
    out.append([[b.client_id, [e.decode() for e in b.entries], b.size, b.more] for b in batches])
    engine.writes_done([b.client_id for b in batches])
print(json.dumps({"compiled": core.COMPILED, "build": core.BUILD, "engine": core.engine.__file__, "out": out}))
"""


def _run(env_extra: dict[str, str], path: Path | None = None) -> dict:
    env = {**os.environ, **env_extra}
    if path is not None:  # import the package from `path`, not from the checkout
        env["PYTHONPATH"] = str(path)
        env["PYTHONSAFEPATH"] = "1"
    done = subprocess.run(
        [sys.executable, "-c", EXERCISE], env=env, capture_output=True, text=True, timeout=60, cwd=path or Path.cwd()
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def _can_compile() -> bool:
    cc = (sysconfig.get_config_var("CC") or "").split()
    return bool(cc) and shutil.which(cc[0]) is not None and Path(sysconfig.get_paths()["include"], "Python.h").exists()


@pytest.mark.skipif(PURE, reason="FANOUT_PURE_PYTHON is set: the sources run on purpose")
def test_the_core_runs_compiled_where_a_c_compiler_is_installed():
    if not _can_compile():
        pytest.skip("no C compiler or Python headers: the core runs as Python")
    assert core.COMPILED, f"{core.BUILD} (make setup builds it)"
    assert core.engine.__file__.endswith(SUFFIX)


def test_the_pure_python_fallback_runs_the_sources_and_behaves_the_same():
    pure = _run({"FANOUT_PURE_PYTHON": "1"})
    assert not pure["compiled"] and pure["engine"].endswith("engine.py")
    assert "FANOUT_PURE_PYTHON" in pure["build"] or "not compiled" in pure["build"]
    default = _run({"FANOUT_PURE_PYTHON": ""})
    assert default["compiled"] == (core.COMPILED or PURE and any(CORE_DIR.glob("*" + SUFFIX)))
    assert default["out"] == pure["out"]
    assert any(batch for batch in pure["out"][-12:])  # the exercise delivered something


@pytest.mark.skipif(not any(CORE_DIR.glob("*" + SUFFIX)), reason="the core is not compiled here")
def test_a_build_is_used_until_a_source_differs_from_the_one_it_was_compiled_from(tmp_path):
    shutil.copytree(CORE_DIR, tmp_path / "core", ignore=shutil.ignore_patterns("__pycache__"))
    for runtime in CORE_DIR.parent.glob("*__mypyc*" + SUFFIX):  # mypyc's shared runtime of the group
        shutil.copy2(runtime, tmp_path)
    fresh = _run({"FANOUT_PURE_PYTHON": ""}, tmp_path)
    assert fresh["compiled"] and fresh["engine"].endswith(SUFFIX)
    ring = tmp_path / "core" / "ring.py"
    later = (tmp_path / "core" / f"ring{SUFFIX}").stat().st_mtime + 10
    os.utime(ring, (later, later))  # written after the build, as pip writes a wheel's sources: same text
    touched = _run({"FANOUT_PURE_PYTHON": ""}, tmp_path)
    assert touched["compiled"] and touched["engine"].endswith(SUFFIX), touched["build"]
    ring.write_text(ring.read_text() + "# an edit since the build\n")
    stale = _run({"FANOUT_PURE_PYTHON": ""}, tmp_path)
    assert not stale["compiled"] and stale["engine"] == str(tmp_path / "core" / "engine.py")
    assert "ring changed since the build" in stale["build"]
    assert stale["out"] == fresh["out"]
    (tmp_path / "core" / "_compiled.json").unlink()  # a build that recorded nothing proves nothing
    unrecorded = _run({"FANOUT_PURE_PYTHON": ""}, tmp_path)
    assert not unrecorded["compiled"]
