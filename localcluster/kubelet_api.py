"""The kubelet API of a local node, as the apiserver uses it: `kubectl logs` and `kubectl port-forward`.

kube-apiserver proxies `kubectl logs` to GET /containerLogs/{namespace}/{pod}/{container}
(follow, previous, tailLines, limitBytes) and `kubectl port-forward` to /portForward/{namespace}/{pod}
(an SPDY/3.1 upgrade, `spdy.py`), at the node's InternalIP and daemonEndpoints port. This server
speaks HTTPS with the node's certificate from the cluster CA (`pki.py`) and requires a client
certificate: one chained to the cluster CA whose fingerprint is one of `client_fingerprints`
(the apiserver's `--kubelet-client-certificate`); anything else is refused at the handshake or
with 403. A real kubelet would also ask the apiserver (SubjectAccessReview); here the one client
allowed is the apiserver itself.
"""

from __future__ import annotations

import logging
import ssl
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Callable, Protocol
from urllib.parse import parse_qs, unquote, urlsplit

from .pki import fingerprint_of

log = logging.getLogger("specdeploy.localcluster.kubelet_api")

FOLLOW_POLL_S = 0.2
READ_CHUNK = 64 * 1024


@dataclass(frozen=True)
class LogQuery:
    follow: bool = False
    previous: bool = False
    tail_lines: int | None = None
    limit_bytes: int | None = None

    @classmethod
    def parse(cls, query: str) -> "LogQuery":
        """The kubelet's query parameters; a malformed number is a ValueError (answered 400)."""
        q = {k: v[-1] for k, v in parse_qs(query).items()}

        def flag(name: str) -> bool:
            return q.get(name, "false").lower() in ("true", "1")

        def number(name: str) -> int | None:
            if name not in q:
                return None
            value = int(q[name])
            if value < 0:
                raise ValueError(f"{name} must be >= 0")
            return value

        return cls(follow=flag("follow"), previous=flag("previous"), tail_lines=number("tailLines"),
                   limit_bytes=number("limitBytes"))


def tail_offset(data: bytes, lines: int) -> int:
    """Offset in `data` where its last `lines` lines start (a final line without newline counts)."""
    if lines == 0:
        return len(data)
    end = len(data) - 1 if data.endswith(b"\n") else len(data)
    pos = end
    for _ in range(lines):
        pos = data.rfind(b"\n", 0, pos)
        if pos < 0:
            return 0
    return pos + 1


class LogSource(Protocol):
    def log_file(self, namespace: str, pod: str, container: str, previous: bool) -> tuple[Path, Callable[[], bool]]:
        """(the log file, a function that is True while that run of the container may still write to it).
        Raises KeyError when there is no such pod/container/run."""

    def port_forward_target(self, namespace: str, pod: str) -> str:
        """The pod's address (KeyError if no such pod runs here)."""


