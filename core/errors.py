"""Errors raised by the core.

As in h11, whose fault an error is decides its class: `CoreUsageError` is the caller's misuse (a bug in the
gateway), `RequestError` is a bad request that came from a peer. Each `RequestError` subclass is one
protocol error code (docs/protocol.md) and carries, like h11's `error_status_hint`, the HTTP status an
HTTP transport answers it with; the connection and every other client go on.
"""


class CoreUsageError(Exception):
    """The caller broke the core's calling contract (e.g. an unknown client id)."""


class RequestError(Exception):
    """A peer's request cannot be honoured. Subclasses set `code` (the protocol error code) and `http_status`."""

    code = "bad_request"
    http_status = 400
    #: WebSocket close code when this error ends the connection; None: the connection goes on
    close_code: int | None = None

    def __init__(self, message: str) -> None:
        super().__init__(message)

    @property
    def message(self) -> str:
        return str(self)


class UnknownTopic(RequestError):
    code = "unknown_topic"
    http_status = 404


class BadTopic(RequestError):
    """The topic name is empty or too long."""

    code = "bad_topic"


class TopicExists(RequestError):
    code = "topic_exists"
    http_status = 409


class TooManyTopics(RequestError):
    code = "too_many_topics"
    http_status = 507


class TooManySubscriptions(RequestError):
    code = "too_many_subscriptions"
    http_status = 409


class AlreadySubscribed(RequestError):
    code = "already_subscribed"
    http_status = 409


class NotSubscribed(RequestError):
    code = "not_subscribed"
    http_status = 404


class NoTarget(RequestError):
    """A publish to a private topic names no user whose queue should get it."""

    code = "no_target"


class MessageTooLarge(RequestError):
    code = "too_large"
    http_status = 413


class BadData(RequestError):
    """The message data cannot be encoded (nested deeper than the encoder writes)."""

    code = "bad_data"


class BadSeq(RequestError):
    """An explicit seq outside [0, 2**53), or not the next of a private queue."""

    code = "bad_seq"


class DuplicateSeq(RequestError):
    """The seq is already waiting in the reorder window (docs/design/reorder-window.md §3: a slot is made available once)."""

    code = "duplicate_seq"
    http_status = 409


class StaleSeq(RequestError):
    """The seq is below the topic's available end: already delivered, or given up as a hole."""

    code = "stale_seq"
    http_status = 409


class SkippedSeq(RequestError):
    """The seq's hole was given up (window or timeout) and announced as lost: the record came too late."""

    code = "skipped_seq"
    http_status = 409


class BadAck(RequestError):
    """An acknowledgement that cannot be taken: long-poll's `ack` is not an integer; an `ack` command on a
    subscription made without `ack: true`, or for a seq the subscription was not handed
    (docs/design/private-queues.md §9)."""

    code = "bad_ack"


class QueueFull(RequestError):
    """Back-pressure (docs/design/private-queues.md §3): a private queue is full. The publisher waits for `take_space_freed`."""

    code = "queue_full"
    http_status = 503


class DirectQueueFull(RequestError):
    """A client's direct queue hit its bound: the client does not read its replies; disconnect it."""

    code = "direct_queue_full"
    close_code = 4009
