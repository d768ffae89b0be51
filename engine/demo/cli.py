"""`specdeploy demo`: the engine end to end on a CPU, with nothing to download.

It makes a model pair of its own (first run only, cached after):
  1. a byte-level BPE tokenizer, trained on Python sources every machine has;
  2. a small Llama-family target (the engine's own model code) trained on the same text;
  3. an EAGLE draft head trained on that target's hidden states, so its drafts get accepted;
then starts the real server on a loopback port, sends requests through the official `openai`
client, and compares speculative decoding with target-only decoding.

A toy trained in a minute writes toy text. Real deployments serve real weights with
`specdeploy engine serve --target DIR --draft DIR --algorithm EAGLE3`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

# Bump when the recipe changes, so a cached pair from an older recipe is not reused.
DEMO_VERSION = "v1"
MODEL_NAME = "specdeploy-demo"
NUM_STEPS, TOPK = 3, 1
DEMO_RUNNING_REQUESTS = 4


@dataclass(frozen=True)
class Recipe:
    corpus_bytes: int = 3_000_000
    vocab_size: int = 1024
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 384
    context_length: int = 1024
    # Steps, capped by seconds: an idle 2-core machine finishes the steps within the caps.
    target_steps: int = 600
    target_train_s: float = 90.0
    draft_steps: int = 400
    draft_train_s: float = 45.0
    # Greedy continuations by the target, half of every draft batch (the demo decodes greedily).
    num_target_generations: int = 48
    generation_prompt_len: int = 16
    # Many small steps beat few large ones when the budget is a minute: 512 tokens a step.
    seq_len: int = 128
    batch_size: int = 4
    seed: int = 0


def default_cache_dir() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "specdeploy" / "demo" / DEMO_VERSION


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("demo", help="train a tiny target + EAGLE draft on CPU and serve them (no download)",
                              description=__doc__.splitlines()[0])
    p.add_argument("--cache-dir", type=Path, default=None, help=f"default: ~/.cache/specdeploy/demo/{DEMO_VERSION}")
    p.add_argument("--retrain", action="store_true", help="ignore a cached model pair")
    p.add_argument("--target-steps", type=int, default=Recipe.target_steps)
    p.add_argument("--target-train-s", type=float, default=Recipe.target_train_s, help="cap on the target's training time")
    p.add_argument("--draft-steps", type=int, default=Recipe.draft_steps)
    p.add_argument("--draft-train-s", type=float, default=Recipe.draft_train_s, help="cap on the draft's training time")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per benchmark request")
    p.add_argument("--verbose", action="store_true", help="show the engine's own log lines")
    p.set_defaults(func=run)
    return p


def say(line: str = "") -> None:
    print(line, flush=True)


# ---- the models ----------------------------------------------------------------------------

def ensure_models(cache_dir: Path, recipe: Recipe, retrain: bool = False) -> tuple[Path, Path]:
    """(target_dir, draft_dir), trained now unless a complete pair of this recipe is cached."""
    target_dir, draft_dir, marker = cache_dir / "target", cache_dir / "draft", cache_dir / "complete.json"
    if not retrain and marker.exists() and json.loads(marker.read_text()).get("recipe") == asdict(recipe):
        say(f"  cached pair found in {cache_dir} (delete it or pass --retrain to train again)")
        return target_dir, draft_dir
    import torch

    from specdeploy.engine.demo import train

    marker.unlink(missing_ok=True)
    torch.manual_seed(recipe.seed)
    t0 = time.monotonic()
    files = train.corpus_files(recipe.corpus_bytes)
    texts = list(train.read_corpus(files))
    tok = train.train_tokenizer(texts, recipe.vocab_size)
    stream = train.tokenize_corpus(tok, texts)
    say(f"  tokenizer: byte-level BPE, {tok.get_vocab_size()} tokens, trained on {len(files)} Python files "
        f"({sum(map(len, texts)) / 1e6:.1f} MB, {stream.numel() / 1e6:.2f} M tokens) in {time.monotonic() - t0:.1f} s")

    config = train.llama_config(
        tok.get_vocab_size(), hidden_size=recipe.hidden_size, num_layers=recipe.num_layers,
        num_heads=recipe.num_heads, num_kv_heads=recipe.num_kv_heads, intermediate_size=recipe.intermediate_size,
        max_position_embeddings=recipe.context_length, bos_token_id=tok.token_to_id(train.BOS_TOKEN),
        eos_token_id=tok.token_to_id(train.EOS_TOKEN))
    say(f"  target: Llama, {recipe.num_layers} layers, hidden {recipe.hidden_size}; training "
        f"{recipe.target_steps} steps (at most {recipe.target_train_s:.0f} s)")
    target = train.train_target(config, stream, max_steps=recipe.target_steps, budget_s=recipe.target_train_s,
                                batch_size=recipe.batch_size, seq_len=recipe.seq_len, seed=recipe.seed,
                                progress=say)
    num_params = sum(p.numel() for p in target.parameters())
    say(f"  target: {num_params / 1e6:.2f} M parameters")
    train.save_model(target, config, target_dir)
    train.save_tokenizer(tok, target_dir)

    t1 = time.monotonic()
    generations = train.target_generations(
        target, stream, num_sequences=recipe.num_target_generations, prompt_len=recipe.generation_prompt_len,
        gen_len=recipe.seq_len + 1 - recipe.generation_prompt_len, seed=recipe.seed)
    say(f"  target: {generations.shape[0]} greedy continuations generated for the draft's training "
        f"in {time.monotonic() - t1:.1f} s")
    draft_config = train.eagle_config(config)
    say(f"  draft: EAGLE head, 1 layer, trained on the target's hidden states; {recipe.draft_steps} steps "
        f"(at most {recipe.draft_train_s:.0f} s)")
    head = train.train_eagle(target, draft_config, stream, max_steps=recipe.draft_steps,
                             budget_s=recipe.draft_train_s, target_sequences=generations,
                             batch_size=recipe.batch_size, seq_len=recipe.seq_len, seed=recipe.seed, progress=say)
    train.save_model(head, draft_config, draft_dir, prefix="")
    marker.write_text(json.dumps({"recipe": asdict(recipe), "trained_s": round(time.monotonic() - t0, 1)}) + "\n")
    say(f"  saved to {cache_dir} ({time.monotonic() - t0:.0f} s in all); the next run starts at once")
    return target_dir, draft_dir


# ---- serving -------------------------------------------------------------------------------

def _serve_argv(target_dir: Path, draft_dir: Path | None, port: int, recipe: Recipe) -> list[str]:
    # The pool holds what 4 full-context requests need, not the whole device (the plan would
    # give a tiny model all of a GPU's memory).
    argv = ["engine", "serve", "--target", str(target_dir), "--served-model-name", MODEL_NAME,
            "--dtype", "float32", "--context-length", str(recipe.context_length),
            "--max-running-requests", str(DEMO_RUNNING_REQUESTS),
            "--max-total-tokens", str(DEMO_RUNNING_REQUESTS * recipe.context_length),
            "--host", "127.0.0.1", "--port", str(port)]
    if draft_dir is None:
        return argv + ["--algorithm", "NONE"]
    return argv + ["--draft", str(draft_dir), "--algorithm", "EAGLE", "--num-steps", str(NUM_STEPS),
                   "--topk", str(TOPK), "--num-draft-tokens", str(NUM_STEPS + 1)]


def _spec_counters(base_url: str) -> tuple[float, float, float]:
    """(draft tokens proposed, accepted, decode steps) from /metrics."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    values = {}
    for family in text_string_to_metric_families(httpx.get(f"{base_url}/metrics").text):
        for s in family.samples:
            values[s.name] = values.get(s.name, 0.0) + s.value
    return (values.get("specdeploy_spec_decode_num_draft_tokens_total", 0.0),
            values.get("specdeploy_spec_decode_num_accepted_tokens_total", 0.0),
            values.get("specdeploy_spec_decode_acceptance_length_count", 0.0))


BENCH_PROMPTS = [
    "def main(", "import os\n", "class Config:\n    def __init__(self", "    return self.",
    "for i in range(", "if __name__ == ", "    def __repr__(self):\n        return ", "# Copyright",
]


async def _benchmark(base_url: str, max_tokens: int, concurrency: int = DEMO_RUNNING_REQUESTS) -> tuple[list[str], int, float]:
    """Greedy completions of BENCH_PROMPTS, `concurrency` at a time: (texts, tokens, seconds)."""
    import openai

    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    gate = asyncio.Semaphore(concurrency)

    async def one(prompt):
        async with gate:
            out = await client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens,
                                                  temperature=0, extra_body={"ignore_eos": True})
            return out.choices[0].text, out.usage.completion_tokens

    t0 = time.monotonic()
    results = await asyncio.gather(*(one(p) for p in BENCH_PROMPTS))
    elapsed_s = time.monotonic() - t0
    await client.close()
    return [text for text, _ in results], sum(n for _, n in results), elapsed_s


def _show(label: str, prompt: str, text: str) -> None:
    say(f"  {label:<10} {prompt!r} -> {text!r}")


def run(args: argparse.Namespace) -> int:
    # The engine's log lines are for `kubectl logs`; the demo prints its own summary instead.
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    recipe = Recipe(target_steps=args.target_steps, target_train_s=args.target_train_s,
                    draft_steps=args.draft_steps, draft_train_s=args.draft_train_s)
    return run_demo(recipe, args.cache_dir or default_cache_dir(), max_tokens=args.max_tokens,
                    retrain=args.retrain)


