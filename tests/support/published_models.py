"""Tiny replicas of published model repositories, file for file as the hub serves them.

Each builder writes a directory with the files a user downloads, in the formats, stored dtypes,
tensor names and index files of the real repository, shrunk (hidden 32, 4 heads, 2 KV heads,
head_dim 8; special tokens keep their order after a 256-byte vocabulary); only the sizes change,
never a tensor's role:

    meta-llama/Llama-3.1-8B-Instruct   config.json (manifests/models/llama-3.1-8b-instruct, shrunk),
                                       generation_config.json (eos [end_of_text, eom, eot],
                                       temperature 0.6, top_p 0.9), 4 bfloat16 safetensors shards
                                       model-0000i-of-00004 + model.safetensors.index.json, tensor
                                       names as transformers' LlamaForCausalLM saves them,
                                       tokenizer.json + tokenizer_config.json (chat template, eos
                                       <|eot_id|>) + special_tokens_map.json
    Qwen/Qwen3-8B                      the same with 5 shards, q_norm/k_norm, the im_start/im_end
                                       template, eos [im_end, endoftext], top_k 20
    yuhuili/EAGLE3-LLaMA3.1-Instruct-8B   config.json (LlamaForCausalLMEagle3, draft_vocab_size,
                                       no rope_theta), one pytorch_model.bin written by torch.save
                                       (as DeepSpeed's save_16bit_model writes it: float16, frozen
                                       parameters left out): fc, midlayer.{input_layernorm,
                                       hidden_norm, self_attn.{q,k,v,o}_proj (q/k/v over 2H),
                                       post_attention_layernorm, mlp}, norm, lm_head over the draft
                                       vocabulary, d2t (int64 offsets), t2d (bool mask)
    yuhuili/EAGLE-LLaMA3.1-Instruct-8B    config.json (LlamaForCausalLM, 1 layer, rope_theta 500000,
                                       no rope scaling), one float32 pytorch_model.bin: the target's
                                       embedding copied in (embed_tokens), fc (with bias) over
                                       [embedding; hidden], layers.0 without input_layernorm

Sources for the head layouts: SafeAILab/EAGLE (eagle/model/cnets1.py, eagle/traineagle3/ cnets.py,
config.json and main.py's save_16bit_model) and SGLang's llama_eagle.py / llama_eagle3.py loaders.
Target weights come from transformers' own classes (random, seeded), so the names are what
transformers writes, independent of the engine that reads them.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "manifests" / "models"

BYTES = 256          # the byte-level base vocabulary; special tokens follow in their published order
SHRINK = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2}
HEAD_DIM = 8         # hidden / heads; written only where the published config names head_dim (Qwen3)
TARGET_LAYERS = 6    # EAGLE-3 reads three of them (the engine's default aux layers need >= 5)

# Llama 3.1's special tokens from 128000 on (the first 11 of its 256 reserved ids).
LLAMA_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                  "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|reserved_special_token_2|>",
                  "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"]
LLAMA_FIRST_SPECIAL = 128000
LLAMA_VOCAB = BYTES + 16
# Qwen3's special tokens from 151643 on.
QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
                 "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
                 "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>",
                 "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
                 "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>"]
QWEN_FIRST_SPECIAL = 151643
QWEN_VOCAB = BYTES + 32
EAGLE3_DRAFT_VOCAB = 64   # 32000 of 128256 in the published head
# Printable ASCII and the space, as byte-level BPE spells them ("Ġ" is the space byte).
ASCII_TEXT = [chr(c) for c in range(33, 127)] + ["Ġ"]
STEERING_PROMPTS = ("Hello world", "The capital of France is", "def f(x):", "1, 2, 3,")

# Llama 3.1 Instruct's template, its structure without the tool-calling branches: a system header
# with the knowledge and today's date, each turn closed by <|eot_id|>.
LLAMA_31_CHAT_TEMPLATE = (
    "{{- bos_token }}\n"
    "{%- if not date_string is defined %}{%- set date_string = \"26 Jul 2024\" %}{%- endif %}\n"
    "{%- if messages[0]['role'] == 'system' %}\n"
    "    {%- set system_message = messages[0]['content']|trim %}\n"
    "    {%- set messages = messages[1:] %}\n"
    "{%- else %}\n"
    "    {%- set system_message = \"\" %}\n"
    "{%- endif %}\n"
    "{{- \"<|start_header_id|>system<|end_header_id|>\\n\\n\" }}\n"
    "{{- \"Cutting Knowledge Date: December 2023\\n\" }}\n"
    "{{- \"Today Date: \" + date_string + \"\\n\\n\" }}\n"
    "{{- system_message }}\n"
    "{{- \"<|eot_id|>\" }}\n"
    "{%- for message in messages %}\n"
    "    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n"
    "{%- endif %}\n"
)
# Qwen3's template, its structure without tools: ChatML turns, an empty think block when
# thinking is switched off.
QWEN3_CHAT_TEMPLATE = (
    "{%- for message in messages %}\n"
    "    {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "    {%- if enable_thinking is defined and enable_thinking is false %}\n"
    "        {{- '<think>\\n\\n</think>\\n\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endif %}\n"
)


def tiny_id(real_id: int, first_special: int) -> int:
    return real_id - first_special + BYTES


def _published_config(folder: str) -> dict:
    return json.loads((MODELS / folder / "config.json").read_text())


def _tokenizer(specials: list[str], bos: str | None) -> Tokenizer:
    """Byte-level BPE over the 256 bytes (no merges), the specials at BYTES, BYTES + 1, ..."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet, key=lambda c: ord(c)))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    assert [tok.token_to_id(s) for s in specials] == list(range(BYTES, BYTES + len(specials)))
    if bos is not None:   # Llama 3's tokenizer.json prepends <|begin_of_text|>
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                           special_tokens=[(bos, tok.token_to_id(bos))])
    return tok


