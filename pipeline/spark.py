"""One place that builds the SparkSession of every pipeline job and test.

Offline and quiet on a small machine: no UI, no progress bars, ERROR-level logging from the first line (a
log4j2 file of our own is handed to the driver JVM before it starts), two shuffle partitions (the data of
one micro-batch or one test is small; a large audit raises it with ``--conf``), and no
``spark.jars.packages`` (nothing is downloaded). The same code runs on a cluster with ``master="spark://..."``
or ``"yarn"``: then the loopback settings are left out and the ``pipeline`` package is shipped to the
executors.
"""

from __future__ import annotations

import os
import sys
import tempfile
import zipfile
from pathlib import Path

from pyspark.sql import SparkSession

__all__ = ["DEFAULT_MASTER", "LOG4J2_PROPERTIES", "get_session"]

DEFAULT_MASTER = "local[*]"
LOG4J2_PROPERTIES = Path(__file__).with_name("log4j2.properties")
_PACKAGE_DIR = Path(__file__).parent


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


#: what executors import from the gateway package: its ingest client only (no server dependency)
_GATEWAY_MODULES = ("__init__.py", "ingest_client.py")


def _ship_package(spark: SparkSession) -> None:
    """Zip ``pipeline/`` and the gateway's ingest client, and add them to the executors' Python path
    (cluster masters only)."""
    archive = Path(tempfile.mkdtemp(prefix="pipeline-pyfiles-")) / "pipeline.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        for path in _PACKAGE_DIR.rglob("*"):
            if path.is_file() and "__pycache__" not in path.parts:
                zf.write(path, Path("pipeline") / path.relative_to(_PACKAGE_DIR))
        gateway_dir = _PACKAGE_DIR.parent / "gateway"
        for name in _GATEWAY_MODULES:
            zf.write(gateway_dir / name, Path("gateway") / name)
    spark.sparkContext.addPyFile(str(archive))


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
    # Python workers must run this interpreter (the venv's), and a local driver must not go looking for a
    # routable interface: both are read when the JVM starts, so they go into the environment first.
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    if _is_local(master):
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    builder = SparkSession.builder.appName(app_name)
    if master is not None:
        builder = builder.master(master)
    for key, value in {**_base_config(master), **(config or {})}.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    if not spark.sparkContext.master.startswith("local"):
        _ship_package(spark)
    return spark
