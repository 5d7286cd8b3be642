"""A TCP proxy in front of a gateway, for the browser tests: it forwards bytes unchanged (the page's origin
is the proxy's host:port, which is also the Host the gateway sees, so the origin check passes) and can
break the network on purpose:

- `cut()` resets every open connection (the browser sees its WebSocket, stream or poll fail: 1006);
- `refusing = True` closes every new connection at once (the gateway looks unreachable);
- `freeze()` makes every connection now open silent, both ways, without closing it (a dead peer that TCP
  has not noticed: only a liveness check finds it); `silent = True` does the same to new connections;
- `refuse_websocket = True` answers a WebSocket handshake `403` (a proxy that does not pass WebSockets).
"""

from __future__ import annotations

import socket
import threading


class TcpProxy:
    def __init__(self, target_port: int, host: str = "127.0.0.1") -> None:
        self.target = (host, target_port)
        self.listener = socket.create_server((host, 0))
        self.port = self.listener.getsockname()[1]
        self.refusing = False
        self.refuse_websocket = False
        self.silent = False
        #: WebSocket handshakes answered 403 so far
        self.websocket_refusals = 0
        self._lock = threading.Lock()
        self._socks: set[socket.socket] = set()
        self._frozen: set[socket.socket] = set()
        self._held: set[socket.socket] = set()
        self._closed = False
        self._thread = threading.Thread(target=self._accept, name="tcp-proxy", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> TcpProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._closed = True
        self.listener.close()
        self.cut()

    def cut(self) -> None:
        """Break every connection now open (both ends see it end without a close frame, like a network that went away)."""
        with self._lock:
            socks, self._socks = self._socks, set()
            self._frozen.clear()
        for sock in socks:
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                sock.shutdown(socket.SHUT_RDWR)  # wakes the pump blocked in recv on it
            except OSError:
                pass

    def freeze(self, *, hold_open: bool = False) -> None:
        """Stop forwarding on every connection now open; they stay open (see the module docstring).
        ``hold_open``: an end closed meanwhile is not passed on either (a stalled middlebox: the other end
        keeps a connection that carries nothing, until the proxy exits)."""
        with self._lock:
            self._frozen |= self._socks
            if hold_open:
                self._held |= self._socks

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if self.refusing:
                client.close()
                continue
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        first = b""
        if self.refuse_websocket:
            # the request head, to see whether it is a WebSocket handshake
            while b"\r\n\r\n" not in first and len(first) < 65536:
                try:
                    chunk = client.recv(65536)
                except OSError:
                    chunk = b""
                if not chunk:
                    client.close()
                    return
                first += chunk
            if b"upgrade: websocket" in first.lower():
                self.websocket_refusals += 1
                client.sendall(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                client.close()
                return
        try:
            upstream = socket.create_connection(self.target, timeout=10)
        except OSError:
            client.close()
            return
        upstream.settimeout(None)
        with self._lock:
            self._socks.update((client, upstream))
            if self.silent:
                self._frozen.update((client, upstream))
        if first:
            upstream.sendall(first)
        threading.Thread(target=self._pump, args=(upstream, client), daemon=True).start()
        self._pump(client, upstream)

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    if src in self._held:
                        return  # the other end is kept open (`freeze(hold_open=True)`)
                    break
                if src in self._frozen:
                    continue  # swallowed
                dst.sendall(data)
        except OSError:
            pass
        for sock in (src, dst):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        with self._lock:
            self._socks.discard(src)
            self._socks.discard(dst)
        for sock in (src, dst):
            try:
                sock.close()
            except OSError:
                pass
