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
(/disagg/status). Writes disagg_serving.json, and each server's output to DIR/logs/NAME.log
(aggregated, prefill, decode, router); a server that exits or is not ready in time has the tail
of its log printed. The two engine processes of the split pair share one GPU: each plans for
SPLIT_GPU_MEMORY_FRACTION of it (engine serve --gpu-memory-fraction), and every server's KV pool
is capped at the same max_total_tokens, so the three configurations compare at equal KV.
"""

from __future__ import annotations

import argparse
import contextlib
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
# The prefill and the decode server run on one GPU: each plans for this share of its memory.
SPLIT_GPU_MEMORY_FRACTION = 0.45
LOG_TAIL_LINES = 60


def free_ports(n: int) -> list[int]:
    """n distinct free loopback ports (all held open until all are chosen)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


@dataclasses.dataclass
class Server:
    name: str
    proc: subprocess.Popen
    url: str
    log: Path

    def tail(self, lines: int = LOG_TAIL_LINES) -> str:
        try:
            text = self.log.read_text(errors="replace").splitlines()
        except OSError as e:
            return f"(no log: {e})"
        return "\n".join(text[-lines:])


def report_failure(servers: list[Server]) -> None:
    """Each server's state and the tail of its log, on stderr (the logs stay under --out)."""
    for srv in servers:
        code = srv.proc.poll()
        state = "running" if code is None else f"exited with {code}"
        print(f"\n===== {srv.name} ({srv.url}, {state}); last lines of {srv.log} =====\n{srv.tail()}",
              file=sys.stderr, flush=True)


def spawn(name: str, argv: list[str], url: str, logs: Path) -> Server:
    logs.mkdir(parents=True, exist_ok=True)
    log = logs / f"{name}.log"
    with open(log, "w") as f:  # the child keeps its own descriptor
        f.write(f"$ {' '.join(argv)}\n")
        f.flush()
        proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT)
    return Server(name, proc, url, log)


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


def serve(name: str, port: int, logs: Path, target_dir: Path, draft_dir: Path, size: dict, *extra: str) -> Server:
    argv = [sys.executable, "-P", "-m", "specdeploy.cli", "engine", "serve", "--target", str(target_dir),
            "--draft", str(draft_dir), "--algorithm", "EAGLE", "--num-steps", "3", "--topk", "1",
            "--num-draft-tokens", "4", "--dtype", size["dtype"], "--served-model-name", "bench",
            "--max-running-requests", "8", "--max-total-tokens", str(size["max_total_tokens"]),
            "--context-length", str(size["model"]["max_position_embeddings"]),
            "--host", "127.0.0.1", "--port", str(port), *extra]
    return spawn(name, argv, f"http://127.0.0.1:{port}", logs)


def wait_ready(srv: Server, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if srv.proc.poll() is not None:
            raise RuntimeError(f"{srv.name} server {srv.url} exited with {srv.proc.returncode} (log: {srv.log})")
        try:
            if httpx.get(f"{srv.url}/ready", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{srv.name} server {srv.url} not ready after {timeout_s} s (log: {srv.log})")


@contextlib.contextmanager
def running(*servers: Server):
    """Stop the servers on the way out; on an error, print what each of them said first."""
    try:
        yield
    except BaseException:
        report_failure(list(servers))
        raise
    finally:
        stop(*(s.proc for s in servers))


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
    out_dir = Path(args.out)
    logs = out_dir / "logs"
    with tempfile.TemporaryDirectory() as tmp:
        target_dir, draft_dir = build_models(Path(tmp), size)
        one_port, prefill_port, decode_port, router_port = free_ports(4)
        one = serve("aggregated", one_port, logs, target_dir, draft_dir, size)
        with running(one):
            wait_ready(one)
            result["aggregated"] = measure(one.url, size)
        split = ("--transfer-host", "127.0.0.1", "--gpu-memory-fraction", str(SPLIT_GPU_MEMORY_FRACTION))
        prefill = serve("prefill", prefill_port, logs, target_dir, draft_dir, size, "--role", "prefill", *split)
        decode = serve("decode", decode_port, logs, target_dir, draft_dir, size, "--role", "decode", *split)
        router = spawn("router", [sys.executable, "-P", "-m", "specdeploy.cli", "router", "--prefill", prefill.url,
                                  "--decode", decode.url, "--host", "127.0.0.1", "--port", str(router_port),
                                  "--refresh-s", "0.5"], f"http://127.0.0.1:{router_port}", logs)
        with running(router, decode, prefill):
            wait_ready(prefill)
            wait_ready(decode)
            wait_ready(router)
            result["disaggregated"] = measure(router.url, size)
            st = httpx.get(f"{prefill.url}/disagg/status").json()
            result["transfer"] = {k: st[k] for k in ("transfers", "bytes_sent", "transfer_s")}
            result["transfer"]["gb_per_s"] = st["bytes_sent"] / st["transfer_s"] / 1e9 if st["transfer_s"] else None
    print(f"{'prompt':>7} {'TTFT one':>10} {'TTFT split':>11} {'ITL one':>9} {'ITL split':>10}   (ms, medians)")
    for a, d in zip(result["aggregated"], result["disaggregated"]):
        print(f"{a['prompt_tokens']:7d} {a['ttft_ms']:10.2f} {d['ttft_ms']:11.2f} {a['itl_ms']:9.3f} {d['itl_ms']:10.3f}")
    t = result["transfer"]
    print(f"transfer: {t['transfers']} requests, {t['bytes_sent'] / 2**20:.1f} MiB in {t['transfer_s']:.3f} s "
          f"({t['gb_per_s'] or 0:.2f} GB/s, Mooncake TCP, one staged region and one batched write per request)")
    out = out_dir / "disagg_serving.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out} (server logs in {logs})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
