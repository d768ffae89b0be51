"""engine/models/hc.py against transformers' DeepSeek-V4 modules on tiny configs.

The references are the real `DeepseekV4HyperConnection`, `DeepseekV4HyperHead` and
`DeepseekV4Model` (its own forward: stream expansion, per-layer mixing, head, final norm), with
DeepSeek-V4's attention and MoE swapped for a small SwiGLU MLP, which is out of scope here.

Tolerances: float32 1e-5 (both sides compute the mixing in float32; only summation order differs).
bfloat16 atol = rtol = 2e-2 on outputs of unit scale (a bf16 ulp at 1.0 is 0.0078; the largest
difference seen is 0.0195): transformers rounds post/comb to bfloat16 before mixing the streams,
while DeepSeek-V4's inference code (and this engine) mixes in float32 and rounds once
(`test_bfloat16_expand_rounds_once`).
"""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn
from transformers.conversion_mapping import get_checkpoint_conversion_mapping
from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as dsv4
from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config

from specdeploy.engine.models.hc import (
    HCConfig,
    HyperConnection,
    HyperHead,
    PlainResidual,
    canonical_hc_key,
    canonical_hc_state_dict,
    expand_embeddings,
    flatten_streams,
    hc_collapse,
    hc_expand,
    make_residual,
    sinkhorn,
    unflatten_streams,
)

HIDDEN = 16
VOCAB = 64
NUM_LAYERS = 2
FP32_TOL = 1e-5
BF16_TOL = 2e-2


def tiny_config(hc_mult: int = 4, sinkhorn_iters: int = 20) -> DeepseekV4Config:
    return DeepseekV4Config(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=2,
        head_dim=8,
        q_lora_rank=8,
        o_groups=2,
        o_lora_rank=8,
        moe_intermediate_size=8,
        n_routed_experts=4,
        num_experts_per_tok=2,
        index_n_heads=2,
        index_head_dim=8,
        index_topk=4,
        sliding_window=8,
        layer_types=["sliding_attention"] * NUM_LAYERS,
        mlp_layer_types=["moe"] * NUM_LAYERS,
        hc_mult=hc_mult,
        hc_sinkhorn_iters=sinkhorn_iters,
        use_cache=False,
    )


def hc_config(config: DeepseekV4Config) -> HCConfig:
    return HCConfig.from_hf_config(config.to_dict())


