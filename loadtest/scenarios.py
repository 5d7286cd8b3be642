"""Named load scenarios, their command-line flags, and the deterministic plan a scenario expands to.

A :class:`Scenario` is the knob set (how many clients, topics, how fast); :func:`plan` turns it into who
subscribes to what, which clients stall and how fast each topic is published. Same scenario and seed, same
plan: runs against the gateway and against nchan are comparable client by client.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from core.config import MAX_LINGER
from loadtest.book import BOOK

TRANSPORTS = ("ws", "longpoll", "mixed")
COMPRESSIONS = ("off", "deflate")
PROTOCOLS = ("fanout", "centrifugo")
DELTAS = ("off", "fossil")
PUBLISH_VIA = ("ingest", "admin")
#: ``--batch-depth auto``: the gateway's ``batch_depth = "auto"`` (docs/design/batching.md §8)
AUTO = "auto"

#: padding that makes a message's data 100 bytes: ``{"ts":<19 digits>,"t":"t0000","n":<5 digits>,"pad":""}``
#: is 57 bytes (a hot topic's name is one byte longer, a low message number a few digits shorter)
PAYLOAD_100 = 43

#: scenarios whose ``compare`` runs the bare server too by default
CROWD_SCENARIOS = ("crowd", "rooms")
#: ``--source-addrs`` at most: 127.0.X.Y with X and Y in 1..254
MAX_SOURCE_ADDRS = 254 * 254
#: the ring capacity of the shipped catch-all topic rule (config/default.toml, pattern "*")
SHIPPED_CAPACITY = 64


def source_addr(k: int) -> str:
    """The k-th client source address (k from 0): 127.0.1.1, 127.0.1.2, ... 127.0.1.254, 127.0.2.1, ...
    (all of 127.0.0.0/8 is the loopback interface's on Linux: nothing to configure)."""
    return f"127.0.{1 + k // 254}.{1 + k % 254}"


#: In ``max`` mode the topic mix keeps the proportions the fixed rates would have, with the base rate
#: counted as this many messages per second.
NOMINAL_MAX_RATE = 1000.0


@dataclass(frozen=True, slots=True)
class Scenario:
    """One load shape. Every run is bounded by ``duration`` seconds *and* ``messages`` published."""

    name: str
    description: str = ""
    clients: int = 100
    topics: int = 20
    #: subscriptions per (light) client
    subs: int = 3
    #: total messages per second over the base topics; ``None`` publishes as fast as the target takes them
    rate: float | None = 1000.0
    #: bytes of padding in each message's data (the JSON around it adds ~60 bytes), or "book": an order book
    #: of 20 levels a side, 3 changed per update (loadtest/book.py)
    payload: int | str = 64
    #: "deflate": WebSocket clients offer permessage-deflate (and inflate); "off": they do not
    compression: str = "off"
    #: "fossil": WebSocket clients subscribe with deltas and apply them; "off": whole messages
    delta: str = "off"
    #: "fanout": WebSocket clients speak our protocol at /ws; "centrifugo": Centrifugo's client protocol at
    #: /connection/websocket (the gateway only)
    protocol: str = "fanout"
    transport: str = "ws"
    duration: float = 5.0
    #: hard cap on published messages, whatever the rate
    messages: int = 2_000_000
    #: fraction of the light clients that stop reading at ``stall_at`` for ``stall_for`` seconds
    stall_frac: float = 0.0
    #: seconds after the publish start; ``None`` = a quarter of the duration
    stall_at: float | None = None
    #: ``None`` = half the duration; ``0`` = never resume
    stall_for: float | None = None
    #: the first ``hot_topics`` topics share ``hot_share`` of the rate; each client takes one hot topic
    hot_topics: int = 0
    hot_share: float = 0.0
    #: busy topics subscribed by one "dominator" client only, published at ``dominator_rate`` msgs/s total
    dominator_topics: int = 0
    dominator_rate: float = 0.0
    #: whether the dominator client connects (the ``dominator`` scenario runs once with, once without)
    dominator: bool = True
    publish_via: str = "ingest"
    #: client worker processes
    procs: int = 1
    seed: int = 1
    #: seconds to wait, after the last publish, for deliveries still in flight
    drain: float = 5.0
    #: ring capacity of the gateway's topics (config ``topics.rules.capacity``)
    capacity: int = 64
    #: messages one ring subscription may give per cycle (gateway config ``topics.rules.batch_depth``); 1 is
    #: one message per topic per frame, ``"auto"`` a slice sized by the subscriber's backlog. nchan has no
    #: equivalent: it sends one message per frame.
    batch_depth: int | str = 1
    #: seconds the gateway's topics hold caught-up subscribers back after a publish (config
    #: ``topics.rules.linger``): fewer, fuller frames for that much latency. nchan has no equivalent.
    linger: float = 0.0
    #: run twice, the hot topics silent ("alone") then published ("beside"), and compare the cold topics'
    #: latency (needs ``hot_topics``)
    coldhot: bool = False
    #: the hot topics exist and are subscribed but get no messages (the "alone" half of a coldhot run)
    hot_silent: bool = False
    #: ``rate=max`` only: most messages per subscription in flight (published but not yet received, or
    #: announced lost, by the clients that read), on average; 0 publishes open loop, as fast as the target
    #: accepts the bytes (the gateway's ingest then takes far more than it can fan out)
    window: int = 0
    #: client i connects from loopback address ``source_addr(i % source_addrs)`` (127.0.1.1, 127.0.1.2, ...):
    #: so many clients per address that the gateway's shipped ``server.max_connections_per_ip`` holds; 0: the
    #: kernel's choice (127.0.0.1 for every client)
    source_addrs: int = 0
    #: the gateway runs its shipped config (config/default.toml) with only what a run needs overridden
    #: (loopback ports 0, the admin token, ``server.max_connections`` when the clients need more); topic rules
    #: as shipped, so ``capacity``, ``batch_depth`` and ``linger`` must be their shipped values
    shipped: bool = False
    #: gateway processes (``server.workers``); above 1 on a Redis broker the load tool starts
    workers: int = 1
    #: reconnect storm: seconds after publishing starts when every WebSocket client drops its connection and
    #: comes back (resubscribing with ``since``) at a random moment within ``storm_spread`` seconds; None: none
    storm_at: float | None = None
    storm_spread: float = 5.0

    def resolved_stall(self) -> tuple[float, float]:
        """(stall_at, stall_for) with the defaults applied; stall_for 0 means never resume."""
        at = self.duration / 4 if self.stall_at is None else self.stall_at
        dur = self.duration / 2 if self.stall_for is None else self.stall_for
        return at, dur

    def validate(self) -> None:
        """Raise ValueError on a scenario that cannot run (our misuse, caught before anything starts)."""
        if self.clients < 1 or self.topics < 1:
            raise ValueError("need at least one client and one topic")
        if not 1 <= self.subs <= self.topics:
            raise ValueError(f"subs must be in [1, topics={self.topics}]")
        if self.hot_topics and not (self.hot_topics < self.topics and self.subs >= 2):
            raise ValueError("hot_topics needs fewer hot than total topics and subs >= 2")
        if self.hot_topics and self.subs - 1 > self.topics - self.hot_topics:
            raise ValueError("not enough cold topics for subs - 1 per client")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}")
        if self.publish_via not in PUBLISH_VIA:
            raise ValueError(f"publish_via must be one of {PUBLISH_VIA}")
        if not 0.0 <= self.stall_frac <= 1.0 or not 0.0 <= self.hot_share <= 1.0:
            raise ValueError("fractions must be in [0, 1]")
        if self.rate is not None and self.rate <= 0:
            raise ValueError("rate must be > 0 (or max)")
        if self.duration <= 0 or self.messages < 1 or self.procs < 1:
            raise ValueError("duration, messages and procs must be positive")
        if self.window < 0:
            raise ValueError("window must be >= 0")
        if self.payload != BOOK and not (isinstance(self.payload, int) and self.payload >= 0):
            raise ValueError(f'payload must be a number of bytes >= 0 or "{BOOK}"')
        if self.compression not in COMPRESSIONS or self.delta not in DELTAS:
            raise ValueError(f"compression must be one of {COMPRESSIONS}, delta one of {DELTAS}")
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"protocol must be one of {PROTOCOLS}")
        if self.protocol == "centrifugo" and (self.transport != "ws" or self.delta != "off" or self.storm_at is not None):
            raise ValueError("protocol centrifugo needs WebSocket clients (--transport ws), no --delta, no storm")
        if self.delta != "off" and (self.transport != "ws" or self.shipped):
            raise ValueError(
                "delta needs WebSocket clients (--transport ws) and the load tool's gateway config"
                " (--no-shipped): the shipped topic rules have no delta"
            )
        if self.batch_depth != AUTO and not (isinstance(self.batch_depth, int) and self.batch_depth >= 1):
            raise ValueError(f'batch_depth must be an integer >= 1 or "{AUTO}"')
        if not 0.0 <= self.linger <= MAX_LINGER:
            raise ValueError(f"linger must be in [0, {MAX_LINGER:g}] seconds")
        if self.coldhot and not (self.hot_topics and 0 < self.hot_share < 1):
            raise ValueError("coldhot needs hot_topics and 0 < hot_share < 1")
        if self.coldhot and self.dominator_topics:
            raise ValueError("coldhot and dominator runs cannot be combined")
        if not 0 <= self.source_addrs <= MAX_SOURCE_ADDRS:
            raise ValueError(f"source_addrs must be in [0, {MAX_SOURCE_ADDRS}]")
        if self.workers < 1:
            raise ValueError("workers must be >= 1")
        if self.shipped and (self.capacity != SHIPPED_CAPACITY or self.batch_depth != 1 or self.linger):
            raise ValueError(
                f"a shipped gateway's topics follow the shipped '*' rule (capacity {SHIPPED_CAPACITY}, "
                "batch_depth 1, no linger): use --no-shipped to set --capacity, --batch-depth or --linger"
            )
        if self.storm_at is not None:
            if self.storm_at < 0 or self.storm_spread < 0:
                raise ValueError("storm_at and storm_spread must be >= 0")
            if self.storm_at + self.storm_spread >= self.duration:
                raise ValueError(
                    "storm_at + storm_spread must be below the duration: publishing goes on while the clients come back"
                )
            if self.transport != "ws":
                raise ValueError("a reconnect storm needs WebSocket clients: transport ws")
            if self.stall_frac or self.dominator_topics or self.coldhot:
                raise ValueError("a reconnect storm cannot be combined with stalls, a dominator or coldhot")


