"""Model shapes from a Hugging Face config.json: the data contract the planner, operator and engine share.

`derive_shapes(config)` reads fields with defaults, so it copes with any `model_type` (including
ones no installed library knows) and with multimodal configs that nest the language model under
`text_config`. A missing essential field or an unknown dtype raises `ConfigError` naming the field.

The one width everything else hangs on is `spec_hidden_size`: the width of the hidden state the
target hands to its draft. It is `hidden_size * hc_mult` for models with manifold-constrained
hyper-connections (DeepSeek-V4: hc_mult 4, so its residual stream is `[T, 4, H]` and MTP consumes
`[T, 4 * H]`), else `hidden_size`. The draft's *input* width differs again for EAGLE-3, which
concatenates auxiliary hidden states of three target layers: see `draft_input_hidden_size`.

KV cache bytes per token, by attention kind (b = dtype bytes, L = layers):
  gqa         2 * L * num_kv_heads * head_dim * b               (K and V per KV head)
  mla         L * (kv_lora_rank + qk_rope_head_dim) * b         (one latent, shared by all heads)
  compressed  DeepSeek-V4: compressed entries per token, plus a bounded number of recent-token
              rows per request (sliding windows, compressor state) and per in-flight token;
              engine/planner/deepseek_v4.py says what each layer kind stores. Both of V4's
              field-naming schemes are read there, into one V4Config.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from specdeploy.engine.planner.deepseek_v4 import CSA, HASH_MOE, V4Config, is_deepseek_v4, read_v4_config, v4_kv_bytes
from specdeploy.engine.planner.errors import MAX_CONFIG_INT, MAX_LAYERS, ConfigError

# Bytes per element of every dtype a config may name. Anything else is refused: a wrong guess
# here halves or doubles every memory figure downstream.
DTYPE_BYTES = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}
DTYPE_ALIASES = {
    "fp32": "float32",
    "float": "float32",
    "fp16": "float16",
    "half": "float16",
    "bf16": "bfloat16",
    "fp8": "float8_e4m3fn",
    "float8": "float8_e4m3fn",
}

# KV cache dtypes a deployment may ask for -> bytes per element (None: the compute dtype's).
# fp8_e4m3: K and V stored as e4m3 codes with one float32 scale per layer for each (from the
# checkpoint's k_scale / v_scale where it has them, else 1); the scales are not per token.
KV_CACHE_DTYPES = {"auto": None, "fp8_e4m3": 1}
# How the engine may quantize a draft head's weights as it loads them: none (as the checkpoint
# stores them), fp8 (e4m3 codes, one float32 scale per 128 x 128 block: every projection of the
# head's layers, its input projection and an EAGLE-3 head's own lm_head; embeddings and norms
# stay as stored).
DRAFT_QUANTIZATIONS = ("none", "fp8")
DRAFT_QUANTIZATION_BLOCK = 128

ALGORITHMS = ("EAGLE", "EAGLE3", "MTP", "NONE")
DRAFT_ALGORITHMS = tuple(a for a in ALGORITHMS if a != "NONE")
# What a config.json is used as: the target, or a draft of one of the algorithms.
MODEL_ROLES = ("target", *DRAFT_ALGORITHMS)
# Dtypes the engine computes in (weights stored otherwise are cast while loading).
COMPUTE_DTYPES = ("bfloat16", "float16", "float32")

# EAGLE-3 feeds the draft the concatenated hidden states of three target layers (low, middle,
# high), so its fc layer and its input buffers are this many target hidden sizes wide.
EAGLE3_AUX_LAYERS = 3

# Model types whose attention q/k/v projections carry a bias though the config has no flag for it.
QKV_BIAS_MODEL_TYPES = frozenset({"qwen2", "qwen2_moe", "qwen2_vl", "qwen2_5_vl", "qwen2_vl_text", "qwen2_5_vl_text"})
# Model types with per-head RMSNorm on q and k (one head_dim-wide weight each).
QK_NORM_MODEL_TYPES = frozenset({"qwen3", "qwen3_moe", "qwen3_vl", "qwen3_vl_text", "qwen3_vl_moe"})


@dataclass(frozen=True)
class ModelShapes:
    """What the planner and the engine need to know about one model (see module docstring)."""

    model_type: str
    architecture: str
    role: str  # one of MODEL_ROLES: what this config is used as; decides which parameters it owns
    dtype: str
    dtype_bytes: int
    kv_cache_dtype: str  # "auto" (K/V in the compute dtype) or "fp8_e4m3"
    kv_dtype_bytes: int  # bytes per stored K/V element
    hidden_size: int
    hc_mult: int
    spec_hidden_size: int
    num_layers: int  # layers this model runs: the decoder stack, or the MTP/EAGLE layers of a draft
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # dense MLP width (0 when every layer is MoE)
    vocab_size: int
    draft_vocab_size: int  # EAGLE-3 heads may predict over a smaller vocabulary; else vocab_size
    tie_word_embeddings: bool
    max_position_embeddings: int  # 0 when the config does not say
    attention: str  # "gqa" (incl. MHA/MQA), "mla" (DeepSeek-V2/V3 latent), "compressed" (DeepSeek-V4)
    # MLA / low-rank attention dims (0 when not used)
    q_lora_rank: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    # DeepSeek-V4 compressed attention (empty / 0 when not used)
    sliding_window: int
    compress_ratios: tuple[int, ...]
    index_head_dim: int
    # MoE (0 when dense)
    num_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    num_shared_experts: int
    shared_expert_intermediate_size: int  # total width of the always-on shared expert MLP
    num_moe_layers: int
    num_dense_layers: int
    num_nextn_predict_layers: int
    # parameter counts (elements); num_params counts only what this role loads itself
    embedding_params: int
    lm_head_params: int
    num_params: int
    kv_cache_bytes_per_token: int  # whole model, before tensor parallelism
    kv_cache_bytes_per_request: int  # fixed per running request (V4's committed recent rows), before TP
    kv_cache_bytes_per_in_flight_token: int  # V4: each slot a step holds (chunk, tree, scratch), before TP
    quantization: str  # quant_method of the checkpoint, "" when unquantized
    # What quantization_config implies the checkpoint weighs (see quantized_weight_bytes); 0 when
    # unquantized or a method this estimate does not know
    quantized_weight_bytes: int
    routed_expert_params: int  # elements of the routed experts' matrices (in num_params)
    has_vision_tower: bool  # a multimodal checkpoint; its vision encoder is not in num_params
    v4: V4Config | None = None  # DeepSeek-V4's layer schedule and dims (the plan's V4 transients)
    expert_quant: str = ""  # V4 routed experts as stored: "fp4" | "fp8" | "" (model dtype)

    @property
    def weight_bytes(self) -> int:
        """Weights counted from the shapes at `dtype` (quantized checkpoints: see `quantization`)."""
        return self.num_params * self.dtype_bytes


def draft_input_hidden_size(algorithm: str, target: ModelShapes) -> int:
    """Width of the hidden state the draft consumes from the target, per token.

    EAGLE-3 concatenates three target layers' hidden states (3 * hidden_size); EAGLE and MTP take
    the target's full residual stream, which is `spec_hidden_size` wide (hc_mult streams for V4).
    """
    if algorithm == "EAGLE3":
        return EAGLE3_AUX_LAYERS * target.hidden_size
    if algorithm in ("EAGLE", "MTP"):
        return target.spec_hidden_size
    if algorithm == "NONE":
        return 0
    raise ConfigError(f"algorithm: unknown {algorithm!r}; expected one of {', '.join(ALGORITHMS)}")


def kv_heads_per_gpu(num_kv_heads: int, tensor_parallel_size: int) -> int:
    """KV heads one GPU holds: split across TP ranks, replicated when there are fewer than ranks."""
    return max(1, num_kv_heads // tensor_parallel_size)


def draft_linears(shapes: ModelShapes, tensor_parallel_size: int,
                  target_spec_hidden_size: int | None = None) -> list[tuple[str, tuple[int, ...], int]] | None:
    """One rank's linears that a draft quantized at load converts (DRAFT_QUANTIZATIONS), as
    (kind, output rows of each fused part, input columns K): per layer the fused q/k/v
    ("merged"), o ("row"), the fused gate/up ("merged") and down ("row") as engine/models shards
    them, the head's input projection ("row": EAGLE fc [Hs, H + Hs], EAGLE-3 fc [H, 3H], split
    by input columns) and EAGLE-3's own lm_head ("lm_head": ceil(V / tp) padded vocabulary rows
    a rank, quantized on a grid of its own; an EAGLE head's lm_head is the target's). None for a
    model that is not a dense GQA EAGLE or EAGLE-3 head."""
    if shapes.role not in ("EAGLE", "EAGLE3") or shapes.attention != "gqa" or shapes.num_routed_experts:
        return None
    tp, h, hd = tensor_parallel_size, shapes.hidden_size, shapes.head_dim
    q = shapes.num_heads * hd // tp
    kv = kv_heads_per_gpu(shapes.num_kv_heads, tp) * hd
    i = shapes.intermediate_size // tp
    attn_in = 2 * h if shapes.role == "EAGLE3" else h
    layer = [("merged", (q, kv, kv), attn_in), ("row", (h,), q), ("merged", (i, i), h), ("row", (h,), i)]
    if shapes.role == "EAGLE":
        hs = target_spec_hidden_size or shapes.spec_hidden_size
        head = [("row", (hs,), (h + hs) // tp)]
    else:
        head = [("row", (h,), EAGLE3_AUX_LAYERS * h // tp), ("lm_head", (-(-shapes.draft_vocab_size // tp),), h)]
    return layer * shapes.num_layers + head


def fp8_block_bytes(kind: str, parts: tuple[int, ...], k: int) -> int:
    """Bytes of one rank's linear (draft_linears) in e4m3 with float32 scales per
    DRAFT_QUANTIZATION_BLOCK square, laid out as engine/models/fp8.py does: fused parts keep the
    block grid when every part but the last fills whole blocks, else one scale row per output row."""
    b, n = DRAFT_QUANTIZATION_BLOCK, sum(parts)
    grid = kind != "merged" or all(p % b == 0 for p in parts[:-1])
    return n * k + 4 * (-(-n // b) if grid else n) * -(-k // b)


def draft_quantization_refusal(shapes: ModelShapes, tensor_parallel_size: int,
                               target_spec_hidden_size: int | None = None) -> str | None:
    """Why the engine cannot quantize this draft's linears at `tensor_parallel_size`, or None: a
    head that is not a dense GQA EAGLE / EAGLE-3 one, or a rank's slice that would cut a scale
    block (every split width a multiple of DRAFT_QUANTIZATION_BLOCK; an lm_head's rows are
    quantized a rank at a time, so any TP size suits it)."""
    linears = draft_linears(shapes, tensor_parallel_size, target_spec_hidden_size)
    if linears is None:
        return f"{shapes.role} head ({shapes.model_type}, {shapes.attention} attention) is not a dense GQA head"
    if tensor_parallel_size == 1:
        return None
    b = DRAFT_QUANTIZATION_BLOCK
    for kind, parts, k in linears:
        if kind == "lm_head":
            continue
        split = parts if kind == "merged" else (k,)
        if any(width % b for width in split):
            what = "output rows" if kind == "merged" else "input columns"
            return (f"{shapes.role} head at TP {tensor_parallel_size}: a rank's {what} "
                    f"({', '.join(map(str, split))}) would cut its {b}-wide FP8 scale blocks")
    return None


def tensor_parallel_params(shapes: ModelShapes, tensor_parallel_size: int,
                           target_spec_hidden_size: int | None = None) -> tuple[int, int] | None:
    """(parameters the engine splits across TP ranks, those of them one rank holds) for a dense
    GQA model, counted as engine/models shards them; everything else (norms, biases of
    row-parallel layers, hyper-connection mixers, EAGLE-3's d2t / t2d) is replicated. None for
    the models the engine does not split this way (MoE, MLA); DeepSeek-V4: its routed experts.

    Per layer: q and o by heads (/ tp), k and v by KV heads (kv_heads_per_gpu: replicated when
    fewer than tp), gate / up / down (/ tp); embedding and lm_head by vocabulary rows, padded to
    ceil(V / tp) per rank; a head's input projection (EAGLE fc [Hs, H + Hs] with Hs the target's
    spec_hidden_size, EAGLE-3 fc [H, 3H], MTP eh_proj / e_proj + h_proj) by input columns."""
    if shapes.attention == "compressed":
        # DeepSeek-V4 (engine/models/deepseek_v4.py): only the routed experts are split (expert
        # parallelism: E / tp of them per rank); attention, embeddings and the rest replicated.
        if shapes.num_routed_experts % tensor_parallel_size:
            return None
        return shapes.routed_expert_params, shapes.routed_expert_params // tensor_parallel_size
    if shapes.attention != "gqa" or shapes.num_routed_experts:
        return None
    tp = tensor_parallel_size
    h, hd = shapes.hidden_size, shapes.head_dim
    q, kv = shapes.num_heads * hd, shapes.num_kv_heads * hd
    kv_local = kv_heads_per_gpu(shapes.num_kv_heads, tp) * hd
    attn_in = 2 * h if shapes.role == "EAGLE3" else h
    whole = attn_in * (q + 2 * kv) + q * h + 3 * h * shapes.intermediate_size
    part = attn_in * (q // tp + 2 * kv_local) + q // tp * h + 3 * h * shapes.intermediate_size // tp
    if shapes.model_type in QKV_BIAS_MODEL_TYPES:
        whole += q + 2 * kv
        part += q // tp + 2 * kv_local
    whole, part = whole * shapes.num_layers, part * shapes.num_layers

    def vocab(rows: int) -> tuple[int, int]:
        return rows * h, -(-rows // tp) * h

    if shapes.role == "target":
        splits = [vocab(shapes.vocab_size)] * (1 if shapes.tie_word_embeddings else 2)
    elif shapes.role == "EAGLE":
        hs = target_spec_hidden_size or shapes.spec_hidden_size
        splits = [((h + hs) * hs, (h + hs) * hs // tp)]
    elif shapes.role == "EAGLE3":
        splits = [(EAGLE3_AUX_LAYERS * h * h, EAGLE3_AUX_LAYERS * h * h // tp), vocab(shapes.draft_vocab_size)]
    else:  # MTP: [embedding; hidden] -> H per layer
        splits = [(2 * h * h * shapes.num_layers, 2 * h * h // tp * shapes.num_layers)]
    for w, p in splits:
        whole, part = whole + w, part + p
    return whole, part


def kv_cache_bytes_per_token_per_gpu(shapes: ModelShapes, tensor_parallel_size: int) -> int:
    """KV bytes one GPU stores per token slot. Only GQA divides by TP; latent (MLA) and V4's single
    shared K=V head are replicated on every rank."""
    if shapes.attention != "gqa":
        return shapes.kv_cache_bytes_per_token
    heads = kv_heads_per_gpu(shapes.num_kv_heads, tensor_parallel_size)
    return 2 * shapes.num_layers * heads * shapes.head_dim * shapes.kv_dtype_bytes


# --------------------------------------------------------------------------------------------
# reading fields


def _text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's fields: `text_config` wins where nested, the top level fills gaps
    (multimodal checkpoints often keep torch_dtype or tie_word_embeddings at the top)."""
    if not isinstance(config, dict):
        raise ConfigError("config.json: expected a JSON object at the top level")
    text = config.get("text_config")
    if text is None:
        return dict(config)
    if not isinstance(text, dict):
        raise ConfigError("text_config: expected a JSON object")
    merged = {k: v for k, v in config.items() if k not in ("text_config", "vision_config", "audio_config")}
    merged.update(text)
    if "architectures" in config:
        merged["architectures"] = config["architectures"]
    return merged


