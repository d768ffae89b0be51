"""Tiny random DeepSeek-V4 models for the CPU tests: configs in both naming schemes, a
transformers reference with every parameter random (sinks, position biases, score-correction
bias and hash table included), and its weights in the engine."""

from __future__ import annotations

import copy

import torch

from specdeploy.engine.models.deepseek_v4 import V4ModelConfig, build_target, canonical_v4_key
from specdeploy.engine.models.layers import load_state

# Newer scheme (layer_types + compress_rates): short ratios so a few dozen tokens close windows
# of every kind; index_topk below the number of CSA entries so the indexer's choice matters.
TINY = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "vocab_size": 96,
    "hidden_size": 32,
    "moe_intermediate_size": 24,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "qk_rope_head_dim": 8,
    "q_lora_rank": 24,
    "o_groups": 2,
    "o_lora_rank": 12,
    "num_experts_per_tok": 2,
    "n_routed_experts": 5,
    "n_shared_experts": 1,
    "scoring_func": "sqrtsoftplus",
    "routed_scaling_factor": 1.5,
    "norm_topk_prob": True,
    "topk_method": "noaux_tc",
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "rope_scaling": {"type": "yarn", "factor": 4, "original_max_position_embeddings": 32,
                     "beta_fast": 32, "beta_slow": 1},
    "layer_types": ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                    "compressed_sparse_attention"],
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
    "mlp_layer_types": ["hash_moe", "moe", "moe", "moe"],
    "hc_mult": 4,
    "hc_sinkhorn_iters": 6,
    "hc_eps": 1e-6,
    "swiglu_limit": 1.0,
    "sliding_window": 6,
    "index_n_heads": 2,
    "index_head_dim": 8,
    "index_topk": 3,
    "num_nextn_predict_layers": 1,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}


def original_scheme(config: dict) -> dict:
    """The same model named as the published checkpoint does (compress_ratios incl. the MTP
    layer, num_hash_layers, rope_scaling); needs ratios 4 / 128."""
    c = copy.deepcopy(config)
    kinds = {"sliding_attention": 0, "compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
    c["compress_ratios"] = [kinds[t] for t in c.pop("layer_types")] + [0]
    c.pop("compress_rates")
    c["num_hash_layers"] = c.pop("mlp_layer_types").count("hash_moe")
    return c


def hf_model(config: dict, seed: int = 0):
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    cfg = DeepseekV4Config(**{k: v for k, v in config.items() if k not in ("architectures", "torch_dtype")})
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(cfg).float().eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "layernorm.weight")):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith("scale"):
                p.copy_(0.5 + torch.rand(p.shape, generator=g))
            else:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
        for name, buf in model.named_buffers():
            if name.endswith("tid2eid"):
                buf.copy_(torch.stack([torch.randperm(cfg.n_routed_experts, generator=g)[:cfg.num_experts_per_tok]
                                       for _ in range(cfg.vocab_size)]))
            elif name.endswith("e_score_correction_bias"):
                buf.copy_(0.2 * torch.randn(buf.shape, generator=g))
    return model


def engine_model(config: dict, hf, dtype=torch.float32, feature_kind=None):
    cfg = V4ModelConfig.from_hf(config)
    model = build_target(cfg, dtype, "cpu", feature_kind)
    state = hf.state_dict()
    load_state(model, ((canonical_v4_key(k), v) for k, v in state.items()))
    return model


class _TopK(tuple):
    @property
    def values(self):
        return self[0]

    @property
    def indices(self):
        return self[1]


def _stable_topk(self, k, dim=-1, largest=True, sorted=True):
    values, indices = self.sort(dim=dim, descending=largest, stable=True)
    return _TopK((values.narrow(dim, 0, k), indices.narrow(dim, 0, k)))


class stable_indexer_ties:
    """Within the block, Tensor.topk (the Lightning Indexer's selection in transformers) breaks
    exact ties toward the lower entry index, as the engine does; torch leaves the order of equal
    scores unspecified (CPU topk's choice depends on the tensor's length, and ReLU makes exact
    zero scores common in tiny models)."""

    def __enter__(self):
        self._saved = torch.Tensor.topk
        torch.Tensor.topk = _stable_topk

    def __exit__(self, *exc):
        torch.Tensor.topk = self._saved


