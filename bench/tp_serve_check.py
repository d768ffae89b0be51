"""`specdeploy engine serve` with the Llama-3.3-70B shape and its EAGLE-3 head at tensor parallel 2
(random bf16 weights: no checkpoint needed, the text is noise): the real process starts its second
rank, loads, captures its graphs and serves; then greedy completions through the OpenAI API at 1
and 16 concurrent requests, tok/s from the server's own usage counts; SIGTERM; exit code 0.

    python3 bench/tp_serve_check.py [--tp 2] [--out /tmp/tp_serve_check.json]
    python3 bench/tp_serve_check.py --smoke     # a tiny model on CPU (gloo): the script's own check
The start-up log (plan, per-rank weights and KV against the plan, graph capture) is kept beside
the JSON (.log).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from common import REPO_ROOT, bootstrap_specdeploy, log  # noqa: E402

bootstrap_specdeploy(REPO_ROOT)

EAGLE3_70B = {"architectures": ["LlamaForCausalLMEagle3"], "num_hidden_layers": 1, "draft_vocab_size": 32000}


def _model_dirs(root: Path, smoke: bool) -> tuple[Path, Path]:
    from specdeploy.engine.demo import train

    target = json.loads((ROOT / "manifests/models/llama-3.3-70b-instruct/config.json").read_text())
    if smoke:
        target.update(hidden_size=64, intermediate_size=128, num_hidden_layers=5, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=512)
    draft = {**target, **EAGLE3_70B, **({"draft_vocab_size": 256} if smoke else {})}
    texts = list(train.read_corpus(train.corpus_files(200_000, roots=[Path(train.__file__).parent])))
    tokenizer = train.train_tokenizer(texts, vocab_size=320)  # ids below the model's vocabulary
    dirs = root / "target", root / "draft"
    for d, config in zip(dirs, (target, draft)):
        d.mkdir(parents=True)
        (d / "config.json").write_text(json.dumps(config))
    train.save_tokenizer(tokenizer, dirs[0])
    return dirs


def _ready(url: str) -> bool:
    import httpx

    try:
        return httpx.get(f"{url}/ready", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out", default="/tmp/tp_serve_check.json")
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()
    import openai

    from specdeploy.engine.serving.cli import free_port

    root = Path(tempfile.mkdtemp(prefix="tp_serve_"))
    target_dir, draft_dir = _model_dirs(root, args.smoke)
    port = free_port()
    argv = [sys.executable, "-P", "-m", "specdeploy.cli", "engine", "serve", "--target", str(target_dir),
            "--draft", str(draft_dir), "--algorithm", "EAGLE3", "--num-steps", "3", "--topk", "1",
            "--num-draft-tokens", "4", "--random-weights", "--tensor-parallel-size", str(args.tp),
            "--context-length", "512" if args.smoke else "8192", "--max-running-requests", "16",
            "--served-model-name", "llama-70b-random", "--host", "127.0.0.1", "--port", str(port)]
    if args.smoke:
        argv += ["--dtype", "float32"]
    log_path = Path(args.out).with_suffix(".log")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "bench"), os.environ.get("PYTHONPATH", "")]))
    t0 = time.monotonic()
    with open(log_path, "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
    result: dict = {"tp": args.tp, "argv": argv[3:], "log": str(log_path)}
    try:
        url = f"http://127.0.0.1:{port}"
        while not _ready(url):
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with {proc.returncode}; see {log_path}")
            if time.monotonic() - t0 > 1800:
                raise TimeoutError(f"not ready after 30 minutes; see {log_path}")
            time.sleep(1)
        result["ready_s"] = time.monotonic() - t0
        log(f"ready after {result['ready_s']:.0f} s (TP {args.tp})")
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)

        def one(i: int) -> int:
            r = client.completions.create(model="llama-70b-random", prompt=f"request {i}: def f(x):",
                                          max_tokens=args.max_tokens, temperature=0, extra_body={"ignore_eos": True})
            return r.usage.completion_tokens

        one(-1)  # warm
        result["concurrency"] = {}
        for n in (1, 16):
            t1 = time.monotonic()
            with concurrent.futures.ThreadPoolExecutor(n) as pool:
                tokens = sum(pool.map(one, range(n)))
            seconds = time.monotonic() - t1
            result["concurrency"][n] = {"tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds}
            log(f"{n} concurrent: {tokens} tokens in {seconds:.2f} s = {tokens / seconds:.1f} tok/s")
        proc.send_signal(signal.SIGTERM)
        result["exit_code"] = proc.wait(timeout=120)
        log(f"SIGTERM: exit code {result['exit_code']}")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        log(f"wrote {args.out} (server log {log_path})")
    return 0 if result.get("exit_code") == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
