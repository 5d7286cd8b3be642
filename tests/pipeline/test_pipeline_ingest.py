"""The feed's sink (pipeline/ingest.py) without Spark: the sans-I/O client, and publish() against the ingest
protocol test double (pipeline_ingest_double.py)."""

from __future__ import annotations

import time

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline import ingest
from pipeline.ingest import IngestClient, IngestProtocolError, IngestRefused, encode_record, publish
from tests.pipeline.pipeline_ingest_double import IngestProtocolDouble


def records(topic: str, seqs, payload=lambda s: f'{{"n": {s}}}'):
    return [(topic, s, payload(s)) for s in seqs]


# -- encoding ---------------------------------------------------------------------------------------------


def test_encode_record_reencodes_data_as_json_value():
    assert orjson.loads(encode_record("t", 7, '{"a": [1, 2]}')) == {"topic": "t", "seq": 7, "data": {"a": [1, 2]}}
    assert orjson.loads(encode_record("t", None, "3.5")) == {"topic": "t", "data": 3.5}
    assert orjson.loads(encode_record("t", 1, None)) == {"topic": "t", "seq": 1, "data": None}
    line = encode_record("t", 1, '"two\\nlines"')
    assert line.endswith(b"\n") and line.count(b"\n") == 1


@pytest.mark.parametrize("data", ['1, "client": "c1"', "{", "not json", '{"a": 1}\n{"b": 2}'])
def test_encode_record_refuses_data_that_is_not_one_json_value(data):
    with pytest.raises(ValueError, match="not JSON"):
        encode_record("t", 1, data)


def test_encode_record_refuses_missing_topic():
    with pytest.raises(ValueError, match="topic"):
        encode_record(None, 1, "1")


# -- the sans-I/O client ----------------------------------------------------------------------------------


def synced(sync_id, accepted, refused):
    return orjson.dumps({"type": "synced", "id": sync_id, "accepted": accepted, "refused": refused}) + b"\n"


def error(line, code, message="m"):
    return orjson.dumps({"type": "error", "line": line, "code": code, "message": message}) + b"\n"


def test_client_counts_lines_and_accepts_already_landed():
    client = IngestClient()
    data = client.encode_records(records("t", range(3)))
    assert data.count(b"\n") == 3
    assert client.sync(9) == b'{"sync":9}\n'
    assert client.lines == 4
    client.receive_data(error(2, "duplicate_seq") + error(3, "stale_seq"))
    assert not client.done
    client.receive_data(synced(9, 1, 2))
    assert client.done
    assert client.result == ingest.SyncResult(sync_id=9, records=3, accepted=1, refused=2, duplicates=1, stale=1)


def test_client_checks_each_sync_of_a_connection_separately():
    client = IngestClient()
    client.encode_records(records("t", range(3)))
    client.sync(1)
    client.receive_data(error(1, "duplicate_seq") + synced(1, 2, 1))
    client.encode_records(records("t", range(3, 5)))
    client.sync(2)
    assert not client.done
    with pytest.raises(IngestProtocolError, match="2 records were written"):
        client.receive_data(synced(2, 3, 0))  # cumulative counts where per-sync ones are due


def test_client_sums_the_syncs_of_a_connection():
    client = IngestClient()
    client.encode_records(records("t", range(3)))
    client.sync(1)
    client.receive_data(error(1, "duplicate_seq") + synced(1, 2, 1))
    client.encode_records(records("t", range(3, 5)))
    client.sync(2)
    client.receive_data(error(5, "stale_seq") + synced(2, 1, 1))
    assert client.done
    assert client.result == ingest.SyncResult(sync_id=2, records=5, accepted=3, refused=2, duplicates=1, stale=1)


def test_client_reassembles_answers_split_anywhere():
    client = IngestClient()
    client.encode_records(records("t", range(2)))
    client.sync(1)
    stream = error(1, "duplicate_seq") + synced(1, 1, 1)
    for i in range(len(stream)):
        client.receive_data(stream[i : i + 1])
    assert client.done


def test_client_raises_the_gateway_message_for_other_errors():
    client = IngestClient()
    client.encode_records(records("t", range(2)))
    with pytest.raises(IngestRefused, match="unknown_topic: no such topic t") as info:
        client.receive_data(error(2, "unknown_topic", "no such topic t"))
    assert (info.value.code, info.value.line) == ("unknown_topic", 2)


