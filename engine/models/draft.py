"""Draft heads: EAGLE-1/2, EAGLE-3 and MTP. All share one calling convention:

    out = head(input_ids [B, Q], hidden [B, Q, W], positions [B, Q], batch, kv)   # [B, Q, Hc]
    logits = head.logits(out)                                                     # [B, Q, Vd]

Entry j of a draft sequence pairs the token at position j + 1 with the target's (or, deeper in
the draft, the head's own) hidden state at position j and predicts the token at position j + 2.
W is the target feature width (`input_size`) on extend and the carried width (`carried_size`,
the head's own output) during multi-step drafting. Vd is the draft vocabulary; `to_target_ids`
maps draft ids to target ids (identity except for EAGLE-3 heads with a reduced vocabulary).

Widths (H = hidden_size, Hs = spec_hidden_size = hc_mult * H):
    EAGLE  on hc_mult = 1: input H   (post-norm last hidden), carried H
    EAGLE  on hc_mult > 1: input Hs  (flattened streams),     carried Hs (streams of its block)
    EAGLE-3:               input 3H  (three target layers),   carried H
    MTP:                   input Hs  (pre-norm last state),   carried Hs

Tensor parallelism: a head runs in its target's TP group (target.tp_rank / tp_size). Its
decoder layer is split like the target's (heads, MLP, KV heads); the input projections (EAGLE's
and EAGLE-3's fc, MTP's eh_proj / e_proj / h_proj) are row-parallel over their replicated
input, one all-reduce of [T, out] each, rather than replicated: at decode batch sizes they are
weight reads (EAGLE-3's fc is 3H x H, 384 MiB in bf16 on the 70B shape) and a rank reading
1 / tp of them saves more than the all-reduce costs. EAGLE-3's own lm_head is vocab-parallel;
norms, d2t / t2d and hyper-connection mixers are replicated.
"""

from __future__ import annotations

import itertools
import logging

import torch
from torch import nn

from specdeploy.engine.models.attention import AttnBatch
from specdeploy.engine.models.checkpoint import Checkpoint
from specdeploy.engine.planner.shapes import DRAFT_ALGORITHMS
from specdeploy.engine.planner.weights import UNUSED_HEAD_TENSORS
from specdeploy.engine.models.hc import (HyperHead, canonical_hc_key, expand_embeddings, flatten_streams,
                                  unflatten_streams)
from specdeploy.engine.memory.kv import KVPool
from specdeploy.engine.models.layers import GatedMLP, ParallelLMHead, RMSNorm, RowParallelLinear, load_state, rope_inv_freq
from specdeploy.engine.models.protocol import SLOT_ROWS
from specdeploy.engine.models.llama import (Attention, DecoderLayer, LlamaModel, ModelConfig, default_dtype,
                                     read_config, rope_tables)

log = logging.getLogger("specdeploy.engine.load")


class DraftHead(nn.Module):
    algorithm: str
    input_size: int
    carried_size: int
    draft_vocab_size: int
    kv_layout = SLOT_ROWS   # models/protocol.py: the runner allocates its KVPool

    def bind_target(self, target: LlamaModel) -> None:
        # Shared modules are held outside the module tree so that they are neither saved,
        # loaded nor counted twice.
        self.__dict__["target"] = target

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids

    def num_kv_layers(self) -> int:
        return self.cfg.num_layers

    def init_rope(self) -> None:
        """Rotary frequencies from the head's own config.json, as it was trained: published heads
        need not share the target's (the EAGLE-3 heads for Llama 3.1 name no rope_theta, so
        10000; the EAGLE-1 head names 500000 without llama3 scaling). Float32, not saved."""
        self.register_buffer("inv_freq", rope_inv_freq(self.cfg.head_dim, self.cfg.rope_theta,
                                                       self.cfg.rope_scaling), persistent=False)


class EagleHead(DraftHead):
    """EAGLE-1/2: fc over [embedding; hidden] then decoder layer(s) whose first has no input
    norm; embedding and lm_head are the target's. No final norm (the head regresses the target's
    post-norm feature)."""

    algorithm = "EAGLE"

    def __init__(self, cfg: ModelConfig, target: LlamaModel, fc_bias: bool = True):
        super().__init__()
        self.cfg = cfg
        hs = target.cfg.spec_hidden_size
        self.hc_mult = target.cfg.hc_mult
        self.input_size = self.carried_size = hs
        self.draft_vocab_size = target.cfg.vocab_size
        tp = (target.tp_rank, target.tp_size)
        # hc_mult > 1: the fc writes all hc streams at once, [T, H + Hs] -> [T, Hs].
        self.fc = RowParallelLinear(cfg.hidden_size + hs, hs, fc_bias, *tp, input_is_parallel=False)
        layer_cfg = _with(cfg, hc_mult=self.hc_mult)
        self.layers = nn.ModuleList(DecoderLayer(layer_cfg, *tp, input_norm=i > 0)
                                    for i in range(cfg.num_layers))
        self.init_rope()
        self.bind_target(target)

    def forward(self, input_ids, hidden, positions, batch: AttnBatch, kv: KVPool) -> torch.Tensor:
        target = self.__dict__["target"]
        x = self.fc(torch.cat([target.embed_tokens(input_ids), hidden.to(target.embed_tokens.weight.dtype)], -1))
        if self.hc_mult > 1:
            x = unflatten_streams(x, self.hc_mult)                        # [B, Q, hc, H]
        cos, sin = rope_tables(self.inv_freq, positions)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, kv.k[i], kv.v[i], batch)
        return flatten_streams(x) if self.hc_mult > 1 else x

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        target = self.__dict__["target"]
        if self.hc_mult > 1:
            return target.logits_from_feature(out)
        return target.logits(out)


