"""What the subscribers of one process receive, kept in compact arrays in arrival order.

One row per ``msg`` entry: 40 bytes, no Python object kept per message. The hot path is
:meth:`Recorder.entries`, called once per delivered frame or poll batch with its already parsed entries.
Messages are the load generator's own: their data is ``{"ts": publish ns, "t": topic, "n": k, "pad": ...}``;
``n == -1`` marks the priming message published before anyone subscribed (never counted).
"""

from __future__ import annotations

import pickle
import resource
from array import array
from collections import Counter
from pathlib import Path
from typing import Any

import msgspec

#: a row costs 40 bytes: 20 M rows is 800 MB per process, then rows are counted but not kept
DEFAULT_MAX_ROWS = 20_000_000
#: how many error entries to keep verbatim for the report
ERROR_SAMPLES = 20


class _Stamp(msgspec.Struct, gc=False):
    """The fields of a load message's data the recorder reads (the padding is skipped, never built)."""

    ts: int
    n: int


class _Msg(msgspec.Struct, tag_field="type", tag="msg", gc=False):
    topic: str
    seq: int
    data: _Stamp


class _Raw(msgspec.Struct, gc=False):
    """A load message as nchan delivers it: the published body itself."""

    t: str
    ts: int
    n: int


#: the common frame, a batch of nothing but well-formed load messages, decoded without a dict per entry;
#: any other frame fails validation and takes the general path (orjson, :meth:`Recorder.entries`)
_decode_msgs = msgspec.json.Decoder(list[_Msg]).decode
_decode_raw = msgspec.json.Decoder(_Raw).decode
_NOT_COMMON = (msgspec.ValidationError, msgspec.DecodeError)


