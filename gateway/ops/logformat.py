"""The log formats of `gateway serve` (`server.log_format`, docs/operations.md "Logs").

"text": `time LEVEL logger: message`, a worker's lines naming it (`worker N logger:`) when there are several.
"json": one JSON object a line, `time` (RFC 3339, UTC, milliseconds), `level`, `worker` (its index; null in
the supervisor of several workers), `logger`, `event` (the message), then the fields the call site gave
(`extra=`: client, user, reason, source, topic, ...), and `exc` (the traceback) when there is one. Every line
goes through the root logger's handler, uvicorn's loggers too (they propagate to it in json mode), and the
lines `gateway serve` prints whatever the log level (the builds, the admin token, "listening on": `say`).
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any, TextIO

import orjson

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

#: the attributes every LogRecord has: the others came from `extra=` and are a line's fields
_RECORD_ATTRIBUTES = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message", "asctime",
    "color_message",  # uvicorn's copy of the message with terminal colours
}
#: what `say` logs through in json mode: its lines are shown whatever `server.log_level` says
_console = logging.getLogger("gateway.console")
_json_mode = False


class JsonFormatter(logging.Formatter):
    """One JSON object per record. A value orjson cannot encode is written as its str(): a log line never
    fails for the value of one field."""

    def __init__(self, worker: int | None) -> None:
        super().__init__()
        self.worker = worker

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": _rfc3339_ms(record.created), "level": record.levelname.lower(), "worker": self.worker,
            "logger": record.name, "event": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _RECORD_ATTRIBUTES and key not in line:
                line[key] = value
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            line["exc"] = record.exc_text
        try:
            return orjson.dumps(line, default=str, option=orjson.OPT_NON_STR_KEYS).decode()
        except orjson.JSONEncodeError:  # e.g. an int beyond 64 bits, which `default` is not asked about
            return orjson.dumps({k: v if isinstance(v, str | None) else str(v) for k, v in line.items()}).decode()


def _rfc3339_ms(created: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(created)) + f".{int(created % 1 * 1000):03d}Z"


def text_formatter(worker: int | None) -> logging.Formatter:
    return logging.Formatter(TEXT_FORMAT if worker is None else
                             TEXT_FORMAT.replace("%(name)s", f"worker {worker} %(name)s"))


def configure(log_format: str, level: str, worker: int | None) -> None:
    """The root logger's handler (stderr) at `level`, formatting as `log_format` says. `worker` None: not
    tagged in text (one process, or the supervisor), null in json."""
    global _json_mode
    _json_mode = log_format == "json"
    logging.basicConfig(level=level.upper(), format=TEXT_FORMAT)
    _console.setLevel(logging.INFO)
    logging.captureWarnings(_json_mode)  # a warning's own format would be the one line that is not JSON
    tag(worker if _json_mode else None)


def tag(worker: int | None) -> None:
    """Every line of this process names `worker` from now on (a worker, once forked)."""
    formatter = JsonFormatter(worker) if _json_mode else text_formatter(worker)
    for handler in logging.getLogger().handlers:
        handler.setFormatter(formatter)


def say(line: str, *, stream: TextIO | None = None, level: int = logging.INFO, **fields: Any) -> None:
    """A line `gateway serve` prints whatever the log level: as is on `stream` (stdout) in text, a log
    record with `fields` in json."""
    if _json_mode:
        _console.log(level, line, extra=fields)
    else:
        print(line, file=stream or sys.stdout, flush=True)


def say_exception(line: str) -> None:
    """`say` for an exception being handled: its traceback follows the line (text) or is its `exc` (json)."""
    if _json_mode:
        _console.exception(line)
    else:
        import traceback

        print(line, file=sys.stderr, flush=True)
        traceback.print_exc()
