"""On a real standalone cluster (issue 12, step 4): a master and one 2-core worker started from the installed
pyspark on 127.0.0.1 (each application gets 1 core: spark.deploy.defaultCores), a real gateway, and

* the commands of docs/pipeline.md's "On a cluster", with the test's master, gateway and paths: the zip +
  ``spark-submit --py-files pipeline.zip pipeline/__main__.py audit ...`` recipe (nothing shipped a second
  time), and the client-mode ``python -m pipeline feed --master spark://...`` whose tasks run on the
  worker's executor, both applications at once (each JVM start waits on the other's less);
* in the same driver, ``--lockstep`` refused at once because the application has 1 task slot for 2
  partitions; the user's ``PYSPARK_PYTHON`` is the executors' interpreter; no temporary directory is left behind.

Skipped when the master or the worker does not come up. One small run of each (about a minute; the
timeout is longer than the suite's: on a busy machine the eight JVMs of the test start slowly).
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
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.pipeline.pipeline_docs import CLUSTER_MASTER, argv, commands, is_cluster_command
from tests.pipeline.pipeline_jvm import fast_jvm_env
from tests.pipeline.test_pipeline_audit import hand_log, write_log

gateway_testing = pytest.importorskip("gateway.testing")
pyspark = pytest.importorskip("pyspark")

pytestmark = [pytest.mark.spark, pytest.mark.timeout(300)]

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
    env = {**fast_jvm_env(), "SPARK_LOCAL_IP": "127.0.0.1", "SPARK_LOG_DIR": str(work),
           # each application 1 core of the worker's 2: the two of the test run side by side
           "SPARK_MASTER_OPTS": "-Dspark.master.rest.enabled=false -Dspark.deploy.defaultCores=1",
           "SPARK_WORKER_DIR": str(work / "work")}  # fmt: skip
    master = _start(["org.apache.spark.deploy.master.Master", "--host", "127.0.0.1", "--port", "0",
                     "--webui-port", "0"], work / "master.log", env)  # fmt: skip
    processes = [master]
    try:
        found = _wait_for(work / "master.log", r"Starting Spark master at (spark://127\.0\.0\.1:\d+)", master, 40)
        if found is None:
            pytest.skip(f"the standalone master did not start: {(work / 'master.log').read_text()[-500:]}")
        url = found.group(1)
        worker = _start(["org.apache.spark.deploy.worker.Worker", "--host", "127.0.0.1", "--cores", "2", "--memory",
                         "2g", "--webui-port", "0", url], work / "worker.log", env)  # fmt: skip
        processes.append(worker)
        if _wait_for(work / "worker.log", r"Successfully registered with master", worker, 40) is None:
            pytest.skip(f"the worker did not register: {(work / 'worker.log').read_text()[-500:]}")
        yield url, work
    finally:
        for process in reversed(processes):
            _stop(process)


def _driver_env(tmp: Path, **extra: str) -> dict:
    env = fast_jvm_env(conf_dir=tmp.parent / "conf")  # SPARK_CONF_DIR outside `tmp`, which must stay empty
    return {**env, "SPARK_LOCAL_IP": "127.0.0.1", "TMPDIR": str(tmp), "PYSPARK_PYTHON": sys.executable, **extra}


def _doc_commands() -> dict[str, str]:
    found = {argv(c, {})[0].rpartition("/")[2]: c for c in commands() if is_cluster_command(c)}
    assert sorted(found) == ["python", "spark-submit", "zip"], found
    return found


def _spark_submit_recipe(url: str, tmp_path: Path, stack: contextlib.ExitStack) -> Callable[[], None]:
    """Starts the zip + spark-submit recipe; returns the check of its outcome (which waits for it)."""
    docs = _doc_commands()
    log = write_log(hand_log(), tmp_path / "log.parquet")
    archive = tmp_path / "pipeline.zip"  # written outside the repository
    subs = {CLUSTER_MASTER: url, "pipeline.zip": str(archive), "$PWD": str(ROOT), "/shared/logs/d.parquet": log,
            "/tmp/report": str(tmp_path / "report")}  # fmt: skip
    subprocess.run(argv(docs["zip"], subs), cwd=ROOT, check=True, capture_output=True)
    (tmp_path / "tmp").mkdir()
    words = argv(docs["spark-submit"], subs)
    words[0] = str(BIN / "spark-submit")
    submit = stack.enter_context(_Run(words, tmp_path, _driver_env(tmp_path / "tmp")))

    def check() -> None:
        returncode, stdout, stderr = submit.wait()
        assert returncode == 0, f"spark-submit: {stderr[-3000:]}"
        assert "loss rate 0.095238" in stdout and (tmp_path / "report" / "report.json").exists()
        assert "already registered" not in stderr
        assert list((tmp_path / "tmp").iterdir()) == []  # nothing shipped: the zip of --py-files is enough

    return check


class _Run:
    """A process whose output goes to files (two run at once: neither may block on a full pipe); killed on
    leaving if still running."""

    def __init__(self, words: list[str], directory: Path, env: dict) -> None:
        self.out, self.err = directory / "stdout", directory / "stderr"
        with self.out.open("wb") as out, self.err.open("wb") as err:
            self.process = subprocess.Popen(words, cwd=ROOT, env=env, stdout=out, stderr=err)

    def wait(self, timeout: float = 240) -> tuple[int, str, str]:
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.__exit__()
        return self.process.returncode, self.out.read_text(errors="replace"), self.err.read_text(errors="replace")

    def __enter__(self) -> _Run:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def test_spark_submit_recipe_and_client_mode_feed_with_lockstep(cluster, tmp_path):
    """Both applications at once (each takes 1 of the worker's 2 cores): the recipe's audit, and in the
    client-mode driver the documented feed then ``--lockstep`` refused for want of a second task slot."""
    url, _ = cluster
    docs = _doc_commands()
    submit, client = tmp_path / "submit", tmp_path / "client"
    submit.mkdir()
    client.mkdir()
    marker = client / "executor-python-was-used"
    wrapper = client / "python"
    wrapper.write_text(f'#!/bin/sh\ntouch "{marker}"\nexec "{sys.executable}" "$@"\n')
    wrapper.chmod(0o755)
    (client / "tmp").mkdir()
    with contextlib.ExitStack() as stack:
        check_recipe = _spark_submit_recipe(url, submit, stack)
        gw = stack.enter_context(gateway_testing.run_gateway())
        subs = {CLUSTER_MASTER: url, "--host gateway.internal --port 7002": f"--host 127.0.0.1 --port {gw.ingest_port}",
                "http://gateway.internal:8080": gw.http_url, "/shared/ck/feed": str(client / "ck")}  # fmt: skip
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
        env = _driver_env(client / "tmp", PYSPARK_PYTHON=str(wrapper), GATEWAY_SERVER_ADMIN_TOKEN=gw.admin_token)
        returncode, stdout, stderr = stack.enter_context(_Run([sys.executable, "-c", script], client, env)).wait()
        ends = gw.call(lambda: {t.name: t.info()["end"] for t in gw.hub.scheduler.engine.topics()})
        check_recipe()
    assert returncode == 0, stderr[-3000:]
    rc_feed, rc_lockstep, seconds = stdout.split("RESULT ")[1].split()
    assert rc_feed == "0", stderr[-2000:]
    assert "10000 records: 10000 delivered into the ring (10000 accepted now, 0 landed earlier), 0 lost" in stdout
    assert ends == {f"feed.rate-{t}": 2500 for t in range(4)}
    assert rc_lockstep == "1" and float(seconds) < 15
    assert "feed: --lockstep runs all 2 partitions at once (a barrier stage) but Spark has 1 task slots" in stderr
    assert marker.exists()  # the executors ran the user's PYSPARK_PYTHON
    assert list((client / "tmp").iterdir()) == []  # temporary directories removed at exit
