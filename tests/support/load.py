"""Completions sent to a Service's ready endpoints by a few clients, as a Service proxy would
route them: the endpoints are the selector's pods that are Ready and not terminating, re-read
every 0.2 s (the endpoints controller's choice; it leaves out the local node's loopback pod IPs,
which no EndpointSlice may hold, so they are read from the pods)."""

from __future__ import annotations

import threading
import time

import httpx


class Load:
    """Completions to the Service's ready endpoints from a few clients, until stopped."""

    def __init__(self, cluster, namespace: str, selector: dict[str, str], model: str, clients: int = 3):
        self.cluster, self.namespace, self.selector, self.model = cluster, namespace, selector, model
        self.done = threading.Event()
        self.results: list[tuple[str, int | str]] = []  # (endpoint, status code or error)
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(clients)]
        self.lock = threading.Lock()
        self.endpoints: list[str] = []
        self.watcher = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        # The Service's endpoints as its EndpointSlice controller picks them: pods of its selector
        # that are Ready and not terminating. (The controller itself leaves out the local node's
        # loopback pod IPs, which no EndpointSlice may hold, so they are read from the pods.)
        selector = ",".join(f"{k}={v}" for k, v in self.selector.items())
        while not self.done.is_set():
            try:
                pods = self.cluster.kubectl_json("get", "pods", "-n", self.namespace, "-l", selector)["items"]
                ready = [p["status"]["podIP"] for p in pods if not p["metadata"].get("deletionTimestamp")
                         and p["status"].get("podIP")
                         and any(c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions") or [])]
                with self.lock:
                    self.endpoints = ready
            except Exception:  # noqa: BLE001 - the next read
                pass
            time.sleep(0.2)

    def _run(self) -> None:
        turn = 0
        with httpx.Client(timeout=120) as client:
            while not self.done.is_set():
                with self.lock:
                    endpoints = list(self.endpoints)
                if not endpoints:
                    time.sleep(0.1)
                    continue
                ip = endpoints[turn % len(endpoints)]
                turn += 1
                try:
                    r = client.post(f"http://{ip}:8000/v1/completions",
                                    json={"model": self.model, "prompt": "def fibonacci(n):", "max_tokens": 32})
                    self.results.append((ip, r.status_code))
                except httpx.HTTPError as err:
                    self.results.append((ip, type(err).__name__))

    def __enter__(self) -> Load:
        self.watcher.start()
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()
        for t in self.threads:
            t.join(150)
        self.watcher.join(10)
