"""A TCP fault proxy for HTTP/1.1 object-store traffic, on loopback only.

Point a client's endpoint at :attr:`WireProxy.endpoint`; the proxy forwards
each request to the real server (S3 or GCS emulator) and can, per request
that a rule matches, inject a fault **on the wire**:

=====================  ==============================================================
``delay``              wait ``seconds``, then forward normally
``stall``              forward the head and half the body, wait ``seconds``, then reset
                       both connections (the server never gets the whole request)
``reset_before``       reset the client connection; nothing reaches the server
``reset_after``        forward the whole request, then reset both connections at once,
                       without waiting for the answer (the server may have acted)
``drop_response``      forward, wait for the server's complete answer (it acted), hold
                       it ``seconds`` (0 by default), then reset the client connection:
                       the acknowledgement is lost
``status``             answer ``status`` (503, 429, 500 ...) without forwarding
``status_after``       forward, wait for the answer (the server acted), then answer
                       ``status`` instead of the real response
=====================  ==============================================================

Requests are parsed just enough to find their boundaries (Content-Length or
chunked bodies, ``Expect: 100-continue`` answered by the proxy itself) and to
let a rule match on method, target and body (a GCS upload names its object in
the body). Every request is logged with the fault applied and the server's
status (``None`` when the server never answered).

Threads, not asyncio: one accept thread and one thread per client connection,
all daemons; every socket has a timeout and every loop a bound.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Self
from urllib.parse import unquote

FAULT_KINDS = ("delay", "stall", "reset_before", "reset_after", "drop_response", "status", "status_after")
IO_TIMEOUT_S = 30.0
MAX_HEAD = 64 * 1024
MAX_REQUESTS_PER_CONNECTION = 100_000


@dataclass(frozen=True)
class Fault:
    kind: str
    seconds: float = 0.0
    status: int = 503

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault {self.kind!r}; one of {FAULT_KINDS}")

    def __str__(self) -> str:
        if self.kind in ("status", "status_after"):
            return f"{self.kind}:{self.status}"
        if self.kind in ("delay", "stall"):
            return f"{self.kind}:{self.seconds:g}s"
        return self.kind


@dataclass
class Request:
    method: str
    target: str
    headers: list[tuple[str, str]]
    body: bytes  # decoded (de-chunked) body, for matching
    raw_body: bytes  # as received, forwarded unchanged

    def header(self, name: str) -> str | None:
        low = name.lower()
        for k, v in self.headers:
            if k.lower() == low:
                return v
        return None

    @property
    def path(self) -> str:
        return unquote(self.target)

    def mentions(self, text: str) -> bool:
        """``text`` appears in the (URL-decoded) target or in the first 4 KiB of the body."""
        return text in self.path or text.encode() in self.body[:4096]

    @property
    def is_write(self) -> bool:
        return self.method in ("PUT", "POST")


@dataclass
class Rule:
    fault: Fault
    match: Callable[[Request], bool]
    times: int | None = 1  # None: every matching request
    fired: int = 0

    def take(self, req: Request) -> bool:
        if self.times is not None and self.fired >= self.times:
            return False
        if not self.match(req):
            return False
        self.fired += 1
        return True


@dataclass
class LogEntry:
    method: str
    target: str
    fault: str
    upstream_status: int | None
    at: float = field(default_factory=time.monotonic)


class _Closed(Exception):
    """The peer closed the connection."""


class _Reader:
    """Buffered reads from a socket, every read bounded by the socket's timeout."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = b""

    def _fill(self) -> None:
        data = self.sock.recv(256 * 1024)
        if not data:
            raise _Closed()
        self.buf += data

    def until(self, sep: bytes, limit: int) -> bytes:
        while sep not in self.buf:
            if len(self.buf) > limit:
                raise ValueError("HTTP head too large")
            self._fill()
        i = self.buf.index(sep) + len(sep)
        out, self.buf = self.buf[:i], self.buf[i:]
        return out

    def exactly(self, n: int) -> bytes:
        while len(self.buf) < n:
            self._fill()
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def rest(self) -> bytes:
        """Everything until the peer closes (a response without length)."""
        chunks = [self.buf]
        self.buf = b""
        for _ in range(1_000_000):
            try:
                data = self.sock.recv(256 * 1024)
            except OSError:
                break
            if not data:
                break
            chunks.append(data)
        return b"".join(chunks)


