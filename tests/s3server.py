"""A real S3-compatible server on 127.0.0.1 for the object-storage tests (moto's standalone
server, in a thread of the test process), and a fault-injecting HTTP proxy in front of it."""

from __future__ import annotations

import http.client
import itertools
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from moto.server import ThreadedMotoServer

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1"}

_ERRORS = {
    "slowdown": (503, "SlowDown", "Please reduce your request rate."),
    "internal": (500, "InternalError", "We encountered an internal error. Please try again."),
}


def start_moto() -> tuple[ThreadedMotoServer, str]:
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    return server, f"http://{host}:{port}"


class FaultProxy:
    """Forwards every request to `upstream`; `plan(n, method, path)` (n counts requests from 1)
    returns None to forward it, "whole" to forward it without its `Range` header (a server that
    ignores ranges), "slowdown" / "internal" to answer S3's 503 / 500 error instead, "reset"
    to close the connection without an answer, or "cut" to forward it and close the connection
    half-way through the answer's body (its headers declare the whole). `edit(path, body)`, when given, returns the body
    to answer for a successful request in place of the server's (a server answering nonsense).
    `injected` counts what was done, `served` the body bytes of successful GETs by path."""

    def __init__(self, upstream: str, plan, edit=None):
        self.upstream = upstream.split("://", 1)[1]
        self.plan = plan
        self.edit = edit
        self.injected: Counter[str] = Counter()
        self.served: Counter[str] = Counter()
        self.seen: list = []
        self._count = itertools.count(1)
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self.url = "http://127.0.0.1:%d" % self._server.server_address[1]
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _decide(self, method: str, path: str) -> str | None:
        with self._lock:
            fault = self.plan(next(self._count), method, path)
            self.seen.append((method, path, fault))
            if fault:
                self.injected[fault] += 1
            return fault

    def _handler(self):
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def handle(self):
                try:
                    super().handle()
                except ConnectionError:  # the client hung up before the end of an answer: it had read enough
                    pass

            def _any(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                fault = proxy._decide(self.command, self.path)
                if fault == "reset":
                    self.close_connection = True
                    return
                if fault and fault not in ("whole", "cut"):
                    status, code, message = _ERRORS[fault]
                    self._answer(status, [("Content-Type", "application/xml")],
                                 f"<Error><Code>{code}</Code><Message>{message}</Message></Error>".encode())
                    return
                conn = http.client.HTTPConnection(proxy.upstream, timeout=60)
                dropped = ("host", "range") if fault == "whole" else ("host",)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in dropped}
                conn.request(self.command, self.path, body=body, headers={**headers, "Host": proxy.upstream})
                reply = conn.getresponse()
                data = reply.read()
                conn.close()
                if reply.status < 300 and proxy.edit is not None:
                    data = proxy.edit(self.path, data)
                if self.command == "GET" and reply.status < 300:
                    with proxy._lock:
                        proxy.served[self.path.split("?")[0]] += len(data)
                self._answer(reply.status, reply.getheaders(), data, cut=fault == "cut")

            def _answer(self, status: int, headers, data: bytes, cut: bool = False) -> None:
                self.send_response(status)
                for k, v in headers:
                    if k.lower() not in ("content-length", "transfer-encoding", "connection", "server", "date"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data[:len(data) // 2] if cut else data)
                if cut:  # a clean close (FIN) before the declared length
                    self.wfile.flush()
                    self.close_connection = True

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _any

        return Handler
