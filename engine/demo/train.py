"""Training small models from scratch: a byte-level BPE tokenizer, a Llama-family target and an
EAGLE draft head on that target's own hidden states.

The demo uses these to make a tiny target + draft pair on CPU with no download; the GPU benchmark
uses the same functions with bigger sizes. Every function takes its sizes and a time budget and
reports progress through `progress(str)`, so a caller decides where the lines go.
"""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path
from typing import Callable, Iterator

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

Progress = Callable[[str], None]

# The demo's chat format. Special tokens are whole vocabulary entries, never split by BPE.
BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|end|>"
SPECIAL_TOKENS = [BOS_TOKEN, EOS_TOKEN, "<|system|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def corpus_files(max_bytes: int, roots: list[Path] | None = None) -> list[Path]:
    """Python sources found on any machine with Python: this package's own, then the standard
    library's, sorted so every machine picks the same files, up to `max_bytes` in total."""
    if roots is None:
        here = Path(__file__).resolve().parent
        roots = [here, here.parent / "specdeploy", Path(sysconfig.get_paths()["stdlib"])]
    files: list[Path] = []
    total = 0
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            if "test" in path.parts or "site-packages" in path.parts:
                continue
            size = path.stat().st_size
            if total + size > max_bytes:
                continue
            files.append(path)
            total += size
    return files


def read_corpus(files: list[Path]) -> Iterator[str]:
    for path in files:
        try:
            yield path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE (GPT-2 style): every byte string is encodable, so no <unk> ever appears."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    # BOS on every encode with special tokens, as Llama's tokenizer does.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", special_tokens=[(BOS_TOKEN, tok.token_to_id(BOS_TOKEN))])
    return tok


def save_tokenizer(tok: Tokenizer, out_dir: Path) -> None:
    """tokenizer.json + tokenizer_config.json (with the chat template), as a HF model directory has."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    config = {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "add_bos_token": False,
              "chat_template": CHAT_TEMPLATE, "model_max_length": 1 << 20,
              "tokenizer_class": "PreTrainedTokenizerFast"}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


# ---- the target ----------------------------------------------------------------------------

def llama_config(vocab_size: int, *, hidden_size: int, num_layers: int, num_heads: int,
                 num_kv_heads: int, intermediate_size: int, max_position_embeddings: int,
                 bos_token_id: int, eos_token_id: int) -> dict:
    """An HF-style config.json for a small Llama (tied embeddings: at this size the embedding is
    a large share of the parameters)."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "float32",
        "vocab_size": vocab_size, "hidden_size": hidden_size, "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers, "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads, "head_dim": hidden_size // num_heads,
        "max_position_embeddings": max_position_embeddings, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "tie_word_embeddings": True, "hidden_act": "silu",
        "bos_token_id": bos_token_id, "eos_token_id": eos_token_id,
    }


def tokenize_corpus(tok: Tokenizer, texts: list[str]):
    """One long stream of token ids [N] (int64), documents separated by EOS."""
    import torch

    eos = tok.token_to_id(EOS_TOKEN)
    ids: list[int] = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.int64)