@dataclass(frozen=True, slots=True)
class ClientPlan:
    name: str
    #: "ws" or "longpoll"
    transport: str
    #: "light", "stalled" or "dominator"
    role: str
    #: indices into Plan.topics
    topics: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Plan:
    topics: tuple[str, ...]
    #: messages per second per topic (relative weights in max mode)
    rates: tuple[float, ...]
    #: "hot", "cold" or "busy" per topic
    classes: tuple[str, ...]
    clients: tuple[ClientPlan, ...]

    def topic_index(self) -> dict[str, int]:
        return {t: i for i, t in enumerate(self.topics)}


def plan(s: Scenario) -> Plan:
    """Expand a scenario into topics, per-topic rates and clients (deterministic in ``s.seed``)."""
    s.validate()
    rng = random.Random(s.seed)
    base = s.rate if s.rate is not None else NOMINAL_MAX_RATE
    n_cold = s.topics - s.hot_topics
    topics = [f"hot{i:03d}" for i in range(s.hot_topics)] + [f"t{i:04d}" for i in range(n_cold)]
    classes = ["hot"] * s.hot_topics + ["cold"] * n_cold
    if s.hot_topics:
        # a silent hot topic is still primed and subscribed: only its messages are missing
        rates = [0.0 if s.hot_silent else base * s.hot_share / s.hot_topics] * s.hot_topics
        rates += [base * (1 - s.hot_share) / n_cold] * n_cold
    else:
        rates = [base / n_cold] * n_cold
    busy = [f"busy{i:03d}" for i in range(s.dominator_topics)]
    if busy:
        rates += [s.dominator_rate / len(busy)] * len(busy)
        classes += ["busy"] * len(busy)
        topics += busy

    stalled = set(rng.sample(range(s.clients), round(s.stall_frac * s.clients)))
    clients = []
    for i in range(s.clients):
        if s.hot_topics:
            cold = rng.sample(range(s.hot_topics, s.topics), s.subs - 1)
            subs = (i % s.hot_topics, *sorted(cold))
        elif s.subs == 1:  # one topic each: dealt in turn, so the topics (rooms) are of equal size
            subs = (i % s.topics,)
        else:
            subs = tuple(sorted(rng.sample(range(s.topics), s.subs)))
        if s.transport == "mixed":
            transport = "ws" if i % 2 == 0 else "longpoll"
        else:
            transport = s.transport
        role = "stalled" if i in stalled else "light"
        clients.append(ClientPlan(f"c{i:05d}", transport, role, subs))
    if busy and s.dominator:
        first = s.topics
        transport = "longpoll" if s.transport == "longpoll" else "ws"
        clients.append(ClientPlan("dom0", transport, "dominator", tuple(range(first, first + len(busy)))))
    return Plan(tuple(topics), tuple(rates), tuple(classes), tuple(clients))


SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario("smoke", "a few clients, a quick sanity run", clients=20, topics=10, subs=3, rate=500, duration=3, drain=2),
        Scenario(
            "fanout", "many clients sharing topics at a steady rate", clients=1000, topics=100, subs=10, rate=1000, duration=10
        ),
        Scenario(
            "throughput",
            "publish as fast as the gateway takes it",
            clients=200,
            topics=20,
            subs=5,
            rate=None,
            duration=10,
            messages=500_000,
        ),
        Scenario(
            "longpoll", "HTTP long-poll clients only", clients=300, topics=50, subs=5, rate=500, transport="longpoll", duration=10
        ),
        Scenario(
            "mixed", "half WebSocket, half long-poll", clients=600, topics=100, subs=5, rate=1000, transport="mixed", duration=10
        ),
        Scenario(
            "stall",
            "10% of the clients stop reading for half the run",
            clients=300,
            topics=30,
            subs=5,
            rate=1000,
            duration=10,
            stall_frac=0.1,
        ),
        Scenario(
            "starvation",
            "one hot topic beside nine cold ones on every client",
            clients=200,
            topics=44,
            subs=10,
            rate=2000,
            hot_topics=4,
            hot_share=0.9,
            duration=10,
        ),
        Scenario(
            "dominator",
            "one client on 100 busy topics beside many light clients (run with and without it)",
            clients=300,
            topics=30,
            subs=3,
            rate=300,
            dominator_topics=100,
            dominator_rate=5000,
            duration=10,
        ),
        # the benchmark targets (docs/benchmarks.md): 100-byte messages (PAYLOAD_100 bytes of padding)
        Scenario(
            "onetopic",
            "1000 clients on one topic, published as fast as the clients take it",
            clients=1000,
            topics=1,
            subs=1,
            rate=None,
            window=32,
            payload=PAYLOAD_100,
            duration=5,
            drain=3,
        ),
        Scenario(
            "spread",
            "1000 clients, each on 4 of 100 topics, published as fast as the clients take it",
            clients=1000,
            topics=100,
            subs=4,
            rate=None,
            window=32,
            payload=PAYLOAD_100,
            duration=5,
            drain=3,
        ),
        Scenario(
            "steady200",
            "1000 clients on one topic at a fixed 200 msgs/s (200k deliveries/s offered)",
            clients=1000,
            topics=1,
            subs=1,
            rate=200,
            payload=PAYLOAD_100,
            duration=5,
            drain=3,
        ),
        # the crowd targets (docs/benchmarks.md): the gateway as shipped, clients over 250 source addresses
        # (40 each, the shipped per-address limit is 256), 100-byte messages, 50,000 deliveries/s in both
        Scenario(
            "crowd",
            "10,000 clients on one topic at 5 msgs/s, the gateway as shipped",
            clients=10_000,
            topics=1,
            subs=1,
            rate=5,
            payload=PAYLOAD_100,
            duration=20,
            procs=2,
            source_addrs=250,
            shipped=True,
            drain=5,
        ),
        Scenario(
            "rooms",
            "10,000 clients over 1,000 topics (rooms of 10), 5 msgs/s per topic, the gateway as shipped",
            clients=10_000,
            topics=1000,
            subs=1,
            rate=5000,
            payload=PAYLOAD_100,
            duration=20,
            procs=2,
            source_addrs=250,
            shipped=True,
            drain=5,
        ),
        Scenario(
            "coldhot",
            "cold topics' latency alone (hot topic silent) and beside a hot topic (run twice)",
            clients=500,
            topics=11,
            subs=2,
            rate=100,
            hot_topics=1,
            hot_share=0.5,
            coldhot=True,
            payload=PAYLOAD_100,
            duration=8,
            drain=3,
        ),
    )
}

