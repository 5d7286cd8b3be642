"""The log formats of `gateway serve` (`server.log_format`, docs/operations.md "Logs").

"text": `time LEVEL logger: message`, a worker's lines naming it (`worker N logger:`) when there are several.
"json": one JSON object a line, `time` (RFC 3339, UTC, milliseconds), `level`, `worker` (its index; null in
the supervisor of several workers), `logger`, `event` (the message), then the fields the call site gave
(`extra=`: client, user, reason, source, topic, ...), and `exc` (the traceback) when there is one. Every line
goes through the root logger's handler, uvicorn's loggers too (they propagate to it in json mode), and the
lines `gateway serve` prints whatever the log level (the builds, the admin token, "listening on": `say`).

No record can write a line of its own in text: the message, arguments included, has its control characters
escaped (`\n` as `\\n`, ...), and so has a traceback's exception message (and notes), the one part of a
traceback that is not the interpreter's own text. In json, JSON escapes them.
"""

from __future__ import annotations

import logging
import re
import sys
import time
import traceback
from typing import Any, TextIO

import orjson

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
#: what a text line never holds as is: C0 and C1 controls, DEL, and the Unicode line and paragraph separators
#: (a viewer may break lines at any of them; ESC sequences would drive the terminal)
_CONTROLS = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")
#: the same but line feeds: a traceback's frames and headers, which are the interpreter's text
_CONTROLS_BUT_LF = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u2028\u2029]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}

#: the attributes every LogRecord has: the others came from `extra=` and are a line's fields
_RECORD_ATTRIBUTES = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message",
    "asctime",
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
            "time": _rfc3339_ms(record.created),
            "level": record.levelname.lower(),
            "worker": self.worker,
            "logger": record.name,
            "event": record.getMessage(),
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


def _escaped(match: re.Match[str]) -> str:
    char = match.group()
    return _NAMED.get(char) or (f"\\x{ord(char):02x}" if ord(char) < 0x100 else f"\\u{ord(char):04x}")


def escape(text: str) -> str:
    """`text` with its control characters written as escapes (`\\n`, `\\x1b`, `\\u2028`): one line, whatever
    a client put in it."""
    return _CONTROLS.sub(_escaped, text)


class TextFormatter(logging.Formatter):
    """The text format, in which no record writes a line of its own (a client's text in a message or its
    arguments, a newline in an exception's message): the message is escaped, and so is each exception's
    message in a traceback, which otherwise reads as Python writes it."""

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 - logging's name
        record.message = escape(record.message)
        return super().formatMessage(record)

    def formatException(self, ei: Any) -> str:  # noqa: N802 - logging's name
        if ei[1] is None:
            return _CONTROLS_BUT_LF.sub(_escaped, super().formatException(ei))
        chunks = []
        formatted = traceback.TracebackException(type(ei[1]), ei[1], ei[2])
        _escape_notes(formatted)
        # The chunks Python prints: headers ("Traceback ...", the chaining notes: "\n..."), frames (indented),
        # and each exception's message and notes, the only chunks starting with other text: one line each.
        for chunk in formatted.format():
            if chunk.startswith((" ", "\n")) or chunk == "Traceback (most recent call last):\n":
                chunks.append(_CONTROLS_BUT_LF.sub(_escaped, chunk))
            else:
                body = chunk.removesuffix("\n")
                chunks.append(escape(body) + chunk[len(body) :])
        return "".join(chunks).removesuffix("\n")

    def formatStack(self, stack_info: str) -> str:  # noqa: N802 - logging's name
        return _CONTROLS_BUT_LF.sub(_escaped, super().formatStack(stack_info))


def _escape_notes(exc: traceback.TracebackException, seen: set[int] | None = None) -> None:
    """Each note of the chain's exceptions on one line (Python prints a note's lines one by one)."""
    seen = set() if seen is None else seen
    if id(exc) in seen:
        return
    seen.add(id(exc))
    if isinstance(exc.__notes__, list):
        exc.__notes__ = [escape(_text(note)) for note in exc.__notes__]
    for linked in (exc.__cause__, exc.__context__, *(exc.exceptions or ())):
        if linked is not None:
            _escape_notes(linked, seen)


def _text(value: object) -> str:
    try:
        return str(value)
    except Exception:  # as Python prints a note whose str() fails
        return "<note str() failed>"


def text_formatter(worker: int | None) -> logging.Formatter:
    return TextFormatter(TEXT_FORMAT if worker is None else TEXT_FORMAT.replace("%(name)s", f"worker {worker} %(name)s"))


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
        # one write of the line and its newline: the workers and the supervisor share the stream, and a line
        # must never be split by another process's line
        out = stream or sys.stdout
        out.write(line + "\n")
        out.flush()


def say_exception(line: str) -> None:
    """`say` for an exception being handled: its traceback follows the line (text) or is its `exc` (json)."""
    if _json_mode:
        _console.exception(line)
    else:
        import traceback

        sys.stderr.write(line + "\n")
        sys.stderr.flush()
        traceback.print_exc()