def _write_json(path: Path, data) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")


def _write_sharded_safetensors(out: Path, state: dict[str, torch.Tensor], shards: int) -> None:
    """model-0000i-of-N.safetensors in the tensors' own order, and the index save_pretrained writes."""
    names = list(state)
    per = -(-len(names) // shards)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: state[n].contiguous() for n in names[i * per:(i + 1) * per]}
        save_file(part, str(out / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    total = sum(t.numel() * t.element_size() for t in state.values())
    _write_json(out / "model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map})


def _transformers_state(config: dict, seed: int, tok: Tokenizer, end_of_turn: str) -> dict[str, torch.Tensor]:
    """Seeded random weights in transformers' own class for `config`, by its names (float32).

    Only values are chosen, never a layout: lm_head rows other than printable ASCII and the space
    are zero, so greedy text is plain ASCII (compared as text with transformers' own decoding);
    and the `end_of_turn` row is the row of the token this model emits most, 5% larger, so
    that greedy turns end with it (generation_config.json's eos list is what stops them).
    """
    import transformers

    cfg = transformers.AutoConfig.for_model(**{k: v for k, v in config.items()
                                               if k not in ("architectures", "transformers_version")})
    torch.manual_seed(seed)
    model = getattr(transformers, config["architectures"][0])(cfg).float().eval()
    head = model.lm_head.weight.data                                     # [V, H]
    keep = torch.zeros(head.shape[0], dtype=torch.bool)
    keep[[tok.token_to_id(c) for c in ASCII_TEXT]] = True
    head[~keep] = 0
    counts = torch.zeros(head.shape[0])
    with torch.no_grad():
        for prompt in STEERING_PROMPTS:
            ids = torch.tensor([tok.encode(prompt).ids])
            out = model.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)
            counts += torch.bincount(out[0, ids.shape[1]:], minlength=head.shape[0])
    head[tok.token_to_id(end_of_turn)] = head[int(counts.argmax())] * 1.05   # still larger in bfloat16
    return {n: t.detach().clone() for n, t in model.state_dict().items()}


def llama_31_8b_instruct(out: Path, seed: int = 0) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    ids = lambda real: tiny_id(real, LLAMA_FIRST_SPECIAL)  # noqa: E731
    config = _published_config("llama-3.1-8b-instruct")
    config.update(SHRINK, num_hidden_layers=TARGET_LAYERS, vocab_size=LLAMA_VOCAB,
                  bos_token_id=ids(config["bos_token_id"]), eos_token_id=[ids(i) for i in config["eos_token_id"]])
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", {
        "bos_token_id": config["bos_token_id"], "do_sample": True, "eos_token_id": config["eos_token_id"],
        "temperature": 0.6, "top_p": 0.9, "transformers_version": "4.42.3"})
    tok = _tokenizer(LLAMA_SPECIALS + [f"<|reserved_special_token_{i}|>" for i in range(3, 8)], "<|begin_of_text|>")
    tok.save(str(out / "tokenizer.json"))
    state = _transformers_state(config, seed, tok, "<|eot_id|>")
    _write_sharded_safetensors(out, {n: t.to(torch.bfloat16) for n, t in state.items()}, shards=4)
    _write_json(out / "tokenizer_config.json", {
        "added_tokens_decoder": {str(tok.token_to_id(s)): {"content": s, "lstrip": False, "normalized": False,
                                                           "rstrip": False, "single_word": False, "special": True}
                                 for s in LLAMA_SPECIALS},
        "bos_token": "<|begin_of_text|>", "chat_template": LLAMA_31_CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": True, "eos_token": "<|eot_id|>",
        "model_input_names": ["input_ids", "attention_mask"], "model_max_length": 131072,
        "tokenizer_class": "PreTrainedTokenizerFast"})
    _write_json(out / "special_tokens_map.json", {
        "bos_token": {"content": "<|begin_of_text|>", "lstrip": False, "normalized": False, "rstrip": False, "single_word": False},
        "eos_token": {"content": "<|eot_id|>", "lstrip": False, "normalized": False, "rstrip": False, "single_word": False}})
    return out


def qwen3_8b(out: Path, seed: int = 0) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    ids = lambda real: tiny_id(real, QWEN_FIRST_SPECIAL)  # noqa: E731
    config = _published_config("qwen3-8b")
    config.update(SHRINK, head_dim=HEAD_DIM, num_hidden_layers=TARGET_LAYERS, max_window_layers=TARGET_LAYERS,
                  vocab_size=QWEN_VOCAB,
                  bos_token_id=ids(config["bos_token_id"]), eos_token_id=ids(config["eos_token_id"]))
    _write_json(out / "config.json", config)
    endoftext, im_end = ids(151643), ids(151645)
    _write_json(out / "generation_config.json", {
        "bos_token_id": endoftext, "do_sample": True, "eos_token_id": [im_end, endoftext], "pad_token_id": endoftext,
        "temperature": 0.6, "top_k": 20, "top_p": 0.95, "transformers_version": "4.51.0"})
    tok = _tokenizer(QWEN_SPECIALS, None)
    tok.save(str(out / "tokenizer.json"))
    state = _transformers_state(config, seed, tok, "<|im_end|>")
    _write_sharded_safetensors(out, {n: t.to(torch.bfloat16) for n, t in state.items()}, shards=5)
    _write_json(out / "tokenizer_config.json", {
        "add_bos_token": False, "add_prefix_space": False,
        "added_tokens_decoder": {str(tok.token_to_id(s)): {"content": s, "lstrip": False, "normalized": False,
                                                           "rstrip": False, "single_word": False,
                                                           "special": s.startswith("<|")}
                                 for s in QWEN_SPECIALS},
        "bos_token": None, "chat_template": QWEN3_CHAT_TEMPLATE, "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>", "errors": "replace", "model_max_length": 131072, "pad_token": "<|endoftext|>",
        "split_special_tokens": False, "tokenizer_class": "Qwen2Tokenizer", "unk_token": None})
    return out


def _rand(g: torch.Generator, *shape: int, std: float = 0.1) -> torch.Tensor:
    return torch.randn(*shape, generator=g) * std


def _norm(g: torch.Generator, n: int) -> torch.Tensor:
    return 1.0 + _rand(g, n, std=0.05)


def eagle3_llama31_instruct_8b(out: Path, target_dir: Path, seed: int = 1) -> Path:
    """The EAGLE-3 head for `target_dir` (a llama_31_8b_instruct replica)."""
    out.mkdir(parents=True, exist_ok=True)
    target = json.loads((target_dir / "config.json").read_text())
    config = _published_config("eagle3-llama3.1-instruct-8b")
    config.update(SHRINK, vocab_size=target["vocab_size"], draft_vocab_size=EAGLE3_DRAFT_VOCAB,
                  bos_token_id=target["bos_token_id"], eos_token_id=target["eos_token_id"][0])
    assert "rope_theta" not in config   # as published: the head was trained at the default 10000
    _write_json(out / "config.json", config)
    g = torch.Generator().manual_seed(seed)
    h, i = config["hidden_size"], config["intermediate_size"]
    q, kv = config["num_attention_heads"] * HEAD_DIM, config["num_key_value_heads"] * HEAD_DIM
    # The draft vocabulary: the most frequent target tokens, sorted; d2t[d] = target id - d.
    draft_ids = torch.sort(torch.randperm(config["vocab_size"], generator=g)[:EAGLE3_DRAFT_VOCAB]).values
    t2d = torch.zeros(config["vocab_size"], dtype=torch.bool)
    t2d[draft_ids] = True
    state = OrderedDict([
        ("midlayer.self_attn.q_proj.weight", _rand(g, q, 2 * h)),
        ("midlayer.self_attn.k_proj.weight", _rand(g, kv, 2 * h)),
        ("midlayer.self_attn.v_proj.weight", _rand(g, kv, 2 * h)),
        ("midlayer.self_attn.o_proj.weight", _rand(g, h, q)),
        ("midlayer.mlp.gate_proj.weight", _rand(g, i, h)),
        ("midlayer.mlp.up_proj.weight", _rand(g, i, h)),
        ("midlayer.mlp.down_proj.weight", _rand(g, h, i)),
        ("midlayer.hidden_norm.weight", _norm(g, h)),
        ("midlayer.input_layernorm.weight", _norm(g, h)),
        ("midlayer.post_attention_layernorm.weight", _norm(g, h)),
        ("norm.weight", _norm(g, h)),
        ("fc.weight", _rand(g, h, 3 * h)),
        ("lm_head.weight", _rand(g, EAGLE3_DRAFT_VOCAB, h, std=0.5)),
    ])
    state = OrderedDict((n, t.to(torch.float16)) for n, t in state.items())
    state["d2t"] = draft_ids - torch.arange(EAGLE3_DRAFT_VOCAB)
    state["t2d"] = t2d
    torch.save(state, out / "pytorch_model.bin")
    return out


def eagle_llama31_instruct_8b(out: Path, target_dir: Path, seed: int = 2) -> Path:
    """The EAGLE-1 head for `target_dir`, with its float32 copy of the target's embedding."""
    out.mkdir(parents=True, exist_ok=True)
    target = json.loads((target_dir / "config.json").read_text())
    config = _published_config("eagle-llama3.1-instruct-8b")
    config.update(SHRINK, vocab_size=target["vocab_size"], bos_token_id=target["bos_token_id"],
                  eos_token_id=target["eos_token_id"][0])
    _write_json(out / "config.json", config)
    from safetensors import safe_open

    index = json.loads((target_dir / "model.safetensors.index.json").read_text())
    with safe_open(str(target_dir / index["weight_map"]["model.embed_tokens.weight"]), "pt") as f:
        embed = f.get_tensor("model.embed_tokens.weight")
    g = torch.Generator().manual_seed(seed)
    h, i = config["hidden_size"], config["intermediate_size"]
    q, kv = config["num_attention_heads"] * HEAD_DIM, config["num_key_value_heads"] * HEAD_DIM
    state = OrderedDict([
        ("embed_tokens.weight", embed.float()),
        ("layers.0.self_attn.q_proj.weight", _rand(g, q, h)),
        ("layers.0.self_attn.k_proj.weight", _rand(g, kv, h)),
        ("layers.0.self_attn.v_proj.weight", _rand(g, kv, h)),
        ("layers.0.self_attn.o_proj.weight", _rand(g, h, q)),
        ("layers.0.mlp.gate_proj.weight", _rand(g, i, h)),
        ("layers.0.mlp.up_proj.weight", _rand(g, i, h)),
        ("layers.0.mlp.down_proj.weight", _rand(g, h, i)),
        ("layers.0.post_attention_layernorm.weight", _norm(g, h)),
        ("fc.weight", _rand(g, h, 2 * h)),
        ("fc.bias", _rand(g, h, std=0.01)),
    ])
    torch.save(state, out / "pytorch_model.bin")
    return out
