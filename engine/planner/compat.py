"""Whether a draft can speculate for a target, from the two config.json files alone.

`pair_incompatibility(algorithm, target_config, draft_config)` is the one check; `specdeploy plan`
(through plan_from_configs), the operator (desired/planning.py, before any child exists) and
`engine serve` (before a weight is read) all call it, so a pair is refused with the same line
wherever it is tried. It returns the reason in one sentence naming both numbers, or None.

What a pair must agree on, and why:
  kind      the draft is the kind of model the algorithm runs. EAGLE-3 heads name
            `LlamaForCausalLMEagle3` (or carry `eagle_config` / `draft_vocab_size`); EAGLE-1/2
            heads name `LlamaForCausalLMEagle`, or (as yuhuili's are published) the base
            architecture with one or two decoder layers; MTP drafts with the target's own
            `num_nextn_predict_layers` (DeepSeek-V3/V4 name it the same in both of V4's schemes).
            A whole causal LM is no head: the engine would read its layers as a head's and fail.
  hidden    a head's hidden_size is the target's: it consumes the target's hidden states (EAGLE:
            fc over [embedding; hidden]; EAGLE-3: fc over three layers' states, 3 x hidden).
  vocab     EAGLE shares the target's embedding and lm_head: equal vocabularies. EAGLE-3 predicts
            over its own draft vocabulary (draft_vocab_size) and maps it into the target's through
            d2t, whose ids index a vocabulary of the head's vocab_size (t2d's length): that must
            be the target's, and the draft vocabulary no larger.
  base      a head whose config names the model it was trained on (the speculators format's
            verifier) must name this target's architecture (and its name, where the target's
            config carries one).
"""

from __future__ import annotations

import re
from typing import Any

# The PlanError reason (PlanReady=False on the resource) for every refusal of this module.
DRAFT_INCOMPATIBLE = "DraftIncompatible"

# Published EAGLE-1/2 heads have one decoder layer (HASS / EAGLE-2 variants at most two); more than
# this is a whole model given where a head belongs.
MAX_HEAD_LAYERS = 2

_HEAD_KINDS = {"EAGLE": "an EAGLE-1/2 head", "EAGLE3": "an EAGLE-3 head", "MTP": "an MTP layer"}


def _text(config: dict[str, Any]) -> dict[str, Any]:
    text = config.get("text_config")
    return {**config, **text} if isinstance(text, dict) else config


def _architecture(c: dict[str, Any]) -> str:
    archs = c.get("architectures")
    return str(archs[0]) if isinstance(archs, list) and archs else str(c.get("model_type") or "?")


def _int(c: dict[str, Any], *names: str) -> int | None:
    for name in names:
        value = c.get(name)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _layers(c: dict[str, Any]) -> int | None:
    return _int(c, "num_hidden_layers", "n_layer", "n_layers", "num_layers")


def draft_kind(draft_config: dict[str, Any]) -> str:
    """What a draft's config.json describes: "EAGLE3", "EAGLE", "model" (a whole causal LM), or
    "" when it does not say (no architecture naming a head, no layer count: derive_shapes then
    names the missing field)."""
    c = _text(draft_config)
    arch = _architecture(c).lower()
    if "eagle3" in arch or "eagle_config" in c or "draft_vocab_size" in c:
        return "EAGLE3"
    if "eagle" in arch:
        return "EAGLE"
    layers = _layers(c)
    if layers is None:
        return ""
    # published EAGLE-1/2 heads keep the base architecture's name
    return "EAGLE" if layers <= MAX_HEAD_LAYERS else "model"


def _named_base(c: dict[str, Any]) -> tuple[str, list[str]]:
    """(name, architectures) of the model a head says it was trained for ("" / [] when silent)."""
    spec = c.get("speculators_config")
    verifier = spec.get("verifier") if isinstance(spec, dict) else None
    if isinstance(verifier, dict):
        archs = verifier.get("architectures")
        return str(verifier.get("name_or_path") or ""), [str(a) for a in archs] if isinstance(archs, list) else []
    return str(c.get("base_model_name_or_path") or ""), []


def _model_id(name: str) -> str:
    """A model name compared loosely: the repository's last part, lower case, without the
    `meta-` prefix and punctuation (Meta-Llama-3.1-8B-Instruct and Llama-3.1-8B-Instruct agree)."""
    base = name.rstrip("/").rsplit("/", 1)[-1].lower().removeprefix("meta-")
    return re.sub(r"[^a-z0-9]", "", base)


def _as(algorithm: str) -> str:
    return f"algorithm {algorithm}"


