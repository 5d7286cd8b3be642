"""The checkpoint's ledger (pipeline/ledger.py): how an attempt's answers become delivered / lost / already
present, and that a replay of a lossy batch stays lossy even when the gateway then answers ``stale_seq``
(the answer an older gateway gives a given-up seq once it left the ring)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pipeline.errors import LossError
from pipeline.feed import FeedOptions, run_feed
from pipeline.ledger import CheckpointStore, Ledger, classify, intervals
from pipeline.retry import RetryPolicy
from tests.pipeline.pipeline_ingest_double import IngestProtocolDouble

E1 = "e-1"


def test_intervals():
    assert intervals([5, 1, 2, 3, 9, 9]) == [[1, 4], [5, 6], [9, 10]]
    assert intervals([]) == []


def test_first_attempt():
    start = {"t": {"epoch": E1, "end": 100}}
    refusals = {("t", "skipped_seq"): [150], ("t", "stale_seq"): [50, 120], ("t", "duplicate_seq"): [130]}
    out = classify(0, accepted=10, refusals=refusals, lost_on_resend={}, landed_on_resend=2, start=start, prior=None)
    # skipped: lost; stale at/above the end the batch started with: lost; below it, or duplicate: present before
    assert out.lost == {"t": {"epoch": E1, "ranges": [[120, 121], [150, 151]]}}
    assert (out.accepted, out.landed_earlier, out.already_present, out.delivered) == (10, 2, 2, 12)


def test_replay_after_a_recorded_outcome_uses_it():
    prior = {"start": {"t": {"epoch": None, "end": 0}},
             "outcome": {"lost": {"t": {"epoch": E1, "ranges": [[3, 5]]}}, "epochs": {"t": E1}}}  # fmt: skip
    refusals = {("t", "stale_seq"): [0, 1, 2, 3, 4], ("t", "duplicate_seq"): [5]}
    out = classify(0, accepted=0, refusals=refusals, lost_on_resend={}, landed_on_resend=0,
                   start={"t": {"epoch": E1, "end": 6}}, prior=prior)  # fmt: skip
    assert out.lost == {"t": {"epoch": E1, "ranges": [[3, 5]]}}
    assert (out.landed_earlier, out.already_present, out.unverified) == (4, 0, 0)


def test_replay_after_an_attempt_that_died_is_landed_but_unverified():
    prior = {"start": {"t": {"epoch": None, "end": 0}}, "outcome": None}
    out = classify(0, accepted=1, refusals={("t", "stale_seq"): [0, 1]}, lost_on_resend={}, landed_on_resend=0,
                   start={"t": {"epoch": E1, "end": 2}}, prior=prior)  # fmt: skip
    assert out.lost == {} and (out.landed_earlier, out.unverified) == (2, 2)


def test_replay_in_a_new_epoch_is_a_first_attempt_there():
    prior = {"start": {"t": {"epoch": E1, "end": 0}},
             "outcome": {"lost": {"t": {"epoch": E1, "ranges": [[0, 5]]}}, "epochs": {"t": E1}}}  # fmt: skip
    out = classify(0, accepted=5, refusals={}, lost_on_resend={}, landed_on_resend=0,
                   start={"t": {"epoch": "e-2", "end": 0}}, prior=prior)  # fmt: skip
    assert out.lost == {} and out.delivered == 5


def test_ledger_round_trip(tmp_path):
    ledger = Ledger.in_checkpoint(str(tmp_path / "ck"))
    prior, start, attempt = ledger.begin(0, {"t": {"epoch": None, "end": 0}})
    assert prior is None and attempt == 1
    out = classify(0, accepted=3, refusals={("t", "skipped_seq"): [3]}, lost_on_resend={}, landed_on_resend=0,
                   start=start, prior=prior)  # fmt: skip
    out.set_epochs({"t": E1})
    ledger.finish(out)
    again = Ledger(CheckpointStore(str(tmp_path / "ck" / "feed-ledger")))
    prior, _, attempt = again.begin(0, {"t": {"epoch": E1, "end": 4}})
    assert attempt == 2 and prior["outcome"]["lost"] == {"t": {"epoch": E1, "ranges": [[3, 4]]}}
    assert again.earlier_loss() == (1, [0]) and again.epochs == {"t": E1}


@pytest.mark.spark
def test_an_older_gateway_that_answers_stale_for_given_up_seqs(spark, tmp_path):
    """skipped_seq on the first attempt, stale_seq on every later one (the seq left the ring): the re-run
    must still report the loss, and --allow-loss commits it with the same figures."""
    given_up = {("feed.rate-0", s) for s in range(10, 20)}
    answered: set = set()

    def refuse(topic, seq):
        if (topic, seq) not in given_up:
            return None
        code = "stale_seq" if (topic, seq) in answered else "skipped_seq"
        answered.add((topic, seq))
        return code

    opts = FeedOptions(source="rate", rows_per_batch=120, topics=3, available_now=True, chunk_size=50,
                       checkpoint=str(tmp_path / "ck"), timeout=20, admin_url=None,
                       retry=RetryPolicy(1, 0.1, 0.1))  # fmt: skip
    with IngestProtocolDouble(refuse=refuse) as double:
        opts = replace(opts, port=double.port)
        with pytest.raises(LossError, match=r"micro-batch 0: 10 of 120 records lost \(feed.rate-0 10 \(\[10, 20\)\)\)"):
            run_feed(spark, opts)
        with pytest.raises(LossError) as info:
            run_feed(spark, opts)
        stats = info.value.stats
        assert (stats.records, stats.accepted, stats.landed_earlier, stats.lost, stats.stale) == (120, 0, 110, 10, 10)
        allowed = run_feed(spark, replace(opts, allow_loss=True))
        assert (allowed.lost, allowed.landed_earlier) == (10, 110)
        after = run_feed(spark, opts)  # the next micro-batch is clean; the checkpoint remembers batch 0
        assert (after.lost, after.accepted, after.earlier_lost, after.earlier_lossy_batches) == (0, 120, 10, [0])