#: flag name -> (Scenario field, type, help)
#: a flag's value parser: a type (int, float, str) or a function of ours that refuses with ArgumentTypeError
_Parse = Callable[[str], Any]

#: flag -> (Scenario field, parser or the name of one in _PARSERS, help)
_FLAGS: dict[str, tuple[str, _Parse | str, str]] = {
    "--clients": ("clients", int, "number of (light) clients"),
    "--topics": ("topics", int, "number of base topics"),
    "--subs": ("subs", int, "subscriptions per client"),
    "--rate": ("rate", "rate", "total publish rate in msgs/s, or 'max'"),
    "--payload": (
        "payload",
        "payload",
        'padding bytes per message, or "book": an order book of 20 levels a side, 3 changed per update',
    ),
    "--compression": ("compression", str, 'WebSocket clients offer permessage-deflate ("deflate") or not ("off")'),
    "--delta": ("delta", str, 'WebSocket clients subscribe with fossil deltas ("fossil") or not ("off")'),
    "--protocol": (
        "protocol",
        str,
        'WebSocket clients speak our protocol at /ws ("fanout") or Centrifugo\'s at'
        ' /connection/websocket ("centrifugo"; the gateway only)',
    ),
    "--transport": ("transport", str, "ws, longpoll or mixed"),
    "--duration": ("duration", float, "publish for this many seconds"),
    "--messages": ("messages", int, "stop publishing after this many messages"),
    "--stall-frac": ("stall_frac", float, "fraction of clients that stop reading"),
    "--stall-at": ("stall_at", float, "seconds after the start when stalled clients stop reading"),
    "--stall-for": ("stall_for", float, "seconds they stay stalled (0: until the end)"),
    "--hot-topics": ("hot_topics", int, "number of hot topics (one per client)"),
    "--hot-share": ("hot_share", float, "share of the rate going to hot topics"),
    "--dominator-topics": ("dominator_topics", int, "busy topics of the dominator client"),
    "--dominator-rate": ("dominator_rate", float, "msgs/s over the busy topics"),
    "--publish-via": ("publish_via", str, "ingest (TCP fast path) or admin (HTTP API)"),
    "--procs": ("procs", int, "client worker processes"),
    "--seed": ("seed", int, "random seed of the plan"),
    "--drain": ("drain", float, "max seconds to wait for in-flight deliveries at the end"),
    "--capacity": ("capacity", int, "ring capacity of the gateway's topics"),
    "--window": ("window", int, "rate max: messages per subscription in flight (0: open loop)"),
    "--batch-depth": (
        "batch_depth",
        "depth",
        "messages a ring subscription may give per cycle, or 'auto' (gateway topic rule batch_depth; nchan has no equivalent)",
    ),
    "--linger": (
        "linger",
        float,
        "seconds the gateway's topics hold caught-up subscribers back after a publish "
        "(gateway topic rule linger; nchan has no equivalent)",
    ),
    "--source-addrs": (
        "source_addrs",
        int,
        "client i connects from loopback address number i %% K (127.0.1.1, 127.0.1.2, ...); 0: all from 127.0.0.1",
    ),
    "--workers": ("workers", int, "gateway processes (server.workers); above 1 on a Redis broker the load tool starts"),
    "--storm-at": (
        "storm_at",
        float,
        "reconnect storm: seconds after publishing starts when every client drops "
        "its connection and comes back with since (gateway only)",
    ),
    "--storm-spread": (
        "storm_spread",
        float,
        "reconnect storm: clients come back at random moments within this many seconds (default 5)",
    ),
}