class _Handler(BaseHTTPRequestHandler):
    server: "_Server"
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt: str, *args) -> None:  # the apiserver's requests, at debug level
        log.debug("%s %s", self.address_string(), fmt % args)

    def _answer(self, code: int, text: str) -> None:
        body = (text + "\n").encode()
        self.send_response(code)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _authenticated(self) -> bool:
        peer = self.connection.getpeercert(binary_form=True) if isinstance(self.connection, ssl.SSLSocket) else None
        if peer and fingerprint_of(peer) in self.server.client_fingerprints:
            return True
        self._answer(403, "Forbidden: only the apiserver's kubelet client certificate is accepted")
        return False

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        if not self._authenticated():
            return
        url = urlsplit(self.path)
        parts = [unquote(p) for p in url.path.strip("/").split("/")]
        if parts == ["healthz"]:
            return self._answer(200, "ok")
        if parts[0] == "containerLogs" and len(parts) == 4:
            return self._logs(*parts[1:], url.query)
        if parts[0] == "portForward" and len(parts) == 3:
            return self._port_forward(parts[1], parts[2])
        self._answer(404, f"not found: {url.path}")

    do_POST = do_GET

    def _logs(self, namespace: str, pod: str, container: str, query: str) -> None:
        try:
            q = LogQuery.parse(query)
        except ValueError as err:
            return self._answer(400, f"bad query: {err}")
        try:
            path, writing = self.server.source.log_file(namespace, pod, container, q.previous)
        except KeyError as err:
            return self._answer(404, str(err.args[0] if err.args else err))
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        budget = q.limit_bytes
        try:
            with path.open("rb") as f:
                start = 0
                if q.tail_lines is not None:
                    start = tail_offset(f.read(), q.tail_lines)
                f.seek(start)
                while True:
                    chunk = f.read(READ_CHUNK if budget is None else min(READ_CHUNK, budget))
                    if chunk:
                        self._chunk(chunk)
                        if budget is not None:
                            budget -= len(chunk)
                            if budget <= 0:
                                break
                        continue
                    if not q.follow or self.server.stopping.is_set():
                        break
                    if not writing():
                        # The run ended: whatever it wrote last, then the end of the stream.
                        rest = f.read()
                        if rest:
                            self._chunk(rest[:budget] if budget is not None else rest)
                        break
                    time.sleep(FOLLOW_POLL_S)
            self._chunk(b"")
        except (BrokenPipeError, ConnectionResetError, ssl.SSLError, OSError) as err:
            log.debug("logs of %s/%s/%s: client went away: %s", namespace, pod, container, err)
            self.close_connection = True

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()

    def _port_forward(self, namespace: str, pod: str) -> None:
        from .spdy import serve_port_forward

        try:
            address = self.server.source.port_forward_target(namespace, pod)
        except KeyError as err:
            return self._answer(404, str(err.args[0] if err.args else err))
        protocols = [p.strip() for p in self.headers.get("X-Stream-Protocol-Version", "").split(",") if p.strip()]
        if "portforward.k8s.io" not in protocols or self.headers.get("Upgrade", "").lower() != "spdy/3.1":
            return self._answer(400, "port-forward needs an SPDY/3.1 upgrade with protocol portforward.k8s.io")
        self.send_response(101)
        self.send_header("Connection", "Upgrade")
        self.send_header("Upgrade", "SPDY/3.1")
        self.send_header("X-Stream-Protocol-Version", "portforward.k8s.io")
        self.end_headers()
        self.wfile.flush()
        self.close_connection = True
        serve_port_forward(self.connection, address, self.server.stopping)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address, source: LogSource, context: ssl.SSLContext, client_fingerprints: set[str]):
        self.source = source
        self.context = context
        self.client_fingerprints = client_fingerprints
        self.stopping = threading.Event()
        super().__init__(address, _Handler)

    def get_request(self):
        sock, addr = self.socket.accept()
        return self.context.wrap_socket(sock, server_side=True, do_handshake_on_connect=False), addr

    def finish_request(self, request, client_address) -> None:
        try:
            request.settimeout(30)
            request.do_handshake()
            request.settimeout(None)
        except (ssl.SSLError, OSError) as err:
            log.info("kubelet API: TLS handshake with %s refused: %s", client_address[0], err)
            request.close()
            return
        super().finish_request(request, client_address)


class KubeletAPI:
    """The HTTPS server; `start()` binds `host:port` (0: any free port) and returns the port."""

    def __init__(self, source: LogSource, host: str, port: int, cert_file: Path, key_file: Path,
                 client_ca_file: Path, client_certs: list[Path]):
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_cert_chain(str(cert_file), str(key_file))
        context.load_verify_locations(str(client_ca_file))
        context.verify_mode = ssl.CERT_REQUIRED
        fingerprints = {fingerprint_of(p.read_bytes()) for p in client_certs}
        self._server = _Server((host, port), source, context, fingerprints)
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="kubelet-api", daemon=True)

    @property
    def port(self) -> int:
        return self._server.server_address[1]

    def start(self) -> int:
        self._thread.start()
        return self.port

    def stop(self) -> None:
        self._server.stopping.set()
        self._server.shutdown()
        self._server.server_close()

