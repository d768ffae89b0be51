"""A local HTTP hub serving real-format checkpoints whose weights are never materialised.

`CheckpointHub` speaks the hub's file protocol (GET /{repo}/resolve/{revision}/{file}, with
HTTP Range, 206 Partial Content and 416) over a real socket. A served safetensors file is
`VirtualSafetensors`: its true 8-byte length and JSON header, then as many zero bytes as the
header's data_offsets say (produced on the fly, never stored), so a 150 GB checkpoint costs a few
megabytes of headers. `bytes_sent` counts what left the server: a planner that downloads weights
instead of headers shows up there.

`deepseek_v4_flash_tensors(config)` lists the tensors of deepseek-ai/DeepSeek-V4-Flash as
published (names, safetensors dtypes, shapes): FP8 e4m3 linears, each with an E8M0 scale per
128 x 128 block (`.scale`, the name the release uses for weight_scale_inv); FP4 routed experts
packed two e2m1 values per byte (I8 [out, in / 2]) with one E8M0 scale per 32 inputs
(F8_E8M0 [out, in / 32]); bf16 embedding, head, norms, router and compressors; float32
hyper-connection mixes, sinks and position biases; int64 hash-routing tables in the first
`num_hash_layers` layers; the MTP layer under `mtp.0.`.
"""

from __future__ import annotations

import json
import math
import struct
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

BITS = {"BF16": 16, "F16": 16, "F32": 32, "I64": 64, "I32": 32, "I8": 8, "U8": 8,
        "F8_E4M3": 8, "F8_E5M2": 8, "F8_E8M0": 8}
FP8_BLOCK = 128
FP4_GROUP = 32

Tensor = tuple[str, str, tuple[int, ...]]  # name, safetensors dtype, shape


def tensor_bytes(dtype: str, shape: tuple[int, ...]) -> int:
    return math.ceil(math.prod(shape) * BITS[dtype] / 8)


class VirtualSafetensors:
    """A safetensors file of zeros: the real header, the payload implied."""

    def __init__(self, tensors: list[Tensor], metadata: dict[str, str] | None = None):
        header: dict[str, Any] = {"__metadata__": metadata or {"format": "pt"}}
        offset = 0
        for name, dtype, shape in tensors:
            size = tensor_bytes(dtype, shape)
            header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
            offset += size
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the format pads the header to 8 bytes with spaces
        self.head = struct.pack("<Q", len(raw)) + raw
        self.payload_bytes = offset
        self.size = len(self.head) + offset

    def read(self, start: int, end: int) -> bytes:
        """Bytes [start, end) of the file."""
        end = min(end, self.size)
        if start >= end:
            return b""
        part = self.head[start:end]
        return part + bytes(end - start - len(part))


@dataclass
class Repo:
    files: dict[str, bytes | VirtualSafetensors]
    token: str | None = None


class CheckpointHub:
    """The hub on loopback. repos: {"org/name": Repo}; every revision serves the same files."""

    def __init__(self, repos: dict[str, Repo], *, honour_range: bool = True):
        self.repos, self.honour_range = repos, honour_range
        self.requests: list[tuple[str, str | None]] = []  # (path, Range header)
        self.bytes_sent = 0
        self._lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                outer._serve(self)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _serve(self, h: BaseHTTPRequestHandler) -> None:
        import urllib.parse

        path = urllib.parse.unquote(h.path)
        with self._lock:
            self.requests.append((path, h.headers.get("Range")))
        for repo_id, repo in self.repos.items():
            prefix = f"/{repo_id}/resolve/"
            if not path.startswith(prefix):
                continue
            if repo.token and h.headers.get("Authorization") != f"Bearer {repo.token}":
                return self._send(h, 401, b"unauthorized")
            # /resolve/{revision}/{file}: the revision may itself hold slashes (refs/pr/1)
            for name, content in repo.files.items():
                if path.endswith("/" + name):
                    return self._send_file(h, content)
        self._send(h, 404, b"not found")

    def _send(self, h: BaseHTTPRequestHandler, status: int, body: bytes, extra: dict[str, str] | None = None) -> None:
        h.send_response(status)
        h.send_header("Content-Length", str(len(body)))
        for key, value in (extra or {}).items():
            h.send_header(key, value)
        h.end_headers()
        h.wfile.write(body)
        with self._lock:
            self.bytes_sent += len(body)

    def _send_file(self, h: BaseHTTPRequestHandler, content: bytes | VirtualSafetensors) -> None:
        size = content.size if isinstance(content, VirtualSafetensors) else len(content)
        read = content.read if isinstance(content, VirtualSafetensors) else (lambda a, b: content[a:b])
        wanted = h.headers.get("Range")
        if wanted and self.honour_range:
            first, _, last = wanted.removeprefix("bytes=").partition("-")
            start, end = int(first), min(int(last) + 1 if last else size, size)
            if start >= size:
                return self._send(h, 416, b"", {"Content-Range": f"bytes */{size}"})
            return self._send(h, 206, read(start, end), {"Content-Range": f"bytes {start}-{end - 1}/{size}"})
        # The whole file, streamed: a client that wants only the header closes early.
        h.send_response(200)
        h.send_header("Content-Length", str(size))
        h.end_headers()
        chunk = 1 << 20
        try:
            for start in range(0, size, chunk):
                body = read(start, start + chunk)
                h.wfile.write(body)
                with self._lock:
                    self.bytes_sent += len(body)
        except (BrokenPipeError, ConnectionResetError):
            pass


