"""The broadcaster engine: pure Python, no I/O, no clock (time comes in as `now`).

See docs/architecture.md for the model and engine.py for the calling contract.
"""

# First: it decides whether the compiled modules or their sources are imported below.
from .native import BUILD, COMPILED  # isort: skip

from .client import Crowd, Sink
from .config import EngineConfig, TopicConfig, TopicKind, TopicRule
from .counters import Counters
from .engine import Batch, Engine, Published, Subscribed
from .entries import (
    encode_error,
    encode_loss,
    encode_message,
    encode_reply,
    frame_batch,
)
from .errors import (
    CoreUsageError,
    DirectQueueFull,
    DuplicateSeq,
    MessageTooLarge,
    NotSubscribed,
    QueueFull,
    RequestError,
    SkippedSeq,
    StaleSeq,
    TopicExists,
    UnknownTopic,
)

__all__ = [
    "BUILD",
    "COMPILED",
    "Batch",
    "CoreUsageError",
    "Counters",
    "Crowd",
    "DirectQueueFull",
    "DuplicateSeq",
    "Engine",
    "EngineConfig",
    "MessageTooLarge",
    "NotSubscribed",
    "Published",
    "QueueFull",
    "RequestError",
    "Sink",
    "SkippedSeq",
    "StaleSeq",
    "Subscribed",
    "TopicConfig",
    "TopicExists",
    "TopicKind",
    "TopicRule",
    "UnknownTopic",
    "encode_error",
    "encode_loss",
    "encode_message",
    "encode_reply",
    "frame_batch",
]