class Recorder:
    """Accumulates the rows, loss notices, subscription starts and errors of the clients of one process."""

    def __init__(self, topic_index: dict[str, int], stalled: list[bool], max_rows: int = DEFAULT_MAX_ROWS):
        self.topic_index = topic_index
        #: by global client index: the client stalls at some point (its counts go to the "stalled" side)
        self.stalled = stalled
        self.max_rows = max_rows
        self.topic, self.client = array("i"), array("i")
        self.seq, self.publish_ns, self.deliver_ns, self.batch_id = array("q"), array("q"), array("q"), array("q")
        #: (client, topic, from, to or -1, reason, deliver_ns)
        self.losses: list[tuple[int, int, int, int, str, int]] = []
        #: (client, topic) -> first seq the stream promises
        self.starts: dict[tuple[int, int], int] = {}
        #: (client, topic) -> the epoch of its first ``subscribed`` entry (a reconnect's ``since`` names it)
        self.epochs: dict[tuple[int, int], str] = {}
        #: (client, topic) -> the ``since`` seq of a resubscribe whose ``subscribed`` entry is awaited: that
        #: entry does not move the stream's start (a gap across the reconnect must show as a gap)
        self.resuming: dict[tuple[int, int], int] = {}
        #: (client, topic, since seq, subscribed seq, receive ns) per answered resubscribe
        self.resumes: list[tuple[int, int, int, int, int]] = []
        self.errors: Counter[str] = Counter()
        self.error_samples: list[Any] = []
        self.frames = 0
        self.foreign = 0  # msg entries on topics not ours
        self.dropped_rows = 0  # beyond max_rows
        #: [light, stalled] totals, read by the progress reporter
        self.msgs = [0, 0]
        self.lost = [0, 0]

    def entries(self, client: int, entries: Any, batch_id: int, now: int) -> int:
        """Record one delivered batch of gateway entries; returns how many ``subscribed`` entries it held."""
        self.frames += 1
        if type(entries) is dict:
            entries = [entries]
        elif type(entries) is not list:
            self._error("bad_batch", entries)
            return 0
        topic_index = self.topic_index
        subscribed = 0
        rows = 0
        for e in entries:
            kind = e.get("type") if type(e) is dict else None
            if kind == "msg":
                t = topic_index.get(e.get("topic"))
                if t is None:
                    self.foreign += 1
                    continue
                data = e.get("data")
                seq = e.get("seq")
                if type(seq) is not int:
                    self._error("bad_seq", e)
                    continue
                ts = -1
                if type(data) is dict:
                    n = data.get("n")
                    if type(n) is int and n < 0:  # priming message: the stream starts after it
                        self._starts_at(client, t, seq + 1)
                        continue
                    ts = data.get("ts", -1)
                    if type(ts) is not int:  # not one of ours (another publisher on --url)
                        ts = -1
                rows += 1
                if len(self.seq) >= self.max_rows:
                    self.dropped_rows += 1
                    continue
                self.topic.append(t)
                self.seq.append(seq)
                self.client.append(client)
                self.publish_ns.append(ts)
                self.deliver_ns.append(now)
                self.batch_id.append(batch_id)
            elif kind == "loss":
                t = topic_index.get(e.get("topic"), -1)
                start, end = e.get("from", 0), e.get("to")
                end = -1 if end is None else end
                if type(start) is not int or type(end) is not int:
                    self._error("bad_loss", e)
                    continue
                self.losses.append((client, t, start, end, str(e.get("reason")), now))
                if end >= 0:
                    self.lost[self.stalled[client]] += end - start
            elif kind == "subscribed":
                t = topic_index.get(e.get("topic"))
                if t is not None:
                    subscribed += 1
                    key = (client, t)
                    since = self.resuming.pop(key, None)
                    seq = e.get("seq", 0)
                    if since is not None:
                        self.resumes.append((client, t, since, seq if type(seq) is int else -1, now))
                        continue
                    self._starts_at(client, t, seq)
                    epoch = e.get("epoch")
                    if isinstance(epoch, str):
                        self.epochs.setdefault(key, epoch)
            elif kind == "error":
                self._error(str(e.get("code")), e)
            elif kind not in ("reply", "unsubscribed", "closed"):
                self._error(f"unknown_entry:{kind}", e)
        self.msgs[self.stalled[client]] += rows
        return subscribed

    def msg_frame(self, client: int, body: bytes, batch_id: int, now: int) -> bool:
        """Record a gateway frame if it holds only load messages (the hot path: a row costs 0.56-0.84 of
        what orjson and :meth:`entries` spend on it). Returns False, recording nothing, for any other frame."""
        try:
            msgs = _decode_msgs(body)
        except _NOT_COMMON:
            return False
        self.frames += 1
        topic_index = self.topic_index
        seqs = self.seq
        add_topic, add_seq, add_stamp = self.topic.append, seqs.append, self.publish_ns.append
        add_client, add_now, add_batch = self.client.append, self.deliver_ns.append, self.batch_id.append
        room = self.max_rows - len(seqs)
        rows = 0
        for m in msgs:
            t = topic_index.get(m.topic)
            if t is None:
                self.foreign += 1
                continue
            data = m.data
            if data.n < 0:  # priming message: the stream starts after it
                self._starts_at(client, t, m.seq + 1)
                continue
            rows += 1
            if rows > room:
                self.dropped_rows += 1
                continue
            add_topic(t)
            add_seq(m.seq)
            add_stamp(data.ts)
            add_client(client)
            add_now(now)
            add_batch(batch_id)
        self.msgs[self.stalled[client]] += rows
        return True

    def raw_frame(self, client: int, body: bytes, batch_id: int, now: int) -> bool:
        """:meth:`raw_message` for a body that is a well-formed load message, decoded without a dict (as
        :meth:`msg_frame`, so both targets are read at the same cost). Returns False for any other body."""
        try:
            raw = _decode_raw(body)
        except _NOT_COMMON:
            return False
        self.frames += 1
        self._raw_row(client, raw.t, raw.n, raw.ts, batch_id, now)
        return True

    def raw_message(self, client: int, body: bytes, data: Any, batch_id: int, now: int) -> None:
        """Record one message delivered as its raw published body (nchan): ``data`` is that body parsed."""
        self.frames += 1
        if type(data) is not dict or type(data.get("t")) is not str:
            self._error("bad_message", body[:200])
            return
        n, ts = data.get("n"), data.get("ts", -1)
        if type(n) is not int or type(ts) is not int:
            self._error("bad_message", body[:200])
            return
        self._raw_row(client, data["t"], n, ts, batch_id, now)

    def _raw_row(self, client: int, name: str, seq: int, ts: int, batch_id: int, now: int) -> None:
        """One well-formed message of nchan's: counted and kept (unless the rows are at their cap), or
        counted as foreign, or skipped as the priming message."""
        topic = self.topic_index.get(name)
        if topic is None or seq < 0:
            if topic is None:
                self.foreign += 1
            return
        self.msgs[self.stalled[client]] += 1
        if len(self.seq) >= self.max_rows:
            self.dropped_rows += 1
            return
        self.topic.append(topic)
        self.seq.append(seq)
        self.client.append(client)
        self.publish_ns.append(ts)
        self.deliver_ns.append(now)
        self.batch_id.append(batch_id)

    def next_seqs(self, clients: set[int]) -> dict[tuple[int, int], int]:
        """(client, topic) -> the next seq each stream of ``clients`` needs: one past the last seq received
        (in arrival order), or the stream's promised start when nothing came yet (a reconnect's ``since``)."""
        import numpy as np  # the storm's one call: workers start without numpy

        out = {key: seq for key, seq in self.starts.items() if key[0] in clients}
        for c, t, _start, end, _reason, _ns in self.losses:  # a loss notice moves the stream past its range
            if c in clients and end >= 0:
                out[(c, t)] = max(out.get((c, t), 0), end)
        if not self.seq:
            return out
        client = np.frombuffer(self.client, np.int32)
        topic = np.frombuffer(self.topic, np.int32)
        seq = np.frombuffer(self.seq, np.int64)
        ours = np.flatnonzero(np.isin(client, np.fromiter(clients, np.int32, len(clients))))
        key = client[ours].astype(np.int64) * (int(topic.max()) + 1) + topic[ours]
        # the last row of each stream: unique over the reversed keys finds each key's last occurrence
        _, last_rev = np.unique(key[::-1], return_index=True)
        last = ours[ours.size - 1 - last_rev]
        for row in last.tolist():
            stream = (int(client[row]), int(topic[row]))
            out[stream] = max(out.get(stream, 0), int(seq[row]) + 1)
        return out

    def _starts_at(self, client: int, topic: int, seq: int) -> None:
        """The client's stream of the topic starts at ``seq`` or later (a priming message, a subscribe ack)."""
        key = (client, topic)
        self.starts[key] = max(self.starts.get(key, 0), seq)

    def _error(self, code: str, sample: Any) -> None:
        self.errors[code] += 1
        if len(self.error_samples) < ERROR_SAMPLES:
            self.error_samples.append(sample)

    def dump(self, path: str | Path, clients: dict[int, dict[str, Any]]) -> None:
        """Write everything to ``path`` (pickle; read back with :func:`load`)."""
        usage = resource.getrusage(resource.RUSAGE_SELF)
        state = {
            "arrays": {
                name: getattr(self, name).tobytes() for name in ("topic", "client", "seq", "publish_ns", "deliver_ns", "batch_id")
            },
            "losses": self.losses,
            "starts": self.starts,
            "resumes": self.resumes,
            "errors": dict(self.errors),
            "error_samples": [repr(s)[:300] for s in self.error_samples],
            "frames": self.frames,
            "foreign": self.foreign,
            "dropped_rows": self.dropped_rows,
            "clients": clients,
            "cpu_s": usage.ru_utime + usage.ru_stime,
            "maxrss_kb": usage.ru_maxrss,
        }
        with open(path, "wb") as f:
            pickle.dump(state, f, protocol=pickle.HIGHEST_PROTOCOL)


def load(path: Path) -> dict[str, Any]:
    with open(path, "rb") as f:
        return pickle.load(f)
