"""A small TCP proxy on 127.0.0.1 that sits between zckpt and a real server (the SeaweedFS S3 server of
:mod:`tests.s3server`) and injects faults at HTTP request boundaries, for the fault tests.

::

    proxy = FaultProxy(("127.0.0.1", s3_server.s3_port)).start()
    proxy.endpoint                      # http://127.0.0.1:NNNN: give it to the client as its S3 endpoint
    proxy.slowdown(3)                   # the next 3 PUT/POST requests are answered 503 SlowDown (S3's XML)
    proxy.reset_puts(2, after=1 << 20)  # the next 2 PUTs bigger than 1 MiB: connection reset (RST) after 1 MiB
    proxy.stall_puts(1)                 # the next PUT: once its headers passed, nothing moves (the client must
                                        # time out)
    proxy.stall_after_object("name")    # every PUT stalls once one object whose key holds "name" was sent whole
                                        # (a PUT's body, or the POST completing its upload): caught mid-upload
    proxy.puts                          # {"/bucket/key": PUT bodies forwarded whole}, the wire's own count
    proxy.down(); proxy.up()            # an outage: connections refused (open ones reset) until up()
    proxy.stop()

It parses the client's side of each connection just enough to find request boundaries (request line, headers,
``Content-Length`` or chunked bodies; ``Expect: 100-continue`` works, since the server's side is relayed
untouched). With ``mirror=True`` (the default) it also mirrors the upstream's availability: while the server is
down (killed), the proxy's own port refuses connections too, as the server's would, and it listens again once
the server is back.
"""

from __future__ import annotations

import collections
import contextlib
import socket
import struct
import threading
import time
import uuid

SLOWDOWN_XML = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
                b'<Message>Please reduce your request rate.</Message><RequestId>%s</RequestId></Error>')


