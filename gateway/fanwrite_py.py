"""The fan-out writer's `Sender` in Python: the twin of the compiled one (gateway/_fanwrite.c), used where
that is not built or when FANOUT_PURE_PYTHON is set (gateway/fanwrite.py chooses).

Same interface, same results: `submit(fds, data)` takes the descriptors the list holds at the call (all
checked before any is written), one `send(fd, data, MSG_DONTWAIT | MSG_NOSIGNAL)` each; `wait()` returns
(index, sent) for each socket that did not take the whole frame since the last wait, indexed in the order of
submission, `sent` being the bytes it took or -errno. It has no thread: each job is sent at once, in
`submit`, which the contract allows (the bytes leave between `submit` and the end of `wait`).

`send` is libc's, called through ctypes: the socket module sends only through a socket object, and wrapping
a descriptor in one costs more than the send itself and closes it when the object is collected.
"""

from __future__ import annotations

import ctypes
import operator
import socket
from typing import Any

#: the flags of the compiled writer; macOS has no MSG_NOSIGNAL (the gateway ignores SIGPIPE anyway)
SEND_FLAGS = socket.MSG_DONTWAIT | getattr(socket, "MSG_NOSIGNAL", 0)
#: the largest descriptor (a C int), and the largest value a C long holds (beyond it: OverflowError, as in C)
FD_MAX = 0x7FFFFFFF
LONG_MAX = (1 << (8 * ctypes.sizeof(ctypes.c_long) - 1)) - 1

_libc = ctypes.CDLL(None, use_errno=True)
_send = _libc.send
_send.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_int)
_send.restype = ctypes.c_ssize_t
_EINTR = 4  # errno.EINTR on every platform the gateway runs on


def _descriptors(fd_list: list[int]) -> list[int]:
    """The list's descriptors as ints, all checked: a copy first, as the items' `__index__` may change the
    list while it is read."""
    fds = list(map(operator.index, tuple(fd_list)))
    if fds and (min(fds) < 0 or max(fds) > FD_MAX):
        for fd in fds:  # the first bad one decides the error, as in C
            if fd > LONG_MAX or fd < -LONG_MAX - 1:
                raise OverflowError("Python int too large to convert to C long")
            if fd < 0 or fd > FD_MAX:
                raise ValueError("a descriptor is out of range")
    return fds


def _frame(data: bytes) -> bytes:
    """The frame as bytes: any C-contiguous bytes-like object, as the compiled writer's `y*` takes."""
    if type(data) is bytes:
        return data
    view = memoryview(data)  # TypeError for str and other non-buffers
    if not view.c_contiguous:
        raise BufferError("the frame is not C-contiguous")
    return view.tobytes()


def _pass_over_busy(transport_list: list[Any], fds: list[int]) -> None:
    """-1 for each socket whose transport is closing (its descriptor may be closed already, its number
    reused) or holds bytes not yet written (ours would overtake them)."""
    if not isinstance(transport_list, list):
        raise TypeError(f"submit() argument 3 must be list, not {type(transport_list).__name__}")
    transports = tuple(transport_list)
    if len(transports) != len(fds):
        raise ValueError("one transport per descriptor")
    for index, transport in enumerate(transports):
        if transport.is_closing() or transport.get_write_buffer_size():
            fds[index] = -1


class Sender:
    """Sends each submitted frame at once, one send per descriptor; `wait` reports what was not taken."""

    __slots__ = ("_short", "_submitted")

    def __init__(self) -> None:
        #: (index, sent or -errno) of the sockets that took less since the last wait
        self._short: list[tuple[int, int]] = []
        #: sockets submitted since the last wait: the next job's first index
        self._submitted = 0

    def submit(self, fds: list[int], data: bytes, transports: list[Any] | None = None, /) -> None:
        """Send data to each socket of the list; what one did not take is reported by `wait`. With
        `transports` (one per socket), a socket whose transport is closing or holds unwritten bytes is
        passed over: it took 0 bytes."""
        if not isinstance(fds, list):
            raise TypeError(f"submit() argument 1 must be list, not {type(fds).__name__}")
        frame = _frame(data)
        descriptors = _descriptors(fds)
        if transports is not None:
            _pass_over_busy(transports, descriptors)
        base = self._submitted
        self._submitted = base + len(descriptors)
        size = len(frame)
        send = _send
        for index, fd in enumerate(descriptors, base):
            sent = send(fd, frame, size, SEND_FLAGS) if fd >= 0 else 0
            if sent != size:
                self._shortfall(index, fd, frame, sent)

    def _shortfall(self, index: int, fd: int, frame: bytes, sent: int) -> None:
        while fd >= 0 and sent < 0 and ctypes.get_errno() == _EINTR:  # interrupted before sending: again, as in C
            sent = _send(fd, frame, len(frame), SEND_FLAGS)
        if sent < 0:
            sent = -ctypes.get_errno()
        if sent != len(frame):
            self._short.append((index, sent))

    def wait(self) -> list[tuple[int, int]]:
        """(index, sent or -errno) for each socket submitted since the last wait that took less, in the
        order of submission; the next wait counts from 0 again."""
        short, self._short = self._short, []
        self._submitted = 0
        return short
