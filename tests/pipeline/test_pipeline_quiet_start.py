"""Starting Spark for a pipeline job prints nothing but real problems (issue 34, item 21): Spark's launcher
always starts the driver JVM with `--add-modules=jdk.incubator.vector`, and the JVM then prints "WARNING:
Using incubator modules: jdk.incubator.vector" on its stderr, which no Spark setting or log level silences.
pipeline/spark.py drops that one line; the JVM's other lines still reach stderr. A fresh interpreter, as
`fanout-pipeline feed` starts one (the suite's shared session started its JVM long before)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap

import pytest

from tests.pipeline.pipeline_jvm import fast_jvm_env

pytestmark = pytest.mark.spark


def test_starting_a_session_prints_no_jvm_start_up_warning() -> None:
    pytest.importorskip("pyspark")
    if shutil.which("java") is None:
        pytest.skip("no Java (`make java`)")
    code = textwrap.dedent("""
        import sys
        from pipeline.spark import get_session

        spark = get_session("local[1]", "quiet-start")
        assert spark.range(3).count() == 3
        print("a line of ours", file=sys.stderr, flush=True)
        spark.stop()
    """)
    # fast_jvm_env: JVM options only (C1, serial GC), which print nothing
    ran = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180, env=fast_jvm_env())
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert "Using incubator modules" not in ran.stderr, ran.stderr
    assert "a line of ours" in ran.stderr
