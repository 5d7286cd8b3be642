"""Every command of docs/pipeline.md runs as written against a gateway started from the shipped config
(gateway.testing.run_gateway with no topic overrides: config/default.toml's rules, ephemeral ports), with
these substitutions only: the gateway's ports and admin token, /data and /tmp/ck in a temporary directory,
--max-seconds 600 -> 4 (the one micro-batch of the file only has to start by then), and the benchmarks'
sizes made small. The cluster commands (spark://spark-master...,
the zip + spark-submit recipe) are run by test_pipeline_cluster.py on a standalone cluster.

The demo is watched by a live WebSocket subscriber, which must get every record of every topic, in order,
with no loss entry: the shipped feed.* rule fits the documented micro-batches.
"""

from __future__ import annotations

import contextlib
import json

import pytest

import pipeline.bench
from pipeline.__main__ import main
from tests.pipeline.pipeline_docs import argv, commands, is_cluster_command
from tests.pipeline.test_pipeline_audit import hand_log, write_log
from tests.pipeline.test_pipeline_e2e import Subscriber, subscriber_socket

gateway_testing = pytest.importorskip("gateway.testing")

pytestmark = pytest.mark.spark

RECORDS = [{"topic": f"feed.files-{t}", "seq": s, "data": json.dumps({"t": t, "s": s})} for s in range(50) for t in range(2)]


def test_the_documented_commands(spark, tmp_path, monkeypatch, capsys):
    data = tmp_path / "data"
    (data / "records").mkdir(parents=True)
    staging = tmp_path / "part-0.json"
    staging.write_text("".join(json.dumps(r) + "\n" for r in RECORDS) + "not a record\n")
    staging.rename(data / "records" / "part-0.json")
    write_log(hand_log(), data / "deliveries.parquet")
    (tmp_path / "deliverylog").mkdir()
    (tmp_path / "deliverylog" / "deliveries-x-1-1.jsonl").write_text(
        "".join(json.dumps({**r, "transport": "ws"}) + "\n" for r in hand_log())
    )
    ran = []
    with gateway_testing.run_gateway() as gw, contextlib.ExitStack() as stack:
        subscriber = Subscriber(stack.enter_context(subscriber_socket(gw.ws_url)),
                                [f"feed.rate-{t}" for t in range(4)])  # fmt: skip
        where = ["--port", str(gw.ingest_port), "--admin-url", gw.http_url]
        substitutions = {"/tmp/ck": str(tmp_path / "ck"), "/data/": f"{data}/", "--max-seconds 600": "--max-seconds 4",
                         "--rows 10000000": "--rows 20000", "--port 7002": f"--port {gw.ingest_port}",
                         "--follow deliverylog": f"--follow {tmp_path / 'deliverylog'}"}  # fmt: skip
        for command in commands():
            if is_cluster_command(command):
                continue
            words = argv(command, substitutions)
            if words[0] == "export":
                name = words[1].split("=")[0]
                monkeypatch.setenv(name, gw.admin_token)
            elif words[:3] == ["python", "-m", "pipeline"]:
                extra = where if words[3] == "feed" else ["--available-now"] if "--follow" in words else []
                assert main(words[3:] + extra) == 0, (command, capsys.readouterr())
            elif words[:3] == ["python", "-m", "pipeline.bench"]:
                extra = ["--rows-per-batch", "2000", "--batches", "2"] if "feed" in words else ["--dir", str(tmp_path / "bench")]
                if "feed" in words and "--in-process-gateway" not in words:
                    extra += ["--admin-url", gw.http_url]
                assert pipeline.bench.main(words[3:] + extra) == 0, command
            else:
                pytest.fail(f"docs/pipeline.md has a command this test does not know how to run: {command}")
            ran.append(words[:4])
            out = capsys.readouterr()
            if words[0] == "export":
                continue
            if words[3] == "feed" and words[2] == "pipeline" and "rate" in words:
                assert "1000 records: 1000 delivered into the ring (1000 accepted now, 0 landed earlier), 0 lost" in out.out
                subscriber.wait_for({f"feed.rate-{t}": 249 for t in range(4)})
                assert subscriber.losses() == []
                for t in range(4):
                    assert subscriber.seqs(f"feed.rate-{t}") == list(range(250))
            elif words[3] == "feed" and words[2] == "pipeline":
                assert "100 records: 100 delivered into the ring" in out.out and "1 bad input records set aside" in out.out
                dead = [json.loads(line) for line in (data / "bad" / "batch-0.jsonl").read_text().splitlines()]
                assert [(d["line"], d["record"]) for d in dead] == [(101, "not a record")]
                assert 'fanout_feed_records_total{outcome="delivered"} 100' in (data / "feed.prom").read_text()
            elif words[3] == "audit" and "--follow" in words:
                assert "audit: 0 windows of 60 s finished" in out.out  # 1.3 us of traffic: no window closed yet
            elif words[3] == "audit":
                assert "loss rate 0.095238" in out.out and (data / "report" / "report.json").exists()
    assert [w[3] for w in ran if w[2:3] == ["pipeline"]] == ["feed", "feed", "audit", "audit"]
    assert len([w for w in ran if w[2:3] == ["pipeline.bench"]]) == 3
