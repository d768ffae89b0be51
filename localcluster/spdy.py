"""`kubectl port-forward`'s kubelet end: the portforward.k8s.io protocol over SPDY/3.1.

After the HTTP upgrade the apiserver (which unwraps kubectl's WebSocket tunnel) opens, for every
connection made to the forwarded local port, two SPDY streams that share a `requestid` header: an
`error` stream and a `data` stream, each naming the pod's `port`. The kubelet connects the data
stream to that port of the pod and copies bytes both ways; a failure to connect is written as
text on the error stream. Each stream is answered with SYN_REPLY; a DATA frame with FIN half-closes
its direction; PING is echoed. Flow control (WINDOW_UPDATE) is not enforced by Kubernetes' SPDY
peer and is ignored here.

Framing is pure (`FrameReader`, `control_frame`, `data_frame`, the header blocks); `serve_port_forward`
is the I/O: one thread and a selector over the upgraded TLS socket and the pod connections, so the
TLS object is never read and written from two threads.
"""

from __future__ import annotations

import logging
import selectors
import socket
import struct
import threading
import zlib
from dataclasses import dataclass

log = logging.getLogger("specdeploy.localcluster.spdy")

VERSION = 3
SYN_STREAM, SYN_REPLY, RST_STREAM, SETTINGS, PING, GOAWAY, HEADERS, WINDOW_UPDATE = 1, 2, 3, 4, 6, 7, 8, 9
FLAG_FIN = 0x01
RST_CANCEL = 5
PORT_CONNECT_TIMEOUT_S = 5.0

# The zlib dictionary of SPDY/3 header blocks (draft-mbelshe-httpbis-spdy-00, section 2.6.10.1):
# length-prefixed common header words, then a run of common values.
_WORDS = (
    "options head post put delete trace accept accept-charset accept-encoding accept-language accept-ranges "
    "age allow authorization cache-control connection content-base content-encoding content-language "
    "content-length content-location content-md5 content-range content-type date etag expect expires from "
    "host if-match if-modified-since if-none-match if-range if-unmodified-since last-modified location "
    "max-forwards pragma proxy-authenticate proxy-authorization range referer retry-after server te trailer "
    "transfer-encoding upgrade user-agent vary via warning www-authenticate method get status"
).split() + ["200 OK", "version", "HTTP/1.1", "url", "public", "set-cookie", "keep-alive", "origin"]
_TAIL = (
    "100101201202205206300302303304305306307402405406407408409410411412413414415416417502504505"
    "203 Non-Authoritative Information204 No Content301 Moved Permanently400 Bad Request401 Unauthorized"
    "403 Forbidden404 Not Found500 Internal Server Error501 Not Implemented503 Service Unavailable"
    "Jan Feb Mar Apr May Jun Jul Aug Sept Oct Nov Dec 00:00:00 Mon, Tue, Wed, Thu, Fri, Sat, Sun, GMT"
    "chunked,text/html,image/png,image/jpg,image/gif,application/xml,application/xhtml+xml,text/plain,"
    "text/javascript,publicprivatemax-age=gzip,deflate,sdchcharset=utf-8charset=iso-8859-1,utf-,*,enq=0."
)
HEADER_DICTIONARY = b"".join(struct.pack(">I", len(w)) + w.encode() for w in _WORDS) + _TAIL.encode()


class ProtocolError(ValueError):
    pass


@dataclass(frozen=True)
class Frame:
    control: bool
    type: int  # control frames: SYN_STREAM...; data frames: 0
    flags: int
    payload: bytes
    stream_id: int = 0  # data frames


def control_frame(type_: int, flags: int, payload: bytes) -> bytes:
    return struct.pack(">HHI", 0x8000 | VERSION, type_, (flags << 24) | len(payload)) + payload


def data_frame(stream_id: int, data: bytes, fin: bool = False) -> bytes:
    return struct.pack(">II", stream_id & 0x7FFFFFFF, ((FLAG_FIN if fin else 0) << 24) | len(data)) + data


class FrameReader:
    """Bytes in, complete frames out."""

    def __init__(self) -> None:
        self.buf = bytearray()

    def feed(self, data: bytes) -> list[Frame]:
        self.buf += data
        frames = []
        while len(self.buf) >= 8:
            first, second = struct.unpack(">II", self.buf[:8])
            length = second & 0xFFFFFF
            if len(self.buf) < 8 + length:
                break
            payload = bytes(self.buf[8:8 + length])
            del self.buf[:8 + length]
            flags = second >> 24
            if first & 0x80000000:
                if (first >> 16) & 0x7FFF != VERSION:
                    raise ProtocolError(f"SPDY version {(first >> 16) & 0x7FFF}, expected {VERSION}")
                frames.append(Frame(True, first & 0xFFFF, flags, payload))
            else:
                frames.append(Frame(False, 0, flags, payload, stream_id=first & 0x7FFFFFFF))
        return frames