@pytest.mark.parametrize(
    "answer",
    [
        synced(1, 3, 0),  # more than written
        synced(1, 1, 1),  # a refusal never explained by an error line
        synced(2, 2, 0),  # someone else's sync
        b"garbage\n",
        b'{"type":"synced","id":1,"accepted":"2","refused":0}\n',
    ],
)
def test_client_rejects_inconsistent_answers(answer):
    client = IngestClient()
    client.encode_records(records("t", range(2)))
    client.sync(1)
    with pytest.raises(IngestProtocolError):
        client.receive_data(answer)


def test_client_fails_when_the_connection_closes_before_synced():
    client = IngestClient()
    client.encode_records(records("t", range(2)))
    client.sync(1)
    with pytest.raises(IngestProtocolError, match="closed"):
        client.receive_data(b"")


def test_client_refuses_misuse():
    client = IngestClient()
    client.sync(1)
    with pytest.raises(RuntimeError):
        client.encode_records(records("t", [1]))
    with pytest.raises(RuntimeError):
        client.sync(2)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=80), max_size=6))
def test_client_answer_parser_never_raises_anything_else(chunks):
    """Fuzz: any bytes from the peer either parse or end in an IngestError."""
    client = IngestClient()
    client.encode_records(records("t", range(2)))
    client.sync(1)
    try:
        for chunk in chunks:
            client.receive_data(chunk)
    except ingest.IngestError:
        pass


# -- publish() over a socket, against the protocol test double --------------------------------------------


def test_publish_sends_chunks_then_sync(monkeypatch):
    sizes = []
    real = IngestClient.encode_records

    def spy(self, recs):
        recs = list(recs)
        sizes.append(len(recs))
        return real(self, recs)

    monkeypatch.setattr(IngestClient, "encode_records", spy)
    with IngestProtocolDouble() as double:
        result = publish(records("t", range(1200)), port=double.port, chunk_size=500, sync_id=42)
    assert sizes == [500, 500, 200]
    assert result == ingest.SyncResult(sync_id=42, records=1200, accepted=1200, refused=0)
    assert list(map(len, ingest.chunks(range(7), 3))) == [3, 3, 1]
    assert double.seqs_by_topic() == {"t": list(range(1200))}
    assert [s["id"] for s in double.syncs] == [42]


def test_publish_without_seq_lets_the_gateway_number():
    with IngestProtocolDouble() as double:
        publish([("t", None, "1"), ("t", None, "2")], port=double.port)
        publish([("t", None, "3")], port=double.port)
    assert [(r.seq, r.data) for r in double.landed] == [(0, 1), (1, 2), (2, 3)]


def test_publish_twice_is_idempotent_with_explicit_seqs():
    batch = records("t", range(300)) + records("u", range(300))
    with IngestProtocolDouble() as double:
        first = publish(batch, port=double.port, chunk_size=64)
        second = publish(batch, port=double.port, chunk_size=64)
    assert (first.accepted, first.refused) == (600, 0)
    assert (second.accepted, second.refused) == (0, 600)
    assert len(double.landed) == 600


def test_publish_reads_answers_while_writing():
    """A retried batch is answered with one error line per record; a writer that did not read them would
    deadlock against a server blocked writing those answers (~5 MB here, far above socket buffers)."""
    batch = records("t", range(60_000), payload=lambda s: "0")
    with IngestProtocolDouble() as double:
        publish(batch, port=double.port)
        started = time.monotonic()
        result = publish(batch, port=double.port, timeout=10)
    assert result.refused == 60_000
    assert time.monotonic() - started < 10


def test_publish_raises_the_gateway_message():
    refuse = lambda topic, seq: "forbidden" if topic == "secret" else None  # noqa: E731
    with IngestProtocolDouble(refuse=refuse) as double:
        with pytest.raises(IngestRefused, match="forbidden") as info:
            publish(records("ok", range(10)) + records("secret", [0]), port=double.port)
    assert info.value.line == 11


def test_publish_times_out_without_synced():
    with IngestProtocolDouble(answer_syncs=False) as double:
        started = time.monotonic()
        with pytest.raises(IngestProtocolError, match="no synced answer within 0.5 s"):
            publish(records("t", range(10)), port=double.port, timeout=0.5)
    assert time.monotonic() - started < 5


def test_publish_fails_when_the_gateway_hangs_up():
    with IngestProtocolDouble(close_after_lines=5) as double:
        with pytest.raises(IngestProtocolError):
            publish(records("t", range(10)), port=double.port, timeout=5)


def test_publish_fails_on_connection_refused():
    with IngestProtocolDouble() as double:
        port = double.port
    with pytest.raises(OSError):
        publish(records("t", range(1)), port=port, timeout=2)


