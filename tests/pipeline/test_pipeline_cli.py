"""The console entry point (python -m pipeline), in-process on the shared session, and its --help."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pipeline.__main__ import build_parser, main
from tests.pipeline.pipeline_ingest_double import IngestProtocolDouble
from tests.pipeline.test_pipeline_audit import hand_log, write_log


def test_help_runs_without_spark():
    out = subprocess.run([sys.executable, "-m", "pipeline", "feed", "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "--by-topic" in out.stdout and "--lockstep" in out.stdout


def test_parser_defaults():
    args = build_parser().parse_args(["feed"])
    assert (args.source, args.host, args.port, args.num_partitions, args.chunk_size) == ("rate", "127.0.0.1", 7002, 2, 500)
    assert args.master is None and not args.by_topic


def test_bad_option_combination_exits_2(capsys):
    assert main(["feed", "--source", "rate", "--available-now"]) == 2
    assert "--rows-per-batch" in capsys.readouterr().err


@pytest.mark.spark
def test_audit_command(spark, tmp_path, capsys):
    log = write_log(hand_log(), tmp_path / "log.parquet")
    assert main(["audit", log, str(tmp_path / "out"), "--exact"]) == 0
    assert "loss rate 0.095238" in capsys.readouterr().out
    assert json.loads((tmp_path / "out" / "report.json").read_text())["loss"]["missing"] == 2
    assert not spark.sparkContext._jsc.sc().isStopped()  # the caller's session is left running


@pytest.mark.spark
def test_feed_command(spark, tmp_path, capsys):
    with IngestProtocolDouble() as double:
        argv = ["feed", "--rows-per-batch", "40", "--topics", "2", "--available-now", "--by-topic", "--no-admin",
                "--port", str(double.port), "--checkpoint", str(tmp_path / "ck")]  # fmt: skip
        assert main(argv) == 0
    assert "40 records: 40 delivered into the ring (40 accepted now, 0 landed earlier), 0 lost" in capsys.readouterr().out
    assert sorted(double.seqs_by_topic()) == ["feed.rate-0", "feed.rate-1"]


@pytest.mark.spark
def test_feed_command_failure_names_the_gateway_error(spark, tmp_path, capsys):
    refuse = lambda topic, seq: "unknown_topic" if topic == "feed.rate-1" else None  # noqa: E731
    with IngestProtocolDouble(refuse=refuse) as double:
        argv = ["feed", "--rows-per-batch", "20", "--available-now", "--port", str(double.port), "--no-admin",
                "--checkpoint", str(tmp_path / "ck")]  # fmt: skip
        assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1].startswith("feed: gateway refused line")
    assert "topic 'feed.rate-1'" in err and "unknown_topic" in err and "Traceback" not in err


@pytest.mark.spark
def test_audit_of_a_log_without_a_column_names_it(spark, tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{k: v for k, v in r.items() if k != "deliver_ns"} for r in hand_log()]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "bad.parquet")
    assert main(["audit", str(tmp_path / "bad.parquet"), str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("audit: delivery log ") and "has no column 'deliver_ns' (int64)" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert main(["audit", str(tmp_path / "nowhere"), str(tmp_path / "out"), "-v"]) == 1
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == f"audit: no delivery log at {tmp_path / 'nowhere'}"
    assert "Traceback" in err  # -v after the subcommand: the traceback too


def test_verbose_is_accepted_before_and_after_the_subcommand():
    assert build_parser().parse_args(["-v", "feed"]).verbose
    assert build_parser().parse_args(["feed", "-v"]).verbose
    assert build_parser().parse_args(["audit", "a", "b", "--verbose"]).verbose
    assert not build_parser().parse_args(["feed"]).verbose


def test_gateway_down_names_host_and_port(capsys):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = ["feed", "--rows-per-batch", "10", "--available-now", "--admin-url", f"http://127.0.0.1:{port}",
            "--admin-token", "t", "--retries", "1", "--backoff", "0.1"]  # fmt: skip
    assert main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"feed: cannot reach the gateway's admin API at 127.0.0.1:{port} (1 retries over")
    assert "Connection refused" in err[-1] and not any("Traceback" in line for line in err)


def test_ship_package_zips_only_what_the_executors_miss(monkeypatch, tmp_path):
    import re
    import tempfile
    import types
    import zipfile

    from pipeline import spark as spark_module

    added: list[str] = []
    fake = types.SimpleNamespace(sparkContext=types.SimpleNamespace(addPyFile=added.append))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(spark_module, "_executors_can_import", lambda s, m: {name: False for name in m})
    shipped = spark_module._ship_package(fake)
    assert added == shipped and len(shipped) == 2
    names = [p.rsplit("/", 1)[1] for p in shipped]
    assert re.fullmatch(r"fanout-pipeline-[0-9a-f]{12}\.zip", names[0])
    assert re.fullmatch(r"fanout-client-[0-9a-f]{12}\.zip", names[1])
    pipeline_files = zipfile.ZipFile(shipped[0]).namelist()
    assert "pipeline/feed.py" in pipeline_files and not any("__pycache__" in n for n in pipeline_files)
    assert zipfile.ZipFile(shipped[1]).namelist() == ["fanout_client/__init__.py", "fanout_client/ingest.py"]
    monkeypatch.setattr(spark_module, "_executors_can_import", lambda s, m: {name: True for name in m})
    assert spark_module._ship_package(fake) == []  # importable there (--py-files, installed): not shipped again


def test_shipped_archives_are_removed_at_exit(tmp_path):
    script = (
        "from pathlib import Path\nfrom pipeline.spark import _zip\n"
        "print(_zip([(Path('pipeline/__init__.py'), 'pipeline/__init__.py')], 'x'))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        env={**__import__("os").environ, "TMPDIR": str(tmp_path)},
    )
    assert out.stdout.startswith(str(tmp_path)) and list(tmp_path.iterdir()) == []


@pytest.mark.spark
def test_feed_without_checkpoint_leaves_no_temporary_directory(spark, tmp_path, monkeypatch, capsys):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with IngestProtocolDouble() as double:
        assert main(["feed", "--rows-per-batch", "20", "--available-now", "--no-admin", "--port", str(double.port)]) == 0
    assert "20 delivered into the ring" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []
