"""A hub on loopback that answers the way an attacker's would, for the hub readers' bounds
(planner/remote.py, operator/cluster/config_source.py, engine/serving/hub.py). The first path
segment picks the behaviour; the rest is whatever the reader asked for:

    /drip-body/...      200, then one byte of a JSON object every `interval_s`, never ending
    /drip-headers/...   the status line, then the headers one byte every `interval_s`
    /huge/...           200 without Content-Length and more JSON than any cap allows
    /huge-declared/...  200 declaring a Content-Length of 1 TB
    /many-shards/...    an index listing more shards than a checkpoint may have
    /bad-shard/...      an index whose shard is a path out of the repository
    /bad-commit/...     a revision listing whose sha is no commit (engine hub.py's API)

Every request's path and Authorization header are recorded.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class HostileHub:
    def __init__(self, interval_s: float = 0.5):
        self.interval_s = interval_s
        self.requests: list[tuple[str, str | None]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_GET(self):
                outer.requests.append((self.path, self.headers.get("Authorization")))
                mode = self.path.split("/")[1]
                try:
                    getattr(self, mode.replace("-", "_"), self.not_found)()
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the reader gave up: what the tests want

            def _json(self, value) -> None:
                body = json.dumps(value).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def not_found(self):
                self.send_response(404)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def drip_body(self):
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(b"{")
                while True:
                    self.wfile.write(b" ")
                    self.wfile.flush()
                    time.sleep(outer.interval_s)

            def drip_headers(self):
                self.wfile.write(b"HTTP/1.1 200 OK\r\n")
                while True:
                    self.wfile.write(b"X")
                    self.wfile.flush()
                    time.sleep(outer.interval_s)

            def huge(self):
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Connection", "close")
                self.end_headers()
                self.wfile.write(b'{"pad": "')
                block = b"x" * (1 << 20)
                for _ in range(64):
                    self.wfile.write(block)

            def huge_declared(self):
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(10 ** 12))
                self.end_headers()
                self.wfile.write(b"{")

            def many_shards(self):
                if self.path.endswith("model.safetensors.index.json"):
                    return self._json({"weight_map": {f"t{i}": f"model-{i:05d}.safetensors" for i in range(5000)}})
                return self.not_found()

            def bad_shard(self):
                if self.path.endswith("model.safetensors.index.json"):
                    return self._json({"weight_map": {"t": "../../secrets/model.safetensors"}})
                return self.not_found()

            def bad_commit(self):
                if "/api/models/" in self.path:
                    return self._json({"sha": "../../../../tmp/evil", "siblings": [{"rfilename": "config.json"}]})
                return self.not_found()

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def endpoint(self, mode: str) -> str:
        return f"{self.url}/{mode}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