# -- Publisher: reconnects, seq answers ---------------------------------------------------------------------


def test_publisher_reconnects_and_writes_again_only_what_it_does_not_know():
    """The first connection drops after 50 lines: nothing was answered (accepted records get no answer), so
    all 100 are written again; the 50 that landed come back duplicate_seq: landed on the broken connection."""
    from pipeline.retry import RetryPolicy

    with IngestProtocolDouble(close_first_after_lines=50) as double:
        with ingest.Publisher("127.0.0.1", double.port, timeout=5, retry=RetryPolicy(2, 0.05, 0.05), chunk_size=10) as pub:
            pub.publish(records("t", range(100)))
            pub.publish(records("t", range(100, 130)))
        outcome = pub.finish()
    assert (outcome.records, outcome.accepted, outcome.landed_on_resend, outcome.reconnects) == (130, 80, 50, 1)
    assert outcome.refusals == {} and double.seqs_by_topic() == {"t": list(range(130))}


def test_publisher_writes_what_it_never_wrote_when_the_connection_breaks_mid_group():
    """The first connection drops after 50 lines while thousands are still to be written: the write that
    fails and those never made are written on the next connection, with the unanswered ones, once each."""
    from pipeline.retry import RetryPolicy

    count = 20_000
    with IngestProtocolDouble(close_first_after_lines=50) as double:
        with ingest.Publisher("127.0.0.1", double.port, timeout=5, retry=RetryPolicy(2, 0.05, 0.05), chunk_size=10) as pub:
            pub.publish(records("t", range(count)))
        outcome = pub.finish()
    assert outcome.reconnects == 1 and outcome.refusals == {} and outcome.lost_on_resend == {}
    assert outcome.accepted + outcome.landed_on_resend == count and outcome.landed_on_resend == 50
    assert double.seqs_by_topic() == {"t": list(range(count))}


def test_publisher_keeps_what_was_answered_before_the_connection_broke():
    from pipeline.retry import RetryPolicy

    refuse = lambda topic, seq: "skipped_seq" if seq in (3, 4) else None  # noqa: E731
    with IngestProtocolDouble(refuse=refuse, close_first_after_lines=7) as double:
        with ingest.Publisher("127.0.0.1", double.port, timeout=5, retry=RetryPolicy(2, 0.05, 0.05)) as pub:
            pub.publish(records("t", range(10)))
        outcome = pub.finish()
    # lines 1-5 are known (line 5's skipped answer came: 1-3 accepted, 4-5 skipped); 6-10 are written again:
    # seqs 5 and 6 had landed before the close (duplicate_seq now), 7-9 are accepted now
    assert outcome.refusals == {("t", "skipped_seq"): [(3, 1, 2)]}
    assert (outcome.records, outcome.accepted, outcome.landed_on_resend, outcome.reconnects) == (10, 6, 2, 1)
    assert sorted(double.seqs_by_topic()["t"]) == [0, 1, 2, 5, 6, 7, 8, 9]


def test_publisher_gives_up_after_its_retries_naming_host_and_port():
    from pipeline.errors import GatewayUnreachable
    from pipeline.retry import RetryPolicy

    with IngestProtocolDouble() as double:
        port = double.port
    started = time.monotonic()
    with pytest.raises(GatewayUnreachable, match=rf"ingest at 127.0.0.1:{port} \(2 retries over \d+ s\).*refused"):
        with ingest.Publisher("127.0.0.1", port, timeout=2, retry=RetryPolicy(2, 0.1, 0.2)) as pub:
            pub.publish(records("t", range(3)))
    assert 0.3 <= time.monotonic() - started < 5


def test_a_refusal_names_the_record():
    from pipeline.retry import RetryPolicy

    refuse = lambda topic, seq: "forbidden" if seq == 2 else None  # noqa: E731
    with IngestProtocolDouble(refuse=refuse) as double:
        with pytest.raises(IngestRefused, match=r"line 3 \(topic 't', seq 2\): forbidden"):
            with ingest.Publisher("127.0.0.1", double.port, retry=RetryPolicy(0, 0, 0)) as pub:
                pub.publish(records("t", range(5)))


@given(st.sets(st.integers(0, 400), max_size=80))
def test_compress_expand_round_trip(seqs):
    runs = ingest.compress(seqs)
    assert list(ingest.expand(runs)) == sorted(seqs)
    assert ingest.compress(range(1, 1000, 2)) == [(1, 2, 500)]
