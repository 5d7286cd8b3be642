"""Socket settings and readings of a client stream (WebSocket, SSE): its write limits, and when its peer's TCP
last acknowledged, and how long a closed one may take to drain."""

from __future__ import annotations

import asyncio
import socket
import struct

#: how long a closed client's buffered data and its close (frame, event) may take to drain before the cut
KICK_GRACE_S = 2.0
#: `struct tcp_info` (linux/tcp.h): eight one-byte fields, then u32 fields: rto, ato, snd_mss, rcv_mss,
#: unacked, sacked, lost, retrans, fackets, last_data_sent, last_ack_sent, last_data_recv, last_ack_recv (ms
#: since the peer's last ACK arrived), ...
TCP_INFO_LAST_ACK_RECV = 56
TCP_INFO_HEAD = 60


def tune_stream(transport: asyncio.Transport, high_water: int, send_buffer: int, notsent_lowat: int) -> None:
    """The write settings of a client stream (`[websocket]`, which SSE follows): the transport's high-water
    mark (resume at a quarter of it), SO_SNDBUF (0: the kernel's) and TCP_NOTSENT_LOWAT (0: the kernel's)."""
    transport.set_write_buffer_limits(high=high_water, low=high_water // 4)
    sock = transport.get_extra_info("socket")
    if sock is None:
        return
    if send_buffer:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)
    if notsent_lowat and hasattr(socket, "TCP_NOTSENT_LOWAT"):  # Linux, macOS
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NOTSENT_LOWAT, notsent_lowat)


def peer_acked_within(transport: asyncio.BaseTransport, seconds: float) -> bool:
    """The peer's TCP sent an ACK within the last `seconds` on the transport's socket (TCP_INFO
    `tcpi_last_ack_recv`: Linux); False when the kernel cannot say."""
    sock = transport.get_extra_info("socket")
    if sock is None or not hasattr(socket, "TCP_INFO"):
        return False
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, TCP_INFO_HEAD)
    except OSError:
        return False
    if len(info) < TCP_INFO_HEAD:
        return False
    return bool(struct.unpack_from("=I", info, TCP_INFO_LAST_ACK_RECV)[0] < seconds * 1000)
