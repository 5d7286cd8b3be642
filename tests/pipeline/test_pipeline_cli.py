"""The console entry point (python -m pipeline), in-process on the shared session, and its --help."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pipeline.__main__ import build_parser, main
from pipeline_ingest_double import IngestProtocolDouble
from test_pipeline_audit import hand_log, write_log


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
        argv = ["feed", "--rows-per-batch", "40", "--topics", "2", "--available-now", "--by-topic",
                "--port", str(double.port), "--checkpoint", str(tmp_path / "ck")]  # fmt: skip
        assert main(argv) == 0
    assert "40 records, 40 accepted" in capsys.readouterr().out
    assert sorted(double.seqs_by_topic()) == ["rate-0", "rate-1"]


@pytest.mark.spark
def test_feed_command_failure_names_the_gateway_error(spark, tmp_path, capsys):
    refuse = lambda topic, seq: "unknown_topic" if topic == "rate-1" else None  # noqa: E731
    with IngestProtocolDouble(refuse=refuse) as double:
        argv = ["feed", "--rows-per-batch", "20", "--available-now", "--port", str(double.port),
                "--checkpoint", str(tmp_path / "ck")]  # fmt: skip
        assert main(argv) == 1
    err = capsys.readouterr().err
    assert "feed: failed: pipeline.ingest.IngestRefused: gateway refused line" in err and "unknown_topic" in err