class _Schedule:
    """Training ends after `max_steps` or `budget_s`, whichever comes first (a busy machine must
    not turn a one-minute demo into ten). The learning rate follows the larger share of the two:
    linear warm-up, then cosine decay to 10%.

    The warm-up also lasts at least `warmup_steps` steps (fewer only where `max_steps` is small):
    on a time budget, a slow first step (CUDA start-up, kernel selection) can use up the whole
    warm-up share of the clock, and a model that meets the peak rate within a step or two of a
    random start stalls near the unigram loss."""

    def __init__(self, peak_lr: float, max_steps: int, budget_s: float, warmup_share: float = 0.05,
                 warmup_steps: int = 30):
        import time

        self.peak_lr, self.max_steps, self.budget_s, self.warmup_share = peak_lr, max_steps, budget_s, warmup_share
        self.warmup_steps = max(1, min(warmup_steps, int(warmup_share * max_steps)))
        self.start_s = time.monotonic()

    @property
    def elapsed_s(self) -> float:
        import time

        return time.monotonic() - self.start_s

    def done(self, step: int) -> bool:
        return step >= self.max_steps or self.elapsed_s >= self.budget_s

    def lr(self, step: int) -> float:
        import math

        share = min(1.0, max(self.elapsed_s / self.budget_s, step / self.max_steps))
        warm = min(1.0, share / self.warmup_share, (step + 1) / self.warmup_steps)
        t = max(0.0, (share - self.warmup_share) / (1 - self.warmup_share))
        return self.peak_lr * max(warm, 0.01) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def _step_autocast(device: str, dtype):
    """Mixed precision for one step's forward and loss (None: none): the parameters and the
    optimizer stay float32 (the master weights), the matrix products run in `dtype`."""
    import contextlib

    import torch

    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=dtype)


def _update(opt, params, loss, lr: float) -> None:
    """One optimizer step at `lr` with gradient clipping at norm 1."""
    import torch

    for group in opt.param_groups:
        group["lr"] = lr
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    # Autocast keeps the low-precision copy of every weight it cast until the outermost autocast
    # region exits. A caller that wraps the whole training loop in one region would otherwise see
    # the first step's weights in every forward while the optimizer moves the float32 ones: the
    # loss hardly falls, and the returned model (the float32 weights) is garbage.
    torch.clear_autocast_cache()


def _random_windows(stream, batch_size: int, length: int, generator):
    import torch

    starts = torch.randint(0, stream.numel() - length, (batch_size,), generator=generator)
    return torch.stack([stream[s:s + length] for s in starts.tolist()])


def _dense_causal_batch(batch_size: int, seq_len: int, device):
    """Slots and masks for a [B, T] training batch over a fresh pool: no prefix, causal."""
    import torch

    from specdeploy.engine.models.attention import causal_batch

    slots = torch.arange(1, batch_size * seq_len + 1, device=device).view(batch_size, seq_len)
    return causal_batch(slots, torch.full((batch_size,), seq_len, device=device),
                        torch.zeros(batch_size, 0, dtype=torch.int64, device=device),
                        torch.zeros(batch_size, dtype=torch.int64, device=device))


def _trainable(model) -> list:
    # The engine builds inference models with frozen parameters; training unfreezes them.
    params = list(model.parameters())
    for p in params:
        p.requires_grad_(True)
    return params


def init_weights(model, std: float = 0.02, seed: int = 0) -> None:
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
            elif name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.zero_()


