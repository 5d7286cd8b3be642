"""On a real standalone cluster (issue 12, step 4): a master and one 1-core worker started from the installed
pyspark on 127.0.0.1, a real gateway, and

* the commands of docs/pipeline.md's "On a cluster", with the test's master, gateway and paths: the zip +
  ``spark-submit --py-files pipeline.zip pipeline/__main__.py audit ...`` recipe (nothing shipped a second
  time), and the client-mode ``python -m pipeline feed --master spark://...`` whose tasks run on the
  worker's executor;
* in the same driver, ``--lockstep`` refused at once because the cluster has 1 task slot for 2 partitions;
  the user's ``PYSPARK_PYTHON`` is the executors' interpreter; no temporary directory is left behind.

Skipped when the master or the worker does not come up. One small run of each (about a minute).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.pipeline.pipeline_docs import CLUSTER_MASTER, argv, commands, is_cluster_command
from tests.pipeline.test_pipeline_audit import hand_log, write_log

gateway_testing = pytest.importorskip("gateway.testing")
pyspark = pytest.importorskip("pyspark")

pytestmark = pytest.mark.spark

ROOT = Path(__file__).resolve().parents[2]
SPARK_HOME = Path(pyspark.__file__).parent
BIN = Path(sys.executable).parent


def _start(args: list[str], log: Path, env: dict) -> subprocess.Popen:
    return subprocess.Popen([str(SPARK_HOME / "bin" / "spark-class"), *args], stdout=log.open("wb"),
                            stderr=subprocess.STDOUT, env=env, start_new_session=True)  # fmt: skip


def _wait_for(log: Path, pattern: str, process: subprocess.Popen, timeout: float) -> re.Match | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and process.poll() is None:
        found = re.search(pattern, log.read_text(errors="replace")) if log.exists() else None
        if found:
            return found
        time.sleep(0.3)
    return None


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)  # its own session: spark-class and the JVM it execs
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(5)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    work = tmp_path_factory.mktemp("cluster")
    env = {**os.environ, "SPARK_LOCAL_IP": "127.0.0.1", "SPARK_LOG_DIR": str(work),
           "SPARK_MASTER_OPTS": "-Dspark.master.rest.enabled=false", "SPARK_WORKER_DIR": str(work / "work")}  # fmt: skip
    master = _start(["org.apache.spark.deploy.master.Master", "--host", "127.0.0.1", "--port", "0",
                     "--webui-port", "0"], work / "master.log", env)  # fmt: skip
    processes = [master]
    try:
        found = _wait_for(work / "master.log", r"Starting Spark master at (spark://127\.0\.0\.1:\d+)", master, 40)
        if found is None:
            pytest.skip(f"the standalone master did not start: {(work / 'master.log').read_text()[-500:]}")
        url = found.group(1)
        worker = _start(["org.apache.spark.deploy.worker.Worker", "--host", "127.0.0.1", "--cores", "1", "--memory",
                         "1g", "--webui-port", "0", url], work / "worker.log", env)  # fmt: skip
        processes.append(worker)
        if _wait_for(work / "worker.log", r"Successfully registered with master", worker, 40) is None:
            pytest.skip(f"the worker did not register: {(work / 'worker.log').read_text()[-500:]}")
        yield url, work
    finally:
        for process in reversed(processes):
            _stop(process)


def _driver_env(tmp: Path, **extra: str) -> dict:
    return {**os.environ, "SPARK_LOCAL_IP": "127.0.0.1", "TMPDIR": str(tmp), "PYSPARK_PYTHON": sys.executable,
            **extra}  # fmt: skip


def _doc_commands() -> dict[str, str]:
    found = {argv(c, {})[0].rpartition("/")[2]: c for c in commands() if is_cluster_command(c)}
    assert sorted(found) == ["python", "spark-submit", "zip"], found
    return found


def test_spark_submit_recipe(cluster, tmp_path):
    url, _ = cluster
    docs = _doc_commands()
    log = write_log(hand_log(), tmp_path / "log.parquet")
    archive = tmp_path / "pipeline.zip"  # written outside the repository
    subs = {CLUSTER_MASTER: url, "pipeline.zip": str(archive), "$PWD": str(ROOT), "/shared/logs/d.parquet": log,
            "/tmp/report": str(tmp_path / "report")}  # fmt: skip
    subprocess.run(argv(docs["zip"], subs), cwd=ROOT, check=True, capture_output=True)
    (tmp_path / "tmp").mkdir()
    words = argv(docs["spark-submit"], subs)
    words[0] = str(BIN / "spark-submit")
    out = subprocess.run(words, cwd=ROOT, env=_driver_env(tmp_path / "tmp"), capture_output=True, text=True,
                         timeout=180)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert "loss rate 0.095238" in out.stdout and (tmp_path / "report" / "report.json").exists()
    assert "already registered" not in out.stderr
    assert list((tmp_path / "tmp").iterdir()) == []  # nothing shipped: the zip of --py-files is enough


def test_client_mode_feed_and_lockstep(cluster, tmp_path):
    url, _ = cluster
    docs = _doc_commands()
    marker = tmp_path / "executor-python-was-used"
    wrapper = tmp_path / "python"
    wrapper.write_text(f'#!/bin/sh\ntouch "{marker}"\nexec "{sys.executable}" "$@"\n')
    wrapper.chmod(0o755)
    (tmp_path / "tmp").mkdir()
    with gateway_testing.run_gateway() as gw:
        subs = {CLUSTER_MASTER: url, "--host gateway.internal --port 7002": f"--host 127.0.0.1 --port {gw.ingest_port}",
                "http://gateway.internal:8080": gw.http_url, "/shared/ck/feed": str(tmp_path / "ck")}  # fmt: skip
        feed = argv(docs["python"], subs)[3:]
        script = (
            "import json, sys, time\n"
            "from pipeline.spark import get_session\n"
            "from pipeline.__main__ import main\n"
            f"spark = get_session({url!r}, 'cluster-test')\n"
            f"rc_feed = main({json.dumps(feed)})\n"
            "t = time.monotonic()\n"
            "rc_lockstep = main(['feed', '--lockstep', '--rows-per-batch', '40', '--available-now', '--no-admin',"
            " '--port', '9'])\n"
            "print('RESULT', rc_feed, rc_lockstep, round(time.monotonic() - t, 1))\n"
            "spark.stop()\n"
        )
        with contextlib.suppress(FileNotFoundError):
            marker.unlink()
        out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=180,
                             env=_driver_env(tmp_path / "tmp", PYSPARK_PYTHON=str(wrapper),
                                             GATEWAY_SERVER_ADMIN_TOKEN=gw.admin_token))  # fmt: skip
        ends = gw.call(lambda: {t.name: t.info()["end"] for t in gw.hub.scheduler.engine.topics()})
    assert out.returncode == 0, out.stderr[-3000:]
    rc_feed, rc_lockstep, seconds = out.stdout.split("RESULT ")[1].split()
    assert rc_feed == "0", out.stderr[-2000:]
    assert "10000 records: 10000 delivered into the ring (10000 accepted now, 0 landed earlier), 0 lost" in out.stdout
    assert ends == {f"feed.rate-{t}": 2500 for t in range(4)}
    assert rc_lockstep == "1" and float(seconds) < 15
    assert "feed: --lockstep runs all 2 partitions at once (a barrier stage) but Spark has 1 task slots" in out.stderr
    assert marker.exists()  # the executors ran the user's PYSPARK_PYTHON
    assert list((tmp_path / "tmp").iterdir()) == []  # temporary directories removed at exit
