"""Errors raised by the core.

As in h11, whose fault an error is decides its class: `CoreUsageError` is the caller's misuse (a bug in the
gateway), `RequestError` is a bad request that came from a peer and maps to a protocol error code that the
gateway sends back (the connection and every other client go on).
"""


class CoreUsageError(Exception):
    """The caller broke the core's calling contract (e.g. an unknown client id)."""


class RequestError(Exception):
    """A peer's request cannot be honoured; `code` is the protocol error code (docs/protocol.md)."""

    code = "bad_request"

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code

    @property
    def message(self) -> str:
        return str(self)


class UnknownTopic(RequestError):
    code = "unknown_topic"


class TopicExists(RequestError):
    code = "topic_exists"


class TooManyTopics(RequestError):
    code = "too_many_topics"


class TooManySubscriptions(RequestError):
    code = "too_many_subscriptions"


class NotSubscribed(RequestError):
    code = "not_subscribed"


class MessageTooLarge(RequestError):
    code = "too_large"


class DuplicateSeq(RequestError):
    """The seq is already waiting in the reorder window (seed 004: a slot is made available once)."""

    code = "duplicate_seq"


class StaleSeq(RequestError):
    """The seq is below the topic's available end: already delivered, or given up as a hole."""

    code = "stale_seq"


class SkippedSeq(RequestError):
    """The seq's hole was given up (window or timeout) and announced as lost: the record came too late."""

    code = "skipped_seq"


class QueueFull(RequestError):
    """Back-pressure (seed 001): a private queue is full. The publisher waits for `take_space_freed`."""

    code = "queue_full"


class DirectQueueFull(RequestError):
    """A client's direct queue hit its bound: the client does not read its replies; disconnect it."""

    code = "direct_queue_full"
