"""A Hugging Face-compatible hub on loopback serving real model directories, as the engine
fetches them (engine/serving/hub.py): GET /api/models/{repo}/revision/{rev} and
GET /{repo}/resolve/{commit}/{file}. It knows `main` and one pinned commit of each repo, with the
same files, and records every request path (a test counts what was downloaded).
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"  # main
PINNED = "fedcba9876543210fedcba9876543210fedcba98"  # an older commit a resource may pin


class FakeHub:
    def __init__(self, repos: dict[str, Path], token: str | None = None):
        self.repos, self.token, self.requests = repos, token, []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                outer.requests.append(self.path)
                if outer.token and self.headers.get("Authorization") != f"Bearer {outer.token}":
                    return self._send(401, b"{}")
                for repo, root in outer.repos.items():
                    for revision, commit in (("main", COMMIT), (PINNED, PINNED)):
                        if self.path == f"/api/models/{repo}/revision/{revision}":
                            files = [{"rfilename": p.name} for p in sorted(root.iterdir())]
                            files.append({"rfilename": "pytorch_model.bin"})  # another format: never fetched
                            return self._send(200, json.dumps({"sha": commit, "siblings": files}).encode())
                        # As the hub does, files resolve by commit and by the revision's name.
                        for prefix in {f"/{repo}/resolve/{commit}/", f"/{repo}/resolve/{revision}/"}:
                            if self.path.startswith(prefix) and (root / self.path[len(prefix):]).is_file():
                                return self._send(200, (root / self.path[len(prefix):]).read_bytes())
                self._send(404, b"{}")

            def _send(self, status, body):
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