class Eagle3Head(DraftHead):
    """EAGLE-3: fc (3H -> H) over three target layers' states; one decoder layer whose attention
    reads [norm(embedding); norm(hidden)] (2H); own norm and lm_head over the draft vocabulary;
    d2t maps draft ids to target ids (target = draft + d2t[draft])."""

    algorithm = "EAGLE3"

    def __init__(self, cfg: ModelConfig, target: LlamaModel, draft_vocab_size: int | None = None):
        super().__init__()
        if target.cfg.hc_mult > 1:
            raise ValueError("EAGLE-3 heads are defined for hc_mult = 1 targets only; "
                             "use EAGLE or MTP for hc_mult > 1")
        if cfg.hidden_size != target.cfg.hidden_size:
            raise ValueError(f"EAGLE-3 head hidden_size {cfg.hidden_size} != target's "
                             f"{target.cfg.hidden_size}")
        self.cfg = _with(cfg, num_layers=1)
        h = cfg.hidden_size
        self.input_size = 3 * h
        self.carried_size = h
        self.draft_vocab_size = draft_vocab_size or cfg.vocab_size
        tp = (target.tp_rank, target.tp_size)
        self.fc = RowParallelLinear(3 * h, h, False, *tp, input_is_parallel=False)
        self.midlayer = nn.Module()
        self.midlayer.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.midlayer.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.midlayer.self_attn = Attention(cfg, 2 * h, *tp)
        self.midlayer.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.midlayer.mlp = GatedMLP(h, cfg.intermediate_size, cfg.mlp_bias, *tp)
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.lm_head = ParallelLMHead(h, self.draft_vocab_size, *tp)
        self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.ones(target.cfg.vocab_size, dtype=torch.bool))
        self.init_rope()
        self.bind_target(target)

    def forward(self, input_ids, hidden, positions, batch: AttnBatch, kv: KVPool) -> torch.Tensor:
        target = self.__dict__["target"]
        m = self.midlayer
        if hidden.shape[-1] == self.input_size:                             # target aux states
            hidden = self.fc(hidden.to(target.embed_tokens.weight.dtype))  # the compute dtype (fc may hold e4m3 codes)
        elif hidden.shape[-1] != self.carried_size:
            raise ValueError(f"EAGLE-3 hidden width {hidden.shape[-1]}: expected the target's "
                             f"{self.input_size} or the head's own {self.carried_size}")
        cos, sin = rope_tables(self.inv_freq, positions)
        x = torch.cat([m.input_layernorm(target.embed_tokens(input_ids)), m.hidden_norm(hidden)], -1)
        h = hidden + m.self_attn(x, cos, sin, kv.k[0], kv.v[0], batch)
        return h + m.mlp(m.post_attention_layernorm(h))

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(out)).float()

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]


class MTPHead(DraftHead):
    """Next-token-prediction layer (DeepSeek style) consuming and emitting [T, Hs]:
    hc_mult = 1: x = eh_proj([enorm(e); hnorm(h)]);
    hc_mult > 1: streams = e_proj(enorm(e)) (broadcast to every stream) + h_proj(hnorm(streams)),
    then one decoder block (with hyper-connections), its own head collapse and norm, and the
    target's lm_head."""

    algorithm = "MTP"

    def __init__(self, cfg: ModelConfig, target: LlamaModel):
        super().__init__()
        self.cfg = _with(cfg, num_layers=1, hc_mult=target.cfg.hc_mult)
        h = cfg.hidden_size
        self.hc_mult = target.cfg.hc_mult
        self.input_size = self.carried_size = target.cfg.spec_hidden_size
        self.draft_vocab_size = target.cfg.vocab_size
        tp = (target.tp_rank, target.tp_size)
        self.enorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(h, cfg.rms_norm_eps)
        if self.hc_mult == 1:
            self.eh_proj = RowParallelLinear(2 * h, h, False, *tp, input_is_parallel=False)
        else:
            self.e_proj = RowParallelLinear(h, h, False, *tp, input_is_parallel=False)
            self.h_proj = RowParallelLinear(h, h, False, *tp, input_is_parallel=False)
            self.hc_head = HyperHead(self.cfg.hc)
        self.layers = nn.ModuleList([DecoderLayer(self.cfg, *tp)])
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.init_rope()
        self.bind_target(target)

    def forward(self, input_ids, hidden, positions, batch: AttnBatch, kv: KVPool) -> torch.Tensor:
        target = self.__dict__["target"]
        e = self.enorm(target.embed_tokens(input_ids))                      # [B, Q, H]
        if self.hc_mult == 1:
            x = self.eh_proj(torch.cat([e, self.hnorm(hidden.to(e.dtype))], -1))
        else:
            streams = unflatten_streams(hidden.to(e.dtype), self.hc_mult)   # [B, Q, hc, H]
            x = expand_embeddings(self.e_proj(e), self.hc_mult) + self.h_proj(self.hnorm(streams))
        cos, sin = rope_tables(self.inv_freq, positions)
        x = self.layers[0](x, cos, sin, kv.k[0], kv.v[0], batch)
        return flatten_streams(x) if self.hc_mult > 1 else x

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        if self.hc_mult > 1:
            out = self.hc_head(unflatten_streams(out, self.hc_mult))
        return self.__dict__["target"].logits(self.norm(out))