def _first(c: dict[str, Any], names: tuple[str, ...]) -> tuple[str, Any]:
    for name in names:
        if c.get(name) is not None:
            return name, c[name]
    return names[0], None


def _int(c: dict[str, Any], names: str | tuple[str, ...], default: int | None = None, *, minimum: int = 0,
         maximum: int = MAX_CONFIG_INT) -> int:
    """An integer field (first of several aliases that is present); missing with no default is an error."""
    names = (names,) if isinstance(names, str) else names
    name, value = _first(c, names)
    if value is None:
        if default is None:
            raise ConfigError(f"{name}: missing from config.json (model_type {c.get('model_type', '?')!r})")
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        else:
            raise ConfigError(f"{name}: expected an integer, got {value!r}")
    if value < minimum:
        raise ConfigError(f"{name}: must be >= {minimum}, got {value}")
    if value > maximum:
        raise ConfigError(f"{name}: {value} is implausible (at most {maximum})")
    return value


def _int_list(c: dict[str, Any], name: str) -> list[int]:
    """A list-of-integers field (absent or null: empty)."""
    value = c.get(name) or []
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise ConfigError(f"{name}: expected a list of integers, got {value!r}")
    return value


def _dtype(c: dict[str, Any], override: str | None) -> str:
    raw = override if override is not None else c.get("torch_dtype", c.get("dtype"))
    if raw is None:
        raise ConfigError("torch_dtype: missing from config.json (no dtype given either)")
    name = str(raw).removeprefix("torch.").lower()
    name = DTYPE_ALIASES.get(name, name)
    if name not in DTYPE_BYTES:
        raise ConfigError(f"torch_dtype: unknown dtype {raw!r}; expected one of {', '.join(DTYPE_BYTES)}")
    return name