def train_target(config: dict, stream, *, max_steps: int, budget_s: float, batch_size: int = 4,
                 seq_len: int = 128, peak_lr: float = 3e-3, device: str = "cpu", seed: int = 0,
                 progress: Progress = print, autocast_dtype=None):
    """Train a Llama-family target (the engine's own model code) on `stream` [N] for `max_steps`
    steps or `budget_s` seconds of wall clock, whichever ends first; returns the model in eval
    mode, float32, frozen again. `autocast_dtype` (e.g. torch.bfloat16 on a GPU): mixed
    precision per step over float32 master weights."""
    import torch
    import torch.nn.functional as F

    from specdeploy.engine.memory.kv import KVPool
    from specdeploy.engine.models.llama import ModelConfig, build_target

    torch.manual_seed(seed)
    cfg = ModelConfig.from_hf(config)
    model = build_target(cfg, torch.float32, device)
    init_weights(model, seed=seed)
    params = _trainable(model)
    model.train()
    opt = torch.optim.AdamW(params, lr=peak_lr, betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator().manual_seed(seed)
    batch = _dense_causal_batch(batch_size, seq_len, device)
    positions = torch.arange(seq_len, device=device).expand(batch_size, seq_len)
    sched = _Schedule(peak_lr, max_steps, budget_s)
    step, tokens, last_report_s, loss_ema = 0, 0, 0.0, None
    while not sched.done(step):
        window = _random_windows(stream, batch_size, seq_len + 1, gen).to(device)   # [B, T + 1]
        # A fresh pool each step: the forward writes K/V into it, and autograd must not see
        # last step's writes.
        kv = KVPool(cfg.num_layers, batch_size * seq_len + 1, cfg.num_kv_heads, cfg.head_dim,
                    torch.float32, device)
        with _step_autocast(device, autocast_dtype):
            out = model(window[:, :-1], positions, batch, kv)
            logits = model.logits(out.hidden)                                      # [B, T, V]
            loss = F.cross_entropy(logits.flatten(0, 1).float(), window[:, 1:].flatten())
        _update(opt, params, loss, sched.lr(step))
        step += 1
        tokens += batch_size * seq_len
        loss_ema = loss.item() if loss_ema is None else 0.9 * loss_ema + 0.1 * loss.item()
        if sched.elapsed_s - last_report_s >= 10 or sched.done(step):
            last_report_s = sched.elapsed_s
            progress(f"  target: step {step}/{max_steps}, {tokens / 1e3:.0f}k tokens, loss {loss_ema:.2f}, "
                     f"{sched.elapsed_s:.0f} s")
    for p in params:
        p.requires_grad_(False)
    return model.eval()


def save_model(model, config: dict, out_dir: Path, prefix: str = "model.") -> None:
    """config.json + model.safetensors with HF tensor names (`prefix` on all but lm_head; tied
    weights stored once, as HF does)."""
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and config.get("tie_word_embeddings"):
            continue
        key = name if name.startswith("lm_head.") else prefix + name
        tensors[key] = tensor.detach().contiguous().cpu()
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")


# ---- the EAGLE head ------------------------------------------------------------------------

def eagle_config(target_config: dict, num_layers: int = 1) -> dict:
    """config.json of an EAGLE-1/2 head for `target_config`: the target's layer shape, fewer layers."""
    config = dict(target_config)
    config.update({"architectures": ["LlamaForCausalLMEagle"], "num_hidden_layers": num_layers})
    return config


def train_eagle(target, draft_config: dict, stream, *, max_steps: int, budget_s: float,
                target_sequences=None, batch_size: int = 4, seq_len: int = 128, peak_lr: float = 1e-2, regression_weight: float = 1.0,
                token_weight: float = 1.0, feature_noise_std: float = 0.05, device: str = "cpu",
                seed: int = 0, progress: Progress = print, autocast_dtype=None):
    """Train an EAGLE head on `target`'s own features (self-distillation).

    Row j of the head sees (token j+1, target feature j) and must produce the target's feature
    j+1 (regression) and the target's next-token distribution at j+1 (soft cross-entropy), as
    the EAGLE paper trains it. `target_sequences` [N, >= seq_len + 1]: the target's own
    generations (see `target_generations`), mixed into every batch. Uniform noise on the input feature stands in for the head's own,
    imperfect, features it consumes in later draft steps. The paper weighs the token loss 0.1 for
    runs of many epochs; with a budget of seconds the token loss carries most of the signal, so
    both weigh 1 here (and the learning rate is high: a one-layer head tolerates it).
    """
    import torch
    import torch.nn.functional as F

    from specdeploy.engine.models.draft import build_draft
    from specdeploy.engine.memory.kv import KVPool
    from specdeploy.engine.models.llama import ModelConfig

    torch.manual_seed(seed)
    target.set_feature("eagle")
    cfg = ModelConfig.from_hf(draft_config)
    head = build_draft("EAGLE", cfg, target, torch.float32, device)
    init_weights(head, seed=seed + 1)
    params = _trainable(head)
    head.train()
    opt = torch.optim.AdamW(params, lr=peak_lr, betas=(0.9, 0.95), weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed + 1)
    tcfg = target.cfg
    batch = _dense_causal_batch(batch_size, seq_len, device)
    positions = torch.arange(seq_len, device=device).expand(batch_size, seq_len)
    sched = _Schedule(peak_lr, max_steps, budget_s)
    step, last_report_s, acc_ema, loss_ema = 0, 0.0, None, None
    while not sched.done(step):
        window = _random_windows(stream, batch_size, seq_len + 1, gen)               # [B, T + 1]
        if target_sequences is not None:
            # Half the rows from the target's own generations: the draft must predict what the
            # target says, which is not always what the corpus says.
            rows = torch.randint(0, target_sequences.shape[0], (batch_size // 2,), generator=gen)
            window[: batch_size // 2] = target_sequences[rows, : seq_len + 1]
        window = window.to(device)
        with torch.no_grad(), _step_autocast(device, autocast_dtype):
            kv = KVPool(tcfg.num_layers, batch_size * seq_len + 1, tcfg.num_kv_heads, tcfg.head_dim,
                        torch.float32, device)
            feature = target(window[:, :-1], positions, batch, kv).feature.float()    # [B, T, H]
            target_probs = F.softmax(target.logits(feature[:, 1:]).float(), dim=-1)   # [B, T-1, V]
        noisy = feature[:, :-1] + (torch.rand_like(feature[:, :-1]) - 0.5) * 2 * feature_noise_std
        kv = KVPool(cfg.num_layers, batch_size * seq_len + 1, cfg.num_kv_heads, cfg.head_dim,
                    torch.float32, device)
        with _step_autocast(device, autocast_dtype):
            # Row j: token j+1 with feature j; the last row has no label and is dropped below.
            out = head(window[:, 1:-1], noisy, positions[:, :-1],
                       _dense_causal_batch(batch_size, seq_len - 1, device), kv)
            logits = head.logits(out).float()                                         # [B, T-1, V]
        regression = F.smooth_l1_loss(out.float(), feature[:, 1:])
        token = -(target_probs * F.log_softmax(logits, dim=-1)).sum(-1).mean()
        loss = regression_weight * regression + token_weight * token
        _update(opt, params, loss, sched.lr(step))
        step += 1
        with torch.no_grad():
            acc = (logits.argmax(-1) == target_probs.argmax(-1)).float().mean().item()
        acc_ema = acc if acc_ema is None else 0.9 * acc_ema + 0.1 * acc
        loss_ema = loss.item() if loss_ema is None else 0.9 * loss_ema + 0.1 * loss.item()
        if sched.elapsed_s - last_report_s >= 10 or sched.done(step):
            last_report_s = sched.elapsed_s
            progress(f"  draft: step {step}/{max_steps}, loss {loss_ema:.3f}, agrees with the target's next "
                     f"token {100 * acc_ema:.0f}% of the time, {sched.elapsed_s:.0f} s")
    for p in params:
        p.requires_grad_(False)
    return head.eval()


def target_generations(target, stream, *, num_sequences: int, prompt_len: int, gen_len: int,
                       temperature: float = 0.0, seed: int = 0, device: str = "cpu"):
    """[num_sequences, prompt_len + gen_len] token ids: corpus prompts continued by the target
    through the engine's Runner (all at once, one batch)."""
    import torch

    from specdeploy.engine.runtime.runner import Request, Runner

    gen = torch.Generator().manual_seed(seed + 2)
    prompts = _random_windows(stream, num_sequences, prompt_len, gen)
    total = prompt_len + gen_len
    runner = Runner(target, None, None, max_total_tokens=num_sequences * (total + 1),
                    max_running_requests=num_sequences, context_length=total + 1, device=device, seed=seed)
    outputs: dict[str, list[int]] = {}
    for i, prompt in enumerate(prompts.tolist()):
        rid = f"gen-{i}"
        outputs[rid] = list(prompt)
        runner.add(Request(id=rid, prompt_ids=prompt, max_tokens=gen_len, temperature=temperature, seed=seed + i))
    while runner.num_running:
        for out in runner.step():
            outputs[out.req_id].extend(out.token_ids)
    return torch.tensor([outputs[f"gen-{i}"][:total] for i in range(num_sequences)], dtype=torch.int64)