def _with(cfg: ModelConfig, **changes) -> ModelConfig:
    from dataclasses import replace
    return replace(cfg, **changes)


def build_draft(algorithm: str, cfg: ModelConfig, target: LlamaModel, dtype: torch.dtype,
                device, **kwargs) -> DraftHead:
    if algorithm not in DRAFT_ALGORITHMS:
        raise ValueError(f"unknown draft algorithm {algorithm!r}; expected one of {DRAFT_ALGORITHMS}")
    cls = {"EAGLE": EagleHead, "EAGLE3": Eagle3Head, "MTP": MTPHead}[algorithm]
    with torch.device(device), default_dtype(dtype):
        head = cls(cfg, target, **kwargs)
    head.to(dtype)
    # As for the target (build_target): recomputed in float32 rather than cast back from dtype.
    head.inv_freq = rope_inv_freq(head.cfg.head_dim, head.cfg.rope_theta, head.cfg.rope_scaling).to(head.inv_freq.device)
    return head.eval()


def _unused(name: str) -> bool:
    """Tensors a published head carries but does not use (EAGLE-1/2 heads ship a copy of the
    target's embedding; the engine uses the target's own): not read, logged at debug. The
    planner leaves the same out of the draft's weight bytes."""
    if name.removeprefix("model.") in UNUSED_HEAD_TENSORS:
        log.debug("weights: %s skipped (the head uses the target's)", name)
        return True
    return False


def load_draft(path: str, algorithm: str, target: LlamaModel, dtype: torch.dtype = torch.bfloat16,
               device="cpu") -> DraftHead:
    """Load a published head layout from an HF-style directory, any checkpoint format
    (engine/models/checkpoint.py; for MTP also the target's own directory, whose `mtp.0.*`
    tensors are the head):
    EAGLE: fc.{weight,bias}, layers.{i}.* (the copy of embed_tokens is skipped); EAGLE-3:
    fc.weight, midlayer.*, norm.weight, lm_head.weight, d2t, t2d; MTP: enorm, hnorm, eh_proj |
    e_proj/h_proj, layers.0.*, hc_head.*, norm. A leading `model.` is dropped; the target's
    embedding/lm_head are shared, not loaded. Each tensor is cast into its parameter's dtype as it
    is copied (heads are published in float32, float16 or bfloat16)."""
    raw = read_config(path)
    cfg = ModelConfig.from_hf(raw, allow_any_type=True)
    ckpt = Checkpoint(path)
    names = [canonical_hc_key(n.removeprefix("model.")) for n in ckpt.names()]
    mtp_in_target = algorithm == "MTP" and any(n.startswith("mtp.") for n in names)

    def renamed(pairs):
        for n, t in pairs:
            n = canonical_hc_key(n.removeprefix("model."))
            if mtp_in_target:
                # The MTP layer shipped inside the target checkpoint (mtp.0.*): take only that layer.
                if not n.startswith("mtp.0."):
                    continue
                n = n.removeprefix("mtp.0.")
            yield n, t

    def skip(name: str) -> bool:
        if mtp_in_target:
            return not canonical_hc_key(name.removeprefix("model.")).startswith("mtp.0.")
        return _unused(name)

    if mtp_in_target:
        names = [n.removeprefix("mtp.0.") for n in names if n.startswith("mtp.0.")]
    kwargs = {}
    extra: list[tuple[str, torch.Tensor]] = []
    if algorithm == "EAGLE":
        kwargs["fc_bias"] = "fc.bias" in names
    if algorithm == "EAGLE3":
        kwargs["draft_vocab_size"] = int(raw.get("draft_vocab_size") or cfg.vocab_size)
        if "d2t" not in names:
            extra.append(("d2t", torch.zeros(kwargs["draft_vocab_size"], dtype=torch.int64)))
            extra.append(("t2d", torch.ones(target.cfg.vocab_size, dtype=torch.bool)))
    head = build_draft(algorithm, cfg, target, dtype, device, **kwargs)
    # Under tensor parallelism each rank reads only its slices (lazy sources, engine/models/checkpoint.py).
    pairs = ckpt.sources(skip=skip) if target.tp_size > 1 else ckpt.tensors(skip=skip)
    tensors = itertools.chain(renamed(pairs), extra)
    load_state(head, tensors, ignore=("rotary_emb.inv_freq",))
    return head