def _architecture(c: dict[str, Any]) -> str:
    archs = c.get("architectures") or []
    return str(archs[0]) if isinstance(archs, list) and archs else ""


def _is_moe_layer(c: dict[str, Any], layer: int, num_experts: int) -> bool:
    """Whether decoder layer `layer` has a routed-expert MLP, DeepSeek and Qwen conventions."""
    if num_experts == 0:
        return False
    if layer < _int(c, "first_k_dense_replace", 0):
        return False
    if layer % _int(c, "moe_layer_freq", 1, minimum=1) != 0:
        return False
    if layer in _int_list(c, "mlp_only_layers"):
        return False
    return (layer + 1) % _int(c, "decoder_sparse_step", 1, minimum=1) == 0


# --------------------------------------------------------------------------------------------
# the derivation


def derive_shapes(config: dict[str, Any], *, role: str | None = None, dtype: str | None = None,
                  kv_cache_dtype: str = "auto") -> ModelShapes:
    """Shapes of the model a config.json describes, used as `role`.

    role: "target" (a whole causal LM); "EAGLE" (EAGLE-1/2 head: fc over [embed; hidden] and its
    decoder layer(s), sharing the target's embedding and lm_head); "EAGLE3" (fc over three target
    hidden states, one decoder layer whose attention reads [embed; hidden] (2 * H wide), its own
    lm_head over draft_vocab_size, sharing the target's embedding); "MTP" (the config's own
    `num_nextn_predict_layers`, each a decoder layer plus its input projection, sharing embedding
    and lm_head). None: "EAGLE3" when the architecture names Eagle3, else "target".
    dtype: overrides the config's torch_dtype (a draft runs in its target's dtype).
    kv_cache_dtype: one of KV_CACHE_DTYPES; "auto" stores K/V in the compute dtype.
    `config` is only read, never modified.
    """
    c = _text_config(config)
    arch = _architecture(c)
    if role is None:
        role = "EAGLE3" if "eagle3" in arch.lower() else "target"
    if role not in MODEL_ROLES:
        raise ConfigError(f"role: unknown {role!r}; expected one of {', '.join(MODEL_ROLES)}")
    model_type = str(c.get("model_type") or "")
    dtype_name = _dtype(c, dtype)
    b = DTYPE_BYTES[dtype_name]
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ConfigError(f"kv_cache_dtype: unknown {kv_cache_dtype!r}; expected one of {', '.join(KV_CACHE_DTYPES)}")
    kv_b = KV_CACHE_DTYPES[kv_cache_dtype] or b
    quantization_config = c.get("quantization_config") or {}
    if not isinstance(quantization_config, dict):
        raise ConfigError(f"quantization_config: expected an object, got {type(quantization_config).__name__}")

    hidden = _int(c, ("hidden_size", "d_model", "n_embd", "dim"), minimum=1)
    num_hidden_layers = _int(c, ("num_hidden_layers", "n_layer", "n_layers", "num_layers"), minimum=1,
                             maximum=MAX_LAYERS)
    heads = _int(c, ("num_attention_heads", "n_head", "n_heads"), minimum=1)
    kv_heads = _int(c, ("num_key_value_heads", "n_kv_heads", "num_kv_heads", "multi_query_group_num"), heads, minimum=1)
    if heads % kv_heads:
        raise ConfigError(f"num_key_value_heads: {kv_heads} does not divide num_attention_heads {heads}")
    if c.get("head_dim") is not None:
        head_dim = _int(c, "head_dim", minimum=1)
    elif hidden % heads:
        raise ConfigError(f"head_dim: missing and hidden_size {hidden} is not a multiple of num_attention_heads {heads}")
    else:
        head_dim = hidden // heads
    vocab = _int(c, ("vocab_size", "n_vocab"), minimum=1)
    draft_vocab = _int(c, "draft_vocab_size", vocab, minimum=1)
    hc_mult = _int(c, "hc_mult", 1, minimum=1)
    nextn = _int(c, "num_nextn_predict_layers", 0, maximum=MAX_LAYERS)
    tie = bool(c.get("tie_word_embeddings", False))

    num_experts = _int(c, ("n_routed_experts", "num_experts", "num_local_experts"), 0)
    if num_experts and c.get("moe_intermediate_size") is None:
        # Mixtral-style configs name the per-expert width intermediate_size; no layer is dense.
        moe_inter = _int(c, ("intermediate_size", "ffn_dim"), minimum=1)
        intermediate = 0
    else:
        moe_inter = _int(c, "moe_intermediate_size", 0)
        # All-MoE models (DeepSeek-V4) may ship no dense width; checked below against dense layers.
        intermediate = _int(c, ("intermediate_size", "ffn_dim", "n_inner"), 0 if num_experts else None, minimum=1)
    experts_per_tok = _int(c, ("num_experts_per_tok", "num_experts_per_token", "moe_topk"), 0)
    if num_experts and not experts_per_tok:
        raise ConfigError("num_experts_per_tok: missing for a mixture-of-experts model")
    n_shared = _int(c, "n_shared_experts", 0)
    shared_inter = n_shared * moe_inter if n_shared else _int(c, "shared_expert_intermediate_size", 0)

    # attention kind and its dims
    kv_lora = _int(c, "kv_lora_rank", 0)
    q_lora = _int(c, "q_lora_rank", 0)
    compressed = is_deepseek_v4(c)
    v4 = read_v4_config(c) if compressed else None
    if v4 is not None:
        attention = "compressed"
        rope_dim = v4.qk_rope_head_dim  # RoPE is inside head_dim here: the trailing rope_dim dims
        nope_dim, v_dim = head_dim - rope_dim, head_dim
    elif kv_lora:
        attention = "mla"
        rope_dim = _int(c, "qk_rope_head_dim", minimum=1)
        nope_dim = _int(c, "qk_nope_head_dim", minimum=1)
        v_dim = _int(c, "v_head_dim", nope_dim)
    else:
        attention = "gqa"
        rope_dim = nope_dim = v_dim = 0
    sliding_window = v4.sliding_window if v4 else 0
    index_head_dim = v4.index_head_dim if v4 else 0

    # Which layers this role runs: the decoder stack, a draft head's own layers, or the MTP layers
    # that follow the decoder stack (indices num_hidden_layers .. +nextn).
    if role == "MTP":
        if nextn == 0:
            raise ConfigError("num_nextn_predict_layers: 0, the model has no MTP layers to draft with")
        layer_ids = range(num_hidden_layers, num_hidden_layers + nextn)
    else:
        layer_ids = range(num_hidden_layers)
    ratios = v4.compress_ratios if v4 else ()

    dims = _Dims(
        c=c, model_type=model_type, hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
        intermediate=intermediate, attention=attention, q_lora=q_lora, kv_lora=kv_lora,
        rope_dim=rope_dim, nope_dim=nope_dim, v_dim=v_dim, index_head_dim=index_head_dim,
        num_experts=num_experts, moe_inter=moe_inter, shared_inter=shared_inter, hc_mult=hc_mult,
        ratios=ratios, v4=v4, vocab=vocab, experts_per_tok=experts_per_tok,
    )
    attn_input = 2 * hidden if role == "EAGLE3" else hidden
    layers_params = sum(_decoder_layer_params(dims, i, attn_input) for i in layer_ids)
    moe_layers = sum(_is_moe_layer(c, i, num_experts) for i in layer_ids)
    if moe_layers < len(layer_ids) and not intermediate:
        raise ConfigError("intermediate_size: missing, and the model has dense MLP layers")

    embedding = vocab * hidden
    lm_head = (draft_vocab if role == "EAGLE3" else vocab) * hidden
    hc_head = hc_mult * hc_mult * hidden + hc_mult + 1 if hc_mult > 1 else 0
    if role == "target":
        params = embedding + (0 if tie else lm_head) + layers_params + hidden + hc_head
    elif role == "EAGLE":
        fc_bias = hidden if c.get("bias", False) else 0
        params = 2 * hidden * hidden + fc_bias + layers_params
        embedding = lm_head = 0
    elif role == "EAGLE3":
        params = EAGLE3_AUX_LAYERS * hidden * hidden + layers_params + hidden + lm_head
        embedding = 0
    else:  # MTP: per layer enorm + hnorm + projection of [embed; hidden] + its head norm
        params = layers_params + len(layer_ids) * (3 * hidden + 2 * hidden * hidden + hc_head)
        embedding = lm_head = 0

    if kv_cache_dtype != "auto" and attention != "gqa":
        # the engine's e4m3 pools are the GQA slot pools; MLA latents and DeepSeek-V4's pools keep the dtype
        raise ConfigError(f"kv_cache_dtype: {kv_cache_dtype} is supported for GQA attention, not {attention}")
    kv_per_token, kv_per_request, kv_per_in_flight = _kv_cache_bytes(dims, layer_ids, kv_b, role)
    routed_experts = moe_layers * num_experts * 3 * hidden * moe_inter
    lm_head_owned = 0 if (role == "target" and tie) else lm_head
    return ModelShapes(
        model_type=model_type,
        architecture=arch,
        role=role,
        dtype=dtype_name,
        dtype_bytes=b,
        kv_cache_dtype=kv_cache_dtype,
        kv_dtype_bytes=kv_b,
        hidden_size=hidden,
        hc_mult=hc_mult,
        spec_hidden_size=hidden * hc_mult,
        num_layers=len(layer_ids),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=intermediate,
        vocab_size=vocab,
        draft_vocab_size=draft_vocab,
        tie_word_embeddings=tie,
        max_position_embeddings=_int(c, ("max_position_embeddings", "n_positions", "seq_length"), 0),
        attention=attention,
        q_lora_rank=q_lora,
        kv_lora_rank=kv_lora,
        qk_rope_head_dim=rope_dim,
        qk_nope_head_dim=nope_dim,
        v_head_dim=v_dim,
        sliding_window=sliding_window,
        compress_ratios=tuple(ratios[i] for i in layer_ids) if compressed else (),
        index_head_dim=index_head_dim,
        num_routed_experts=num_experts,
        num_experts_per_tok=experts_per_tok,
        moe_intermediate_size=moe_inter,
        num_shared_experts=n_shared,
        shared_expert_intermediate_size=shared_inter,
        num_moe_layers=moe_layers,
        num_dense_layers=len(layer_ids) - moe_layers,
        num_nextn_predict_layers=nextn,
        embedding_params=embedding,
        lm_head_params=0 if (role == "target" and tie) else lm_head,
        num_params=params,
        kv_cache_bytes_per_token=kv_per_token,
        kv_cache_bytes_per_request=kv_per_request,
        kv_cache_bytes_per_in_flight_token=kv_per_in_flight,
        quantization=str(quantization_config.get("quant_method", "")),
        quantized_weight_bytes=quantized_weight_bytes(
            c, quantization_config, params=params, embedding=embedding, lm_head=lm_head_owned,
            routed_experts=routed_experts, hidden=hidden, dtype_bytes=b,
        ),
        routed_expert_params=routed_experts,
        has_vision_tower=isinstance(config.get("vision_config"), dict),
        v4=v4,
        expert_quant=_expert_quant(c, quantization_config) if v4 is not None else "",
    )


