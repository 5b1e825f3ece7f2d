"""A real S3-compatible server for tests (moto's server mode on loopback) and a fault-injecting
HTTP proxy to put in front of it.

moto keeps its buckets in the process (not in the server thread), so a second server, a restarted
server and a proxy all see the same objects. moto reads a whole object for every ranged GET: keep
test objects small (<= 8 MiB).
"""

from __future__ import annotations

import http.client
import http.server
import socket
import threading
import time
from collections import deque
from typing import Any

TEST_ENVIRONMENT = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_CONFIG_FILE": "/nonexistent/tokenmill-test-aws-config",
    "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent/tokenmill-test-aws-credentials",
    # small budgets keep the fault tests fast; a test that needs more sets its own policy
    "TOKENMILL_S3_MAX_ATTEMPTS": "5",
    "TOKENMILL_S3_BACKOFF_BASE": "0.01",
    "TOKENMILL_S3_BACKOFF_MAX": "0.05",
    "TOKENMILL_S3_CONNECT_TIMEOUT": "2",
    "TOKENMILL_S3_READ_TIMEOUT": "5",
}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


class MotoServer:
    """moto's ThreadedMotoServer on 127.0.0.1 that can be stopped and restarted on its port."""

    def __init__(self, port: int | None = None) -> None:
        self.port = port if port is not None else free_port()
        self._server: Any = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        from moto.server import ThreadedMotoServer

        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self._server.start()

    def stop(self) -> None:
        if self._server is None:
            return
        server, self._server = self._server, None
        server.stop()
        # ThreadedMotoServer.stop() leaves the listening socket open (clients would hang, not
        # fail); close it so a stopped server refuses connections like a dead one.
        inner = getattr(server, "_server", None)
        if inner is not None:
            inner.server_close()


class FaultProxy:
    """A loopback HTTP proxy that forwards to ``upstream_port``, except for planned faults.

    ``fail(n)`` answers the next n requests with 503 SlowDown, ``drop(n)`` closes the connection without an answer, ``hang(n)`` (and ``hang_when``, for
    the requests a predicate picks) answers nothing until the client gives up and closes the
    connection: a read timeout decided by the client's clock alone, not by a race between two
    timers on a loaded machine. ``trickle_when`` sends the answer to the GETs a predicate picks
    one body byte every 50 ms: each read succeeds well within any per-read timeout.
    """

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.plan: deque[str] = deque()
        self.lock = threading.Lock()
        self.requests = 0
        self.faults = 0
        self.log: list[tuple[str, str]] = []  # (method, path with query) of every request
        self.hang_predicate: Any = None
        self.trickle_predicate: Any = None
        self._closing = threading.Event()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                pass

            def _handle(self) -> None:
                with proxy.lock:
                    proxy.requests += 1
                    proxy.log.append((self.command, self.path))
                    kind = proxy.plan.popleft() if proxy.plan else "forward"
                    predicate = proxy.hang_predicate
                    trickling = proxy.trickle_predicate
                    if (
                        kind == "forward"
                        and predicate is not None
                        and predicate(self.command, self.path, self.headers)
                    ):
                        kind = "hang"
                    if (
                        kind == "forward"
                        and self.command == "GET"
                        and trickling is not None
                        and trickling(self.command, self.path, self.headers)
                    ):
                        kind = "trickle"
                    if kind != "forward":
                        proxy.faults += 1
                if kind == "fail":
                    body = (
                        b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
                        b"<Message>Please reduce your request rate.</Message></Error>"
                    )
                    self.send_response(503)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(body)
                    return
                if kind == "drop":
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                if kind == "hang":
                    self._hang()
                    return
                self._forward(trickle=kind == "trickle")

            def _hang(self) -> None:
                # until the client closes its end (recv gives b"") or the proxy closes
                self.close_connection = True
                self.connection.settimeout(0.05)
                while not proxy._closing.is_set():
                    try:
                        if not self.connection.recv(1, socket.MSG_PEEK):
                            return
                    except TimeoutError:
                        continue
                    except OSError:
                        return

            def _forward(self, trickle: bool = False) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                upstream = http.client.HTTPConnection("127.0.0.1", proxy.upstream_port, timeout=30)
                try:
                    headers = {k: v for k, v in self.headers.items() if k.lower() != "connection"}
                    try:
                        upstream.request(self.command, self.path, body=body, headers=headers)
                        response = upstream.getresponse()
                        payload = response.read()
                    except OSError:
                        # The server is down (a planned stop): the client sees a dropped
                        # connection, as it would from S3, without a traceback in the log.
                        self.close_connection = True
                        return
                    try:
                        self.send_response(response.status)
                        dropped = ("transfer-encoding", "connection", "content-length")
                        for key, value in response.getheaders():
                            if key.lower() not in dropped:
                                self.send_header(key, value)
                        # a HEAD answer carries the object's length, not its (empty) body's
                        length = response.getheader("Content-Length")
                        if self.command != "HEAD" or length is None:
                            length = str(len(payload))
                        self.send_header("Content-Length", length)
                        self.end_headers()
                        if self.command != "HEAD" and not trickle:
                            self.wfile.write(payload)
                        for index in range(len(payload) if trickle else 0):
                            if proxy._closing.is_set():
                                break
                            self.wfile.write(payload[index : index + 1])
                            self.wfile.flush()
                            time.sleep(0.05)
                    except (BrokenPipeError, ConnectionResetError):
                        pass  # the client gave up (a planned timeout)
                finally:
                    upstream.close()

            do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _handle

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(
            target=self._server.serve_forever, args=(0.05,), daemon=True
        )
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def fail(self, count: int) -> None:
        with self.lock:
            self.plan.extend(["fail"] * count)

    def drop(self, count: int) -> None:
        with self.lock:
            self.plan.extend(["drop"] * count)

    def hang(self, count: int) -> None:
        with self.lock:
            self.plan.extend(["hang"] * count)

    def hang_when(self, predicate: Any) -> None:
        """Hang every request for which ``predicate(command, path, headers)`` is true."""
        with self.lock:
            self.hang_predicate = predicate

    def trickle_when(self, predicate: Any) -> None:
        """Trickle the body of every GET for which ``predicate(command, path, headers)`` is
        true (the whole body, one byte per 50 ms)."""
        with self.lock:
            self.trickle_predicate = predicate

    def listings(self) -> list[str]:
        """The LIST requests (``GET /<bucket>?list-type=2&...``) seen so far."""
        with self.lock:
            return [path for method, path in self.log if method == "GET" and "list-type=2" in path]

    def close(self) -> None:
        self._closing.set()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()