def parse_rate(text: str) -> float | None:
    if text.strip().lower() == "max":
        return None
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError("rate must be > 0 or 'max'")
    return value


def parse_depth(text: str) -> int | str:
    """A ``--batch-depth`` value: an integer (``Scenario.validate`` wants it >= 1) or ``auto``."""
    if text.strip().lower() == AUTO:
        return AUTO
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"batch depth must be a positive integer or '{AUTO}', not {text!r}") from None


def parse_payload(text: str) -> int | str:
    """A ``--payload`` value: padding bytes, or ``book``."""
    if text.strip().lower() == BOOK:
        return BOOK
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"payload must be a number of bytes or '{BOOK}', not {text!r}") from None


_PARSERS: dict[str, _Parse] = {"rate": parse_rate, "depth": parse_depth, "payload": parse_payload}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the scenario positional and the override flags (all default to the scenario's values)."""
    parser.add_argument("scenario", choices=sorted(SCENARIOS), help="named scenario")
    for flag, (_field, kind, help_text) in _FLAGS.items():
        parser.add_argument(
            flag, type=_PARSERS[kind] if isinstance(kind, str) else kind, default=argparse.SUPPRESS, help=help_text
        )
    parser.add_argument(
        "--shipped",
        action=argparse.BooleanOptionalAction,
        default=argparse.SUPPRESS,
        help="the gateway runs its shipped config, only ports, admin token and (when the clients "
        "need more) server.max_connections overridden (default: on for crowd and rooms)",
    )


def from_args(args: argparse.Namespace) -> Scenario:
    """The named scenario with the flags given on the command line applied, validated."""
    scenario = SCENARIOS[args.scenario]
    changes = {field: getattr(args, field) for (field, _k, _h) in _FLAGS.values() if hasattr(args, field)}
    if hasattr(args, "shipped"):
        changes["shipped"] = args.shipped
    scenario = dataclasses.replace(scenario, **changes)
    scenario.validate()
    return scenario