def randomize_mixing_(module: nn.Module, generator: torch.Generator) -> None:
    """Non-trivial mixing weights (the reference init is near-uniform): mixes of unit scale,
    biases and scales far from 0 / 1 so that pre, post and comb differ per token and stream."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("fn"):
                p.copy_(torch.randn(p.shape, generator=generator) / p.shape[-1] ** 0.5)
            elif name.endswith("base"):
                p.copy_(torch.randn(p.shape, generator=generator))
            elif name.endswith("scale"):
                p.copy_(0.5 + 1.5 * torch.rand(p.shape, generator=generator))


def random_streams(shape: tuple[int, ...], seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def reference_pre(streams: torch.Tensor, collapsed: torch.Tensor) -> torch.Tensor:
    """transformers consumes `pre` inside the module; recover it from collapsed = Σ_i pre_i S_i.

    streams [T, hc, H] has full row rank (H > hc), so the least-squares solution is exact."""
    return torch.linalg.lstsq(streams.transpose(-1, -2), collapsed.unsqueeze(-1)).solution.squeeze(-1)


class SwiGLU(nn.Module):
    """Stand-in sublayer: DeepSeek-V4's attention and MoE are not part of the mHC residual."""

    def __init__(self, generator: torch.Generator) -> None:
        super().__init__()
        self.gate_up = nn.Linear(HIDDEN, 2 * 32, bias=False)
        self.down = nn.Linear(32, HIDDEN, bias=False)
        with torch.no_grad():
            for linear in (self.gate_up, self.down):
                fan_in = linear.weight.shape[1]
                linear.weight.copy_(torch.randn(linear.weight.shape, generator=generator) / fan_in**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(nn.functional.silu(gate) * up)


class AttentionStub(nn.Module):
    """Has DeepseekV4Attention's call signature: (hidden, **kwargs) -> (output, weights)."""

    def __init__(self, generator: torch.Generator) -> None:
        super().__init__()
        self.mlp = SwiGLU(generator)

    def forward(self, hidden_states: torch.Tensor, **kwargs) -> tuple[torch.Tensor, None]:
        return self.mlp(hidden_states), None


class MoEStub(nn.Module):
    """Has DeepseekV4SparseMoeBlock's call signature: (hidden, input_ids=...) -> output."""

    def __init__(self, generator: torch.Generator) -> None:
        super().__init__()
        self.mlp = SwiGLU(generator)

    def forward(self, hidden_states: torch.Tensor, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        return self.mlp(hidden_states)


def reference_model(config: DeepseekV4Config, dtype: torch.dtype, seed: int = 0) -> dsv4.DeepseekV4Model:
    """A real DeepseekV4Model with simple sublayers, cast the way checkpoints load it: every
    module in `_keep_in_fp32_modules_strict` (mixing weights, norms) stays float32."""
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = dsv4.DeepseekV4Model(config).eval()
    randomize_mixing_(model, generator)
    with torch.no_grad():
        model.embed_tokens.weight.copy_(torch.randn(model.embed_tokens.weight.shape, generator=generator))
        for layer in model.layers:
            layer.self_attn = AttentionStub(generator)
            layer.mlp = MoEStub(generator)
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight.copy_(1 + 0.1 * torch.randn(HIDDEN, generator=generator))
    keep_fp32 = set(dsv4.DeepseekV4PreTrainedModel._keep_in_fp32_modules_strict)
    for name, param in model.named_parameters():
        if not keep_fp32.intersection(name.split(".")):
            param.data = param.data.to(dtype)
    return model


class OurStack(nn.Module):
    """The mHC parts of a model laid out as the engine's blocks name them."""

    def __init__(self, cfg: HCConfig, num_layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.ModuleDict({"attn_hc": HyperConnection(cfg), "ffn_hc": HyperConnection(cfg)})
            for _ in range(num_layers)
        )
        self.hc_head = HyperHead(cfg)

    def load_hc(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Strict load of exactly our parameters from a checkpoint in either layout."""
        canonical = canonical_hc_state_dict(state_dict)
        ours = self.state_dict().keys()
        self.load_state_dict({k: v for k, v in canonical.items() if k in ours}, strict=True)


def our_forward(stack: OurStack, ref: dsv4.DeepseekV4Model, input_ids: torch.Tensor) -> torch.Tensor:
    """input_ids [T] -> final hidden [T, H], the engine's flow, borrowing the reference's
    embedding, norms and stand-in sublayers (they are not under test)."""
    streams = expand_embeddings(ref.embed_tokens(input_ids), stack.hc_head.fn.shape[0])  # [T, hc, H]
    for ours, theirs in zip(stack.layers, ref.layers):
        streams = ours["attn_hc"](streams, lambda x: theirs.self_attn(theirs.input_layernorm(x))[0])
        streams = ours["ffn_hc"](streams, lambda x: theirs.mlp(theirs.post_attention_layernorm(x)))
    return ref.norm(stack.hc_head(streams))


def loaded_stack(ref: dsv4.DeepseekV4Model, config: DeepseekV4Config) -> OurStack:
    stack = OurStack(hc_config(config), NUM_LAYERS)
    stack.load_hc(ref.state_dict())
    return stack


# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("hc_mult", "sinkhorn_iters"), [(4, 20), (2, 3), (4, 1), (1, 20)])
def test_mixing_weights_match_reference(hc_mult: int, sinkhorn_iters: int) -> None:
    config = tiny_config(hc_mult, sinkhorn_iters)
    reference = dsv4.DeepseekV4HyperConnection(config)
    randomize_mixing_(reference, torch.Generator().manual_seed(1))
    ours = HyperConnection(hc_config(config))
    ours.load_state_dict(reference.state_dict())  # transformers' names are ours
    streams = random_streams((1, 7, hc_mult, HIDDEN), seed=2)  # the reference needs [B, S, hc, H]

    with torch.no_grad():
        ref_post, ref_comb, ref_collapsed = reference(streams)
        pre, post, comb = ours.mixing_weights(streams[0])
        collapsed = hc_collapse(streams[0], pre)

    assert pre.dtype == post.dtype == comb.dtype == torch.float32
    assert (pre.shape, post.shape, comb.shape) == ((7, hc_mult), (7, hc_mult), (7, hc_mult, hc_mult))
    torch.testing.assert_close(post, ref_post[0], atol=FP32_TOL, rtol=FP32_TOL)
    torch.testing.assert_close(comb, ref_comb[0], atol=FP32_TOL, rtol=FP32_TOL)
    torch.testing.assert_close(collapsed, ref_collapsed[0], atol=FP32_TOL, rtol=FP32_TOL)
    torch.testing.assert_close(pre, reference_pre(streams[0], ref_collapsed[0]), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_head_matches_reference(dtype: torch.dtype) -> None:
    config = tiny_config()
    reference = dsv4.DeepseekV4HyperHead(config)
    randomize_mixing_(reference, torch.Generator().manual_seed(3))
    ours = HyperHead(hc_config(config))
    # transformers names the head's parameters hc_fn / hc_base / hc_scale; the name map strips that.
    renamed = {canonical_hc_key(f"hc_head.{k}"): v for k, v in reference.state_dict().items()}
    ours.load_state_dict({k.removeprefix("hc_head."): v for k, v in renamed.items()})
    streams = random_streams((1, 5, 4, HIDDEN), seed=4, dtype=dtype)

    with torch.no_grad():
        expected = reference(streams)[0]
        got = ours(streams[0])

    assert got.shape == (5, HIDDEN) and got.dtype == dtype
    # Same casting on both sides (float32 weights, one cast at the end): tight in both dtypes.
    torch.testing.assert_close(got, expected, atol=FP32_TOL, rtol=FP32_TOL)


def test_decoder_layer_flow_matches_reference() -> None:
    """One real DeepseekV4DecoderLayer (sublayers stubbed) against the two-line block."""
    config = tiny_config()
    ref = reference_model(config, torch.float32)
    layer = ref.layers[0]
    stack = loaded_stack(ref, config)
    streams = random_streams((1, 6, 4, HIDDEN), seed=5)

    with torch.no_grad():
        expected = layer(streams)[0]
        ours = stack.layers[0]
        got = ours["attn_hc"](streams[0], lambda x: layer.self_attn(layer.input_layernorm(x))[0])
        got = ours["ffn_hc"](got, lambda x: layer.mlp(layer.post_attention_layernorm(x)))

        # The same flow with comb applied untransposed must be caught by this tolerance.
        pre, post, comb = ours["attn_hc"].mixing_weights(streams[0])
        out = layer.self_attn(layer.input_layernorm(hc_collapse(streams[0], pre)))[0]
        untransposed = hc_expand(out, streams[0], post, comb.transpose(-1, -2))
        transposed = hc_expand(out, streams[0], post, comb)

    torch.testing.assert_close(got, expected, atol=FP32_TOL, rtol=FP32_TOL)
    assert (untransposed - transposed).abs().max() > 100 * FP32_TOL


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, FP32_TOL), (torch.bfloat16, BF16_TOL)])
def test_model_flow_matches_reference(dtype: torch.dtype, tol: float) -> None:
    """DeepseekV4Model.forward (expand → 2 blocks → hc_head → norm) against ours."""
    config = tiny_config()
    ref = reference_model(config, dtype)
    stack = loaded_stack(ref, config)
    input_ids = torch.randint(0, VOCAB, (9,), generator=torch.Generator().manual_seed(6))

    with torch.no_grad():
        expected = ref(input_ids=input_ids.unsqueeze(0)).last_hidden_state[0]
        got = our_forward(stack, ref, input_ids)

    assert got.shape == (9, HIDDEN) and got.dtype == dtype
    torch.testing.assert_close(got, expected, atol=tol, rtol=tol)


def test_bfloat16_expand_rounds_once() -> None:
    """bfloat16 streams are mixed in float32 and rounded once (DeepSeek-V4's inference code):
    every element is within bf16 rounding (unit roundoff 2**-8) of the exact float64 mix.
    Rounding post/comb to bfloat16 first, as transformers does, breaks that bound."""
    hc = HyperConnection(HCConfig(HIDDEN, hc_mult=4))
    randomize_mixing_(hc, torch.Generator().manual_seed(16))
    streams = random_streams((256, 4, HIDDEN), seed=17, dtype=torch.bfloat16)
    sublayer_out = random_streams((256, HIDDEN), seed=18, dtype=torch.bfloat16)
    with torch.no_grad():
        _, post, comb = hc.mixing_weights(streams)
        got = hc_expand(sublayer_out, streams, post, comb)
        exact = torch.einsum("ti,td->tid", post.double(), sublayer_out.double()) + torch.einsum(
            "tij,tid->tjd", comb.double(), streams.double()
        )
        post16, comb16 = post.to(torch.bfloat16), comb.to(torch.bfloat16)
        rounded_weights_first = post16.unsqueeze(-1) * sublayer_out.unsqueeze(-2) + torch.matmul(
            comb16.transpose(-1, -2), streams
        )

    bound = 2.0**-8 * exact.abs() + 1e-6  # the float32 arithmetic adds ~1e-7 relative
    assert got.dtype == torch.bfloat16
    assert bool(((got.double() - exact).abs() <= bound).all())
    assert not bool(((rounded_weights_first.double() - exact).abs() <= bound).all())


def test_sinkhorn_is_doubly_stochastic() -> None:
    logits = random_streams((256, 4, 4), seed=8)  # unit scale, as mixes * scale + base are
    comb = sinkhorn(logits, iters=20, eps=1e-6)
    assert comb.dtype == torch.float32 and bool((comb > 0).all())
    # Ends on a column step: columns are exact up to eps; rows converge with the iterations
    # (DeepSeek-V4's 20 leave them within ~1e-3 at this scale, 50 within float32 noise).
    torch.testing.assert_close(comb.sum(-2), torch.ones(256, 4), atol=1e-5, rtol=0)
    torch.testing.assert_close(comb.sum(-1), torch.ones(256, 4), atol=2e-3, rtol=0)
    converged = sinkhorn(logits, iters=50, eps=1e-6)
    torch.testing.assert_close(converged.sum(-1), torch.ones(256, 4), atol=1e-5, rtol=0)
    torch.testing.assert_close(converged.sum(-2), torch.ones(256, 4), atol=1e-5, rtol=0)
    # One iteration leaves rows visibly off, so the assertions above measure the iterations.
    assert (sinkhorn(logits, iters=1, eps=1e-6).sum(-1) - 1).abs().max() > 1e-1


def test_leading_dims_are_token_dims() -> None:
    """[B, S, hc, H] gives the same result as the token-flattened [T, hc, H]."""
    cfg = HCConfig(hidden_size=HIDDEN, hc_mult=4)
    hc, head = HyperConnection(cfg), HyperHead(cfg)
    generator = torch.Generator().manual_seed(9)
    randomize_mixing_(hc, generator)
    randomize_mixing_(head, generator)
    sublayer = SwiGLU(generator)
    streams = random_streams((2, 3, 4, HIDDEN), seed=10)

    with torch.no_grad():
        batched = hc(streams, sublayer), head(streams)
        flat = hc(streams.flatten(0, 1), sublayer), head(streams.flatten(0, 1))

    torch.testing.assert_close(batched[0].flatten(0, 1), flat[0], atol=FP32_TOL, rtol=FP32_TOL)
    torch.testing.assert_close(batched[1].flatten(0, 1), flat[1], atol=FP32_TOL, rtol=FP32_TOL)


def test_spec_hidden_width_is_hc_times_hidden() -> None:
    """What the draft gets from an hc_mult = 4 target is [T, 4 * H], stream-major; a buffer sized
    with hidden_size cannot take it, and the draft side can recover the streams exactly."""
    config = tiny_config(hc_mult=4)
    cfg = hc_config(config)
    streams = expand_embeddings(random_streams((5, HIDDEN), seed=11), cfg.hc_mult)
    streams = streams + random_streams(streams.shape, seed=12)  # make the streams differ

    spec_hidden = flatten_streams(streams)
    assert spec_hidden.shape == (5, cfg.hc_mult * cfg.hidden_size) == (5, 64)
    torch.testing.assert_close(spec_hidden[:, HIDDEN : 2 * HIDDEN], streams[:, 1], atol=0, rtol=0)
    torch.testing.assert_close(unflatten_streams(spec_hidden, cfg.hc_mult), streams, atol=0, rtol=0)

    draft_buffer = torch.zeros(8, cfg.hc_mult * cfg.hidden_size)  # [max_tokens, spec_hidden_size]
    draft_buffer[:5].copy_(spec_hidden)
    with pytest.raises(RuntimeError):
        torch.zeros(8, cfg.hidden_size)[:5].copy_(spec_hidden)
    with pytest.raises(ValueError, match="hc_mult"):
        unflatten_streams(torch.zeros(5, HIDDEN + 2), cfg.hc_mult)
    # The mixing projection reads all hc * H features; an H-wide one does not load.
    assert HyperConnection(cfg).fn.shape[-1] == 64
    with pytest.raises(RuntimeError, match="size mismatch"):
        narrow = {"fn": torch.zeros(24, HIDDEN), "base": torch.zeros(24), "scale": torch.ones(3)}
        HyperConnection(cfg).load_state_dict(narrow)


def test_hc_mult_one_is_the_plain_residual() -> None:
    """A config without hc_mult (Llama family) gets `x + F(x)` on [T, H] and no mixing weights;
    HyperConnection with one stream is a learned gate (DeepSeek-V4's math), not that."""
    llama = {"model_type": "llama", "hidden_size": HIDDEN, "rms_norm_eps": 1e-5}
    cfg = HCConfig.from_hf_config(llama)
    assert (cfg.hc_mult, cfg.norm_eps) == (1, 1e-5)
    residual = make_residual(cfg)
    assert isinstance(residual, PlainResidual) and not list(residual.parameters())
    assert isinstance(make_residual(HCConfig(hidden_size=HIDDEN, hc_mult=4)), HyperConnection)

    generator = torch.Generator().manual_seed(13)
    sublayer = SwiGLU(generator)
    hidden = random_streams((5, HIDDEN), seed=14)
    with torch.no_grad():
        torch.testing.assert_close(residual(hidden, sublayer), hidden + sublayer(hidden), atol=0, rtol=0)
        gate = HyperConnection(cfg)
        randomize_mixing_(gate, generator)
        gated = gate(expand_embeddings(hidden, 1), sublayer)
    assert flatten_streams(expand_embeddings(hidden, 1)).shape == hidden.shape  # spec width = H
    assert (gated[:, 0] - (hidden + sublayer(hidden))).abs().max() > 1e-2


def test_hf_config_fields() -> None:
    config = tiny_config(hc_mult=4, sinkhorn_iters=7).to_dict()
    config["hc_eps"], config["rms_norm_eps"] = 1e-5, 1e-4
    expected = HCConfig(HIDDEN, hc_mult=4, sinkhorn_iters=7, hc_eps=1e-5, norm_eps=1e-4)
    assert HCConfig.from_hf_config(config) == expected
    nested = {"model_type": "multimodal", "text_config": config}
    assert HCConfig.from_hf_config(nested).hc_mult == 4
    with pytest.raises(ValueError):
        HCConfig(HIDDEN, hc_mult=0)


def published_state_dict(ref: dsv4.DeepseekV4Model) -> dict[str, torch.Tensor]:
    """The reference's weights under DeepSeek-V4's released names (flat `hc_*` parameters),
    plus neighbouring keys the name map must leave alone."""
    state: dict[str, torch.Tensor] = {"embed.weight": ref.embed_tokens.weight, "norm.weight": ref.norm.weight}
    for i, layer in enumerate(ref.layers):
        state[f"layers.{i}.attn_norm.weight"] = layer.input_layernorm.weight
        for released, module in (("hc_attn", layer.attn_hc), ("hc_ffn", layer.ffn_hc)):
            for part in ("fn", "base", "scale"):
                state[f"layers.{i}.{released}_{part}"] = getattr(module, part)
    for part in ("fn", "base", "scale"):
        state[f"hc_head_{part}"] = getattr(ref.hc_head, f"hc_{part}")
    return {k: v.detach().clone() for k, v in state.items()}


def test_published_layout_loads_through_name_map() -> None:
    config = tiny_config()
    ref = reference_model(config, torch.float32)
    published = published_state_dict(ref)
    canonical = canonical_hc_state_dict(published)

    # Non-hc keys pass through; no released hc name survives.
    assert {"embed.weight", "norm.weight", "layers.0.attn_norm.weight"} <= canonical.keys()
    assert not [k for k in canonical if re.search(r"(^|\.)hc_(attn|ffn|head)_", k)]
    # transformers' own conversion of the released names agrees with ours.
    mapping = get_checkpoint_conversion_mapping("deepseek_v4")
    renamings = [t for t in mapping if isinstance(t, WeightRenaming)]
    converters = [t for t in mapping if isinstance(t, WeightConverter)]
    for key in published:
        if "hc_" in key:
            theirs, _ = rename_source_key(key, renamings, converters)
            assert canonical_hc_key(theirs) == canonical_hc_key(key), key

    from_published, from_transformers = OurStack(hc_config(config), NUM_LAYERS), loaded_stack(ref, config)
    from_published.load_hc(published)
    input_ids = torch.arange(8)
    with torch.no_grad():
        got = our_forward(from_published, ref, input_ids)
        expected = our_forward(from_transformers, ref, input_ids)
    torch.testing.assert_close(got, expected, atol=0, rtol=0)


def test_mtp_layer_names_map() -> None:
    """The released next-token-prediction layer carries its own mixing weights and head."""
    assert canonical_hc_key("mtp.0.hc_attn_fn") == "mtp.0.attn_hc.fn"
    assert canonical_hc_key("mtp.0.hc_ffn_scale") == "mtp.0.ffn_hc.scale"
    assert canonical_hc_key("mtp.0.hc_head_base") == "mtp.0.hc_head.base"
    assert canonical_hc_key("model.hc_head.hc_fn") == "model.hc_head.fn"
    with pytest.raises(KeyError):
        canonical_hc_state_dict({"hc_head_fn": torch.zeros(1), "hc_head.hc_fn": torch.zeros(1)})


def test_mixing_weights_stay_float32_when_the_model_is_cast() -> None:
    model = nn.ModuleDict({"hc": HyperConnection(HCConfig(HIDDEN, hc_mult=4)), "proj": nn.Linear(HIDDEN, 8)})
    randomize_mixing_(model["hc"], torch.Generator().manual_seed(15))
    fn_before = model["hc"].fn.detach().clone()

    model.to(torch.bfloat16)
    assert model["proj"].weight.dtype == torch.bfloat16
    assert {p.dtype for p in model["hc"].parameters()} == {torch.float32}
    torch.testing.assert_close(model["hc"].fn, fn_before, atol=0, rtol=0)  # not rounded

    model.half().to("meta")
    assert model["hc"].fn.device.type == "meta" and model["hc"].fn.dtype == torch.float32
    model.to_empty(device="cpu")
    assert model["hc"].fn.device.type == "cpu" and model["hc"].fn.dtype == torch.float32