def run_demo(recipe: Recipe, cache_dir: Path, *, max_tokens: int = 64, retrain: bool = False) -> int:
    import openai
    import torch

    from specdeploy.engine.serving.cli import ServerThread, free_port

    t_start = time.monotonic()
    device = "GPU" if torch.cuda.is_available() else "CPU"
    say("specdeploy demo: a tiny target + EAGLE draft made on this machine (no download), served by the real")
    say("engine through its OpenAI API. Real deployments serve real weights (specdeploy engine serve --target ...).")
    say()
    say(f"[1/3] models ({cache_dir})")
    target_dir, draft_dir = ensure_models(cache_dir, recipe, retrain=retrain)

    say()
    say(f"[2/3] engine: target + EAGLE draft ({NUM_STEPS} draft steps, topk {TOPK}), {device}, float32")
    spec_server = ServerThread(_serve_argv(target_dir, draft_dir, free_port(), recipe)).start()
    say(f"  serving at {spec_server.base_url}/v1")
    try:
        client = openai.OpenAI(base_url=f"{spec_server.base_url}/v1", api_key="unused", max_retries=0)
        # Sampled (seeded): greedy decoding of a model this small falls into loops at once. The
        # benchmark below is greedy, where speculative output must equal target-only output.
        sampling = dict(temperature=0.7, top_p=0.95, seed=1)
        prompt = "def fibonacci(n):\n"
        out = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=48, **sampling)
        _show("completion", prompt, out.choices[0].text)
        messages = [{"role": "user", "content": "Write a function that adds two numbers."}]
        chat = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=48, **sampling)
        _show("chat", messages[0]["content"], chat.choices[0].message.content)
        prompt = "class Scheduler:\n    def "
        print(f"  {'streamed':<10} {prompt!r} -> ", end="", flush=True)
        for chunk in client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=48, stream=True,
                                               **sampling):
            if chunk.choices and chunk.choices[0].text:
                print(repr(chunk.choices[0].text)[1:-1], end="", flush=True)
        say()
        before = _spec_counters(spec_server.base_url)
        spec_texts, spec_tokens, spec_s = asyncio.run(_benchmark(spec_server.base_url, max_tokens))
        after = _spec_counters(spec_server.base_url)
    finally:
        spec_server.stop()
    proposed, accepted, steps = (a - b for a, b in zip(after, before))

    plain_server = ServerThread(_serve_argv(target_dir, None, free_port(), recipe)).start()
    try:
        plain_texts, plain_tokens, plain_s = asyncio.run(_benchmark(plain_server.base_url, max_tokens))
    finally:
        plain_server.stop()

    say()
    say(f"[3/3] benchmark: {len(BENCH_PROMPTS)} greedy completions x {max_tokens} tokens, "
        f"{DEMO_RUNNING_REQUESTS} at a time, {device}")
    accept_len = 1 + accepted / steps if steps else float("nan")
    spec_rate, plain_rate = spec_tokens / spec_s, plain_tokens / plain_s
    say(f"  speculative (EAGLE): {spec_tokens} tokens in {spec_s:.2f} s = {spec_rate:.0f} tok/s; "
        f"mean acceptance length {accept_len:.2f} ({accepted:.0f} of {proposed:.0f} drafts accepted, "
        f"{100 * accepted / max(proposed, 1):.0f}%)")
    say(f"  target only:         {plain_tokens} tokens in {plain_s:.2f} s = {plain_rate:.0f} tok/s")
    say(f"  speed-up: {spec_rate / plain_rate:.2f}x")
    same = sum(a == b for a, b in zip(spec_texts, plain_texts))
    say(f"  greedy outputs identical to target-only: {same} of {len(spec_texts)}"
        + ("" if same == len(spec_texts) else " (float rounding differs between a 4-token verify and 1-token decode)"))
    say()
    say("  A model this small costs little per forward, so the draft's own work eats much of what accepted")
    say("  tokens save; with a real target on a GPU the target's forward dominates and verifying several")
    say("  tokens costs about as much as decoding one, which is where the acceptance length becomes speed.")
    say()
    say("  Serve this pair yourself (an EAGLE pair: the head is EAGLE-1/2, not EAGLE-3):")
    say(f"    specdeploy engine serve --target {target_dir} --draft {draft_dir} --algorithm EAGLE \\")
    say(f"      --served-model-name {MODEL_NAME} --dtype float32 --port 8000")
    say(f"  and send clients model \"{MODEL_NAME}\" (without --served-model-name: the --target path as given).")
    say(f"done in {time.monotonic() - t_start:.0f} s")
    return 0
