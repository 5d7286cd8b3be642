"""One place that builds the SparkSession of every pipeline job and test.

Offline and quiet on a small machine: no UI, no progress bars, ERROR-level logging from the first line (a
log4j2 file of our own is handed to the driver JVM before it starts), two shuffle partitions (the data of
one micro-batch or one test is small; a large audit raises it with ``--conf``), and no
``spark.jars.packages`` (nothing is downloaded). The same code runs on a cluster with ``master="spark://..."``
or ``"yarn"``: then the loopback settings are left out, and what the executors cannot import already (asked
with one tiny job: the ``pipeline`` package, the ingest client ``fanout_client.ingest``) is zipped and shipped to them; a
package shipped with ``spark-submit --py-files`` or installed on the executors is not shipped again.

``PYSPARK_PYTHON`` / ``PYSPARK_DRIVER_PYTHON`` set by the user are kept (executors on other machines need
their own interpreter's path); unset, they default to the running interpreter.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import importlib.util
import logging
import os
import shutil
import sys
import tempfile
import threading
import zipfile
from collections.abc import Iterable, Iterator
from pathlib import Path

from pyspark.sql import SparkSession

__all__ = ["DEFAULT_MASTER", "LOG4J2_PROPERTIES", "get_session", "master_url"]

DEFAULT_MASTER = "local[*]"
LOG4J2_PROPERTIES = Path(__file__).with_name("log4j2.properties")
_PACKAGE_DIR = Path(__file__).parent

log = logging.getLogger(__name__)


def master_url(spark: SparkSession) -> str:
    """The master a running session was started with (``local[*]``, ``spark://...``, ``yarn``)."""
    master = spark.sparkContext.master
    if master is None:  # a started context always has one (spark.master is required to start it)
        raise RuntimeError("the Spark context has no master")
    return master


def _is_local(master: str | None) -> bool:
    if master is None:
        # No master given: spark-submit's (when it launched us, the JVM already runs) or else local[*].
        return "PYSPARK_GATEWAY_PORT" not in os.environ
    return master.startswith("local")


def _base_config(master: str | None) -> dict[str, str]:
    java_options = f"-Dlog4j2.configurationFile={LOG4J2_PROPERTIES.as_uri()}"
    config = {
        "spark.ui.enabled": "false",
        "spark.ui.showConsoleProgress": "false",
        "spark.sql.shuffle.partitions": "2",
        "spark.sql.session.timeZone": "UTC",
        # The driver JVM only: in local mode the executors live in it; a cluster's executors keep their own
        # logging (our file's path does not exist there).
        "spark.driver.extraJavaOptions": java_options,
    }
    if _is_local(master):
        config["spark.driver.host"] = "127.0.0.1"
        config["spark.driver.bindAddress"] = "127.0.0.1"
    return config


#: what executors import of the client package: its ingest client only (``fanout_client/__init__.py`` imports
#: nothing eagerly, so neither the WebSocket client nor its dependencies are needed there)
_CLIENT_MODULES = ("__init__.py", "ingest.py")


def _executors_can_import(spark: SparkSession, modules: tuple[str, ...]) -> dict[str, bool]:
    """Whether an executor's Python finds each module (one task: what --py-files or the cluster's own
    installation already provide)."""

    def probe(_: Iterable[int]) -> Iterator[dict[str, bool]]:
        import importlib.util as util

        found: dict[str, bool] = {}
        for name in modules:
            try:
                found[name] = util.find_spec(name) is not None
            except (ImportError, ValueError):
                found[name] = False
        yield found

    try:
        return spark.sparkContext.parallelize([0], 1).mapPartitions(probe).collect()[0]
    except Exception as exc:  # noqa: BLE001 - no executor answer: ship everything, as before
        log.warning("could not ask the executors what they can import (%s): shipping the pipeline", exc)
        return {name: False for name in modules}


def _zip(files: list[tuple[Path, str]], name: str) -> str:
    """A zip of ``files`` (path, name in the archive) in a temporary directory removed at exit; its file name
    carries a digest of the content, so it never collides with a user's ``pipeline.zip``."""
    digest = hashlib.sha256()
    for path, arcname in files:
        digest.update(arcname.encode() + b"\0" + path.read_bytes())
    directory = tempfile.mkdtemp(prefix="pipeline-pyfiles-")
    atexit.register(shutil.rmtree, directory, True)
    archive = Path(directory) / f"{name}-{digest.hexdigest()[:12]}.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        for path, arcname in files:
            zf.write(path, arcname)
    return str(archive)


def _ship_package(spark: SparkSession) -> list[str]:
    """Ship to the executors what they cannot import already: ``pipeline/`` (when it is a directory here)
    and the ingest client, ``fanout_client.ingest`` (all they need to talk to the gateway). Returns the archives
    added."""
    found = _executors_can_import(spark, ("pipeline.feed", "fanout_client.ingest"))
    shipped = []
    if not found["pipeline.feed"]:
        if not _PACKAGE_DIR.is_dir():
            raise RuntimeError(
                f"the executors cannot import `pipeline` and {_PACKAGE_DIR} is not a directory to "
                f"ship: pass the package with spark-submit --py-files"
            )
        files = [
            (p, str(Path("pipeline") / p.relative_to(_PACKAGE_DIR)))
            for p in sorted(_PACKAGE_DIR.rglob("*"))
            if p.is_file() and "__pycache__" not in p.parts
        ]
        shipped.append(_zip(files, "fanout-pipeline"))
    if not found["fanout_client.ingest"]:
        spec = importlib.util.find_spec("fanout_client.ingest")
        if spec is None or spec.origin is None or not Path(spec.origin).is_file():
            raise RuntimeError("the executors cannot import fanout_client.ingest and it is no file here to ship")
        client_dir = Path(spec.origin).parent
        shipped.append(_zip([(client_dir / name, f"fanout_client/{name}") for name in _CLIENT_MODULES], "fanout-client"))
    for archive in shipped:
        spark.sparkContext.addPyFile(archive)
    return shipped


#: what the driver JVM prints on its stderr as it starts, whatever the log level: Spark's launcher always adds
#: `--add-modules=jdk.incubator.vector` (for its vectorised BLAS), and the JVM warns of any incubator module
_JVM_START_NOISE = (b"WARNING: Using incubator modules: ",)


def _copy_lines(source: int, target: int) -> None:
    """Copy the lines of the pipe `source` to the descriptor `target` until every writer closed it, but the
    JVM's start-up noise; a failed write drops the line (the JVM must never block on a full pipe). Closes
    both at the end."""
    with os.fdopen(source, "rb") as pipe:
        for line in pipe:
            if line.startswith(_JVM_START_NOISE):
                continue
            with contextlib.suppress(OSError):
                while line:
                    line = line[os.write(target, line) :]
    os.close(target)


@contextlib.contextmanager
def _jvm_start_noise_dropped() -> Iterator[None]:
    """While a JVM may start (getOrCreate), stderr (descriptor 2, which the JVM inherits) is a pipe whose lines
    a thread copies to the real stderr, all but the start-up noise; the JVM keeps the pipe for its life, the
    thread copying until the JVM exits. Our own stderr is restored on leaving."""
    sys.stderr.flush()
    try:
        real = os.dup(2)
    except OSError:  # no stderr to filter
        yield
        return
    read_end, write_end = os.pipe()
    threading.Thread(target=_copy_lines, args=(read_end, real), name="jvm-stderr", daemon=True).start()
    os.dup2(write_end, 2)
    os.close(write_end)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(real, 2)  # `real` stays open for the thread (it writes the JVM's lines there, then closes it)


def get_session(
    master: str | None = DEFAULT_MASTER,
    app_name: str = "fanout-pipeline",
    config: dict[str, str] | None = None,
) -> SparkSession:
    """The SparkSession for a pipeline job (an existing one in this process is reused, as Spark does).

    ``master`` None leaves the choice to spark-submit (``--master``) or, without it, to Spark's default,
    ``local[*]``. ``config`` entries override the defaults, e.g. ``{"spark.driver.memory": "4g"}`` (honoured
    only when this call starts the JVM).
    """
    # Python workers run this interpreter (the venv's) unless the user says otherwise (a cluster's executors
    # may need another path), and a local driver must not go looking for a routable interface: both are read
    # when the JVM starts, so they go into the environment first.
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    if _is_local(master):
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    builder = SparkSession.builder.appName(app_name)
    if master is not None:
        builder = builder.master(master)
    for key, value in {**_base_config(master), **(config or {})}.items():
        builder = builder.config(key, value)
    with _jvm_start_noise_dropped():
        spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    if not master_url(spark).startswith("local"):
        _ship_package(spark)
    return spark
