"""TTFT, inter-token latency and transfer bandwidth: one engine server against a prefill server
and a decode server behind `specdeploy router`, all on this machine (one GPU: two engine
processes share it).

    python3 bench/disagg_serving.py --out DIR          # on a GPU, ~5 min
    python3 bench/disagg_serving.py --smoke --out DIR  # CPU, tiny shapes, ~1 min

A random Llama-family target (device: hidden 2048, 16 layers, GQA 16/8 heads, ~0.9 B
parameters, bf16; smoke: the test-sized toy) with an EAGLE head built to be accepted often
(engine/demo/toy.py) is saved as a checkpoint with a tokenizer trained here. Each
configuration serves it as `specdeploy engine serve` subprocesses; requests are streamed through
the official openai client with prompts of token ids, greedy, ignore_eos. Per prompt length:
TTFT (request sent -> first streamed text), ITL ((last - first chunk) / (tokens - 1)), medians
over the requests; for the split pair also the prefill server's bytes sent / time in transfers
(/disagg/status). Writes disagg_serving.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import REPO_ROOT, bootstrap_specdeploy  # noqa: E402

bootstrap_specdeploy()

import httpx  # noqa: E402
import openai  # noqa: E402
import torch  # noqa: E402

SIZES = {
    "device": {"model": {"hidden_size": 2048, "intermediate_size": 5632, "num_layers": 16, "num_heads": 16,
                         "num_kv_heads": 8, "head_dim": 128, "max_position_embeddings": 8192},
               "vocab_size": 2048, "prompts": (512, 2048, 6144), "requests": 8, "max_tokens": 64,
               "dtype": "bfloat16", "max_total_tokens": 65536},
    "smoke": {"model": {"max_position_embeddings": 512}, "vocab_size": 320, "prompts": (16, 64),
              "requests": 3, "max_tokens": 12, "dtype": "float32", "max_total_tokens": 2048},
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def hf_config(cfg) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "float32",
            "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
            "head_dim": cfg.head_dim, "max_position_embeddings": cfg.max_position_embeddings,
            "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
            "tie_word_embeddings": cfg.tie_word_embeddings}


def build_models(root: Path, size: dict) -> tuple[Path, Path]:
    from specdeploy.engine.demo import train
    from specdeploy.engine.demo.toy import copy_draft, predictable_target, tiny_config

    texts = list(train.read_corpus(train.corpus_files(2_000_000, roots=[REPO_ROOT / "engine"])))
    tok = train.train_tokenizer(texts, vocab_size=size["vocab_size"])
    cfg = tiny_config(vocab_size=tok.get_vocab_size(), **size["model"])
    target, perm = predictable_target(cfg, seed=0)
    draft = copy_draft("EAGLE", target, perm)
    target_dir, draft_dir = root / "target", root / "draft"
    train.save_model(target, hf_config(cfg), target_dir)
    train.save_tokenizer(tok, target_dir)
    train.save_model(draft, hf_config(dataclasses.replace(cfg, num_layers=draft.cfg.num_layers)), draft_dir, prefix="")
    return target_dir, draft_dir


def serve(target_dir: Path, draft_dir: Path, size: dict, *extra: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    argv = [sys.executable, "-P", "-m", "specdeploy.cli", "engine", "serve", "--target", str(target_dir),
            "--draft", str(draft_dir), "--algorithm", "EAGLE", "--num-steps", "3", "--topk", "1",
            "--num-draft-tokens", "4", "--dtype", size["dtype"], "--served-model-name", "bench",
            "--max-running-requests", "8", "--max-total-tokens", str(size["max_total_tokens"]),
            "--context-length", str(size["model"]["max_position_embeddings"]),
            "--host", "127.0.0.1", "--port", str(port), *extra]
    log = open(Path(tempfile.gettempdir()) / f"disagg_bench_{port}.log", "w")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    return proc, f"http://127.0.0.1:{port}"


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: the server exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} not ready after {timeout_s} s")


def measure(url: str, size: dict) -> list[dict]:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
    g = torch.Generator().manual_seed(0)
    rows = []
    for n in size["prompts"]:
        ttft, itl = [], []
        for _ in range(size["requests"] + 1):  # the first is a warm-up, not counted
            prompt = torch.randint(0, size["vocab_size"], (n,), generator=g).tolist()
            t0 = time.perf_counter()
            first = last = None
            tokens = 0
            stream = client.completions.create(model="bench", prompt=prompt, max_tokens=size["max_tokens"],
                                               temperature=0, stream=True, stream_options={"include_usage": True},
                                               extra_body={"ignore_eos": True})
            for chunk in stream:
                now = time.perf_counter()
                if chunk.choices and chunk.choices[0].text:
                    first = first or now
                    last = now
                if chunk.usage:
                    tokens = chunk.usage.completion_tokens
            if first is None:
                raise RuntimeError("no text streamed")
            if _ > 0:
                ttft.append(first - t0)
                itl.append((last - first) / max(tokens - 1, 1))
        rows.append({"prompt_tokens": n, "ttft_ms": 1e3 * statistics.median(ttft),
                     "itl_ms": 1e3 * statistics.median(itl), "requests": len(ttft)})
    return rows


def stop(*procs: subprocess.Popen) -> None:
    for proc in procs:
        proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes")
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    size = SIZES["smoke" if args.smoke else "device"]
    result = {"size": "smoke" if args.smoke else "device", "device": torch.cuda.get_device_name(0)
              if torch.cuda.is_available() else "cpu"}
    with tempfile.TemporaryDirectory() as tmp:
        target_dir, draft_dir = build_models(Path(tmp), size)
        proc, url = serve(target_dir, draft_dir, size)
        try:
            wait_ready(url, proc)
            result["aggregated"] = measure(url, size)
        finally:
            stop(proc)
        transfer = ("--transfer-host", "127.0.0.1")
        prefill, prefill_url = serve(target_dir, draft_dir, size, "--role", "prefill", *transfer)
        decode, decode_url = serve(target_dir, draft_dir, size, "--role", "decode", *transfer)
        port = free_port()
        router = subprocess.Popen([sys.executable, "-P", "-m", "specdeploy.cli", "router", "--prefill", prefill_url,
                                   "--decode", decode_url, "--host", "127.0.0.1", "--port", str(port),
                                   "--refresh-s", "0.5"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        router_url = f"http://127.0.0.1:{port}"
        try:
            wait_ready(prefill_url, prefill)
            wait_ready(decode_url, decode)
            wait_ready(router_url, router)
            result["disaggregated"] = measure(router_url, size)
            st = httpx.get(f"{prefill_url}/disagg/status").json()
            result["transfer"] = {k: st[k] for k in ("transfers", "bytes_sent", "transfer_s")}
            result["transfer"]["gb_per_s"] = st["bytes_sent"] / st["transfer_s"] / 1e9 if st["transfer_s"] else None
        finally:
            stop(router, decode, prefill)
    print(f"{'prompt':>7} {'TTFT one':>10} {'TTFT split':>11} {'ITL one':>9} {'ITL split':>10}   (ms, medians)")
    for a, d in zip(result["aggregated"], result["disaggregated"]):
        print(f"{a['prompt_tokens']:7d} {a['ttft_ms']:10.2f} {d['ttft_ms']:11.2f} {a['itl_ms']:9.3f} {d['itl_ms']:10.3f}")
    t = result["transfer"]
    print(f"transfer: {t['transfers']} requests, {t['bytes_sent'] / 2**20:.1f} MiB in {t['transfer_s']:.3f} s "
          f"({t['gb_per_s'] or 0:.2f} GB/s, Mooncake TCP through host copies where the pools are on a GPU)")
    out = Path(args.out) / "disagg_serving.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