def _expert_quant(c: dict[str, Any], q: dict[str, Any]) -> str:
    """How a DeepSeek-V4 checkpoint stores its routed experts (engine/models/deepseek_v4.py
    dequantizes them inside the expert computation)."""
    if not q:
        return ""
    if (q.get("expert_dtype") or c.get("expert_dtype")) == "fp4":
        return "fp4"
    return "fp8" if q.get("quant_method") == "fp8" else ""


# --------------------------------------------------------------------------------------------
# weight bytes a quantization_config implies (when no checkpoint header can be read)

# DeepSeek-V4's FP4 experts: two e2m1 values per byte and one E8M0 scale byte per 32 values
# along the input dimension (weight I8 [out, in / 2], scale F8_E8M0 [out, in / 32]).
FP4_GROUP = 32


def _scales(elements: int, group: int, scale_bytes: int) -> int:
    return -(-elements // group) * scale_bytes if group else 0


def quantized_weight_bytes(
    c: dict[str, Any], q: dict[str, Any], *, params: int, embedding: int, lm_head: int,
    routed_experts: int, hidden: int, dtype_bytes: int,
) -> int:
    """Bytes of a checkpoint whose linears `quantization_config` (q) quantizes, or 0.

    An estimate for when no safetensors header can be read: every parameter but the embedding
    (and lm_head, unless the method quantizes it) is counted as a quantized linear, so the
    norms and routers that really stay in 16/32 bits are counted at the quantized width (well
    under 0.1% of a large model). Scales are counted per matrix group as if each linear were one
    matrix (ceil per matrix ignored). Known methods:
      fp8 (DeepSeek, Qwen3-FP8): e4m3 bytes + one scale per weight_block_size block (float32;
          1 byte with scale_fmt ue8m0) or per tensor; expert_dtype "fp4": routed experts at
          half a byte + one E8M0 per 32
      compressed-tensors: num_bits per weight + bf16 scales by strategy (tensor, channel, group,
          block); lm_head stays unquantized when listed in `ignore`
      fbgemm_fp8: e4m3 bytes + one float32 scale per output row
    """
    method = str(q.get("quant_method", ""))
    kept = embedding
    linear = params - embedding
    if method == "fp8":
        linear -= lm_head
        kept += lm_head
        scale_bytes = 1 if q.get("scale_fmt") == "ue8m0" else 4
        block = q.get("weight_block_size")
        group = int(block[0]) * int(block[1]) if isinstance(block, list) and len(block) == 2 else 0
        fp4 = (q.get("expert_dtype") or c.get("expert_dtype")) == "fp4"
        fp8 = linear - (routed_experts if fp4 else 0)
        total = fp8 + _scales(fp8, group, scale_bytes)
        if fp4:
            total += routed_experts // 2 + _scales(routed_experts, FP4_GROUP, 1)
        return total + kept * dtype_bytes
    if method == "fbgemm_fp8":
        linear -= lm_head
        kept += lm_head
        return linear + _scales(linear, hidden, 4) + kept * dtype_bytes
    if method == "compressed-tensors":
        groups = [g for g in (q.get("config_groups") or {}).values() if isinstance(g, dict) and g.get("weights")]
        if not groups:
            return 0
        weights = groups[0]["weights"]
        bits = int(weights.get("num_bits") or 0)
        if not bits:
            return 0
        if any(str(name).endswith("lm_head") for name in q.get("ignore") or []):
            linear -= lm_head
            kept += lm_head
        strategy = weights.get("strategy") or "tensor"
        if strategy == "channel":
            group = hidden  # one scale per output row: rows ~ elements / input width
        elif strategy == "group":
            group = int(weights.get("group_size") or 128)
        elif strategy == "block":
            block = weights.get("block_structure") or [128, 128]
            group = int(block[0]) * int(block[1])
        else:
            group = 0
        scales = _scales(linear, group, dtype_bytes)
        if weights.get("symmetric") is False:
            scales *= 2  # a zero point beside every scale
        return -(-linear * bits // 8) + scales + kept * dtype_bytes
    return 0


def derive_draft_shapes(
    algorithm: str, target_config: dict[str, Any], draft_config: dict[str, Any] | None, *, dtype: str,
    kv_cache_dtype: str = "auto",
) -> ModelShapes | None:
    """The draft's shapes for `algorithm`, run in the target's `dtype` (and its KV cache dtype).

    EAGLE / EAGLE3 need the head's own config; MTP uses the draft config when one is given (a
    separate NextN checkpoint) and otherwise the target's own `num_nextn_predict_layers`.
    """
    if algorithm == "NONE":
        return None
    if algorithm in ("EAGLE", "EAGLE3"):
        if draft_config is None:
            raise ConfigError(f"draft: {algorithm} needs the draft head's config.json")
        return derive_shapes(draft_config, role=algorithm, dtype=dtype, kv_cache_dtype=kv_cache_dtype)
    if algorithm == "MTP":
        return derive_shapes(draft_config if draft_config is not None else target_config, role="MTP", dtype=dtype,
                             kv_cache_dtype=kv_cache_dtype)
    raise ConfigError(f"algorithm: unknown {algorithm!r}; expected one of {', '.join(ALGORITHMS)}")


@dataclass(frozen=True)
class _Dims:
    c: dict[str, Any]
    model_type: str
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    attention: str
    q_lora: int
    kv_lora: int
    rope_dim: int
    nope_dim: int
    v_dim: int
    index_head_dim: int
    num_experts: int
    moe_inter: int
    shared_inter: int
    hc_mult: int
    ratios: tuple[int, ...]
    v4: V4Config | None = None
    vocab: int = 0
    experts_per_tok: int = 0


def _attention_params(d: _Dims, layer: int, attn_input: int) -> int:
    """Attention weights of one layer; `attn_input` is the width q/k/v read (2H for EAGLE-3)."""
    h, nh = d.hidden, d.heads
    if d.attention == "gqa":
        params = attn_input * nh * d.head_dim + 2 * attn_input * d.kv_heads * d.head_dim + nh * d.head_dim * h
        if d.model_type in QKV_BIAS_MODEL_TYPES or d.c.get("attention_bias"):
            params += nh * d.head_dim + 2 * d.kv_heads * d.head_dim
        if d.model_type in QK_NORM_MODEL_TYPES:
            params += 2 * d.head_dim
        return params
    if d.attention == "mla":
        qk_dim = d.nope_dim + d.rope_dim
        q = h * d.q_lora + d.q_lora + d.q_lora * nh * qk_dim if d.q_lora else h * nh * qk_dim
        kv = h * (d.kv_lora + d.rope_dim) + d.kv_lora + d.kv_lora * nh * (d.nope_dim + d.v_dim)
        return q + kv + nh * d.v_dim * h
    # compressed (DeepSeek-V4): low-rank q, one shared K=V head, grouped low-rank output, sinks
    assert d.v4 is not None, "compressed attention is read with its DeepSeek-V4 schedule"
    hd = d.head_dim
    o_groups = _int(d.c, "o_groups", 1, minimum=1)
    o_lora = _int(d.c, "o_lora_rank", 1, minimum=1)
    params = h * d.q_lora + d.q_lora + d.q_lora * nh * hd + h * hd + hd
    params += nh * hd * o_lora + o_groups * o_lora * h + nh
    ratio = d.ratios[layer]
    if d.v4.attention_kinds[layer] == CSA:
        # CSA compressor: overlapping windows, so kv/gate project to 2 * head_dim; plus the indexer
        ihd = d.index_head_dim
        index_heads = _int(d.c, "index_n_heads", 1, minimum=1)
        params += 2 * h * 2 * hd + ratio * 2 * hd + hd
        params += 2 * h * 2 * ihd + ratio * 2 * ihd + ihd + d.q_lora * index_heads * ihd + h * index_heads
    elif ratio > 0:
        params += 2 * h * hd + ratio * hd + hd  # HCA compressor: kv, gate, position bias, norm
    return params


def _mlp_params(d: _Dims, layer: int) -> int:
    h = d.hidden
    if not _is_moe_layer(d.c, layer, d.num_experts):
        return 3 * h * d.intermediate  # gated MLP: gate, up, down
    params = d.num_experts * 3 * h * d.moe_inter + d.num_experts * h  # experts + router
    if d.v4 is not None:
        # V4: hash-routed layers look their experts up per token id (tid2eid); the others carry
        # the noaux_tc score-correction bias
        params += d.vocab * d.experts_per_tok if d.v4.mlp_kinds[layer] == HASH_MOE else d.num_experts
    if d.shared_inter:
        params += 3 * h * d.shared_inter
        if d.c.get("shared_expert_intermediate_size"):
            params += h  # Qwen2-MoE's sigmoid gate on the shared expert
    return params


def _decoder_layer_params(d: _Dims, layer: int, attn_input: int) -> int:
    params = _attention_params(d, layer, attn_input) + _mlp_params(d, layer)
    params += 2 * d.hidden if attn_input == d.hidden else 3 * d.hidden  # norms (EAGLE-3 adds hidden_norm)
    if d.hc_mult > 1:
        # two hyper-connections (attention, MLP): pre (n) + post (n) + comb (n*n) mixing weights
        # projected from the n * H stream, with their bias and three scales
        mix = (2 + d.hc_mult) * d.hc_mult
        params += 2 * (mix * d.hc_mult * d.hidden + mix + 3)
    return params


def _kv_cache_bytes(d: _Dims, layer_ids: range, dtype_bytes: int, role: str) -> tuple[int, int, int]:
    """(bytes per token, per request, per in-flight token) of the KV cache of `layer_ids`, before TP."""
    n = len(layer_ids)
    if d.attention == "gqa":
        return 2 * n * d.kv_heads * d.head_dim * dtype_bytes, 0, 0
    if d.attention == "mla":
        return n * (d.kv_lora + d.rope_dim) * dtype_bytes, 0, 0
    assert d.v4 is not None, "compressed attention is read with its DeepSeek-V4 schedule"
    kv = v4_kv_bytes(d.v4, "MTP" if role == "MTP" else "target", dtype_bytes)
    return kv.per_token, kv.per_request, kv.per_in_flight_token


def shapes_to_dict(shapes: ModelShapes) -> dict[str, Any]:
    """JSON-ready dict of every field (tuples as lists)."""
    out = dataclasses.asdict(shapes)
    out["compress_ratios"] = list(shapes.compress_ratios)
    return out