def _parse_headers(head: bytes) -> tuple[str, list[tuple[str, str]]]:
    lines = head.decode("latin-1").split("\r\n")
    headers = []
    for ln in lines[1:]:
        if not ln:
            continue
        k, _, v = ln.partition(":")
        headers.append((k.strip(), v.strip()))
    return lines[0], headers


def _get(headers: list[tuple[str, str]], name: str) -> str | None:
    for k, v in headers:
        if k.lower() == name:
            return v
    return None


def _read_body(r: _Reader, headers: list[tuple[str, str]]) -> tuple[bytes, bytes]:
    """(decoded body, raw body as received)."""
    te = (_get(headers, "transfer-encoding") or "").lower()
    if "chunked" in te:
        raw, dec = [], []
        for _ in range(10_000_000):
            line = r.until(b"\r\n", MAX_HEAD)
            raw.append(line)
            size = int(line.split(b";")[0].strip(), 16)
            if size == 0:
                for _ in range(1000):  # trailers, up to the empty line
                    t = r.until(b"\r\n", MAX_HEAD)
                    raw.append(t)
                    if t == b"\r\n":
                        break
                break
            data = r.exactly(size + 2)
            raw.append(data)
            dec.append(data[:-2])
        return b"".join(dec), b"".join(raw)
    n = int(_get(headers, "content-length") or 0)
    data = r.exactly(n)
    return data, data


def _rst(sock: socket.socket | None) -> None:
    """Close with a TCP reset (SO_LINGER 0), not a clean FIN."""
    if sock is None:
        return
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    try:
        sock.close()
    except OSError:
        pass


