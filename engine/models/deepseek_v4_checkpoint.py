"""DeepSeek-V4 checkpoints as published, and as transformers saves them, into the engine's model.

Published names (deepseek-ai/DeepSeek-V4-*; the same renames transformers' conversion mapping
for deepseek_v4 applies) -> the engine's (transformers' module names):

    embed.weight / head.weight / norm.weight          embed_tokens / lm_head / norm
    hc_head_{fn,base,scale}                           hc_head.{fn,base,scale}
    layers.{i}.attn_norm / ffn_norm                   input_layernorm / post_attention_layernorm
    layers.{i}.hc_{attn,ffn}_{fn,base,scale}          {attn,ffn}_hc.{fn,base,scale}
    layers.{i}.attn.{wq_a,q_norm,wq_b,wkv,kv_norm,wo_a,wo_b,attn_sink}
                          self_attn.{q_a_proj,q_a_norm,q_b_proj,kv_proj,kv_norm,o_a_proj,o_b_proj,sinks}
    layers.{i}.attn.compressor.{wkv,wgate,ape,norm}   self_attn.compressor.{kv_proj,gate_proj,position_bias,kv_norm}
    layers.{i}.attn.indexer.compressor.*              self_attn.compressor.indexer.* (same leaves)
    layers.{i}.attn.indexer.{wq_b,weights_proj}       self_attn.compressor.indexer.{q_b_proj,scorer.weights_proj}
    layers.{i}.ffn.gate.{weight,bias,tid2eid}         mlp.gate.{weight,e_score_correction_bias,tid2eid}
    layers.{i}.ffn.shared_experts.{w1,w3,w2}          mlp.shared_experts.{gate,up,down}_proj
    layers.{i}.ffn.experts.{j}.{w1,w3,w2}.weight      mlp.experts.gate_up_proj[j] = [w1; w3], down_proj[j] = w2
    mtp.0.{enorm,hnorm,e_proj,h_proj,norm,hc_head_*}  the MTP draft's own; mtp.0.<block> its decoder block

Quantization (config.json quantization_config quant_method fp8, weight_block_size [128, 128];
expert_dtype fp4): a linear's scale is stored beside it as `<linear>.scale` (read as
weight_scale_inv, float32 or E8M0). FP8 linears stay e4m3 codes in the engine's FP8 linears
(engine/models/fp8.py: Triton kernels on Hopper, dequantize + matmul elsewhere); the grouped
output projection (wo_a), read as one block matrix, is dequantized to the model dtype on load.
Routed experts, FP4 (e2m1 pairs packed in int8 [N, K / 2], one E8M0 scale per 32 inputs) or FP8,
stay as stored (the bytes the plan counts) in their stacked tensors and are dequantized inside
the expert computation (engine/models/deepseek_v4.py _Experts): on CUDA every expert of a layer,
one projection at a time, into a model-dtype temporary before the grouped GEMM; elsewhere the
experts a batch hits.
"""

from __future__ import annotations

import logging
import re

import torch

from specdeploy.engine.models.checkpoint import Checkpoint
from specdeploy.engine.models.deepseek_v4 import DeepseekV4Model, DeepseekV4MTP, V4ModelConfig, build_mtp, build_target
from specdeploy.engine.models.fp8 import convert_fp8_linears, dequantize_fp8, fp8_format, ignored_tensor, scale_to_float
from specdeploy.engine.models.hc import canonical_hc_key
from specdeploy.engine.models.layers import load_state

log = logging.getLogger("specdeploy.engine.load")

