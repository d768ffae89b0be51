"""A TCP relay from the node's address to the apiserver on the host's loopback.

Pods in their own network namespaces cannot reach 127.0.0.1 of the host, where the control plane
listens (and only listens: nothing of it is exposed beyond loopback). The node relays one port of
its own address, on the pods' private bridge, to it; the apiserver's certificate names that
address too (kwokctl's kubeApiserverCertSANs), so a pod's client verifies it as usual. Bytes are
copied, never read: TLS stays end to end.
"""

from __future__ import annotations

import logging
import socket
import threading

log = logging.getLogger("specdeploy.localcluster.relay")


def _pipe(src: socket.socket, dst: socket.socket) -> None:
    try:
        while chunk := src.recv(65536):
            dst.sendall(chunk)
    except OSError:
        pass
    finally:
        for s, how in ((dst, socket.SHUT_WR), (src, socket.SHUT_RD)):
            try:
                s.shutdown(how)
            except OSError:
                pass


class TcpRelay:
    def __init__(self, listen: tuple[str, int], target: tuple[str, int]):
        self.listen, self.target = listen, target
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(listen)
        self._stop = threading.Event()

    def start(self) -> "TcpRelay":
        self._sock.listen(64)
        self._sock.settimeout(0.5)
        threading.Thread(target=self._accept, name="apiserver-relay", daemon=True).start()
        log.info("relaying %s:%d to the apiserver at %s:%d", *self.listen, *self.target)
        return self

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._sock.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=5)
                upstream.settimeout(None)
            except OSError as err:
                log.warning("apiserver relay: %s", err)
                client.close()
                continue
            client.settimeout(None)
            finished: list[int] = []
            lock = threading.Lock()
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._copy, args=(a, b, finished, lock, (client, upstream)), daemon=True).start()

    @staticmethod
    def _copy(a: socket.socket, b: socket.socket, finished: list[int], lock: threading.Lock,
              both: tuple[socket.socket, socket.socket]) -> None:
        _pipe(a, b)
        with lock:
            finished.append(1)
            last = len(finished) == 2
        if last:  # the second direction to finish closes both sockets
            for s in both:
                s.close()

    def stop(self) -> None:
        self._stop.set()
        self._sock.close()