def _rst(sock: socket.socket) -> None:
    """Close with a TCP reset (SO_LINGER 0): the peer sees ECONNRESET, not an orderly end."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        sock.close()


class _Closed(Exception):
    pass


class FaultProxy:
    def __init__(self, upstream: tuple[str, int], *, mirror: bool = True):
        self.upstream = upstream
        self.mirror = mirror
        self.lock = threading.Lock()
        self.puts: collections.Counter = collections.Counter()
        self.requests: list[tuple[str, str, str]] = []  # (method, path, what the proxy did)
        self.ranges: list[tuple[str, str, str]] = []  # (method, path, Range header or "") of every request
        self.put_bytes = 0  # PUT body bytes forwarded (whole or not)
        self._slowdown = 0
        self._slowdown_methods = ("PUT", "POST")
        self._resets = 0
        self._reset_after = 0
        self._stalls = 0
        self._stall_marker: str | None = None  # stall_after_object's key part
        self._stall_all = False  # every PUT stalls (set once the object stall_after_object waits for was sent)
        self._down = False  # down(): refuse connections until up()
        self._stop = threading.Event()
        self._listener: socket.socket | None = None
        self._conns: set[socket.socket] = set()
        self._stalled: set[socket.socket] = set()  # clients whose connection is held: the server side stays quiet
        self.port = self._listen(0)
        self.endpoint = f"http://127.0.0.1:{self.port}"

    # ---------------------------------------------------------------- faults

    def slowdown(self, n: int, methods=("PUT", "POST")) -> None:
        with self.lock:
            self._slowdown, self._slowdown_methods = n, tuple(methods)

    def reset_puts(self, n: int, after: int = 0) -> None:
        with self.lock:
            self._resets, self._reset_after = n, after

    def stall_puts(self, n: int) -> None:
        with self.lock:
            self._stalls = n

    def stall_after_object(self, marker: str) -> None:
        """Stall every later PUT once one object whose key holds ``marker`` was sent whole: a PUT whose body was
        forwarded, or the POST completing a multipart upload (``uploadId``). Set in the request path itself, as
        the body's last byte goes out, so no PUT the client sends after it gets through."""
        with self.lock:
            self._stall_marker, self._stall_all = marker, False

    def down(self) -> None:
        """Refuse connections from now on, as a server that is not running would (its port closed; connections
        open through the proxy are reset), until :meth:`up`. The server behind it keeps running."""
        with self.lock:
            self._down = True
        self._go_down()
        for c in list(self._conns):
            _rst(c)

    def up(self) -> None:
        """Accept connections again (within about 0.1 s)."""
        with self.lock:
            self._down = False

    def clear(self) -> None:
        with self.lock:
            self._slowdown = self._resets = self._stalls = 0
            self._stall_marker, self._stall_all = None, False

    @property
    def pending(self) -> dict[str, int]:
        with self.lock:
            return {"slowdown": self._slowdown, "resets": self._resets, "stalls": self._stalls}

    def count(self, what: str) -> int:
        with self.lock:
            return sum(1 for r in self.requests if r[2] == what)

    # ---------------------------------------------------------------- lifecycle

    def _listen(self, port: int) -> int:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
        s.listen(64)
        s.settimeout(0.2)
        self._listener = s
        return s.getsockname()[1]

    def start(self) -> FaultProxy:
        threading.Thread(target=self._accept_loop, name="faultproxy", daemon=True).start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._listener is not None:
            with contextlib.suppress(OSError):
                self._listener.close()
        for c in list(self._conns):
            _rst(c)

    def _upstream_up(self) -> bool:
        try:
            socket.create_connection(self.upstream, timeout=0.5).close()
            return True
        except OSError:
            return False

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            listener = self._listener
            if listener is not None and self._down:
                self._go_down()
                continue
            if listener is None:
                if not self._down and (not self.mirror or self._upstream_up()):
                    with contextlib.suppress(OSError):
                        self._listen(self.port)
                else:
                    time.sleep(0.05)
                continue
            try:
                client, _ = listener.accept()
            except socket.timeout:
                if self.mirror and not self._upstream_up():
                    self._go_down()
                continue
            except OSError:
                if self._stop.is_set():
                    return
                continue
            if self._down:  # (accepted just as down() closed the port)
                _rst(client)
                continue
            try:
                server = socket.create_connection(self.upstream, timeout=5)
            except OSError:
                _rst(client)
                if self.mirror:
                    self._go_down()
                continue
            server.settimeout(None)
            client.settimeout(None)
            self._conns.update((client, server))
            threading.Thread(target=self._client_side, args=(client, server), daemon=True).start()
            threading.Thread(target=self._relay, args=(server, client), daemon=True).start()

    def _go_down(self) -> None:
        """The upstream refuses: refuse too (close the listening socket) until it is back."""
        if self._listener is not None:
            with contextlib.suppress(OSError):
                self._listener.close()
            self._listener = None

    # ---------------------------------------------------------------- pumps

    def _relay(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            if dst not in self._stalled:
                for s in (src, dst):
                    with contextlib.suppress(OSError):
                        s.shutdown(socket.SHUT_RDWR)
            self._conns.discard(src)

    def _client_side(self, client: socket.socket, server: socket.socket) -> None:
        reader = _Reader(client)
        try:
            while True:
                head = reader.until(b"\r\n\r\n")
                if head is None:
                    break
                self._one_request(head, reader, client, server)
        except _Closed:
            pass
        except OSError:
            pass
        finally:
            for s in (client, server):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
            self._conns.discard(client)

    def _one_request(self, head: bytes, reader: _Reader, client: socket.socket, server: socket.socket) -> None:
        lines = head.decode("latin-1").split("\r\n")
        method, target = (lines[0].split(" ") + ["", ""])[:2]
        path = target.split("?", 1)[0]
        headers = {}
        for line in lines[1:]:
            k, _, v = line.partition(":")
            headers[k.strip().lower()] = v.strip()
        with self.lock:
            action = "forward"
            if self._slowdown and method in self._slowdown_methods:
                self._slowdown -= 1
                action = "slowdown"
            elif method == "PUT" and self._stalls:
                self._stalls -= 1
                action = "stall"
            elif method == "PUT" and self._stall_all:
                action = "stall"
            elif method == "PUT" and self._resets and self._body_size(headers) > self._reset_after:
                self._resets -= 1  # (only bodies the reset can cut in the middle)
                action = "reset"
            if method == "POST" and "uploadId=" in target and self._stall_marker and self._stall_marker in path:
                self._stall_all = True
            self.requests.append((method, target, action))
            self.ranges.append((method, target, headers.get("range", "")))
        if action == "slowdown":
            body = SLOWDOWN_XML % uuid.uuid4().hex.encode()
            client.sendall(b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\nConnection: close\r\n"
                           b"Content-Length: %d\r\n\r\n" % len(body) + body)
            _rst(server)
            with contextlib.suppress(OSError):
                client.shutdown(socket.SHUT_WR)
            time.sleep(0.05)
            raise _Closed
        server.sendall(head)
        if action == "stall":
            self._hold(client, server)
        limit = self._reset_after if action == "reset" else None
        whole = self._body(headers, reader, server, method, limit, client=client)
        if method == "PUT" and whole:
            with self.lock:
                self.puts[path] += 1
                if self._stall_marker and self._stall_marker in path and "uploadId=" not in target:
                    self._stall_all = True

    @staticmethod
    def _body_size(headers: dict) -> int:
        """The body's length where the headers say it (chunked bodies: unknown, taken as large)."""
        if "chunked" in headers.get("transfer-encoding", "").lower():
            return 1 << 62
        return int(headers.get("x-amz-decoded-content-length") or headers.get("content-length") or 0)

    def _body(self, headers, reader, server, method, reset_after, *, client) -> bool:
        """Forward one request body; False when the body was cut short (by a fault)."""
        sent = 0

        def forward(data: bytes) -> None:
            nonlocal sent
            if reset_after is not None and sent + len(data) >= reset_after:
                cut = max(0, reset_after - sent)
                server.sendall(data[:cut])
                _rst(client)
                _rst(server)
                raise _Closed
            server.sendall(data)
            sent += len(data)
            if method == "PUT":
                with self.lock:
                    self.put_bytes += len(data)

        if "chunked" in headers.get("transfer-encoding", "").lower():
            while True:
                size_line = reader.until(b"\r\n")
                if size_line is None:
                    raise _Closed
                forward(size_line)
                n = int(size_line.split(b";")[0].strip() or b"0", 16)
                if n == 0:
                    while True:  # trailers, then the empty line
                        line = reader.until(b"\r\n")
                        if line is None:
                            raise _Closed
                        forward(line)
                        if line == b"\r\n":
                            return True
                for chunk in reader.exactly(n + 2):
                    forward(chunk)
        n = int(headers.get("content-length") or 0)
        for chunk in reader.exactly(n):
            forward(chunk)
        if reset_after is not None:  # a body shorter than the reset point: reset right after it
            _rst(client)
            _rst(server)
            raise _Closed
        return True

    def _hold(self, client: socket.socket, server: socket.socket) -> None:
        """A stall: forward nothing more, in either direction, until the client gives up (or the proxy stops)."""
        self._stalled.add(client)
        client.settimeout(0.2)
        while not self._stop.is_set():
            try:
                if not client.recv(65536):
                    break
            except socket.timeout:
                continue
            except OSError:
                break
        self._stalled.discard(client)
        _rst(server)
        raise _Closed


class _Reader:
    """Buffered reads from a socket: up to a delimiter, or exactly n bytes (yielded in pieces)."""

    def __init__(self, sock: socket.socket):
        self.sock, self.buf = sock, b""

    def _more(self) -> bool:
        data = self.sock.recv(65536)
        if not data:
            return False
        self.buf += data
        return True

    def until(self, delim: bytes) -> bytes | None:
        while delim not in self.buf:
            if not self._more():
                return None
        i = self.buf.index(delim) + len(delim)
        out, self.buf = self.buf[:i], self.buf[i:]
        return out

    def exactly(self, n: int):
        while n > 0:
            if not self.buf and not self._more():
                raise _Closed
            take = self.buf[:n]
            self.buf = self.buf[len(take):]
            n -= len(take)
            yield take
