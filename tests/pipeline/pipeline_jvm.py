"""JVM options that make the tests' short-lived Spark JVMs start and warm up faster, results unchanged.

On the shared 2-core machine the JVM's optimising (C2) compiler threads cost a test Spark JVM most of its
CPU: a test's jobs are over before C2 code would pay off. ``-XX:TieredStopAtLevel=1`` keeps the quick C1
compiler only, and the serial collector needs no GC threads (the heaps are small); measured, the first audit
of the shared session took 15 s instead of 50 s on a busy machine. Spark's own environment variables carry
them, each to one kind of JVM, with nothing printed (unlike ``JAVA_TOOL_OPTIONS``).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

JAVA_OPTIONS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"

#: spark-class's launcher (SPARK_LAUNCHER_OPTS), a driver started by spark-submit or PySpark
#: (SPARK_SUBMIT_OPTS), a standalone master and worker (SPARK_DAEMON_JAVA_OPTS)
VARIABLES = ("SPARK_LAUNCHER_OPTS", "SPARK_SUBMIT_OPTS", "SPARK_DAEMON_JAVA_OPTS")


def fast_jvm_env(env: dict[str, str] | None = None, conf_dir: Path | None = None) -> dict[str, str]:
    """``env`` (default: ours) with JAVA_OPTIONS for every JVM Spark starts; with ``conf_dir``, also a
    spark-defaults.conf there (SPARK_CONF_DIR) giving them to the executors a cluster starts."""
    out = dict(os.environ if env is None else env)
    for name in VARIABLES:
        out[name] = f"{out.get(name, '')} {JAVA_OPTIONS}".strip()
    if conf_dir is not None:
        conf_dir.mkdir(parents=True, exist_ok=True)
        (conf_dir / "spark-defaults.conf").write_text(f"spark.executor.extraJavaOptions {JAVA_OPTIONS}\n")
        out["SPARK_CONF_DIR"] = str(conf_dir)
    return out


@contextlib.contextmanager
def fast_jvm() -> Iterator[None]:
    """While a JVM starts in this process (get_session): our environment with JAVA_OPTIONS, restored after."""
    saved = {name: os.environ.get(name) for name in VARIABLES}
    os.environ.update({name: fast_jvm_env()[name] for name in VARIABLES})
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
