"""Per-process counts of the WebSocket frame-level bounds, for /metrics (gateway/ops/metrics.py)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, Metric


class WSCounters:
    #: pongs not written because a later ping came while the peer's writes were paused (one waits)
    pongs_coalesced = 0
    #: connections closed for fragmenting a message into more than `websocket.max_fragments` frames
    fragment_closes = 0
    #: times a connection's input was left for the next turn of the loop (its budget, or the turn's, spent)
    input_deferrals = 0
    #: keepalive pings not sent: frames flowed since the last one and the peer's TCP acknowledged within the interval
    pings_skipped = 0
    #: frames compressed (permessage-deflate: once per distinct frame and window), their bytes before and after
    deflated_frames = 0
    deflate_input_bytes = 0
    deflate_output_bytes = 0
    #: data frames' payload bytes handed to WebSocket clients, one count per client, and the bytes of those
    #: frames on the wire (headers included, compressed where negotiated)
    payload_bytes = 0
    wire_bytes = 0

    def collect(self) -> Iterator[Metric]:
        yield CounterMetricFamily(
            "fanout_ws_pongs_coalesced",
            "pongs not written: a later ping came while the client's writes were paused (one pong waits)",
            value=self.pongs_coalesced,
        )
        yield CounterMetricFamily(
            "fanout_ws_fragment_closes",
            "connections closed (1008) for a message in more than websocket.max_fragments frames",
            value=self.fragment_closes,
        )
        yield CounterMetricFamily(
            "fanout_ws_pings_skipped",
            "keepalive pings not sent: frames flowed since the last one and the peer's TCP acknowledged within the interval",
            value=self.pings_skipped,
        )
        yield CounterMetricFamily(
            "fanout_ws_input_deferrals",
            "times a WebSocket client's input was left for the next turn of the event loop (its share of the turn spent)",
            value=self.input_deferrals,
        )
        yield CounterMetricFamily(
            "fanout_ws_payload_bytes",
            "payload bytes of the data frames handed to WebSocket clients (one count per client)",
            value=self.payload_bytes,
        )
        yield CounterMetricFamily(
            "fanout_ws_wire_bytes",
            "bytes of those frames on the wire: headers included, compressed where permessage-deflate was negotiated",
            value=self.wire_bytes,
        )
        yield CounterMetricFamily(
            "fanout_ws_deflated_frames",
            "frames compressed (once per distinct frame and window size, whatever the number of clients)",
            value=self.deflated_frames,
        )
        yield CounterMetricFamily(
            "fanout_ws_deflate_input_bytes", "payload bytes of the frames compressed", value=self.deflate_input_bytes
        )
        yield CounterMetricFamily(
            "fanout_ws_deflate_output_bytes", "their payload bytes once compressed (as sent)", value=self.deflate_output_bytes
        )


ws_counters = WSCounters()
