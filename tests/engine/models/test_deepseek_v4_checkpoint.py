"""A DeepSeek-V4 checkpoint as published (original tensor names, FP8 block linears with their
`.scale`, FP4 routed experts, the MTP layer under mtp.0.*, sharded safetensors with an index)
loads into the engine and computes what its dequantized twin computes."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors.torch import save_file

from specdeploy.engine.models import deepseek_v4 as v4mod
from specdeploy.engine.models.attention import causal_batch
from specdeploy.engine.models.deepseek_v4_checkpoint import engine_name, load_v4_mtp, load_v4_target, mtp_engine_name
from specdeploy.engine.models.fp8 import E2M1_VALUES, dequantize_fp4, dequantize_fp8, quantize_fp8_block
from specdeploy.engine.memory.kv import SlotTable

from v4_tiny import TINY, engine_model, hf_model, published, random_mtp

pytest.importorskip("transformers.models.deepseek_v4")

BLOCK = (16, 16)
CONFIG = {**copy.deepcopy(TINY), "moe_intermediate_size": 32, "expert_dtype": "fp4",
          "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": list(BLOCK)}}
UNQUANTIZED = {k: v for k, v in CONFIG.items() if k not in ("quantization_config", "expert_dtype")}
FP8_LINEARS = ("attn.wq_a.", "attn.wq_b.", "attn.wkv.", "attn.wo_a.", "attn.wo_b.", "indexer.wq_b.",
               "shared_experts.w1.", "shared_experts.w2.", "shared_experts.w3.", "e_proj.", "h_proj.")


def quantize_fp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (e2m1 pairs int8 [N, K / 2], E8M0 scale bits uint8 [N, K / 32])."""
    n, k = w.shape
    groups = w.float().view(n, k // 32, 32)
    exp = torch.ceil(torch.log2(groups.abs().amax(-1).clamp(min=1e-30) / 6.0))
    q = groups / torch.exp2(exp)[..., None]
    table = torch.tensor(E2M1_VALUES)
    codes = (q.reshape(n, k)[..., None] - table).abs().argmin(-1).to(torch.uint8)   # nearest value
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed.view(torch.int8), (exp + 127).to(torch.uint8)


def write_published(tmp_path, hf, mtp) -> tuple[dict, dict]:
    """The published checkpoint of `hf` + `mtp` in tmp_path; -> (its tensors, the dequantized
    twin's transformers-named state)."""
    out, twin = {}, {}
    state = {k.removeprefix("model."): v for k, v in hf.state_dict().items()}
    i = CONFIG["moe_intermediate_size"]
    for name, t in state.items():
        if name.endswith("mlp.experts.gate_up_proj") or name.endswith("mlp.experts.down_proj"):
            continue
        pub = published(name)
        if pub.endswith(".weight") and any(p in pub for p in FP8_LINEARS):
            codes, scale = quantize_fp8_block(t, BLOCK)
            out[pub], out[pub[:-len("weight")] + "scale"] = codes, scale
            twin[name] = dequantize_fp8(codes, scale, BLOCK, torch.float32)
        else:
            out[pub] = t.contiguous()
            twin[name] = t
    for layer in range(CONFIG["num_hidden_layers"]):
        gate_up, down = state[f"layers.{layer}.mlp.experts.gate_up_proj"], state[f"layers.{layer}.mlp.experts.down_proj"]
        deq_gu, deq_down = [], []
        for e in range(gate_up.shape[0]):
            parts = {"w1": gate_up[e, :i], "w3": gate_up[e, i:], "w2": down[e]}
            deq = {}
            for proj, w in parts.items():
                codes, scale = quantize_fp4(w)
                out[f"layers.{layer}.ffn.experts.{e}.{proj}.weight"] = codes
                out[f"layers.{layer}.ffn.experts.{e}.{proj}.scale"] = scale
                deq[proj] = dequantize_fp4(codes, scale, dtype=torch.float32)
            deq_gu.append(torch.cat([deq["w1"], deq["w3"]]))
            deq_down.append(deq["w2"])
        twin[f"layers.{layer}.mlp.experts.gate_up_proj"] = torch.stack(deq_gu)
        twin[f"layers.{layer}.mlp.experts.down_proj"] = torch.stack(deq_down)
    # the MTP layer: its block's parameters straight under mtp.0., its own norms / projections
    mtp_twin = {}
    for name, t in mtp.state_dict().items():
        if name.startswith("layers.0.mlp.experts."):
            continue
        pub = "mtp.0." + published(name.removeprefix("layers.0."))
        if pub.endswith(".weight") and any(p in pub for p in FP8_LINEARS):
            codes, scale = quantize_fp8_block(t, BLOCK)
            out[pub], out[pub[:-len("weight")] + "scale"] = codes, scale
            mtp_twin[name] = dequantize_fp8(codes, scale, BLOCK, torch.float32)
        else:
            out[pub] = t.contiguous()
            mtp_twin[name] = t
    experts = mtp.layers[0].mlp.experts
    deq_gu, deq_down = [], []
    for e in range(experts.gate_up_proj.shape[0]):
        deq = {}
        for proj, w in {"w1": experts.gate_up_proj[e, :i], "w3": experts.gate_up_proj[e, i:],
                        "w2": experts.down_proj[e]}.items():
            codes, scale = quantize_fp4(w)
            out[f"mtp.0.ffn.experts.{e}.{proj}.weight"], out[f"mtp.0.ffn.experts.{e}.{proj}.scale"] = codes, scale
            deq[proj] = dequantize_fp4(codes, scale, dtype=torch.float32)
        deq_gu.append(torch.cat([deq["w1"], deq["w3"]]))
        deq_down.append(deq["w2"])
    mtp_twin["layers.0.mlp.experts.gate_up_proj"] = torch.stack(deq_gu)
    mtp_twin["layers.0.mlp.experts.down_proj"] = torch.stack(deq_down)
    out["mtp.0.emb.weight"] = state["embed_tokens.weight"]  # a shared copy some exports carry

    names = sorted(out)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in shards.items():
        save_file({k: out[k].contiguous() for k in keys}, str(tmp_path / file))
    index = {"metadata": {}, "weight_map": {k: f for f, ks in shards.items() for k in ks}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    return twin, mtp_twin


def forward_logits(model, ids):
    n = ids.shape[1]
    table = SlotTable(n + 4, 1, n + 4, "cpu")
    kv = model.make_kv(n + 4, n + 3, 1, n + 4, torch.float32, "cpu")
    table.listeners.append(kv)
    slots = table.alloc(n)[None]
    batch = causal_batch(slots, torch.tensor([n]), torch.zeros(1, 0, dtype=torch.int64), torch.tensor([0]))
    with torch.no_grad():
        out = model(ids, torch.arange(n)[None], batch, kv)
    return model.logits(out.hidden)[0], out.feature, (slots, batch, kv)


def test_published_names_map_to_the_engine():
    assert engine_name("embed.weight") == "embed_tokens.weight"
    assert engine_name("hc_head_fn") == "hc_head.fn"
    assert engine_name("layers.3.attn.indexer.compressor.ape") == "layers.3.self_attn.compressor.indexer.position_bias"
    assert (engine_name("layers.3.attn.indexer.weights_proj.weight")
            == "layers.3.self_attn.compressor.indexer.scorer.weights_proj.weight")
    assert engine_name("layers.0.attn.wq_b.scale") == "layers.0.self_attn.q_b_proj.weight_scale_inv"
    assert engine_name("layers.0.hc_attn_scale") == "layers.0.attn_hc.scale"
    assert engine_name("layers.0.ffn.gate.bias") == "layers.0.mlp.gate.e_score_correction_bias"
    assert engine_name("model.layers.0.attn_hc.scale") == "layers.0.attn_hc.scale"  # transformers' own
    assert mtp_engine_name("mtp.0.hc_head_base") == "hc_head.base"
    assert mtp_engine_name("mtp.0.attn.wkv.weight") == "layers.0.self_attn.kv_proj.weight"
    assert mtp_engine_name("mtp.0.emb.weight") is None and mtp_engine_name("layers.0.attn.wkv.weight") is None


def test_fp8_fp4_published_checkpoint_computes_its_dequantized_twin(tmp_path):
    hf = hf_model(UNQUANTIZED)
    twin_target = engine_model(UNQUANTIZED, hf)
    twin_mtp = random_mtp(twin_target)
    twin_state, mtp_state = write_published(tmp_path, hf, twin_mtp)
    # the twins hold exactly the dequantized values
    from specdeploy.engine.models.layers import load_state
    from specdeploy.engine.models.deepseek_v4 import canonical_v4_key
    load_state(twin_target, ((canonical_v4_key(k), v) for k, v in twin_state.items()))
    load_state(twin_mtp, ((canonical_v4_key(k), v) for k, v in mtp_state.items()))

    target = load_v4_target(str(tmp_path), torch.float32, "cpu", feature_kind="mtp")
    twin_target.set_feature("mtp")
    assert target.layers[0].self_attn.q_a_proj.weight.dtype == torch.float8_e4m3fn  # FP8 kept as codes
    assert target.layers[0].self_attn.compressor is None
    assert target.layers[1].self_attn.compressor.kv_proj.weight.dtype == torch.float32  # shipped unquantized
    experts = target.layers[1].mlp.experts  # FP4 kept as stored: e2m1 pairs + E8M0 bits
    assert (experts.gate_up_proj.dtype, experts.gate_up_proj_scale.dtype) == (torch.int8, torch.uint8)
    assert experts.gate_up_proj.shape[-1] == CONFIG["hidden_size"] // 2
    ids = torch.randint(0, CONFIG["vocab_size"], (1, 19), generator=torch.Generator().manual_seed(2))
    got, feature, _ = forward_logits(target, ids)
    want, want_feature, _ = forward_logits(twin_target, ids)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # the CUDA paths: the experts' codes dequantized a chunk at a time before each grouped GEMM
    # (in a capture, and eagerly for long chunks), and a row's expert gathered (decode)
    for path in ("grouped", "chunked", "gathered"):
        v4mod.EXPERT_PATH = path
        try:
            other, _, _ = forward_logits(target, ids)
        finally:
            v4mod.EXPERT_PATH = None
        torch.testing.assert_close(other, want, atol=1e-5, rtol=1e-5)

    mtp = load_v4_mtp(str(tmp_path), target, torch.float32, "cpu")
    shifted = torch.roll(ids, -1, 1)
    outs = []
    for head, _tgt, feat in ((mtp, target, feature), (twin_mtp, twin_target, want_feature)):
        n = ids.shape[1]
        table = SlotTable(n + 4, 1, n + 4, "cpu")
        kv = head.make_kv(n + 4, n + 3, 1, n + 4, torch.float32, "cpu")
        table.listeners.append(kv)
        slots = table.alloc(n)[None]
        batch = causal_batch(slots, torch.tensor([n]), torch.zeros(1, 0, dtype=torch.int64), torch.tensor([0]))
        with torch.no_grad():
            outs.append(head.logits(head(shifted, feat, torch.arange(n)[None], batch, kv)))
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)
