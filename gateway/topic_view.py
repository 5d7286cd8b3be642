"""The engine as everyone but the scheduler sees it: its topics and clients, read-only.

The scheduler (gateway/scheduler.py) is the engine's only writer; the broker, the topic catalog, the client
registry, presence, the admin API and the metrics get this view of it instead (`Scheduler.topics`), and
change it through the scheduler's verbs. The core `Engine` has these members, so the view costs nothing per
read (the Redis broker asks `has_topic` for every message it feeds); the check that nobody else holds the
engine itself is tests/core/test_engine_has_one_writer.py.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Protocol

from core import Counters, EngineConfig, TopicConfig
from core.client import Client
from core.topics import Topic


class TopicView(Protocol):
    @property
    def config(self) -> EngineConfig:
        """The engine's settings: its topic rules, `max_message_bytes`."""

    @property
    def counters(self) -> Counters: ...

    @property
    def topic_count(self) -> int: ...

    @property
    def direct_bytes(self) -> int:
        """Bytes in all clients' direct queues."""

    def has_topic(self, name: str) -> bool: ...

    def topic(self, name: str) -> Topic:
        """The topic (raises `UnknownTopic`): read its `config`, `subs`, `info()`; never change it."""

    def topics(self) -> list[Topic]: ...

    def topic_config(self, name: str) -> TopicConfig | None:
        """The settings the topic has, or would get on first use; None if it neither exists nor matches a rule."""

    def has_client(self, client_id: Hashable) -> bool: ...

    def client(self, client_id: Hashable) -> Client:
        """The engine's client (raises `CoreUsageError`): read its `owner`, `subs`, queues; never change it."""