def random_mtp(target, seed: int = 3):
    """The target's MTP layer (mtp.0) with random weights."""
    from specdeploy.engine.models.deepseek_v4 import build_mtp

    head = build_mtp(target, torch.float32, "cpu")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name.endswith("weight") and "norm" in name:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith("scale"):
                p.copy_(0.5 + torch.rand(p.shape, generator=g))
            else:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
        for name, buf in head.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(0.2 * torch.randn(buf.shape, generator=g))
    return head


# A small vocabulary, so that even a random MTP layer guesses the target's token often enough
# for accepted drafts (and their committed tree slots and closed windows) to be exercised.
SMALL_VOCAB = 12


def target_and_mtp(config: dict):
    """The engine's target for `config` (weights from transformers' model) and a random MTP layer."""
    target = engine_model(config, hf_model(config))
    return target, random_mtp(target)


# transformers name (without `model.`) -> published name, applied in order
TO_PUBLISHED = (
    ("self_attn.compressor.indexer.scorer.weights_proj", "attn.indexer.weights_proj"),
    ("self_attn.compressor.indexer.q_b_proj", "attn.indexer.wq_b"),
    ("self_attn.compressor.indexer.", "attn.indexer.compressor."),
    ("self_attn.", "attn."),
    ("mlp.shared_experts.gate_proj", "ffn.shared_experts.w1"),
    ("mlp.shared_experts.up_proj", "ffn.shared_experts.w3"),
    ("mlp.shared_experts.down_proj", "ffn.shared_experts.w2"),
    ("mlp.gate.e_score_correction_bias", "ffn.gate.bias"),
    ("mlp.", "ffn."),
    ("input_layernorm", "attn_norm"),
    ("post_attention_layernorm", "ffn_norm"),
    ("attn_hc.", "hc_attn_"),
    ("ffn_hc.", "hc_ffn_"),
    ("hc_head.hc_", "hc_head_"),
    ("hc_head.", "hc_head_"),
    ("compressor.kv_proj", "compressor.wkv"),
    ("compressor.gate_proj", "compressor.wgate"),
    ("compressor.position_bias", "compressor.ape"),
    ("compressor.kv_norm", "compressor.norm"),
    ("attn.q_a_proj", "attn.wq_a"),
    ("attn.q_a_norm", "attn.q_norm"),
    ("attn.q_b_proj", "attn.wq_b"),
    ("attn.kv_proj", "attn.wkv"),
    ("attn.o_a_proj", "attn.wo_a"),
    ("attn.o_b_proj", "attn.wo_b"),
    ("attn.sinks", "attn.attn_sink"),
)


def published(name: str) -> str:
    """A transformers-layout tensor name -> the published checkpoint's (the inverse of the
    engine's loader map, written out independently)."""
    name = name.removeprefix("model.")
    if name == "embed_tokens.weight":
        return "embed.weight"
    if name == "lm_head.weight":
        return "head.weight"
    for a, b in TO_PUBLISHED:
        name = name.replace(a, b)
    return name


def save_published(root, config: dict, hf, mtp) -> None:
    """`root` as a published DeepSeek-V4 directory (unquantized): config.json, one safetensors
    file with the original tensor names, routed experts per expert, the MTP layer under mtp.0.*."""
    import json

    from safetensors.torch import save_file

    i = config["moe_intermediate_size"]
    tensors = {published(k): v.contiguous() for k, v in hf.state_dict().items()}
    tensors.update({"mtp.0." + published(k.removeprefix("layers.0.")): v.contiguous()
                    for k, v in mtp.state_dict().items() if not k.startswith("layers.0.mlp.experts.")})
    stacked = {"mtp.0.ffn.experts.": (mtp.layers[0].mlp.experts.gate_up_proj, mtp.layers[0].mlp.experts.down_proj)}
    for name in [n for n in tensors if n.endswith("ffn.experts.gate_up_proj")]:
        stacked[name.removesuffix("gate_up_proj")] = (tensors.pop(name), tensors.pop(name.replace("gate_up_proj", "down_proj")))
    for base, (gate_up, down) in stacked.items():
        for e in range(gate_up.shape[0]):
            tensors[f"{base}{e}.w1.weight"] = gate_up[e, :i].contiguous()
            tensors[f"{base}{e}.w3.weight"] = gate_up[e, i:].contiguous()
            tensors[f"{base}{e}.w2.weight"] = down[e].contiguous()
    root.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(root / "model.safetensors"))
    (root / "config.json").write_text(json.dumps(config))
