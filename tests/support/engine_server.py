"""The tiny engine server the serving tests start: its limits, its `engine serve` flags, a free
port, the wait for /ready, what a test knows of a running one and its /metrics samples
(tests/engine/serving/conftest.py builds its fixtures from these)."""

from __future__ import annotations

import dataclasses
import socket
import time
from pathlib import Path

import httpx

MODEL_NAME = "tiny-target"
CONTEXT_LENGTH = 256
MAX_RUNNING_REQUESTS = 4
MAX_QUEUED_REQUESTS = 4
MAX_TOTAL_TOKENS = 2048


def hf_config(cfg) -> dict:
    """config.json for an engine ModelConfig."""
    return {"architectures": ["LlamaForCausalLM"], "model_type": cfg.model_type, "torch_dtype": "float32",
            "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
            "head_dim": cfg.head_dim, "max_position_embeddings": cfg.max_position_embeddings,
            "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
            "tie_word_embeddings": cfg.tie_word_embeddings}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_argv(target_dir: Path, draft_dir: Path, port: int, *extra: str) -> list[str]:
    return ["engine", "serve", "--target", str(target_dir), "--draft", str(draft_dir), "--algorithm", "EAGLE",
            "--num-steps", "3", "--topk", "1", "--num-draft-tokens", "4", "--dtype", "float32",
            "--served-model-name", MODEL_NAME, "--context-length", str(CONTEXT_LENGTH),
            "--max-running-requests", str(MAX_RUNNING_REQUESTS),
            "--max-queued-requests", str(MAX_QUEUED_REQUESTS),
            "--max-total-tokens", str(MAX_TOTAL_TOKENS), "--host", "127.0.0.1", "--port", str(port),
            "--log-interval-s", "1", *extra]


def wait_ready(base_url: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base_url}/ready", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{base_url} did not become ready in {timeout_s} s")


@dataclasses.dataclass(frozen=True)
class Server:
    url: str
    model: str
    vocab_size: int
    context_length: int
    max_running_requests: int
    max_queued_requests: int

    def metrics(self) -> dict[str, float]:
        return metric_samples(self.url)


def metric_samples(base_url: str) -> dict[str, float]:
    """{'name{label=value,...}': value} of every sample /metrics exposes."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(httpx.get(f"{base_url}/metrics").text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            out[f"{s.name}{{{labels}}}"] = s.value
    return out