class HeaderCodec:
    """One zlib stream per direction for the whole connection, as SPDY/3 requires."""

    def __init__(self) -> None:
        self._inflate = zlib.decompressobj(zdict=HEADER_DICTIONARY)
        self._deflate = zlib.compressobj(zdict=HEADER_DICTIONARY)

    def decode(self, block: bytes) -> dict[str, str]:
        raw = self._inflate.decompress(block)
        (count,), pos, headers = struct.unpack_from(">I", raw), 4, {}
        for _ in range(count):
            (n,) = struct.unpack_from(">I", raw, pos)
            name = raw[pos + 4:pos + 4 + n].decode()
            pos += 4 + n
            (n,) = struct.unpack_from(">I", raw, pos)
            headers[name] = raw[pos + 4:pos + 4 + n].decode()
            pos += 4 + n
        return headers

    def encode(self, headers: dict[str, str]) -> bytes:
        raw = struct.pack(">I", len(headers))
        for name, value in headers.items():
            raw += struct.pack(">I", len(name)) + name.encode() + struct.pack(">I", len(value)) + value.encode()
        return self._deflate.compress(raw) + self._deflate.flush(zlib.Z_SYNC_FLUSH)


def syn_stream_fields(payload: bytes) -> tuple[int, bytes]:
    """(stream id, compressed header block) of a SYN_STREAM."""
    stream_id = struct.unpack_from(">I", payload)[0] & 0x7FFFFFFF
    return stream_id, payload[10:]


@dataclass
class _Forward:
    data_stream: int
    sock: socket.socket | None
    remote_done: bool = False  # the pod closed its side
    local_done: bool = False  # the client sent FIN


def serve_port_forward(conn: socket.socket, address: str, stopping: threading.Event) -> None:
    """Serve one upgraded connection until the peer closes it or `stopping` is set."""
    codec, reader = HeaderCodec(), FrameReader()
    errors: dict[str, int] = {}  # requestid -> error stream id
    forwards: dict[int, _Forward] = {}  # data stream id -> forward
    by_sock: dict[socket.socket, _Forward] = {}
    sel = selectors.DefaultSelector()
    sel.register(conn, selectors.EVENT_READ)

    def send(frame: bytes) -> None:
        conn.sendall(frame)

    def reply(stream_id: int, fin: bool = False) -> None:
        send(control_frame(SYN_REPLY, FLAG_FIN if fin else 0, struct.pack(">I", stream_id) + codec.encode({})))

    def close_pod(fwd: _Forward) -> None:
        if fwd.sock is not None:
            try:
                sel.unregister(fwd.sock)
            except (KeyError, ValueError):
                pass
            by_sock.pop(fwd.sock, None)
            fwd.sock.close()
            fwd.sock = None

    def on_syn(payload: bytes) -> None:
        stream_id, block = syn_stream_fields(payload)
        headers = codec.decode(block)
        kind, request = headers.get("streamtype"), headers.get("requestid", "")
        reply(stream_id)
        if kind == "error":
            errors[request] = stream_id
            return
        if kind != "data":
            send(control_frame(RST_STREAM, 0, struct.pack(">II", stream_id, RST_CANCEL)))
            return
        port = headers.get("port", "")
        try:
            pod_sock = socket.create_connection((address, int(port)), timeout=PORT_CONNECT_TIMEOUT_S)
            pod_sock.settimeout(None)
        except (OSError, ValueError) as err:
            message = f"error forwarding port {port} to pod at {address}: {err}"
            log.info(message)
            if request in errors:
                send(data_frame(errors[request], message.encode(), fin=True))
            send(data_frame(stream_id, b"", fin=True))
            return
        fwd = _Forward(stream_id, pod_sock)
        forwards[stream_id] = fwd
        by_sock[pod_sock] = fwd
        sel.register(pod_sock, selectors.EVENT_READ)

    def on_frame(frame: Frame) -> bool:
        if not frame.control:
            fwd = forwards.get(frame.stream_id)
            if fwd is None or fwd.sock is None:
                return True  # the error stream (the client writes nothing there) or a closed forward
            if frame.payload:
                fwd.sock.sendall(frame.payload)
            if frame.flags & FLAG_FIN:
                fwd.local_done = True
                try:
                    fwd.sock.shutdown(socket.SHUT_WR)
                except OSError:
                    pass
            return True
        if frame.type == SYN_STREAM:
            on_syn(frame.payload)
        elif frame.type == PING:
            send(control_frame(PING, 0, frame.payload))
        elif frame.type == RST_STREAM:
            stream_id = struct.unpack_from(">I", frame.payload)[0] & 0x7FFFFFFF
            if stream_id in forwards:
                close_pod(forwards.pop(stream_id))
        elif frame.type == GOAWAY:
            return False
        return True  # SETTINGS, WINDOW_UPDATE, HEADERS: nothing to do

    try:
        running = True
        while running and not stopping.is_set():
            for key, _ in sel.select(timeout=0.5):
                if key.fileobj is conn:
                    data = conn.recv(65536)
                    if not data:
                        running = False
                        break
                    # A TLS record may hold more than recv returned: drain what is decrypted.
                    while hasattr(conn, "pending") and conn.pending():
                        data += conn.recv(conn.pending())
                    for frame in reader.feed(data):
                        if not on_frame(frame):
                            running = False
                else:
                    fwd = by_sock.get(key.fileobj)
                    if fwd is None:
                        continue
                    try:
                        chunk = fwd.sock.recv(65536)
                    except OSError:
                        chunk = b""
                    if chunk:
                        send(data_frame(fwd.data_stream, chunk))
                    else:
                        send(data_frame(fwd.data_stream, b"", fin=True))
                        fwd.remote_done = True
                        close_pod(fwd)
    except (OSError, ProtocolError, zlib.error, struct.error) as err:
        log.debug("port-forward to %s ended: %s", address, err)
    finally:
        for fwd in list(forwards.values()):
            close_pod(fwd)
        sel.close()
        try:
            conn.close()
        except OSError:
            pass