# --------------------------------------------------------------------------------------------
# DeepSeek-V4-Flash as published


def _fp8(name: str, out: int, inp: int) -> list[Tensor]:
    """An FP8 block-quantized linear: e4m3 weight [out, in], E8M0 scale per 128 x 128 block."""
    blocks = (math.ceil(out / FP8_BLOCK), math.ceil(inp / FP8_BLOCK))
    return [(f"{name}.weight", "F8_E4M3", (out, inp)), (f"{name}.scale", "F8_E8M0", blocks)]


def _fp4(name: str, out: int, inp: int) -> list[Tensor]:
    """An FP4 expert linear: e2m1 pairs in I8 [out, in / 2], E8M0 scale [out, in / 32]."""
    return [(f"{name}.weight", "I8", (out, inp // 2)), (f"{name}.scale", "F8_E8M0", (out, inp // FP4_GROUP))]


def _v4_block(c: dict[str, Any], prefix: str, ratio: int, hash_routed: bool) -> list[Tensor]:
    h, hc, heads, hd = c["hidden_size"], c["hc_mult"], c["num_attention_heads"], c["head_dim"]
    q_lora, o_groups, o_lora = c["q_lora_rank"], c["o_groups"], c["o_lora_rank"]
    experts, inter, vocab = c["n_routed_experts"], c["moe_intermediate_size"], c["vocab_size"]
    ihd, iheads = c["index_head_dim"], c["index_n_heads"]
    mix = (2 + hc) * hc
    t: list[Tensor] = []
    for sub in ("attn", "ffn"):
        t += [(f"{prefix}.hc_{sub}_fn", "F32", (mix, hc * h)), (f"{prefix}.hc_{sub}_base", "F32", (mix,)),
              (f"{prefix}.hc_{sub}_scale", "F32", (3,))]
    t += [(f"{prefix}.attn_norm.weight", "BF16", (h,)), (f"{prefix}.ffn_norm.weight", "BF16", (h,)),
          (f"{prefix}.attn.attn_sink", "F32", (heads,))]
    t += _fp8(f"{prefix}.attn.wq_a", q_lora, h) + [(f"{prefix}.attn.q_norm.weight", "BF16", (q_lora,))]
    t += _fp8(f"{prefix}.attn.wq_b", heads * hd, q_lora)
    t += _fp8(f"{prefix}.attn.wkv", hd, h) + [(f"{prefix}.attn.kv_norm.weight", "BF16", (hd,))]
    t += _fp8(f"{prefix}.attn.wo_a", o_groups * o_lora, heads * hd // o_groups)
    t += _fp8(f"{prefix}.attn.wo_b", h, o_groups * o_lora)
    if ratio:
        width = (2 if ratio == 4 else 1) * hd  # CSA windows overlap: twice the head
        t += [(f"{prefix}.attn.compressor.ape", "F32", (ratio, width)),
              (f"{prefix}.attn.compressor.norm.weight", "BF16", (hd,)),
              (f"{prefix}.attn.compressor.wgate.weight", "BF16", (width, h)),
              (f"{prefix}.attn.compressor.wkv.weight", "BF16", (width, h))]
    if ratio == 4:
        t += _fp8(f"{prefix}.attn.indexer.wq_b", iheads * ihd, q_lora)
        t += [(f"{prefix}.attn.indexer.weights_proj.weight", "BF16", (iheads, h)),
              (f"{prefix}.attn.indexer.compressor.ape", "F32", (ratio, 2 * ihd)),
              (f"{prefix}.attn.indexer.compressor.norm.weight", "BF16", (ihd,)),
              (f"{prefix}.attn.indexer.compressor.wgate.weight", "BF16", (2 * ihd, h)),
              (f"{prefix}.attn.indexer.compressor.wkv.weight", "BF16", (2 * ihd, h))]
    t.append((f"{prefix}.ffn.gate.weight", "BF16", (experts, h)))
    if hash_routed:
        t.append((f"{prefix}.ffn.gate.tid2eid", "I64", (vocab, c["num_experts_per_tok"])))
    else:
        t.append((f"{prefix}.ffn.gate.bias", "F32", (experts,)))
    for e in range(experts):
        t += _fp4(f"{prefix}.ffn.experts.{e}.w1", inter, h) + _fp4(f"{prefix}.ffn.experts.{e}.w2", h, inter)
        t += _fp4(f"{prefix}.ffn.experts.{e}.w3", inter, h)
    shared = inter * c.get("n_shared_experts", 1)
    t += _fp8(f"{prefix}.ffn.shared_experts.w1", shared, h) + _fp8(f"{prefix}.ffn.shared_experts.w2", h, shared)
    t += _fp8(f"{prefix}.ffn.shared_experts.w3", shared, h)
    return t


def deepseek_v4_flash_tensors(c: dict[str, Any]) -> list[list[Tensor]]:
    """The checkpoint's tensors grouped by decoder layer (then the MTP layers, then the globals)."""
    h, hc, vocab = c["hidden_size"], c["hc_mult"], c["vocab_size"]
    layers, ratios = c["num_hidden_layers"], c["compress_ratios"]
    groups = [_v4_block(c, f"layers.{i}", ratios[i], i < c.get("num_hash_layers", 0)) for i in range(layers)]
    for m in range(c.get("num_nextn_predict_layers", 0)):
        p = f"mtp.{m}"
        ratio = ratios[layers + m] if layers + m < len(ratios) else 0
        t = _v4_block(c, p, ratio, False)
        t += _fp8(f"{p}.e_proj", h, h) + _fp8(f"{p}.h_proj", h, h)
        t += [(f"{p}.enorm.weight", "BF16", (h,)), (f"{p}.hnorm.weight", "BF16", (h,)),
              (f"{p}.norm.weight", "BF16", (h,)), (f"{p}.hc_head_fn", "F32", (hc, hc * h)),
              (f"{p}.hc_head_base", "F32", (hc,)), (f"{p}.hc_head_scale", "F32", (1,))]
        groups.append(t)
    groups.append([("embed.weight", "BF16", (vocab, h)), ("head.weight", "BF16", (vocab, h)),
                   ("norm.weight", "BF16", (h,)), ("hc_head_fn", "F32", (hc, hc * h)),
                   ("hc_head_base", "F32", (hc,)), ("hc_head_scale", "F32", (1,))])
    return groups


def sharded_checkpoint(groups: list[list[Tensor]], per_shard: int) -> dict[str, bytes | VirtualSafetensors]:
    """model-0000i-of-0000n.safetensors shards of `per_shard` groups each, and their index."""
    chunks = [sum(groups[i:i + per_shard], []) for i in range(0, len(groups), per_shard)]
    n = len(chunks)
    files: dict[str, bytes | VirtualSafetensors] = {}
    weight_map = {}
    for i, tensors in enumerate(chunks, 1):
        name = f"model-{i:05d}-of-{n:05d}.safetensors"
        files[name] = VirtualSafetensors(tensors)
        weight_map.update({t[0]: name for t in tensors})
    total = sum(f.payload_bytes for f in files.values() if isinstance(f, VirtualSafetensors))
    files["model.safetensors.index.json"] = json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2).encode()
    return files
