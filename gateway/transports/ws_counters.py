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

    def collect(self) -> Iterator[Metric]:
        yield CounterMetricFamily("fanout_ws_pongs_coalesced", "pongs not written: a later ping came while the"
                                  " client's writes were paused (one pong waits)", value=self.pongs_coalesced)
        yield CounterMetricFamily("fanout_ws_fragment_closes", "connections closed (1008) for a message in more"
                                  " than websocket.max_fragments frames", value=self.fragment_closes)
        yield CounterMetricFamily("fanout_ws_pings_skipped", "keepalive pings not sent: frames flowed since the last"
                                  " one and the peer's TCP acknowledged within the interval", value=self.pings_skipped)
        yield CounterMetricFamily("fanout_ws_input_deferrals", "times a WebSocket client's input was left for the"
                                  " next turn of the event loop (its share of the turn spent)",
                                  value=self.input_deferrals)


ws_counters = WSCounters()