def pair_incompatibility(algorithm: str, target_config: dict[str, Any],
                         draft_config: dict[str, Any] | None) -> str | None:
    """Why `draft_config` cannot draft for `target_config` under `algorithm`, or None.

    Only what the configs say is judged; fields a config does not carry are left to the shapes
    (derive_shapes names a missing field as ConfigError). Pure: the dicts are only read."""
    if algorithm == "NONE" or not isinstance(target_config, dict):
        return None
    target = _text(target_config)
    if algorithm == "MTP":
        source = _text(draft_config) if isinstance(draft_config, dict) else target
        nextn = _int(source, "num_nextn_predict_layers") or 0
        if nextn <= 0:
            who = "the draft" if isinstance(draft_config, dict) else "the target"
            return (f"MTP drafts with a model's own multi-token-prediction layers, and {who} "
                    f"({_architecture(source)}) has num_nextn_predict_layers {nextn}: use EAGLE or "
                    f"EAGLE3 with a head trained for this target, or NONE")
        if not isinstance(draft_config, dict):
            return None
        return _widths("MTP", target, source)
    if algorithm not in ("EAGLE", "EAGLE3") or not isinstance(draft_config, dict):
        return None  # unknown algorithms and a missing draft are SpecSettings' and plan()'s to refuse
    draft = _text(draft_config)
    kind = draft_kind(draft)
    if kind == "model":
        head = ("an EAGLE-3 head (architectures LlamaForCausalLMEagle3, one decoder layer, its own "
                "draft_vocab_size)" if algorithm == "EAGLE3" else
                "an EAGLE-1/2 head (architectures LlamaForCausalLMEagle, or one decoder layer)")
        return (f"the draft ({_architecture(draft)}, {_layers(draft)} layers) is a whole causal LM, "
                f"not a draft head: {algorithm} needs {head} trained on this target; serve this "
                f"model as a target of its own (algorithm NONE), or use its MTP layers where it has them")
    if kind and kind != algorithm:
        layers = _layers(draft)
        shape = f", {layers} decoder layer{'s' if layers != 1 else ''}" if layers is not None else ""
        return (f"the draft is {_HEAD_KINDS[kind]} ({_architecture(draft)}{shape}) and drafts with "
                f"{_as(kind)}, not {algorithm}")
    problem = _widths(algorithm, target, draft)
    if problem:
        return problem
    return _base_model(target, draft)


def _widths(algorithm: str, target: dict[str, Any], draft: dict[str, Any]) -> str | None:
    """Hidden size and vocabulary of a head against its target."""
    target_hidden = _int(target, "hidden_size", "d_model", "n_embd", "dim")
    draft_hidden = _int(draft, "hidden_size", "d_model", "n_embd", "dim")
    if target_hidden is not None and draft_hidden is not None and target_hidden != draft_hidden:
        return (f"hidden_size: the draft's is {draft_hidden} and the target's {target_hidden}; "
                f"a head reads the hidden states of the model it was trained on")
    target_vocab = _int(target, "vocab_size", "n_vocab")
    draft_vocab = _int(draft, "vocab_size", "n_vocab")
    if target_vocab is None or draft_vocab is None:
        return None
    if algorithm == "EAGLE3":
        if draft_vocab != target_vocab:
            return (f"vocab_size: the EAGLE-3 head maps its draft tokens into a vocabulary of "
                    f"{draft_vocab} (d2t / t2d) and the target's has {target_vocab}; the head was "
                    f"trained on another tokenizer")
        reduced = _int(draft, "draft_vocab_size")
        if reduced is not None and reduced > target_vocab:
            return (f"draft_vocab_size: {reduced} draft tokens cannot map into the target's "
                    f"vocabulary of {target_vocab}")
        return None
    if draft_vocab != target_vocab:
        return (f"vocab_size: the draft's is {draft_vocab} and the target's {target_vocab}; "
                f"{algorithm} shares the target's embedding and lm_head, so they must be equal")
    return None


def _base_model(target: dict[str, Any], draft: dict[str, Any]) -> str | None:
    name, archs = _named_base(draft)
    target_arch = _architecture(target)
    if archs and target.get("architectures") and target_arch not in archs:
        return (f"the head was trained for {name or 'a model'} ({', '.join(archs)}) and the target "
                f"is {target_arch}")
    target_name = str(target.get("_name_or_path") or "")
    if name and target_name and _model_id(name) != _model_id(target_name):
        return f"the head was trained for {name} and the target is {target_name}"
    return None