class WireProxy:
    """A fault-injecting HTTP/1.1 proxy on 127.0.0.1 in front of ``upstream``
    (``http://127.0.0.1:PORT``). ``flavor`` ("s3" or "gcs") shapes the error
    bodies of injected statuses."""

    def __init__(self, upstream: str, *, flavor: str = "s3") -> None:
        host_port = upstream.split("://", 1)[-1].rstrip("/")
        host, _, port = host_port.partition(":")
        if host not in ("127.0.0.1", "localhost"):
            raise ValueError("the wire proxy forwards to loopback only")
        self.upstream = ("127.0.0.1", int(port or 80))
        self.flavor = flavor
        self.rules: list[Rule] = []
        self.log: list[LogEntry] = []
        self._lock = threading.Lock()
        self._socks: set[socket.socket] = set()
        self._listener: socket.socket | None = None
        self._stopped = threading.Event()
        self.port = 0

    # -- control ---------------------------------------------------------
    def start(self) -> WireProxy:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", 0))
        s.listen(128)
        s.settimeout(0.2)
        self._listener = s
        self.port = s.getsockname()[1]
        threading.Thread(target=self._accept_loop, name="wireproxy-accept", daemon=True).start()
        return self

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def add(self, fault: Fault, match: Callable[[Request], bool], *, times: int | None = 1) -> Rule:
        rule = Rule(fault, match, times)
        with self._lock:
            self.rules.append(rule)
        return rule

    def clear(self) -> None:
        with self._lock:
            self.rules.clear()

    def entries(self, fault_kind: str | None = None) -> list[LogEntry]:
        with self._lock:
            return [e for e in self.log if fault_kind is None or e.fault.split(":")[0] == fault_kind]

    def reset_all(self) -> None:
        """Reset every open connection (clients must reconnect)."""
        with self._lock:
            socks = list(self._socks)
            self._socks.clear()
        for s in socks:
            _rst(s)

    def stop(self) -> None:
        self._stopped.set()
        if self._listener is not None:
            self._listener.close()
        self.reset_all()

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- machinery -------------------------------------------------------
    def _track(self, s: socket.socket) -> None:
        with self._lock:
            self._socks.add(s)

    def _untrack(self, s: socket.socket | None) -> None:
        if s is None:
            return
        with self._lock:
            self._socks.discard(s)

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self._stopped.is_set():
            try:
                c, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            c.settimeout(IO_TIMEOUT_S)
            self._track(c)
            threading.Thread(target=self._serve, args=(c,), name="wireproxy-conn", daemon=True).start()

    def _choose(self, req: Request) -> Fault | None:
        with self._lock:
            for rule in self.rules:
                if rule.take(req):
                    return rule.fault
        return None

    def _record(self, req: Request, fault: Fault | None, status: int | None) -> None:
        with self._lock:
            self.log.append(LogEntry(req.method, req.path, str(fault) if fault else "", status))

    def _connect_upstream(self) -> socket.socket:
        u = socket.create_connection(self.upstream, timeout=IO_TIMEOUT_S)
        u.settimeout(IO_TIMEOUT_S)
        self._track(u)
        return u

    def _serve(self, client: socket.socket) -> None:
        upstream: socket.socket | None = None
        ur: _Reader | None = None
        cr = _Reader(client)
        try:
            for _ in range(MAX_REQUESTS_PER_CONNECTION):
                if self._stopped.is_set():
                    return
                try:
                    head = cr.until(b"\r\n\r\n", MAX_HEAD)
                except (_Closed, OSError, ValueError):
                    return
                start_line, headers = _parse_headers(head)
                method, target = (start_line.split(" ") + ["", ""])[:2]
                expect = (_get(headers, "expect") or "").lower() == "100-continue"
                if expect:
                    client.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
                    headers = [(k, v) for k, v in headers if k.lower() != "expect"]
                body, raw_body = _read_body(cr, headers)
                req = Request(method, target, headers, body, raw_body)
                fault = self._choose(req)
                out_head = (start_line + "\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers) + "\r\n").encode(
                    "latin-1"
                )
                kind = fault.kind if fault else ""
                if kind == "reset_before":
                    self._record(req, fault, None)
                    return  # finally: reset
                if kind == "status":
                    self._record(req, fault, None)
                    assert fault is not None
                    client.sendall(self._error_response(fault.status, method))
                    continue
                if kind == "delay":
                    assert fault is not None
                    time.sleep(fault.seconds)
                if upstream is None:
                    upstream = self._connect_upstream()
                    ur = _Reader(upstream)
                assert ur is not None
                if kind == "stall":
                    assert fault is not None
                    upstream.sendall(out_head + raw_body[: len(raw_body) // 2])
                    self._record(req, fault, None)
                    time.sleep(fault.seconds)
                    return  # finally: reset both
                upstream.sendall(out_head + raw_body)
                if kind == "reset_after":
                    self._record(req, fault, None)
                    return
                resp, status, keep = self._read_response(ur, method)
                self._record(req, fault, status)
                if kind == "drop_response":
                    assert fault is not None
                    time.sleep(fault.seconds)
                    return
                if kind == "status_after":
                    assert fault is not None
                    client.sendall(self._error_response(fault.status, method))
                else:
                    client.sendall(resp)
                if not keep:
                    self._untrack(upstream)
                    upstream.close()
                    upstream, ur = None, None
        except (OSError, _Closed, ValueError):
            return
        finally:
            self._untrack(client)
            _rst(client)
            self._untrack(upstream)
            _rst(upstream)

    @staticmethod
    def _read_response(r: _Reader, method: str) -> tuple[bytes, int, bool]:
        for _ in range(10):
            head = r.until(b"\r\n\r\n", MAX_HEAD)
            status_line, headers = _parse_headers(head)
            status = int(status_line.split(" ")[1])
            if status == 100:
                continue
            keep = (_get(headers, "connection") or "").lower() != "close"
            if method == "HEAD" or status in (204, 304) or 100 <= status < 200:
                return head, status, keep
            te = (_get(headers, "transfer-encoding") or "").lower()
            if "chunked" in te or _get(headers, "content-length") is not None:
                _, raw = _read_body(r, headers)
                return head + raw, status, keep
            return head + r.rest(), status, False
        raise ValueError("too many interim responses")

    def _error_response(self, status: int, method: str) -> bytes:
        reason = {429: "Too Many Requests", 500: "Internal Server Error", 503: "Service Unavailable"}.get(
            status, "Error"
        )
        if self.flavor == "gcs":
            body = (f'{{"error":{{"code":{status},"message":"injected by the wire proxy",'
                    '"errors":[{"reason":"backendError","message":"injected"}]}}').encode()
            ctype = "application/json; charset=UTF-8"
        else:
            code = {429: "SlowDown", 500: "InternalError", 503: "SlowDown"}.get(status, "InternalError")
            body = (f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
                    f"<Message>injected by the wire proxy</Message><RequestId>wireproxy</RequestId></Error>").encode()
            ctype = "application/xml"
        head = (f"HTTP/1.1 {status} {reason}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
                "Connection: keep-alive\r\n\r\n").encode()
        return head if method == "HEAD" else head + body
