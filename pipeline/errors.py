"""The failures a pipeline user can act on: each one is a single line naming the cause (the gateway's
host:port, the input file and line, the topic and the setting to change, the missing column).

The command line (``python -m pipeline``) prints ``feed: <message>`` / ``audit: <message>`` for these and
exits 1; the traceback only with ``-v``. Spark wraps an exception raised in a task or in ``foreachBatch``
in several layers of its own; :func:`one_line` digs the original line out again.
"""

from __future__ import annotations

import re

__all__ = [
    "BadInput",
    "BadLog",
    "GatewayUnreachable",
    "AdminRefused",
    "LossError",
    "PipelineError",
    "PlanError",
    "one_line",
]


class PipelineError(Exception):
    """Base class: ``str(exc)`` is the one line the user sees."""


class GatewayUnreachable(PipelineError):
    """The gateway's ingest or admin API could not be reached (after the retries)."""


class AdminRefused(PipelineError):
    """The admin API answered with an error (wrong token, unknown topic and no rule, ...)."""


class PlanError(PipelineError):
    """The feed's plan cannot work with the gateway's topic settings (found before publishing)."""


class BadInput(PipelineError):
    """A malformed input record (without ``--bad-records``)."""


class LossError(PipelineError):
    """Records were lost (refused as ``skipped_seq`` or given up and gone) and ``--allow-loss`` was not given."""


class BadLog(PipelineError):
    """A delivery log the audit cannot read (missing column, wrong type, no such path)."""


_OURS = re.compile(
    r"^(?:pipeline\.[\w.]+\.|gateway\.[\w.]+\.)?"
    r"(GatewayUnreachable|AdminRefused|PlanError|BadInput|LossError|BadLog|IngestRefused|IngestProtocolError"
    r"|ConnectionLost|RoundBroken): (.+)$",
    re.M,
)
_GENERIC = re.compile(r"^(?:[\w.]+\.)?(\w*(?:Error|Exception|Refused)): (.+)$", re.M)


def one_line(exc: BaseException) -> str:
    """The line that says what went wrong: ``str(exc)`` for our own errors; out of Spark's many-layered
    wrappers, the last line raised by our code, else the last ``SomethingError: ...`` line, else the first."""
    if isinstance(exc, PipelineError):
        return str(exc)
    text = str(exc)
    ours = _OURS.findall(text)
    if ours:
        return ours[-1][1].strip()
    generic = [m for m in _GENERIC.findall(text) if not m[0].startswith(("Py4J", "StreamingQuery"))]
    if generic:
        name, message = generic[-1]
        return f"{name}: {message.strip()}"
    first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    return first[:500]
