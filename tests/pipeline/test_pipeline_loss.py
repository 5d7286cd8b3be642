"""No silent success (issue 12): a micro-batch that lost records fails the feed, and re-running its
checkpoint reports the same loss, never "already landed", even once the lost seqs left the gateway's ring
(then the gateway answers them ``stale_seq``, the same answer a record that landed gets).

Against a real gateway on the shipped config (gateway.testing.run_gateway, no topic overrides). The loss is
made deterministic by a producer that runs far ahead of the feed: right before the feed publishes its
micro-batch, a record with a much higher seq lands on one topic, so the gateway gives up the feed's seqs of
that topic as holes (as it does when one spread partition drifts ahead of the others by more than the
reorder window).
"""

from __future__ import annotations

import pytest

import pipeline.feed
from fanout_client.ingest import IngestConnection
from pipeline.__main__ import main

gateway_testing = pytest.importorskip("gateway.testing")

pytestmark = pytest.mark.spark

#: feed.* rule: reorder_window 65,536, capacity 65,536 (config/default.toml)
WINDOW = 65_536


def publish_far_ahead(port: int, topic: str, seq: int) -> None:
    with IngestConnection(port=port) as connection:
        connection.send({"topic": topic, "seq": seq, "data": "ahead"})
        synced = connection.sync(1)
        assert (synced.accepted, synced.refused) == (1, 0)


def feed(gw, checkpoint, *extra: str) -> list[str]:
    return ["feed", "--source", "rate", "--rows-per-batch", "1000", "--topics", "4", "--available-now",
            "--checkpoint", str(checkpoint), "--port", str(gw.ingest_port), "--admin-url", gw.http_url,
            "--admin-token", gw.admin_token, "--retries", "1", *extra]  # fmt: skip


@pytest.fixture
def ahead_once(monkeypatch):
    """Makes the next published micro-batch meet a producer that ran ahead on topic feed.rate-0."""
    real = pipeline.feed.publish_batch
    plan: list[tuple[int, int]] = []

    def publish_batch(batch_df, batch_id, opts):
        while plan:
            publish_far_ahead(opts.port, "feed.rate-0", plan.pop(0)[1])
        return real(batch_df, batch_id, opts)

    monkeypatch.setattr(pipeline.feed, "publish_batch", publish_batch)
    return lambda seq: plan.append((0, seq))


def last_line(text: str) -> str:
    return text.strip().splitlines()[-1]


def test_rerunning_a_failed_checkpoint_never_turns_loss_into_success(spark, tmp_path, capsys, ahead_once):
    checkpoint = tmp_path / "ck"
    with gateway_testing.run_gateway() as gw:
        # first run: feed.rate-0's seqs 0..249 are given up before they arrive, and stay in the ring
        ahead_once(WINDOW + 4_000)
        assert main(feed(gw, checkpoint)) == 1
        err = capsys.readouterr().err
        assert "1000 records: 750 delivered into the ring (750 accepted now, 0 landed earlier), 250 lost" in err
        assert last_line(err).startswith("feed: micro-batch 0: 250 of 1000 records lost (feed.rate-0 250 ([0, 250)))")
        assert "not committed" in last_line(err)

        # the ring moves on (another 2 x capacity seqs): the given-up seqs leave it, so the gateway now
        # answers them stale_seq, as it answers the 750 that landed
        publish_far_ahead(gw.ingest_port, "feed.rate-0", 3 * WINDOW + 10_000)

        # the re-run replays batch 0: every record is refused; the ledger says which ones were lost
        assert main(feed(gw, checkpoint)) == 1
        err = capsys.readouterr().err
        assert "1000 records: 750 delivered into the ring (0 accepted now, 750 landed earlier), 250 lost" in err
        assert "micro-batch 0: 250 of 1000 records lost" in last_line(err)

        # --allow-loss commits batch 0 (still reported, exit 0); available-now then also runs batch 1, whose
        # seqs 250..499 of feed.rate-0 are behind the far-ahead record too
        assert main(feed(gw, checkpoint, "--allow-loss")) == 0
        out = capsys.readouterr().out
        assert (
            "2 batches, 2000 records: 1500 delivered into the ring (750 accepted now, 750 landed earlier), "
            "500 lost (feed.rate-0 500)"
        ) in out
        # the next run (batch 2, lossy as well) also says what the checkpoint lost before
        assert main(feed(gw, checkpoint)) == 1
        assert "earlier runs on this checkpoint lost 500 records (batches 0, 1)" in capsys.readouterr().err


def test_loss_of_seqs_gone_from_the_ring_before_they_arrive(spark, tmp_path, capsys, ahead_once):
    """Given up and gone from the ring before the feed's records arrive, on the very first attempt: a gateway
    that remembers given-up seqs answers skipped_seq, an older one stale_seq; as those seqs were at or above
    the topic's end when the batch started, lost either way, never "already landed"."""
    with gateway_testing.run_gateway() as gw:
        ahead_once(3 * WINDOW + 10_000)
        assert main(feed(gw, tmp_path / "ck")) == 1
        err = capsys.readouterr().err
        assert "750 delivered into the ring (750 accepted now, 0 landed earlier), 250 lost" in err


def test_a_second_checkpoint_over_the_same_topics_is_not_loss(spark, tmp_path, capsys):
    """Records another checkpoint published before are "already present": not delivered by this feed, not
    lost, exit 0."""
    with gateway_testing.run_gateway() as gw:
        assert main(feed(gw, tmp_path / "ck1")) == 0
        capsys.readouterr()
        assert main(feed(gw, tmp_path / "ck2")) == 0
        out = capsys.readouterr().out
        assert "0 delivered into the ring (0 accepted now, 0 landed earlier), 0 lost; 1000 already present" in out