# In the order transformers applies them (some patterns act on an earlier one's result).
_RENAMES = tuple((re.compile(a), b) for a, b in (
    (r"\.attn\.", ".self_attn."),
    (r"\.ffn\.", ".mlp."),
    (r"\.indexer\.compressor\.", ".compressor.indexer."),
    (r"^embed\.weight", "embed_tokens.weight"),
    (r"^head\.weight", "lm_head.weight"),
    (r"\.attn_norm\.", ".input_layernorm."),
    (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.attn_sink", ".sinks"),
    (r"\.indexer\.weights_proj\.", ".compressor.indexer.scorer.weights_proj."),
    (r"\.indexer\.wq_b\.", ".compressor.indexer.q_b_proj."),
    (r"\.norm\.", ".kv_norm."),
    (r"\.ape$", ".position_bias"),
    (r"\.wq_a\.", ".q_a_proj."),
    (r"\.self_attn\.wq_b\.", ".self_attn.q_b_proj."),
    (r"\.wkv\.", ".kv_proj."),
    (r"\.wgate\.", ".gate_proj."),
    (r"\.wo_a\.", ".o_a_proj."),
    (r"\.wo_b\.", ".o_b_proj."),
    (r"\.q_norm\.", ".q_a_norm."),
    (r"\.gate\.bias$", ".gate.e_score_correction_bias"),
    (r"\.shared_experts\.w1\.", ".shared_experts.gate_proj."),
    (r"\.shared_experts\.w2\.", ".shared_experts.down_proj."),
    (r"\.shared_experts\.w3\.", ".shared_experts.up_proj."),
))
_EXPERT = re.compile(r"^layers\.(\d+)\.mlp\.experts\.(\d+)\.(w1|w2|w3)\.(weight|weight_scale_inv)$")
# Head-level tensors of an MTP layer (everything else under mtp.{k}. is its decoder block).
_MTP_HEAD = ("enorm.", "hnorm.", "e_proj.", "h_proj.", "norm.", "hc_head_")
_MTP_SHARED = ("emb.", "head.", "embed.")
SCALE_SUFFIX = ".weight_scale_inv"


def engine_name(name: str) -> str:
    """A checkpoint tensor name (published or transformers layout) -> the engine's name."""
    name = name.removeprefix("model.")
    if name.endswith(".scale") and not name.endswith(("_hc.scale", "hc_head.scale")):
        name = name[: -len(".scale")] + SCALE_SUFFIX  # published per-block scales
    for pattern, replacement in _RENAMES:
        name = pattern.sub(replacement, name)
    return canonical_hc_key(name)


def mtp_engine_name(name: str, index: int = 0) -> str | None:
    """`mtp.{index}.*` -> the MTP draft's name (None: not this layer's, or shared with the target)."""
    prefix = f"mtp.{index}."
    if not name.startswith(prefix):
        return None
    rest = name[len(prefix):]
    if rest.startswith(_MTP_SHARED):
        return None
    if rest.startswith(_MTP_HEAD):
        return canonical_hc_key(engine_name(rest))
    return engine_name("layers.0." + rest)


class _Experts:
    """Fills each layer's stacked expert tensors from per-expert ones and reports a stacked
    parameter once all its experts are in. Quantized experts (a `.weight_scale_inv` beside the
    weight) are kept as their codes and scales (FP4: int8 pairs + E8M0 bits; FP8: e4m3 + float32
    block scales), dequantized inside the expert computation; unquantized ones are copied."""

    def __init__(self, model: torch.nn.Module, names: set[str], fmt, dtype: torch.dtype, peek):
        self.model, self.names, self.fmt, self.dtype = model, names, fmt, dtype
        self.pending: dict[str, torch.Tensor] = {}
        self.filled: dict[str, set[tuple[int, str]]] = {}
        self.kind = None
        quantized = sorted(n for n in names if _EXPERT.match(n) and n.endswith(SCALE_SUFFIX))
        if quantized:
            codes = peek(quantized[0].removesuffix(SCALE_SUFFIX) + ".weight")
            self.kind = "fp4" if codes.dtype in (torch.int8, torch.uint8) else "fp8"
            for path, module in model.named_modules():
                if path.endswith("mlp.experts"):
                    module.quantize(self.kind, fmt.block if fmt is not None else (128, 128))

    def _code(self, weight: torch.Tensor, scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        if scale is None:
            return weight.to(self.dtype), None
        if self.kind == "fp4":
            if scale.dtype == torch.uint8:
                bits = scale
            elif scale.dtype.itemsize == 1 and not scale.is_floating_point():
                bits = scale.view(torch.uint8)
            elif str(scale.dtype) == "torch.float8_e8m0fnu":
                bits = scale.view(torch.uint8)
            else:  # float scales of powers of two
                bits = (torch.log2(scale.float()).round() + 127).to(torch.uint8)
            return weight.view(torch.int8), bits
        return weight, scale_to_float(scale)

    def take(self, name: str, tensor: torch.Tensor):
        """Consume an expert tensor; yields (stacked name, parameter) when one is complete."""
        m = _EXPERT.match(name)
        layer, expert, proj = int(m.group(1)), int(m.group(2)), m.group(3)
        experts = self.model.get_submodule(f"layers.{layer}.mlp.experts")
        expert -= experts.lo  # this rank's experts only (tensor parallel: expert parallelism)
        if not 0 <= expert < experts.num_local:
            return
        base = name.rsplit(".", 1)[0]
        weight_name, scale_name = base + ".weight", base + SCALE_SUFFIX
        self.pending[name] = tensor
        if weight_name not in self.pending or (scale_name in self.names and scale_name not in self.pending):
            return
        weight, scale = self._code(self.pending.pop(weight_name), self.pending.pop(scale_name, None))
        if (scale is None) != (self.kind is None):
            raise ValueError(f"checkpoint: {weight_name} is {'un' if scale is None else ''}quantized "
                             "unlike the other routed experts")
        i = experts.gate_up_proj.shape[1] // 2
        stacked = "down_proj" if proj == "w2" else "gate_up_proj"
        rows = {"w1": slice(0, i), "w3": slice(i, 2 * i), "w2": slice(None)}[proj]
        with torch.no_grad():
            getattr(experts, stacked)[expert, rows].copy_(weight)
            if scale is not None:
                target = getattr(experts, stacked + "_scale")[expert]
                if proj != "w2" and self.kind == "fp8":  # block rows of w1 / w3 within gate_up
                    bn = experts.block[0]
                    if i % bn:
                        raise ValueError(f"checkpoint: {weight_name}: {i} rows are not whole {bn}-row scale blocks")
                    rows = slice(0, i // bn) if proj == "w1" else slice(i // bn, 2 * i // bn)
                target[rows].copy_(scale)
        e = experts.gate_up_proj.shape[0]
        projs = ("w2",) if proj == "w2" else ("w1", "w3")
        key = f"layers.{layer}.mlp.experts.{stacked}"
        done = self.filled.setdefault(key, set())
        done.add((expert, proj))
        if len(done) == e * len(projs):
            # Handed to load_state as its own parameters: counted as loaded, copied onto themselves.
            yield key, getattr(experts, stacked)
            if self.kind is not None:
                yield key + "_scale", getattr(experts, stacked + "_scale")


def _dequantize_grouped(model: torch.nn.Module, tensors, dtype):
    """wo_a (the grouped output projection) arrives as codes + scale: hand load_state its
    dequantized weight (the forward reads it as one [groups * rank, heads * hd / groups] matrix)."""
    held: dict[str, torch.Tensor] = {}
    for name, tensor in tensors:
        if ".o_a_proj." in name:
            held[name] = tensor
            base = name.rsplit(".", 1)[0]
            w, s = held.get(base + ".weight"), held.get(base + SCALE_SUFFIX)
            if w is not None and (s is not None or w.is_floating_point() and w.dtype != torch.float8_e4m3fn):
                held.pop(base + ".weight")
                held.pop(base + SCALE_SUFFIX, None)
                fmt_block = getattr(model, "_fp8_block", (128, 128))
                yield base + ".weight", (w.to(dtype) if s is None else dequantize_fp8(w, s, fmt_block, dtype))
            continue
        yield name, tensor
    if held:
        raise ValueError(f"checkpoint: {sorted(held)[0]} has no matching weight / scale")


def _load(model: torch.nn.Module, checkpoint: Checkpoint, raw: dict, rename, dtype: torch.dtype,
          ignore: tuple[str, ...] = ()) -> None:
    fmt = fp8_format(raw)
    names = {}
    for n in checkpoint.names():
        mapped = rename(n)
        if mapped is not None:
            names[n] = mapped
    local = next((m for p, m in model.named_modules() if p.endswith("mlp.experts")), None)
    if local is not None and local.tp_size > 1:
        def mine(mapped: str) -> bool:
            m = _EXPERT.match(mapped)
            return m is None or local.lo <= int(m.group(2)) < local.lo + local.num_local
        names = {n: mapped for n, mapped in names.items() if mine(mapped)}
    engine_names = set(names.values())
    if fmt is not None:
        model._fp8_block = fmt.block
        # o_a_proj stays in the model dtype (dequantized on load); experts are not linears.
        fp8_names = {n for n in engine_names if ".o_a_proj." not in n}
        converted = convert_fp8_linears(model, fmt, fp8_names)
        log.info("fp8: %d linears from %s %s checkpoint weights", len(converted), fmt.scheme, fmt.scale_name)
    back = {v: k for k, v in names.items()}
    experts = _Experts(model, engine_names, fmt, dtype, lambda n: checkpoint.get(back[n]))

    def stream():
        for name, tensor in checkpoint.tensors(skip=lambda n: n not in names):
            mapped = names[name]
            if _EXPERT.match(mapped):
                yield from experts.take(mapped, tensor)
            else:
                yield mapped, tensor

    load_state(model, _dequantize_grouped(model, stream(), dtype),
               ignore=("rotary_emb.", *ignore, *ignored_tensor(fmt)))
    if experts.pending:
        raise ValueError(f"checkpoint: expert tensor {sorted(experts.pending)[0]} has no matching weight / scale")


def load_v4_target(path: str, dtype: torch.dtype = torch.bfloat16, device="cpu",
                   feature_kind: str | None = None, tp_rank: int = 0, tp_size: int = 1) -> DeepseekV4Model:
    """DeepSeek-V4 from a model directory (config.json + weights, published or transformers
    names, FP8 / FP4 as published); under tensor parallelism each rank reads only its experts."""
    from specdeploy.engine.models.llama import read_config

    raw = read_config(path)
    model = build_target(V4ModelConfig.from_hf(raw), dtype, device, feature_kind, tp_rank, tp_size)
    _load(model, Checkpoint(path), raw, lambda n: None if n.startswith("mtp.") else engine_name(n), dtype)
    return model


def load_v4_mtp(path: str, target: DeepseekV4Model, dtype: torch.dtype = torch.bfloat16, device="cpu") -> DeepseekV4MTP:
    """The target checkpoint's first MTP layer (mtp.0.*) as the draft."""
    from specdeploy.engine.models.llama import read_config

    raw = read_config(path)
    head = build_mtp(target, dtype, device)
    _load(head, Checkpoint(path), raw, mtp_engine_name, dtype)
    return head


def is_deepseek_v4_config(raw: dict) -> bool:
    c = raw.get("text_config", raw)
    return str(c.get("model_type", "")).startswith("deepseek_v4")
